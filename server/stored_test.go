package server

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
)

// storages are the key stores the stored-response tests run on: in
// memory, and on PostgreSQL in a schema of the test's own.
var storages = []struct {
	name       string
	newStorage newStorageFunc
}{
	{"memory", memoryStorage},
	{"postgres", postgresStorage},
}

// serveKeyed serves h behind idempotency.Middleware on keys with opts,
// every request authenticated as client "c", until the test ends, and
// returns a function that POSTs body with the key and returns the answer.
func serveKeyed(t *testing.T, keys idempotency.Store, opts idempotency.Options, h http.HandlerFunc) func(key, body string) (*http.Response, string) {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = testLogger(t)
	}
	mw := idempotency.Middleware(keys, opts)(h)
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mw.ServeHTTP(w, r.WithContext(idempotency.WithClientID(r.Context(), "c")))
	}))
	tr := &http.Transport{}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		hs.Close()
	})
	return func(key, body string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest("POST", hs.URL+"/v1/things", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp, string(b)
	}
}

// TestReplayOwnMediaTypeLikeSealed: a handler's own media type that begins
// like the sealed one (application/vnd.idemkit.sealedreport+json) is not
// sealed: on a server that never seals, its replays are its 201, not 500.
func TestReplayOwnMediaTypeLikeSealed(t *testing.T) {
	const ct = "application/vnd.idemkit.sealedreport+json"
	for _, st := range storages {
		t.Run(st.name, func(t *testing.T) {
			post := serveKeyed(t, st.newStorage(t).Keys, idempotency.Options{}, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", ct)
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, `{"report":"r_1"}`)
			})
			first, firstBody := post("k-report", `{}`)
			for i := range 2 {
				again, body := post("k-report", `{}`)
				if again.StatusCode != http.StatusCreated || body != firstBody || again.Header.Get("Content-Type") != ct ||
					again.Header.Get("Idempotent-Replayed") != "true" {
					t.Errorf("replay %d: %d %s %q, want the first answer %d %s %q", i+1, again.StatusCode, again.Header.Get("Content-Type"), body,
						first.StatusCode, first.Header.Get("Content-Type"), firstBody)
				}
			}
		})
	}
}
