package idem

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type payment struct {
	ID       string `json:"id,omitempty"`
	Amount   int    `json:"amount"`
	Currency string `json:"currency"`
	Customer string `json:"customer"`
}

// seen is a request as a Client test server saw it.
type seen struct {
	method, path, rawQuery string
	header                 http.Header
	body                   string
}

// apiServer starts a server that records each request and answers it
// with handle.
func apiServer(t *testing.T, handle func(w http.ResponseWriter, r *http.Request)) (url string, requests func() []seen) {
	t.Helper()
	var mu sync.Mutex
	var reqs []seen
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		reqs = append(reqs, seen{r.Method, r.URL.Path, r.URL.RawQuery, r.Header.Clone(), string(body)})
		mu.Unlock()
		handle(w, r)
	}))
	return srv.URL, func() []seen {
		mu.Lock()
		defer mu.Unlock()
		return append([]seen(nil), reqs...)
	}
}

func newClient(t *testing.T, baseURL string) *Client {
	t.Helper()
	return &Client{BaseURL: baseURL, Token: "sk_test_demo", HTTPClient: &http.Client{Transport: newTransport(t, fastPolicy)}}
}

func answerJSON(status int, contentType, body string) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, _ *http.Request) {
		if contentType != "" {
			w.Header().Set("Content-Type", contentType)
		}
		w.WriteHeader(status)
		io.WriteString(w, body)
	}
}

func TestClientPostEncodesAndDecodesJSON(t *testing.T) {
	url, requests := apiServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/v1/payments/pay_123")
		w.WriteHeader(201)
		io.WriteString(w, `{"id":"pay_123","amount":4200,"currency":"usd","customer":"cus_123","status":"succeeded"}`)
	})
	c := newClient(t, url)
	var out payment
	resp, err := c.Post(context.Background(), "/v1/payments", payment{Amount: 4200, Currency: "usd", Customer: "cus_123"}, &out)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 201 || resp.Header.Get("Location") != "/v1/payments/pay_123" {
		t.Errorf("response %d, Location %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	if want := (payment{ID: "pay_123", Amount: 4200, Currency: "usd", Customer: "cus_123"}); out != want {
		t.Errorf("decoded %+v, want %+v", out, want)
	}
	reqs := requests()
	if len(reqs) != 1 {
		t.Fatalf("%d requests, want 1", len(reqs))
	}
	r := reqs[0]
	var sent map[string]any
	if err := json.Unmarshal([]byte(r.body), &sent); err != nil {
		t.Fatalf("body %q is not JSON: %v", r.body, err)
	}
	if sent["amount"] != 4200.0 || sent["currency"] != "usd" || sent["customer"] != "cus_123" || len(sent) != 3 {
		t.Errorf("sent %v", sent)
	}
	checks := []struct{ header, want string }{
		{"Content-Type", "application/json"},
		{"Accept", "application/json"},
		{"Authorization", "Bearer sk_test_demo"},
	}
	for _, c := range checks {
		if got := r.header.Get(c.header); got != c.want {
			t.Errorf("%s = %q, want %q", c.header, got, c.want)
		}
	}
	if r.method != http.MethodPost || r.path != "/v1/payments" || r.header.Get("Idempotency-Key") == "" {
		t.Errorf("request %s %s with key %q, want a keyed POST /v1/payments", r.method, r.path, r.header.Get("Idempotency-Key"))
	}
}

func TestClientGetSendsNoBodyAndNoKey(t *testing.T) {
	url, requests := apiServer(t, answerJSON(200, "application/json", `{"id":"pay_123","amount":1,"currency":"eur","customer":"c"}`))
	c := newClient(t, url)
	c.Token = ""
	var out payment
	if _, err := c.Get(context.Background(), "v1/payments/pay_123", &out); err != nil {
		t.Fatal(err)
	}
	if out.ID != "pay_123" || out.Currency != "eur" {
		t.Errorf("decoded %+v", out)
	}
	r := requests()[0]
	if r.method != http.MethodGet || r.body != "" || r.header.Get("Content-Type") != "" || r.header.Get("Idempotency-Key") != "" {
		t.Errorf("GET sent body %q, Content-Type %q, key %q; want none", r.body, r.header.Get("Content-Type"), r.header.Get("Idempotency-Key"))
	}
	if _, ok := r.header["Authorization"]; ok {
		t.Errorf("Authorization sent without a Token: %q", r.header.Get("Authorization"))
	}
}

func TestClientBaseURLJoin(t *testing.T) {
	tests := []struct {
		base, path, want string
	}{
		{"", "/v1/payments", "/v1/payments"},
		{"/", "/v1/payments", "/v1/payments"},
		{"", "v1/payments", "/v1/payments"},
		{"/", "v1/payments", "/v1/payments"},
		{"/api", "/v1/payments", "/api/v1/payments"},
		{"/api/", "/v1/payments", "/api/v1/payments"},
		{"/api/", "v1/payments", "/api/v1/payments"},
	}
	url, requests := apiServer(t, answerJSON(200, "application/json", `{}`))
	for i, tt := range tests {
		c := newClient(t, url+tt.base)
		if _, err := c.Get(context.Background(), tt.path, nil); err != nil {
			t.Fatalf("BaseURL %q, path %q: %v", url+tt.base, tt.path, err)
		}
		if got := requests()[i].path; got != tt.want {
			t.Errorf("BaseURL %q, path %q: server saw %q, want %q", url+tt.base, tt.path, got, tt.want)
		}
	}
}

func TestClientProblemJSONIsAPIError(t *testing.T) {
	const body = `{"type":"https://idemkit.dev/problems/invalid-body","title":"Invalid request body","status":400,"detail":"amount must be positive"}`
	url, requests := apiServer(t, answerJSON(400, "application/problem+json", body))
	resp, err := newClient(t, url).Post(context.Background(), "/v1/payments?api_secret=hunter2", payment{Amount: -1}, nil)
	if reqs := requests(); len(reqs) != 1 || reqs[0].rawQuery != "api_secret=hunter2" {
		t.Fatalf("requests %+v, want one, with its query", reqs)
	}
	var apiErr *APIError
	if !errors.As(err, &apiErr) {
		t.Fatalf("err = %v, want *APIError", err)
	}
	if resp == nil || resp.StatusCode != 400 {
		t.Errorf("response %v, want the 400 returned with the error", resp)
	}
	if apiErr.StatusCode != 400 || apiErr.Method != http.MethodPost || apiErr.URL != url+"/v1/payments" {
		t.Errorf("APIError = %+v, want 400, POST and the URL without its query", apiErr)
	}
	want := Problem{Type: "https://idemkit.dev/problems/invalid-body", Title: "Invalid request body", Status: 400, Detail: "amount must be positive"}
	if apiErr.Problem == nil || *apiErr.Problem != want {
		t.Errorf("Problem = %+v, want %+v", apiErr.Problem, want)
	}
	if string(apiErr.Body) != body {
		t.Errorf("Body = %q, want the body as sent", apiErr.Body)
	}
	msg := err.Error()
	if !strings.HasPrefix(msg, "idem: ") || !strings.Contains(msg, "400") || !strings.Contains(msg, "amount must be positive") || strings.Contains(msg, "hunter2") {
		t.Errorf("message %q: want the idem prefix, status and detail, and no query", msg)
	}
}

func TestClientNonJSONErrorKeepsBody(t *testing.T) {
	url, _ := apiServer(t, answerJSON(404, "text/plain; charset=utf-8", "no such payment\n"))
	withUser := strings.Replace(url, "http://", "http://user:s3cret@", 1)
	_, err := newClient(t, withUser).Get(context.Background(), "/v1/payments/pay_404", nil)
	var apiErr *APIError
	if !errors.As(err, &apiErr) {
		t.Fatalf("err = %v, want *APIError", err)
	}
	if apiErr.URL != url+"/v1/payments/pay_404" || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("APIError.URL = %q, message %q: want the URL without its user info", apiErr.URL, err)
	}
	if apiErr.StatusCode != 404 || apiErr.Problem != nil || string(apiErr.Body) != "no such payment\n" {
		t.Errorf("APIError = %+v (Problem %+v), want 404, no Problem, the body kept", apiErr, apiErr.Problem)
	}
}

func TestClientExhaustedStatusIsAPIError(t *testing.T) {
	url, requests := apiServer(t, answerJSON(503, "application/problem+json", `{"title":"Service Unavailable","detail":"try later"}`))
	_, err := newClient(t, url).Post(context.Background(), "/v1/payments", payment{Amount: 1}, nil)
	var apiErr *APIError
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 503 || apiErr.Problem == nil || apiErr.Problem.Detail != "try later" {
		t.Errorf("err = %v, want an APIError with the last 503's problem", err)
	}
	if n := len(requests()); n != DefaultMaxAttempts {
		t.Errorf("%d requests, want %d", n, DefaultMaxAttempts)
	}
}

func TestClientKeyReuseErrorThroughPost(t *testing.T) {
	url, requests := apiServer(t, answerJSON(422, "application/problem+json", `{"title":"Idempotency key reused","detail":"The key was first used with another body."}`))
	ctx := WithKey(context.Background(), "order-42")
	resp, err := newClient(t, url).Post(ctx, "/v1/payments", payment{Amount: 2}, nil)
	var reuse *KeyReuseError
	if !errors.As(err, &reuse) {
		t.Fatalf("err = %v, want a *KeyReuseError", err)
	}
	var apiErr *APIError
	if resp != nil || errors.As(err, &apiErr) {
		t.Errorf("got response %v, error %T; want no response and no APIError", resp, err)
	}
	if reuse.Key != "order-42" || reuse.Problem.Detail != "The key was first used with another body." {
		t.Errorf("KeyReuseError = %+v, Problem %+v", reuse, reuse.Problem)
	}
	if reqs := requests(); len(reqs) != 1 || reqs[0].header.Get("Idempotency-Key") != "order-42" {
		t.Errorf("requests %+v, want one with the pinned key", reqs)
	}
}

func TestClientInProgressErrorThroughPost(t *testing.T) {
	url, _ := apiServer(t, answerJSON(409, "application/problem+json", `{"title":"Request in progress"}`))
	c := newClient(t, url)
	c.HTTPClient.Transport.(*Transport).Retry.MaxConflictRetries = 2
	_, err := c.Post(context.Background(), "/v1/payments", payment{Amount: 3}, nil)
	var inprog *InProgressError
	if !errors.As(err, &inprog) || inprog.Polls != 3 {
		t.Errorf("err = %v, want an *InProgressError after 3 polls", err)
	}
}

func TestClientDecodeErrors(t *testing.T) {
	t.Run("invalid JSON", func(t *testing.T) {
		url, _ := apiServer(t, answerJSON(200, "application/json", `{"id":`))
		var out payment
		resp, err := newClient(t, url).Get(context.Background(), "/v1/payments/x", &out)
		if err == nil || !strings.Contains(err.Error(), "decoding") || resp == nil || resp.StatusCode != 200 {
			t.Errorf("Get = %v, %v; want the 200 and a decoding error", resp, err)
		}
	})
	t.Run("204 into out", func(t *testing.T) {
		url, _ := apiServer(t, answerJSON(204, "", ""))
		out := payment{ID: "unchanged"}
		if _, err := newClient(t, url).Post(context.Background(), "/v1/payments/x/cancel", nil, &out); err != nil || out.ID != "unchanged" {
			t.Errorf("err = %v, out %+v; want no error and out untouched", err, out)
		}
	})
	t.Run("unencodable input", func(t *testing.T) {
		url, requests := apiServer(t, answerJSON(201, "", ""))
		_, err := newClient(t, url).Post(context.Background(), "/v1/payments", map[string]any{"bad": make(chan int)}, nil)
		var jsonErr *json.UnsupportedTypeError
		if !errors.As(err, &jsonErr) || len(requests()) != 0 {
			t.Errorf("err = %v after %d requests, want a JSON encoding error before sending", err, len(requests()))
		}
	})
}

func TestClientZeroHTTPClientRetriesWithKey(t *testing.T) {
	var mu sync.Mutex
	var keys []string
	url, _ := apiServer(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		n := len(keys)
		mu.Unlock()
		if n == 1 {
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(503)
			return
		}
		w.WriteHeader(201)
	})
	c := &Client{BaseURL: url}
	resp, err := c.Post(context.Background(), "/v1/payments", payment{Amount: 5}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 201 || len(keys) != 2 || keys[0] == "" || keys[0] != keys[1] {
		t.Errorf("status %d, keys %q; want 201 after two attempts with one key", resp.StatusCode, keys)
	}
}

func TestReplayed(t *testing.T) {
	tests := []struct {
		value string
		set   bool
		want  bool
	}{
		{"", false, false},
		{"true", true, true},
		{"TRUE", true, true},
		{" true ", true, true},
		{"?1", true, true}, // an sf-boolean
		{"false", true, false},
		{"?0", true, false},
		{"1", true, false},
		{"", true, false},
	}
	for _, tt := range tests {
		resp := &http.Response{Header: http.Header{}}
		if tt.set {
			resp.Header.Set("Idempotent-Replayed", tt.value)
		}
		if got := Replayed(resp); got != tt.want {
			t.Errorf("Replayed(Idempotent-Replayed: %q, set %t) = %t, want %t", tt.value, tt.set, got, tt.want)
		}
	}
}

func TestClientReplayed(t *testing.T) {
	var mu sync.Mutex
	seenKeys := map[string]bool{}
	url, _ := apiServer(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		key := r.Header.Get("Idempotency-Key")
		replay := seenKeys[key]
		seenKeys[key] = true
		mu.Unlock()
		if replay {
			w.Header().Set("Idempotent-Replayed", "true")
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(201)
		io.WriteString(w, `{"id":"pay_1","amount":7,"currency":"usd","customer":"c"}`)
	})
	c := newClient(t, url)
	ctx := WithKey(context.Background(), "order-7")
	var replays []bool
	for range 2 {
		var out payment
		resp, err := c.Post(ctx, "/v1/payments", payment{Amount: 7}, &out)
		if err != nil {
			t.Fatal(err)
		}
		if out.ID != "pay_1" {
			t.Errorf("decoded %+v", out)
		}
		replays = append(replays, Replayed(resp))
	}
	if replays[0] || !replays[1] {
		t.Errorf("Replayed = %v, want [false true]", replays)
	}
}

// TestClientPinsOneKeyPerCall checks that a Client call keeps one key over
// its redirects and names it in its errors, even when http.Client.Timeout
// replaces the Transport's error.
func TestClientPinsOneKeyPerCall(t *testing.T) {
	t.Run("redirect", func(t *testing.T) {
		url, requests := apiServer(t, func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/payments" {
				w.Header().Set("Location", "/v2/payments")
				w.WriteHeader(http.StatusPermanentRedirect)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		if _, err := newClient(t, url).Post(context.Background(), "/v1/payments", payment{Amount: 5}, nil); err != nil {
			t.Fatal(err)
		}
		reqs := requests()
		if len(reqs) != 2 || reqs[1].path != "/v2/payments" || reqs[0].header.Get("Idempotency-Key") == "" || reqs[0].header.Get("Idempotency-Key") != reqs[1].header.Get("Idempotency-Key") {
			t.Errorf("requests %+v, want one key on both hops", reqs)
		}
	})

	t.Run("http.Client.Timeout", func(t *testing.T) {
		arrived := make(chan struct{}, 8)
		url, requests := apiServer(t, func(w http.ResponseWriter, r *http.Request) {
			arrived <- struct{}{} // recorded
			<-r.Context().Done()
		})
		c := newClient(t, url)
		// Long enough for the request to reach the server on a busy
		// machine; the handler holds it past the timeout.
		c.HTTPClient.Timeout = time.Second
		_, err := c.Post(context.Background(), "/v1/payments", payment{Amount: 5}, nil)
		select {
		case <-arrived:
		case <-time.After(10 * time.Second):
		}
		reqs := requests()
		if len(reqs) == 0 {
			t.Fatalf("err = %v and no request reached the server", err)
		}
		if key := reqs[0].header.Get("Idempotency-Key"); err == nil || key == "" || !strings.Contains(err.Error(), key) {
			t.Errorf("err = %v, want it to name the key sent (%s)", err, key)
		}
	})

	t.Run("APIError", func(t *testing.T) {
		url, requests := apiServer(t, answerJSON(http.StatusBadRequest, "application/problem+json", `{"title":"Bad Request"}`))
		_, err := newClient(t, url).Post(context.Background(), "/v1/payments", payment{Amount: 5}, nil)
		var apiErr *APIError
		if !errors.As(err, &apiErr) || apiErr.Key == "" || apiErr.Key != requests()[0].header.Get("Idempotency-Key") {
			t.Errorf("err = %#v, want an APIError with the key sent", err)
		}
	})
}

// TestClientDecodeErrorNamesTheKey checks that a 2xx answer to a keyed
// call whose body cannot be decoded gives an error naming the key sent:
// the payment was made, and the key is how to fetch its answer again.
func TestClientDecodeErrorNamesTheKey(t *testing.T) {
	for _, body := range []string{`{"id":`, `not JSON`, `{"id": 5}`} {
		t.Run(body, func(t *testing.T) {
			url, requests := apiServer(t, answerJSON(http.StatusCreated, "application/json", body))
			var out payment
			resp, err := newClient(t, url).Post(context.Background(), "/v1/payments", payment{Amount: 5}, &out)
			require.Error(t, err)
			require.NotNil(t, resp)
			assert.Equal(t, http.StatusCreated, resp.StatusCode)
			reqs := requests()
			require.Len(t, reqs, 1)
			key := reqs[0].header.Get(DefaultKeyHeader)
			require.NotEmpty(t, key)
			assert.Contains(t, err.Error(), key, "the error must name the key sent")
			assert.Contains(t, err.Error(), "decoding")
		})
	}
}

// TestClientReportsTheKeySent checks that a Client whose Transport takes
// the key from a body field reports the key the body carried, which the
// server saw, and not the one the Client pinned and never sent.
func TestClientReportsTheKeySent(t *testing.T) {
	const bodyKey = "body-key-0001"
	in := map[string]any{"idempotency_key": bodyKey, "amount": 5}
	newBodyKeyClient := func(url string) *Client {
		c := newClient(t, url)
		c.HTTPClient.Transport.(*Transport).KeyBodyField = "idempotency_key"
		return c
	}
	sentKey := func(t *testing.T, reqs []seen) string {
		t.Helper()
		require.NotEmpty(t, reqs)
		var got map[string]any
		require.NoError(t, json.Unmarshal([]byte(reqs[0].body), &got))
		require.Equal(t, bodyKey, got["idempotency_key"], "the body's key is the one sent")
		return bodyKey
	}

	t.Run("APIError", func(t *testing.T) {
		url, requests := apiServer(t, answerJSON(http.StatusBadRequest, "application/problem+json", `{"title":"Bad Request"}`))
		_, err := newBodyKeyClient(url).Post(context.Background(), "/v1/payments", in, nil)
		var apiErr *APIError
		require.ErrorAs(t, err, &apiErr)
		assert.Equal(t, sentKey(t, requests()), apiErr.Key)
	})
	t.Run("attempts ran out", func(t *testing.T) {
		url, requests := apiServer(t, func(w http.ResponseWriter, _ *http.Request) {
			panic(http.ErrAbortHandler) // the connection is cut: an error, retried
		})
		_, err := newBodyKeyClient(url).Post(context.Background(), "/v1/payments", in, nil)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "idempotency key "+sentKey(t, requests())+":")
	})
	t.Run("decode error", func(t *testing.T) {
		url, requests := apiServer(t, answerJSON(http.StatusCreated, "application/json", `{"id":`))
		var out payment
		_, err := newBodyKeyClient(url).Post(context.Background(), "/v1/payments", in, &out)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "idempotency key "+sentKey(t, requests())+":")
	})
	t.Run("pinned key inserted", func(t *testing.T) {
		url, requests := apiServer(t, answerJSON(http.StatusBadRequest, "application/problem+json", `{"title":"Bad Request"}`))
		ctx := WithKey(context.Background(), "pinned-key-0001")
		_, err := newBodyKeyClient(url).Post(ctx, "/v1/payments", map[string]any{"amount": 5}, nil)
		var apiErr *APIError
		require.ErrorAs(t, err, &apiErr)
		assert.Equal(t, "pinned-key-0001", apiErr.Key)
		assert.Contains(t, requests()[0].body, `"idempotency_key":"pinned-key-0001"`)
	})
}

// TestSynctestClientErrorBodyIsBounded checks that a Client reads an error
// answer's body for a bounded time, as the Transport reads problem details:
// a server that stalls mid-body gets an APIError with what came, not a
// caller stuck for good on a context with no deadline.
func TestSynctestClientErrorBodyIsBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		body := newStallingBody(`{"title":"Bad Req`)
		base := roundTripFunc(stalling(http.StatusBadRequest, body))
		c := &Client{BaseURL: "https://api.example.com", HTTPClient: &http.Client{Transport: &Transport{Base: base}}}
		start := time.Now()
		_, err := c.Post(context.Background(), "/v1/payments", payment{Amount: 5}, nil)
		var apiErr *APIError
		require.ErrorAs(t, err, &apiErr)
		assert.Equal(t, http.StatusBadRequest, apiErr.StatusCode)
		assert.Equal(t, `{"title":"Bad Req`, string(apiErr.Body))
		assert.LessOrEqual(t, time.Since(start), maxDrainTime)
	})
}

// TestClientErrorSaysTheRequestOnce: an error of a Client call names the
// method, the URL and the key once, whatever idem error is inside, and
// keeps http.Client's *url.Error and idem's error in its chain.
func TestClientErrorSaysTheRequestOnce(t *testing.T) {
	reuse, _ := apiServer(t, answerJSON(422, "application/problem+json", `{"title":"Idempotency key reused"}`))
	busy, _ := apiServer(t, answerJSON(409, "application/problem+json", `{"title":"Request in progress"}`))
	down := "http://127.0.0.1:1" // nothing listens: a refused dial, retried
	for _, base := range []string{reuse, busy, down} {
		c := newClient(t, base)
		tr := c.HTTPClient.Transport.(*Transport)
		tr.Retry.MaxConflictRetries, tr.Retry.MaxAttempts = 1, 2
		_, err := c.Post(WithKey(context.Background(), "order-42"), "/v1/payments", payment{Amount: 2}, nil)
		if err == nil {
			t.Fatalf("%s: no error", base)
		}
		msg := err.Error()
		for _, once := range []string{base + "/v1/payments", "order-42", "POST"} {
			if n := strings.Count(msg, once); n != 1 {
				t.Errorf("%s: %q appears %d times in %q", base, once, n, msg)
			}
		}
		var ue *url.Error
		if !errors.As(err, &ue) {
			t.Errorf("%s: no *url.Error in the chain of %v", base, err)
		}
	}
}
