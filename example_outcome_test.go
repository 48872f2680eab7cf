package idem_test

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// After any keyed call, OutcomeOf says whether the payment may have
// happened: not sent (it may go to another provider, under a new key),
// done (the answer says what happened), or unknown (retry it later with
// the same key, to the same provider, and to no other).
func ExampleOutcomeOf() {
	// A provider that is down: nothing listens on its port.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	down := "http://" + ln.Addr().String()
	ln.Close()
	// One that answers.
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	defer up.Close()
	// One that takes each request, then drops the connection unanswered.
	lost := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close()
	}))
	defer lost.Close()

	client := &http.Client{Transport: &idem.Transport{
		Retry: idem.RetryPolicy{MaxAttempts: 2, InitialInterval: time.Millisecond},
	}}
	for _, url := range []string{down, up.URL, lost.URL} {
		resp, err := client.Post(url+"/v1/payments", "application/json", strings.NewReader(`{"amount":4200}`))
		switch idem.OutcomeOf(resp, err) {
		case idem.OutcomeNotSent:
			fmt.Println("not sent: another provider may take it, under a new key")
		case idem.OutcomeDone:
			resp.Body.Close()
			fmt.Println("done:", resp.Status)
		case idem.OutcomeUnknown:
			var rerr *idem.RetryError
			errors.As(err, &rerr)
			fmt.Println("unknown: retry later with the same key, here only:", rerr.Key != "")
		}
	}
	// Output:
	// not sent: another provider may take it, under a new key
	// done: 201 Created
	// unknown: retry later with the same key, here only: true
}
