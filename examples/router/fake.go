package main

import (
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"sync"
)

// fakeProvider is an in-process payments API on 127.0.0.1 that honours
// idempotency keys: a key seen before gets its payment's answer again,
// marked Idempotent-Replayed. cut, if set, is asked for each request (1
// for the first) whether to cut the connection after the payment is
// made, instead of answering: a half-sent payment, as the client sees it.
type fakeProvider struct {
	srv *httptest.Server

	mu       sync.Mutex
	requests int
	keys     []string          // of each request
	payments map[string]string // key → payment id
	cut      func(n int) bool
	// cutBody, if set, is asked for each request (1 for the first)
	// whether to answer 201 with a chunked body cut half-way, after the
	// payment is made.
	cutBody func(n int) bool
}

func newFakeProvider(name string) *fakeProvider {
	f := &fakeProvider{payments: map[string]string{}}
	f.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var p Payment
		key := r.Header.Get("Idempotency-Key")
		if r.Method != http.MethodPost || key == "" || json.NewDecoder(r.Body).Decode(&p) != nil || p.Amount <= 0 {
			http.Error(w, "want a POST with an Idempotency-Key and a payment", http.StatusBadRequest)
			return
		}
		f.mu.Lock()
		f.requests++
		n := f.requests
		f.keys = append(f.keys, key)
		id, replay := f.payments[key]
		if !replay {
			id = fmt.Sprintf("%s_pay_%d", name, len(f.payments)+1)
			f.payments[key] = id
		}
		cut := f.cut != nil && f.cut(n)
		cutBody := f.cutBody != nil && f.cutBody(n)
		f.mu.Unlock()
		if cut {
			if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
				conn.Close()
			}
			return
		}
		w.Header().Set("Content-Type", "application/json")
		if replay {
			w.Header().Set("Idempotent-Replayed", "true")
		}
		w.WriteHeader(http.StatusCreated)
		if cutBody {
			fmt.Fprintf(w, `{"id":%q`, id[:len(id)/2])
			w.(http.Flusher).Flush() // a chunk, then the connection is cut
			panic(http.ErrAbortHandler)
		}
		fmt.Fprintf(w, `{"id":%q}`, id)
	}))
	f.srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the cut answers are logged
	f.srv.Start()
	return f
}

// URL returns the provider's base URL.
func (f *fakeProvider) URL() string { return f.srv.URL }

// Close stops the provider.
func (f *fakeProvider) Close() { f.srv.Close() }

// made returns the number of payments made and of requests received.
func (f *fakeProvider) made() (payments, requests int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.payments), f.requests
}

// seenKeys returns the key of each request received.
func (f *fakeProvider) seenKeys() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.keys...)
}

// cuttingBodies makes the provider cut the bodies of its first n answers.
func (f *fakeProvider) cuttingBodies(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cutBody = func(i int) bool { return i <= n }
}

// cutting makes the provider cut its first n answers.
func (f *fakeProvider) cutting(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cut = func(i int) bool { return i <= n }
}
