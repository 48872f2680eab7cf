package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem"
)

// A Transport with the Stripe Provider reads Stripe's own answers: a 409
// idempotency_key_in_use (a request with the key still running) is waited
// out and asked again with the same key, and a 400 idempotency_error (the
// key used with other parameters) ends the call with a KeyReuseError, as a
// 422 does under the IETF draft.
func ExampleTransport_Provider() {
	// A fake of Stripe's API: the first request with a key finds it in use
	// (an earlier attempt is still running), then gets the charge; the key
	// with other parameters gets an idempotency_error.
	var mu sync.Mutex
	first := map[string]string{} // key -> parameters first seen with it
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		params, seen := first[key]
		if !seen {
			first[key] = string(body)
		}
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch {
		case !seen:
			w.WriteHeader(http.StatusConflict)
			fmt.Fprintf(w, `{"error":{"code":"idempotency_key_in_use","type":"invalid_request_error","message":"There is currently another in-progress request using this Idempotent Key: %s."}}`, key)
		case params != string(body):
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprintf(w, `{"error":{"type":"idempotency_error","message":"Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than '%s' if you meant to execute a different request."}}`, key)
		default:
			io.WriteString(w, `{"id":"ch_1","object":"charge"}`)
		}
	}))
	defer srv.Close()

	client := &http.Client{Transport: &idem.Transport{
		Provider: idem.Stripe,
		Retry:    idem.RetryPolicy{InitialInterval: 10 * time.Millisecond},
		OnAttempt: func(a idem.Attempt) {
			fmt.Printf("attempt %d: %s, retry %t (%s)\n", a.Number, a.Response.Status, a.Retry, a.Reason)
		},
	}}
	charge := func(amount string) (*http.Response, error) {
		ctx := idem.WithKey(context.Background(), "order-1234")
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/charges", strings.NewReader("amount="+amount+"&currency=usd"))
		if err != nil {
			log.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		return client.Do(req)
	}

	resp, err := charge("4200")
	if err != nil {
		log.Fatal(err)
	}
	var c struct{ ID string }
	json.NewDecoder(resp.Body).Decode(&c)
	resp.Body.Close()
	fmt.Println("charged:", c.ID)

	_, err = charge("9900") // a bug: the same key for another charge
	var reuse *idem.KeyReuseError
	if errors.As(err, &reuse) {
		fmt.Println("key reused:", reuse.Key)
		fmt.Println(reuse.Problem.Detail)
	}
	// Output:
	// attempt 1: 409 Conflict, retry true (409: still running, backoff)
	// attempt 2: 200 OK, retry false (200 OK)
	// charged: ch_1
	// attempt 1: 400 Bad Request, retry false (400 Bad Request (Stripe): key used for another request)
	// key reused: order-1234
	// Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than 'order-1234' if you meant to execute a different request.
}

// A Provider for an API idem does not know: here one that takes the key in
// an Acme-Request-Key header and answers a key used for another request
// with 400 and the code REQUEST_KEY_MISMATCH. Its Classify reads the start
// of the 400's body; the answers it does not recognise keep the
// Transport's table.
func ExampleProvider() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Println("key header set:", r.Header.Get("Acme-Request-Key") != "")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, `{"code":"REQUEST_KEY_MISMATCH","text":"This request key was used for another transfer."}`)
	}))
	defer srv.Close()

	type acmeError struct{ Code, Text string }
	acme := idem.Provider{
		Name:         "Acme",
		KeyHeader:    "Acme-Request-Key",
		BodyStatuses: []int{http.StatusBadRequest},
		Classify: func(resp *http.Response, body []byte) idem.Verdict {
			var e acmeError
			if json.Unmarshal(body, &e) == nil && e.Code == "REQUEST_KEY_MISMATCH" {
				return idem.VerdictKeyReuse
			}
			return idem.VerdictDefault
		},
		Message: func(body []byte) string {
			var e acmeError
			json.Unmarshal(body, &e)
			return e.Text
		},
	}

	client := &http.Client{Transport: &idem.Transport{Provider: acme}}
	_, err := client.Post(srv.URL+"/transfers", "application/json", strings.NewReader(`{"amount":100}`))
	var reuse *idem.KeyReuseError
	if errors.As(err, &reuse) {
		fmt.Println(reuse.Problem.Detail)
	}
	// Output:
	// key header set: true
	// This request key was used for another transfer.
}
