package idem

import (
	"context"
	"net/http"
	"net/http/httptrace"
	"reflect"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// attemptLog is a base transport that records what AttemptFromContext
// says of each request it sends, and the key header it carries.
type attemptLog struct {
	base     http.RoundTripper
	mu       sync.Mutex
	attempts []Attempt
	keys     []string
}

func (l *attemptLog) RoundTrip(req *http.Request) (*http.Response, error) {
	a, ok := AttemptFromContext(req.Context())
	if !ok {
		a.Number = -1
	}
	l.mu.Lock()
	l.attempts = append(l.attempts, a)
	l.keys = append(l.keys, req.Header.Get(DefaultKeyHeader))
	l.mu.Unlock()
	return l.base.RoundTrip(req)
}

func TestAttemptFromContext(t *testing.T) {
	for _, tt := range []struct {
		name   string
		method string
		policy RetryPolicy
	}{
		{"keyed", http.MethodPost, fastPolicy},
		{"keyed with AttemptTimeout", http.MethodPost, RetryPolicy{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, AttemptTimeout: time.Minute}},
		{"unkeyed", http.MethodPut, fastPolicy},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, &recorder{script: []int{503, 500, 201}})
			log := &attemptLog{base: newTransport(t, tt.policy).Base}
			tr := &Transport{Base: log, Retry: tt.policy}
			req, err := http.NewRequest(tt.method, srv.URL, nil)
			if err != nil {
				t.Fatal(err)
			}
			// Many header values, all sent with the key on every attempt.
			for i := range 10 {
				req.Header.Add("X-Many", strconv.Itoa(i))
			}
			resp, err := tr.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			readAll(t, resp)
			if len(log.attempts) != 3 {
				t.Fatalf("base saw %d attempts, want 3", len(log.attempts))
			}
			for i, a := range log.attempts {
				if a.Number != i+1 || a.Key != log.keys[i] || (a.Key == "") == (tt.method == http.MethodPost) {
					t.Errorf("attempt %d: AttemptFromContext = %+v, key header %q; want number %d and the key sent", i+1, a, log.keys[i], i+1)
				}
			}
			if got := resp.Request.Header.Values("X-Many"); len(got) != 10 || got[9] != "9" {
				t.Errorf("X-Many sent as %q, want the 10 values", got)
			}
		})
	}
	if a, ok := AttemptFromContext(context.Background()); ok {
		t.Errorf("AttemptFromContext(Background) = %+v, true; want false", a)
	}
}

// TestAttemptFitsItsSizeClass pins what an attempt's object adds to its
// request copy: 80 bytes on a 64-bit platform, which with Go 1.26's
// 304-byte http.Request fill the 384-byte size class. A field more moves
// every attempt to the 416-byte class: 32 bytes more for the garbage
// collector on every call.
func TestAttemptFitsItsSizeClass(t *testing.T) {
	if strconv.IntSize != 64 {
		t.Skip("the sizes are a 64-bit platform's")
	}
	own := reflect.TypeFor[attemptRequest]().Size() - reflect.TypeFor[http.Request]().Size()
	if own > 80 {
		t.Errorf("an attempt adds %d bytes to its request, want at most 80", own)
	}
}

// TestKitLendsNoCounts: a kit an attempt gave back, after its headers went
// out, lends the next attempt none of its counts: a POST to a closed port
// after one that reached a server is not sent.
func TestKitLendsNoCounts(t *testing.T) {
	srv := newServer(t, &recorder{script: []int{201}})
	tr := newTransport(t, RetryPolicy{MaxAttempts: 1})
	resp, err := post(t, tr, context.Background(), srv.URL, `{}`)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp) // gives the kit back
	resp, err = post(t, tr, context.Background(), closedURL(t), `{}`)
	if got := OutcomeOf(resp, err); got != OutcomeNotSent {
		t.Errorf("OutcomeOf = %v, want not sent (err: %v)", got, err)
	}
}

// TestAnswerContextHandsOutNoTrace: once an attempt has read its answer,
// its context (the response's request's) no longer hands net/http the
// attempt's wire trace, whose kit other attempts borrow next.
func TestAnswerContextHandsOutNoTrace(t *testing.T) {
	srv := newServer(t, &recorder{script: []int{201}})
	resp, err := post(t, newTransport(t, fastPolicy), context.Background(), srv.URL, `{}`)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if trace := httptrace.ContextClientTrace(resp.Request.Context()); trace != nil {
		t.Errorf("the answer's request context still hands out a trace: %p", trace)
	}
}

// TestCallerTraceStaysWithItsOperation: a trace the caller put on one
// operation's context does not run for the next operation.
func TestCallerTraceStaysWithItsOperation(t *testing.T) {
	srv := newServer(t, &recorder{script: []int{201}})
	tr := newTransport(t, fastPolicy)
	var conns atomic.Int32
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		GetConn: func(string) { conns.Add(1) },
	})
	resp, err := post(t, tr, ctx, srv.URL, `{}`)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if conns.Load() != 1 {
		t.Fatalf("the caller's GetConn ran %d times, want 1", conns.Load())
	}
	resp, err = post(t, tr, context.Background(), srv.URL, `{}`)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if conns.Load() != 1 {
		t.Errorf("the caller's GetConn ran %d times after an operation of its own and one without it, want 1", conns.Load())
	}
}

// TestAnswerRequestCarriesTheAttempt: the final response's Request is one
// whose context carries the attempt, as OutcomeOf needs: the Base's own
// copy of the attempt's request is kept as it is, and another request the
// Base answered with is replaced by the attempt's.
func TestAnswerRequestCarriesTheAttempt(t *testing.T) {
	for _, tt := range []struct {
		name string
		of   func(req *http.Request) *http.Request // the Request the Base answers with
		kept bool
	}{
		{"the Base's copy", func(req *http.Request) *http.Request { return req.WithContext(req.Context()) }, true},
		{"another request", func(req *http.Request) *http.Request { return req.WithContext(context.Background()) }, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var answered *http.Request
			base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
				resp, err := benchBase(req)
				answered = tt.of(req)
				resp.Request = answered
				return resp, err
			})
			req, err := http.NewRequest(http.MethodPost, "http://stub.invalid/v1/payments", nil)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := (&Transport{Base: base}).RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if a, ok := AttemptFromContext(resp.Request.Context()); !ok || a.Number != 1 {
				t.Errorf("AttemptFromContext(resp.Request.Context()) = %+v, %v; want attempt 1", a, ok)
			}
			if kept := resp.Request == answered; kept != tt.kept {
				t.Errorf("the Base's Request kept: %v, want %v", kept, tt.kept)
			}
		})
	}
}
