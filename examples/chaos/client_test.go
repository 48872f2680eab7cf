package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem"
)

func TestClassify(t *testing.T) {
	// idem.Client returns the Transport's errors inside a *url.Error.
	wrap := func(err error) error { return &url.Error{Op: "Post", URL: "http://x/v1/payments", Err: err} }
	tests := []struct {
		name string
		err  error
		want state
	}{
		{"success", nil, succeeded},
		{"key reused", wrap(&idem.KeyReuseError{Key: "k", Attempts: 1}), failed},
		{"key reused, answering a retry", wrap(&idem.KeyReuseError{Key: "k", Attempts: 2}), pending},
		{"in progress", wrap(&idem.InProgressError{Key: "k"}), pending},
		{"attempts ran out", wrap(&idem.RetryError{Attempts: 3, Err: io.ErrUnexpectedEOF}), pending},
		{"attempt timeout", wrap(&idem.RetryError{Attempts: 3, Err: fmt.Errorf("%w after 1s", idem.ErrAttemptTimeout)}), pending},
		{"budget", wrap(&idem.RetryError{Attempts: 1, Err: fmt.Errorf("%w; last attempt: EOF", idem.ErrBudgetExhausted)}), pending},
		{"503 after the attempts", &idem.APIError{StatusCode: 503}, pending},
		{"502", &idem.APIError{StatusCode: 502}, pending},
		{"409", &idem.APIError{StatusCode: 409}, pending},
		{"429", &idem.APIError{StatusCode: 429}, pending},
		{"400", &idem.APIError{StatusCode: 400}, failed},
		{"402", &idem.APIError{StatusCode: 402}, failed},
		{"single connection error", wrap(errors.New("connection reset by peer")), pending},
		{"2xx whose answer was lost", wrap(&idem.AnswerLostError{Key: "k", StatusCode: 201}), pending},
		{"key expired", wrap(&idem.KeyExpiredError{Key: "k"}), pending},
	}
	for _, tt := range tests {
		if got := classify(nil, tt.err); got.state != tt.want {
			t.Errorf("%s: classify(%v) = %+v, want state %d", tt.name, tt.err, got, tt.want)
		}
	}
}

// testClients returns clients of the API at url, as the chaos run makes
// them, with short waits.
func testClients(url string) *clients {
	c, _ := newClients(config{accounts: 1, attemptTimeout: time.Second, lockTimeout: time.Second}, url, newStats())
	return c
}

// TestCallPinsKeyAndFirstSent: every call for an operation carries its key
// and the first-sent time stored with it, the same on every call however
// late, as the README tells users.
func TestCallPinsKeyAndFirstSent(t *testing.T) {
	var mu sync.Mutex
	var seen [][2]string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, [2]string{r.Header.Get("Idempotency-Key"), r.Header.Get("Repeatability-First-Sent")})
		n := len(seen)
		mu.Unlock()
		if n == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"pay_1","charge":"ch_1"}`))
	}))
	defer srv.Close()
	c := testClients(srv.URL)
	c.cfg.cancelRate = 0
	first := time.Now().Add(-time.Hour).Truncate(time.Second)
	o := newOp(1, c.accounts[0], first)
	c.pending.Add(1)
	rng := rand.New(rand.NewPCG(1, 2))
	c.api[0].HTTPClient.Transport.(*idem.Transport).Retry.MaxAttempts = 1
	c.call(context.Background(), 0, o, rng) // 503: unknown, asked again
	require.Equal(t, pending, o.state)
	c.call(context.Background(), 0, o, rng)
	require.Equal(t, succeeded, o.state)
	want := [2]string{o.key, first.UTC().Format(http.TimeFormat)}
	assert.Equal(t, [][2]string{want, want}, seen)
}

// TestCallRefusalOfRetryStaysPending: the first attempt's connection is
// cut after the server had the request, and the retry is refused (403):
// the payment may exist, so the operation stays pending; it is never
// recorded as failed.
func TestCallRefusalOfRetryStaysPending(t *testing.T) {
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
				conn.Close()
			}
			return
		}
		w.WriteHeader(http.StatusForbidden)
	}))
	defer srv.Close()
	c := testClients(srv.URL)
	o := newOp(1, c.accounts[0], time.Now())
	c.pending.Add(1)
	c.call(context.Background(), 0, o, rand.New(rand.NewPCG(1, 2)))
	assert.Equal(t, pending, o.state, "last: %s", o.last)
	assert.Equal(t, int32(2), n.Load())
}
