package main

import (
	"net/http"
	"net/http/httptest"
	"sync"
)

// fault is a failure injected into one request on its way to the server.
type fault int

const (
	// pass lets the request through untouched.
	pass fault = iota
	// unavailable answers 503 at the edge, as an overloaded proxy would:
	// the server never sees the request.
	unavailable
	// loseResponse lets the server handle the request to the end (it
	// commits), then closes the connection without sending the response:
	// the client cannot tell whether anything happened.
	loseResponse
)

// faults is an http.Handler in front of the server that injects the
// planned faults into the payment requests (POST /v1/payments), one fault
// per request, in order; requests past the plan pass. It is safe for
// concurrent use.
type faults struct {
	next http.Handler
	tl   *timeline

	mu       sync.Mutex
	plan     []fault
	injected int
}

// add appends faults to the plan.
func (f *faults) add(fs ...fault) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.plan = append(f.plan, fs...)
}

// take returns the fault for the next payment request.
func (f *faults) take(r *http.Request) fault {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/payments" {
		return pass
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.plan) == 0 {
		return pass
	}
	ft := f.plan[0]
	f.plan = f.plan[1:]
	if ft != pass {
		f.injected++
	}
	return ft
}

// count returns the number of faults injected so far.
func (f *faults) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.injected
}

func (f *faults) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch f.take(r) {
	case unavailable:
		f.tl.fault("503 from the edge: the server never sees this request")
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusServiceUnavailable)
		w.Write([]byte(`{"title":"Service Unavailable","status":503,"detail":"Injected by the scenario runner."}` + "\n"))
	case loseResponse:
		rec := httptest.NewRecorder()
		f.next.ServeHTTP(rec, r)
		f.tl.fault("the server answered %s; the connection is cut before the client reads it", statusLine(rec.Code))
		conn, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			panic(http.ErrAbortHandler) // closes the connection all the same
		}
		conn.Close()
	default:
		f.next.ServeHTTP(w, r)
	}
}
