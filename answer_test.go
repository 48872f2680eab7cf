package idem

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLostAnswerIsRecovered checks that a keyed request whose 2xx answer
// is cut while its body is read gets it whole all the same: the answer is
// read inside the attempt, and the cut retried with the same key, which
// the server answers with its stored reply. Over HTTP/1.1 and HTTP/2.
func TestLostAnswerIsRecovered(t *testing.T) {
	const answer = `{"id":"pay_123","amount":4200,"currency":"usd","customer":"cus_123"}`
	for _, h2 := range []bool{false, true} {
		t.Run(fmt.Sprintf("HTTP/2 %t", h2), func(t *testing.T) {
			var mu sync.Mutex
			var keys []string
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				mu.Lock()
				keys = append(keys, r.Header.Get(DefaultKeyHeader))
				n := len(keys)
				mu.Unlock()
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Content-Length", fmt.Sprint(len(answer)))
				w.WriteHeader(http.StatusCreated)
				if n == 1 {
					// The payment is made; its answer is cut halfway.
					io.WriteString(w, answer[:20])
					w.(http.Flusher).Flush()
					panic(http.ErrAbortHandler)
				}
				w.Header().Set("Idempotent-Replayed", "true")
				io.WriteString(w, answer)
			})
			var srv = newServer(t, h)
			base := http.RoundTripper(nil)
			if h2 {
				srv = newHTTP2Server(t, h)
				base = srv.Client().Transport
			} else {
				b := &http.Transport{}
				t.Cleanup(b.CloseIdleConnections)
				base = b
			}
			tr := &Transport{Base: base, Retry: fastPolicy}
			resp, err := post(t, tr, context.Background(), srv.URL+"/v1/payments", `{"amount":4200}`)
			require.NoError(t, err)
			assert.Equal(t, http.StatusCreated, resp.StatusCode)
			assert.Equal(t, answer, readAll(t, resp), "the whole answer, from the replay")
			mu.Lock()
			defer mu.Unlock()
			require.Len(t, keys, 2)
			assert.Equal(t, keys[0], keys[1])
		})
	}
}

// TestAnswersNotBuffered checks what is handed over unread, as before:
// answers over MaxBufferedResponse, of unknown length, to unkeyed
// requests, or with buffering off; their cut bodies fail the caller's
// read, and nothing is sent again.
func TestAnswersNotBuffered(t *testing.T) {
	const answer = `{"id":"pay_123","amount":4200}`
	for _, tt := range []struct {
		name          string
		method        string
		max           int64
		contentLength bool
	}{
		{"larger than MaxBufferedResponse", http.MethodPost, 10, true},
		{"unknown length", http.MethodPost, 0, false},
		{"unkeyed", http.MethodPut, 0, true},
		{"buffering off", http.MethodPost, -1, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var mu sync.Mutex
			var n int
			srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				n++
				mu.Unlock()
				if tt.contentLength {
					w.Header().Set("Content-Length", fmt.Sprint(len(answer)))
				}
				w.WriteHeader(http.StatusOK)
				io.WriteString(w, answer[:10])
				w.(http.Flusher).Flush()
				panic(http.ErrAbortHandler)
			}))
			tr := newTransport(t, fastPolicy)
			tr.MaxBufferedResponse = tt.max
			req, err := http.NewRequest(tt.method, srv.URL, strings.NewReader(`{}`))
			require.NoError(t, err)
			resp, err := tr.RoundTrip(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			_, err = io.ReadAll(resp.Body)
			assert.Error(t, err, "the cut is the caller's to see")
			mu.Lock()
			defer mu.Unlock()
			assert.Equal(t, 1, n)
		})
	}
}

// TestSynctestAnswerReadWithinAttemptTimeout checks that AttemptTimeout
// bounds the read of a buffered answer: a body that stalls is an attempt
// timeout, retried with the same key.
func TestSynctestAnswerReadWithinAttemptTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const answer = `{"id":"pay_123"}`
		srv := newFake(func(req *http.Request) (*http.Response, error) {
			resp, _ := replyBody(201, "application/json", answer)(req)
			body := newStallingBody(answer[:5])
			// As net/http's, the body ends when the request's context does.
			context.AfterFunc(req.Context(), func() { body.Close() })
			resp.Body = body
			return resp, nil
		}, replyBody(201, "application/json", answer))
		start := time.Now()
		resp, err := fakePost(t, &Transport{Base: srv, Retry: RetryPolicy{AttemptTimeout: 2 * time.Second}}, context.Background())
		require.NoError(t, err)
		assert.Equal(t, answer, readAll(t, resp))
		require.Len(t, srv.keys, 2)
		assert.Equal(t, srv.keys[0], srv.keys[1])
		assert.GreaterOrEqual(t, time.Since(start), 2*time.Second, "the first attempt timed out")
	})
}
