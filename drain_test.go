package idem

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// stallingBody returns its data, then blocks until it is closed, like the
// body of a server that stopped sending.
type stallingBody struct {
	data   string
	once   sync.Once
	closed chan struct{}
}

func newStallingBody(data string) *stallingBody {
	return &stallingBody{data: data, closed: make(chan struct{})}
}

func (b *stallingBody) Read(p []byte) (int, error) {
	if b.data != "" {
		n := copy(p, b.data)
		b.data = b.data[n:]
		return n, nil
	}
	<-b.closed
	return 0, errors.New("read on closed body")
}

func (b *stallingBody) Close() error {
	b.once.Do(func() { close(b.closed) })
	return nil
}

// stalling answers code with a body that stalls after 9 bytes.
func stalling(code int, body *stallingBody) answer {
	return func(req *http.Request) (*http.Response, error) {
		resp, _ := replyBody(code, "application/problem+json", "x", "Retry-After", "0")(req)
		resp.Body, resp.ContentLength = body, 100
		return resp, nil
	}
}

// TestSynctestStalledBodiesAreGivenUp checks that the body of a response
// that is not returned (a retried 503, a 409, a 422) is read for a bounded
// time, then closed, however long it stalls and with no context deadline.
func TestSynctestStalledBodiesAreGivenUp(t *testing.T) {
	tests := []struct {
		name     string
		code     int
		policy   RetryPolicy
		wantTime time.Duration // spent on the stalled body
	}{
		{"503", 503, RetryPolicy{}, maxDrainTime},
		{"409", 409, RetryPolicy{}, maxDrainTime},
		{"422", 422, RetryPolicy{}, maxDrainTime},
		{"503 AttemptTimeout", 503, RetryPolicy{AttemptTimeout: 100 * time.Millisecond}, 100 * time.Millisecond},
		{"503 MaxElapsedTime", 503, RetryPolicy{MaxElapsedTime: 500 * time.Millisecond}, 500 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				body := newStallingBody(`{"title":`)
				srv := newFake(stalling(tt.code, body), reply(201))
				start := time.Now()
				resp, err := fakePost(t, &Transport{Base: srv, Retry: tt.policy}, context.Background())
				elapsed := time.Since(start)
				if resp != nil {
					resp.Body.Close()
				}
				select {
				case <-body.closed:
				default:
					t.Errorf("the stalled body was not closed")
				}
				if elapsed != tt.wantTime {
					t.Errorf("RoundTrip took %v, want %v on the stalled body", elapsed, tt.wantTime)
				}
				switch {
				case tt.code == 422:
					var reuse *KeyReuseError
					if !errors.As(err, &reuse) {
						t.Errorf("err = %v, want a KeyReuseError", err)
					}
				case tt.policy.MaxElapsedTime > 0:
					// Reading the body used up the operation's time.
					var rerr *RetryError
					if !errors.As(err, &rerr) || rerr.Attempts != 1 || rerr.Key != srv.keys[0] || !errors.Is(err, context.DeadlineExceeded) || len(srv.at) != 1 {
						t.Errorf("err = %v after %d requests, want a RetryError after 1 attempt, with the key and DeadlineExceeded", err, len(srv.at))
					}
				case err != nil || resp.StatusCode != 201:
					t.Errorf("got %v, %v; want the retry's 201", resp, err)
				}
			})
		})
	}
}

// TestStalledBodyConnectionIsNotReused checks on the wire that a retried
// answer whose body stalls is given up within AttemptTimeout and its
// connection closed, not reused for the retry.
func TestStalledBodyConnectionIsNotReused(t *testing.T) {
	var calls atomic.Int32
	var mu sync.Mutex
	var addrs []string // the client's address of each request: its connection
	stalledClosed := make(chan struct{})
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		addrs = append(addrs, r.RemoteAddr)
		mu.Unlock()
		if calls.Add(1) == 1 {
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(http.StatusServiceUnavailable)
			io.WriteString(w, `{"title":`)
			w.(http.Flusher).Flush()
			<-r.Context().Done() // the client closed the connection
			close(stalledClosed)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	srv.Start()
	t.Cleanup(srv.Close)
	// The deadline only stops a broken Transport from hanging the test.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// AttemptTimeout bounds the retry too: a second long enough for it on
	// a busy machine (with 100ms, a retry that waited for its connection
	// past it made a third request, or a dial nobody used).
	tr := newTransport(t, RetryPolicy{AttemptTimeout: time.Second, InitialInterval: time.Millisecond})
	resp, err := post(t, tr, ctx, srv.URL, `{"amount":4200}`)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	<-stalledClosed
	mu.Lock()
	defer mu.Unlock()
	if resp.StatusCode != 201 || len(addrs) != 2 || addrs[0] == addrs[1] {
		t.Errorf("status %d after requests on connections %v; want 201 after 2 on 2 connections", resp.StatusCode, addrs)
	}
}
