package idempotency

import (
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
)

// TestHandlerGetsTheBodyReadWhole checks what the handler of a claimed
// key gets of the body the middleware read: the same bytes, its length,
// and GetBody for another copy, whatever Content-Length the request
// declared (net/http's server holds a body to it; a caller in process
// may not).
func TestHandlerGetsTheBodyReadWhole(t *testing.T) {
	body := `{"amount":4200,"currency":"usd"}`
	for _, tc := range []struct {
		name     string
		declared int64
	}{
		{"declared", int64(len(body))},
		{"unknown", -1},
		{"declared shorter", 5},
		{"declared longer", 100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got, again string
			var length int64
			h := testHandler(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				got, length = string(b), r.ContentLength
				rc, err := r.GetBody()
				if err != nil {
					t.Fatal(err)
				}
				b, _ = io.ReadAll(rc)
				again = string(b)
				w.WriteHeader(http.StatusCreated)
			})
			req := keyed("k", body).request(t, "")
			req.ContentLength = tc.declared
			if r := serveRequest(t, h, req); r.status != http.StatusCreated {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			if got != body || again != body || length != int64(len(body)) {
				t.Errorf("handler read %q (Content-Length %d), GetBody %q; want %q (%d)", got, length, again, body, len(body))
			}
		})
	}
}

// TestBodyOverTheLimitIsRefusedWhateverItDeclares checks that a body over
// MaxBodyBytes gets 413 also when its declared Content-Length is under
// the limit.
func TestBodyOverTheLimitIsRefusedWhateverItDeclares(t *testing.T) {
	for _, declared := range []int64{10, 64, -1, 1000} {
		h := testHandler(t, NewMemoryStore(), Options{MaxBodyBytes: 64}, func(w http.ResponseWriter, r *http.Request) {
			t.Error("the handler ran")
		})
		req := httptest.NewRequest("POST", "/v1/payments", strings.NewReader(`"`+strings.Repeat("x", 100)+`"`))
		req.Header.Set("Idempotency-Key", "k")
		req.ContentLength = declared
		if r := serveRequest(t, h, req); r.status != http.StatusRequestEntityTooLarge {
			t.Errorf("declared %d: status %d, want 413", declared, r.status)
		}
	}
}

// TestBodyDeclaredHugeWithoutLimitIsReadAsSent checks that, with no limit
// (a negative MaxBodyBytes), a Content-Length far larger than the body sent
// costs no more memory than the body: net/http's server accepts any
// Content-Length, and a buffer of a declared 1 TiB ends the process with a
// fatal out-of-memory error (1<<62 here: a panic, which a test survives).
func TestBodyDeclaredHugeWithoutLimitIsReadAsSent(t *testing.T) {
	body := `{"amount":4200}`
	var got string
	h := testHandler(t, NewMemoryStore(), Options{MaxBodyBytes: -1}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got = string(b)
		w.WriteHeader(http.StatusCreated)
	})
	req := keyed("k", body).request(t, "")
	req.ContentLength = 1 << 62
	if r := serveRequest(t, h, req); r.status != http.StatusCreated || got != body {
		t.Fatalf("status %d, handler read %q; want 201, %q", r.status, got, body)
	}
}

// stalled is a body that sends a few bytes, then fails as a client's
// that stalled until the server's read timeout.
type stalled struct{ r io.Reader }

func (s *stalled) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err == io.EOF {
		return n, io.ErrUnexpectedEOF
	}
	return n, err
}

// TestBodyThatStallsCostsWhatItSent: a request that declares a body of
// MaxBodyBytes and sends a few bytes of it costs the server about what it
// sent, not what it declared (many such connections, each held until the
// read timeout, would otherwise hold MaxBodyBytes each).
func TestBodyThatStallsCostsWhatItSent(t *testing.T) {
	h := testHandler(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		t.Error("the handler ran")
	})
	var before, after runtime.MemStats
	req := keyed("k", "").request(t, "")
	req.Body = io.NopCloser(&stalled{strings.NewReader(`{"amount":`)})
	req.ContentLength = DefaultMaxBodyBytes
	runtime.ReadMemStats(&before)
	serveRequest(t, h, req)
	runtime.ReadMemStats(&after)
	if got := after.TotalAlloc - before.TotalAlloc; got > 64<<10 {
		t.Errorf("a request that sent 10 bytes of a declared %d allocated %d bytes", DefaultMaxBodyBytes, got)
	}
}
