package idem

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// newHTTP2Server starts an httptest TLS server that speaks HTTP/2.
func newHTTP2Server(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	srv.EnableHTTP2 = true
	srv.Config.ErrorLog = discardLog() // aborted handlers are logged
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv
}

// routed is a base transport that sends the first attempt to first and
// every later one to rest, both HTTP/2 test servers, and records the
// first attempt's error and the key of every attempt.
type routed struct {
	first, rest *httptest.Server
	mu          sync.Mutex
	firstErr    error
	keys        []string
}

func (r *routed) RoundTrip(req *http.Request) (*http.Response, error) {
	a, _ := AttemptFromContext(req.Context())
	r.mu.Lock()
	r.keys = append(r.keys, req.Header.Get(DefaultKeyHeader))
	r.mu.Unlock()
	srv := r.rest
	if a.Number == 1 {
		srv = r.first
	}
	req = req.Clone(req.Context())
	req.URL.Host, req.Host = srv.Listener.Addr().String(), ""
	resp, err := srv.Client().Transport.RoundTrip(req)
	if a.Number == 1 {
		r.mu.Lock()
		r.firstErr = err
		r.mu.Unlock()
	}
	return resp, err
}

// created answers 201 with the request's body.
var created = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	w.WriteHeader(http.StatusCreated)
	w.Write(body)
})

// sendHTTP2 posts a body through a Transport over rt and checks that it
// ends in the 201 of the second attempt, with one key on both attempts.
func sendHTTP2(t *testing.T, rt *routed) {
	t.Helper()
	resp, err := post(t, &Transport{Base: rt, Retry: fastPolicy}, context.Background(), "https://idem.invalid/v1/payments", `{"amount":4200}`)
	if err != nil {
		t.Fatalf("err = %v, want the fault retried (the first attempt failed with %v)", err, rt.firstErr)
	}
	if body := readAll(t, resp); resp.StatusCode != http.StatusCreated || body != `{"amount":4200}` || resp.ProtoMajor != 2 {
		t.Errorf("got %s %s %q, want HTTP/2 201 with the body sent again", resp.Proto, resp.Status, body)
	}
	if len(rt.keys) != 2 || rt.keys[0] == "" || rt.keys[0] != rt.keys[1] {
		t.Errorf("keys %q, want the same key on the two attempts", rt.keys)
	}
}

func TestHTTP2FaultsAreRetried(t *testing.T) {
	t.Run("RST_STREAM before the response", func(t *testing.T) {
		aborting := newHTTP2Server(t, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
			panic(http.ErrAbortHandler) // the server resets the stream
		}))
		rt := &routed{first: aborting, rest: newHTTP2Server(t, created)}
		sendHTTP2(t, rt)
		if got := http2Reason(rt.firstErr); got != "HTTP/2 stream reset" {
			t.Errorf("the first attempt failed with %v (%T), classified %q; want a stream reset", rt.firstErr, rt.firstErr, got)
		}
	})

	t.Run("GOAWAY and close", func(t *testing.T) {
		// A server shutting down sends GOAWAY, then closes the connection
		// with the request still running. Another goroutine of the server
		// sends the GOAWAY: the scenario runs again, with a longer pause
		// before the close, until the client saw the GOAWAY first (else
		// its error is a plain unexpected EOF, retried as such).
		for try := 1; try <= 20; try++ {
			running, release := make(chan struct{}), make(chan struct{})
			closing := newHTTP2Server(t, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
				close(running)
				<-release
			}))
			go func() {
				<-running
				go closing.Config.Shutdown(context.Background())
				time.Sleep(time.Duration(try) * 10 * time.Millisecond)
				closing.CloseClientConnections()
				close(release)
			}()
			rt := &routed{first: closing, rest: newHTTP2Server(t, created)}
			sendHTTP2(t, rt)
			if got := http2Reason(rt.firstErr); got == "HTTP/2 GOAWAY" {
				return
			}
			t.Logf("try %d: the first attempt failed with %v, not a GOAWAY", try, rt.firstErr)
		}
		t.Fatal("the client never saw the GOAWAY before the close")
	})

	t.Run("reset after the response headers", func(t *testing.T) {
		var calls atomic.Int32
		srv := newHTTP2Server(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			calls.Add(1)
			w.WriteHeader(http.StatusCreated)
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}))
		tr := &Transport{Base: srv.Client().Transport, Retry: fastPolicy}
		resp, err := post(t, tr, context.Background(), srv.URL, `{"amount":4200}`)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if _, err := io.ReadAll(resp.Body); err == nil || http2Reason(err) != "HTTP/2 stream reset" || resp.StatusCode != http.StatusCreated || calls.Load() != 1 {
			t.Errorf("status %d, body error %v after %d requests; want the 201 once, its body read failing with the reset", resp.StatusCode, err, calls.Load())
		}
	})
}
