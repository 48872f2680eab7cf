package idempotency

import (
	"context"
	"fmt"
	"net/http"
	"testing"
)

// TestHostileInvalidStatus: a handler that writes a status net/http
// refuses (WriteHeader panics on codes outside 100-999). The recorder must
// not store an outcome that can never be sent.
func TestHostileInvalidStatus(t *testing.T) {
	for _, code := range []int{0, 42, 1000} {
		t.Run(fmt.Sprint(code), func(t *testing.T) {
			store := NewMemoryStore()
			h := testHandler(t, store, Options{StoreServerErrors: true}, func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(code)
				w.Write([]byte("ok"))
			})
			func() {
				defer func() { recover() }()
				serve(t, h, keyed("k", "{}"))
			}()
			res, err := store.Claim(context.Background(), ClaimRequest{ClientID: "c", Key: "k", Method: "POST", Path: "/v1/payments",
				Fingerprint: mustFingerprint(t, "POST", "/v1/payments", "", "application/json", "{}"), FingerprintVersion: FingerprintVersion, LockTimeout: DefaultLockTimeout})
			if err != nil {
				t.Fatal(err)
			}
			if res.Outcome == Exists && res.Record.Status == StatusCompleted {
				t.Errorf("WriteHeader(%d), which net/http refuses with a panic, stored as the key's outcome %d", code, res.Record.Response.Status)
			}
		})
	}
}

// TestHostileContentTypeSuppressed: a handler that suppresses the
// Content-Type (net/http's documented nil value) gets none on its first
// response; the replay must not get a sniffed one.
func TestHostileContentTypeSuppressed(t *testing.T) {
	ts := mwServer(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Type"] = nil
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte("<html>created</html>"))
	})
	first := ts.mustSend(t, keyed("k", "{}"))
	second := ts.mustSend(t, keyed("k", "{}"))
	if !second.replayed() || first.header.Get("Content-Type") != second.header.Get("Content-Type") {
		t.Errorf("Content-Type of first %q, of replay %q (replayed=%v); want the same",
			first.header.Get("Content-Type"), second.header.Get("Content-Type"), second.replayed())
	}
}
