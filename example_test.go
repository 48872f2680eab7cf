package idem_test

import (
	"context"
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

// Wrap an http.Client's transport: every POST gets an idempotency key, and
// a retry after a 503 sends the same key, so the server charges once.
func Example() {
	var mu sync.Mutex
	var keys []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		if len(keys) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable) // a flaky first attempt
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()

	client := &http.Client{Transport: &idem.Transport{
		Retry: idem.RetryPolicy{InitialInterval: 10 * time.Millisecond},
	}}
	resp, err := client.Post(srv.URL+"/v1/payments", "application/json",
		strings.NewReader(`{"amount": 4200, "currency": "usd", "customer": "cus_123"}`))
	if err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()

	mu.Lock()
	defer mu.Unlock()
	fmt.Println(resp.Status)
	fmt.Println("attempts:", len(keys))
	fmt.Println("same key on both attempts:", keys[0] != "" && keys[0] == keys[1])
	// Output:
	// 201 Created
	// attempts: 2
	// same key on both attempts: true
}

// Pin the key of an operation to retry it across calls, or after a
// restart: every request sent with the context carries it.
func ExampleWithKey() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Println("server saw key:", r.Header.Get("Idempotency-Key"))
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()

	client := &http.Client{Transport: &idem.Transport{}}
	ctx := idem.WithKey(context.Background(), "order-1234-payment")
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/payments", strings.NewReader(`{"amount": 4200}`))
	if err != nil {
		log.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()
	fmt.Println(resp.Status)
	// Output:
	// server saw key: order-1234-payment
	// 201 Created
}

// A 422 means the key was used before for another request: a bug in the
// caller, never retried. It comes back through http.Client inside a
// *url.Error; errors.As reaches it.
func ExampleKeyReuseError() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusUnprocessableEntity)
		io.WriteString(w, `{"title": "Idempotency key reused", "detail": "The key was first used with another request body."}`)
	}))
	defer srv.Close()

	client := &http.Client{Transport: &idem.Transport{}}
	ctx := idem.WithKey(context.Background(), "order-1234-payment")
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/payments", strings.NewReader(`{"amount": 9900}`))
	_, err := client.Do(req)

	var reuse *idem.KeyReuseError
	if errors.As(err, &reuse) {
		fmt.Println("key reused:", reuse.Key)
		fmt.Println("server says:", reuse.Problem.Detail)
	}
	// Output:
	// key reused: order-1234-payment
	// server says: The key was first used with another request body.
}

// OnAttempt sees every attempt: what came back, whether another follows
// and why.
func ExampleTransport_OnAttempt() {
	var mu sync.Mutex
	statuses := []int{http.StatusServiceUnavailable, http.StatusTooManyRequests, http.StatusCreated}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		status := statuses[0]
		statuses = statuses[1:]
		mu.Unlock()
		if status != http.StatusCreated {
			w.Header().Set("Retry-After", "0")
		}
		w.WriteHeader(status)
	}))
	defer srv.Close()

	var keys []string
	tr := &idem.Transport{
		OnAttempt: func(a idem.Attempt) {
			keys = append(keys, a.Key)
			fmt.Printf("attempt %d: %s, retry %t (%s)\n", a.Number, a.Response.Status, a.Retry, a.Reason)
		},
	}
	resp, err := (&http.Client{Transport: tr}).Post(srv.URL+"/v1/payments", "application/json", strings.NewReader(`{"amount": 4200}`))
	if err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()
	fmt.Println("one key for all attempts:", keys[0] == keys[1] && keys[1] == keys[2])
	// Output:
	// attempt 1: 503 Service Unavailable, retry true (Retry-After)
	// attempt 2: 429 Too Many Requests, retry true (Retry-After)
	// attempt 3: 201 Created, retry false (201 Created)
	// one key for all attempts: true
}

// stripeShouldRetry follows Stripe's Stripe-Should-Retry header, which
// overrides the status: "true" asks for a retry, "false" forbids one.
func stripeShouldRetry(resp *http.Response, err error) idem.Verdict {
	if resp == nil {
		return idem.VerdictDefault
	}
	switch resp.Header.Get("Stripe-Should-Retry") {
	case "true":
		return idem.VerdictRetry
	case "false":
		return idem.VerdictStop
	}
	return idem.VerdictDefault
}

// Classify lets the API say what to retry: here Stripe's
// Stripe-Should-Retry header turns a 400 into a retry and a 500 into a
// final answer.
func ExampleTransport_Classify() {
	var mu sync.Mutex
	answers := []struct {
		status      int
		shouldRetry string
	}{
		{http.StatusBadRequest, "true"},           // a lock timeout: retry
		{http.StatusCreated, ""},                  // the first payment
		{http.StatusInternalServerError, "false"}, // a decline that must not be retried
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		a := answers[0]
		answers = answers[1:]
		mu.Unlock()
		if a.shouldRetry != "" {
			w.Header().Set("Stripe-Should-Retry", a.shouldRetry)
			w.Header().Set("Retry-After", "0")
		}
		w.WriteHeader(a.status)
	}))
	defer srv.Close()

	client := &http.Client{Transport: &idem.Transport{
		Classify: stripeShouldRetry,
		OnAttempt: func(a idem.Attempt) {
			fmt.Printf("attempt %d: %s, retry %t\n", a.Number, a.Response.Status, a.Retry)
		},
	}}
	for range 2 {
		resp, err := client.Post(srv.URL+"/v1/charges", "application/json", strings.NewReader(`{"amount": 4200}`))
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
	}
	// Output:
	// attempt 1: 400 Bad Request, retry true
	// attempt 2: 201 Created, retry false
	// attempt 1: 500 Internal Server Error, retry false
}

// Client posts JSON with a bearer token and decodes the answer; every POST
// is keyed and retried by the Transport.
func ExampleClient() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer sk_test_demo" || r.Header.Get("Idempotency-Key") == "" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id": "pay_1", "status": "succeeded", "request": %s}`, body)
	}))
	defer srv.Close()

	type Payment struct {
		ID       string `json:"id,omitempty"`
		Amount   int    `json:"amount"`
		Currency string `json:"currency"`
		Customer string `json:"customer"`
	}
	c := &idem.Client{BaseURL: srv.URL, Token: "sk_test_demo"}
	var created struct {
		ID      string  `json:"id"`
		Status  string  `json:"status"`
		Request Payment `json:"request"`
	}
	resp, err := c.Post(context.Background(), "/v1/payments", Payment{Amount: 4200, Currency: "usd", Customer: "cus_123"}, &created)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(resp.StatusCode, created.ID, created.Status)
	fmt.Println(created.Request.Amount, created.Request.Currency, created.Request.Customer)
	// Output:
	// 201 pay_1 succeeded
	// 4200 usd cus_123
}

// A server that honours the key answers a retry of a completed operation
// from its stored result, and says so.
func ExampleReplayed() {
	var mu sync.Mutex
	done := map[string]bool{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		key := r.Header.Get("Idempotency-Key")
		if done[key] {
			w.Header().Set("Idempotent-Replayed", "true")
		}
		done[key] = true
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()

	c := &idem.Client{BaseURL: srv.URL}
	ctx := idem.WithKey(context.Background(), "order-1234-payment")
	for range 2 {
		resp, err := c.Post(ctx, "/v1/payments", map[string]int{"amount": 4200}, nil)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(resp.Status, "replayed:", idem.Replayed(resp))
	}
	// Output:
	// 201 Created replayed: false
	// 201 Created replayed: true
}
