package idem

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/idem/internal/keyheader"
)

// fastPolicy keeps the wire tests quick: the waits are real but short.
var fastPolicy = RetryPolicy{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond}

// recorded is one request as a test server saw it.
type recorded struct {
	method, key, body string
}

// recorder is an httptest handler that answers from a script of statuses
// (the last one repeats) and records every request.
type recorder struct {
	mu      sync.Mutex
	reqs    []recorded
	script  []int
	headers map[string]string // set on every non-2xx answer
}

func (rec *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	rec.mu.Lock()
	rec.reqs = append(rec.reqs, recorded{r.Method, r.Header.Get("Idempotency-Key"), string(body)})
	n := len(rec.reqs)
	status := rec.script[min(n, len(rec.script))-1]
	rec.mu.Unlock()
	if status >= 300 {
		for k, v := range rec.headers {
			w.Header().Set(k, v)
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	io.WriteString(w, `{"attempt":`+string(rune('0'+n))+`}`)
}

func (rec *recorder) requests() []recorded {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]recorded(nil), rec.reqs...)
}

func newServer(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

func newTransport(t *testing.T, p RetryPolicy) *Transport {
	t.Helper()
	base := &http.Transport{}
	t.Cleanup(base.CloseIdleConnections)
	return &Transport{Base: base, Retry: p}
}

func post(t *testing.T, tr http.RoundTripper, ctx context.Context, url, body string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	return tr.RoundTrip(req)
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestFlaky503ThenCreatedReusesKeyAndBody(t *testing.T) {
	rec := &recorder{script: []int{503, 503, 201}}
	srv := newServer(t, rec)
	tr := newTransport(t, fastPolicy)
	const body = `{"amount":4200,"currency":"usd","customer":"cus_123"}`

	resp, err := post(t, tr, context.Background(), srv.URL, body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 201 {
		t.Fatalf("status = %d, want 201", resp.StatusCode)
	}
	if got := readAll(t, resp); got != `{"attempt":3}` {
		t.Errorf("body = %s, want the third attempt's", got)
	}
	reqs := rec.requests()
	if len(reqs) != 3 {
		t.Fatalf("server saw %d requests, want 3", len(reqs))
	}
	key, err := uuid.Parse(reqs[0].key)
	if err != nil || key.Version() != 4 || key.String() != reqs[0].key {
		t.Fatalf("key %q is not a canonical UUIDv4 (%v)", reqs[0].key, err)
	}
	for i, r := range reqs {
		if r.key != reqs[0].key || r.body != body || r.method != http.MethodPost {
			t.Errorf("attempt %d = %+v, want the same key %s and body on every attempt", i+1, r, reqs[0].key)
		}
	}
}

func TestDistinctOperationsGetDistinctKeys(t *testing.T) {
	rec := &recorder{script: []int{201}}
	srv := newServer(t, rec)
	tr := newTransport(t, fastPolicy)
	for range 3 {
		resp, err := post(t, tr, context.Background(), srv.URL, `{}`)
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, resp)
	}
	seen := map[string]bool{}
	for _, r := range rec.requests() {
		if seen[r.key] {
			t.Errorf("key %s sent by two operations", r.key)
		}
		seen[r.key] = true
	}
}

func TestKeyPrecedence(t *testing.T) {
	rec := &recorder{script: []int{201}}
	srv := newServer(t, rec)
	tr := newTransport(t, fastPolicy)

	ctx := WithKey(context.Background(), "pinned-key-1")
	resp, err := post(t, tr, ctx, srv.URL, `{}`)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if got, _ := KeyFromContext(ctx); got != "pinned-key-1" {
		t.Errorf("KeyFromContext = %q", got)
	}

	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "from-header")
	resp, err = tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)

	got := rec.requests()
	if got[0].key != "pinned-key-1" || got[1].key != "from-header" {
		t.Errorf("keys = %q, %q; want the pinned key, then the request's own header", got[0].key, got[1].key)
	}
	if req.Header.Get("Idempotency-Key") != "from-header" || len(req.Header) != 1 {
		t.Errorf("the caller's request was modified: %v", req.Header)
	}
}

// TestNonCanonicalKeyHeaderWins checks that a key set directly in the
// header map under another spelling is the operation's key, sent once
// under the canonical name, on every attempt.
func TestNonCanonicalKeyHeaderWins(t *testing.T) {
	for _, name := range []string{"idempotency-key", "IDEMPOTENCY-KEY", "idempotency-Key"} {
		t.Run(name, func(t *testing.T) {
			var mu sync.Mutex
			var lines [][]string
			srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				lines = append(lines, r.Header.Values("Idempotency-Key"))
				n := len(lines)
				mu.Unlock()
				if n == 1 {
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				w.WriteHeader(http.StatusCreated)
			}))
			req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
			req.Header[name] = []string{"caller-key-1"}
			resp, err := newTransport(t, fastPolicy).RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			readAll(t, resp)
			if len(lines) != 2 {
				t.Fatalf("%d requests, want 2", len(lines))
			}
			for i, l := range lines {
				if len(l) != 1 || l[0] != "caller-key-1" {
					t.Errorf("attempt %d sent key lines %q, want the caller's key once", i+1, l)
				}
			}
			if len(req.Header) != 1 || req.Header[name][0] != "caller-key-1" {
				t.Errorf("the caller's request was modified: %v", req.Header)
			}
		})
	}
}

// TestKeyHeaderUnderTwoSpellingsRefused checks that a key header set
// under its canonical name and another spelling is two key lines, which
// are refused before sending, as two lines under one name are.
func TestKeyHeaderUnderTwoSpellingsRefused(t *testing.T) {
	rec := &recorder{script: []int{201}}
	srv := newServer(t, rec)
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
	req.Header["Idempotency-Key"] = []string{"caller-key-1"}
	req.Header["idempotency-key"] = []string{"caller-key-1"}
	_, err := newTransport(t, fastPolicy).RoundTrip(req)
	if !errors.Is(err, keyheader.ErrMultiple) {
		t.Errorf("err = %v, want keyheader.ErrMultiple in its chain", err)
	}
	if n := len(rec.requests()); n != 0 {
		t.Errorf("server saw %d requests, want none", n)
	}
}

// TestKeyedRequestWithoutHeaderMap checks a keyed request built by hand
// with a nil Header: it is sent with a key, and its Header stays nil.
func TestKeyedRequestWithoutHeaderMap(t *testing.T) {
	rec := &recorder{script: []int{503, 201}}
	srv := newServer(t, rec)
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
	req.Header = nil
	resp, err := newTransport(t, fastPolicy).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	got := rec.requests()
	if len(got) != 2 || got[0].key == "" || got[1].key != got[0].key {
		t.Errorf("requests = %+v, want two with one key", got)
	}
	if req.Header != nil {
		t.Errorf("the caller's request was modified: Header = %v", req.Header)
	}
}

func TestInvalidPinnedKeyFailsBeforeSending(t *testing.T) {
	rec := &recorder{script: []int{201}}
	srv := newServer(t, rec)
	tr := newTransport(t, fastPolicy)
	for _, key := range []string{"", "has space", strings.Repeat("k", MaxKeyLen+1), "clé"} {
		_, err := post(t, tr, WithKey(context.Background(), key), srv.URL, `{}`)
		if err == nil {
			t.Errorf("key %q: no error", key)
		}
	}
	if n := len(rec.requests()); n != 0 {
		t.Errorf("server saw %d requests, want none", n)
	}
}

func TestUnkeyedMethods(t *testing.T) {
	for _, method := range []string{"GET", "PUT", "DELETE", "HEAD", "OPTIONS"} {
		t.Run(method, func(t *testing.T) {
			rec := &recorder{script: []int{502, 200}}
			srv := newServer(t, rec)
			req, _ := http.NewRequest(method, srv.URL, nil)
			resp, err := newTransport(t, fastPolicy).RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			readAll(t, resp)
			reqs := rec.requests()
			if len(reqs) != 2 || reqs[0].key != "" || reqs[1].key != "" {
				t.Errorf("requests = %+v, want two without a key", reqs)
			}
		})
	}
}

func TestConnectionClosedMidRequestIsRetried(t *testing.T) {
	var calls atomic.Int32
	var keys sync.Map
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys.Store(r.Header.Get("Idempotency-Key"), true)
		if calls.Add(1) == 1 {
			// Hang up without answering: the client sees EOF.
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				conn.Close()
			}
			return
		}
		w.WriteHeader(201)
	}))
	resp, err := post(t, newTransport(t, fastPolicy), context.Background(), srv.URL, `{"a":1}`)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if resp.StatusCode != 201 || calls.Load() != 2 {
		t.Errorf("status %d after %d calls, want 201 after 2", resp.StatusCode, calls.Load())
	}
	n := 0
	keys.Range(func(any, any) bool { n++; return true })
	if n != 1 {
		t.Errorf("%d distinct keys, want 1", n)
	}
}

func TestConnectionRefusedExhaustsToRetryError(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now

	var attempts []Attempt
	tr := newTransport(t, RetryPolicy{MaxAttempts: 3, InitialInterval: time.Millisecond})
	tr.OnAttempt = func(a Attempt) { attempts = append(attempts, a) }
	_, err = post(t, tr, context.Background(), "http://"+addr, `{}`)
	var rerr *RetryError
	if !errors.As(err, &rerr) {
		t.Fatalf("err = %v, want *RetryError", err)
	}
	if rerr.Attempts != 3 || rerr.Key == "" {
		t.Errorf("RetryError = %+v, want 3 attempts and the key", rerr)
	}
	if len(attempts) != 3 || !attempts[0].Retry || !attempts[1].Retry || attempts[2].Retry {
		t.Errorf("attempts = %+v", attempts)
	}
	if attempts[2].Reason != "attempts exhausted" {
		t.Errorf("last reason = %q", attempts[2].Reason)
	}
}

func TestExhaustionOnStatusReturnsLastResponse(t *testing.T) {
	rec := &recorder{script: []int{503}}
	srv := newServer(t, rec)
	resp, err := post(t, newTransport(t, RetryPolicy{MaxAttempts: 3, InitialInterval: time.Millisecond}), context.Background(), srv.URL, `{}`)
	if err != nil {
		t.Fatalf("err = %v, want the last response", err)
	}
	if resp.StatusCode != 503 || readAll(t, resp) != `{"attempt":3}` {
		t.Errorf("got %d, want the third 503 as it came", resp.StatusCode)
	}
}

func TestAttemptTimeoutIsRetriedAndSlowBodyIsNotCut(t *testing.T) {
	var calls atomic.Int32
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // the server notices a hang-up only once the body is read
		if calls.Add(1) == 1 {
			select { // first attempt: slower than the attempt timeout
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
			return
		}
		w.WriteHeader(201)
		w.(http.Flusher).Flush()
		time.Sleep(600 * time.Millisecond) // a body slower than the attempt timeout
		io.WriteString(w, "paid")
	}))
	p := fastPolicy
	p.AttemptTimeout = 250 * time.Millisecond // a retry's headers come well within it, even on a busy machine
	var reasons []string
	tr := newTransport(t, p)
	tr.OnAttempt = func(a Attempt) { reasons = append(reasons, errorReason(a.Err)) }
	resp, err := post(t, tr, context.Background(), srv.URL, `{}`)
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, resp); got != "paid" {
		t.Errorf("body = %q, want the whole slow body", got)
	}
	// At least two calls: a retry slowed past the timeout by a busy
	// machine is retried in its turn.
	if calls.Load() < 2 || reasons[0] != "attempt timed out" {
		t.Errorf("calls = %d, reasons = %v; want a timed-out attempt then success", calls.Load(), reasons)
	}
}

func TestAttemptTimeoutExhaustedIsDistinctFromCancel(t *testing.T) {
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // the server notices a hang-up only once the body is read
		<-r.Context().Done()
	}))
	p := fastPolicy
	p.MaxAttempts, p.AttemptTimeout = 2, 20*time.Millisecond
	_, err := post(t, newTransport(t, p), context.Background(), srv.URL, `{}`)
	if !errors.Is(err, ErrAttemptTimeout) {
		t.Errorf("err = %v, want ErrAttemptTimeout in the chain", err)
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v: an attempt timeout must not look like the caller's cancellation", err)
	}
}

func TestContextCanceledDuringWaitReturnsPromptly(t *testing.T) {
	rec := &recorder{script: []int{503}, headers: map[string]string{"Retry-After": "20"}}
	srv := newServer(t, rec)
	ctx, cancel := context.WithCancel(context.Background())
	tr := newTransport(t, RetryPolicy{})
	tr.OnAttempt = func(a Attempt) {
		if a.Retry {
			go func() { time.Sleep(10 * time.Millisecond); cancel() }()
		}
	}
	start := time.Now()
	_, err := post(t, tr, ctx, srv.URL, `{}`)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled in the chain", err)
	}
	var rerr *RetryError
	if !errors.As(err, &rerr) || rerr.Attempts != 1 {
		t.Errorf("err = %#v, want a RetryError after 1 attempt", err)
	}
	// Not a timing assertion on speed: a Retry-After of 20s was not slept.
	if time.Since(start) > 10*time.Second {
		t.Errorf("RoundTrip slept through the cancellation")
	}
	if n := len(rec.requests()); n != 1 {
		t.Errorf("server saw %d requests after cancellation, want 1", n)
	}
}

func TestConflictThenCreated(t *testing.T) {
	rec := &recorder{script: []int{409, 409, 201}, headers: map[string]string{"Retry-After": "0"}}
	srv := newServer(t, rec)
	p := fastPolicy
	p.MaxAttempts = 1 // 409 waits must not use attempts
	resp, err := post(t, newTransport(t, p), context.Background(), srv.URL, `{}`)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	reqs := rec.requests()
	if resp.StatusCode != 201 || len(reqs) != 3 {
		t.Fatalf("status %d after %d requests, want 201 after 3", resp.StatusCode, len(reqs))
	}
	if reqs[0].key != reqs[1].key || reqs[1].key != reqs[2].key {
		t.Errorf("keys differ across 409 retries: %+v", reqs)
	}
}

func TestConflictBudgetEndsInProgress(t *testing.T) {
	rec := &recorder{script: []int{409}, headers: map[string]string{"Content-Type": "application/problem+json"}}
	srv := newServer(t, rec)
	p := fastPolicy
	p.MaxConflictRetries = 3
	_, err := post(t, newTransport(t, p), context.Background(), srv.URL, `{}`)
	var inprog *InProgressError
	if !errors.As(err, &inprog) {
		t.Fatalf("err = %v, want *InProgressError", err)
	}
	if inprog.Polls != 4 || inprog.Key == "" || !strings.Contains(err.Error(), "retry later with the same key") {
		t.Errorf("InProgressError = %+v (%v)", inprog, err)
	}
	var rerr *RetryError
	if errors.As(err, &rerr) {
		t.Errorf("an unknown outcome must be distinct from a RetryError")
	}
}

func TestUnprocessableIsKeyReuseErrorAfterOneRequest(t *testing.T) {
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(422)
		io.WriteString(w, `{"type":"https://idemkit.dev/problems/idempotency-key-mismatch","title":"Idempotency key reused","detail":"The key was first used with another body."}`)
	}))
	client := &http.Client{Transport: newTransport(t, fastPolicy)}
	ctx := WithKey(context.Background(), "k-422")
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/payments", strings.NewReader(`{}`))
	_, err := client.Do(req)
	var reuse *KeyReuseError
	if !errors.As(err, &reuse) {
		t.Fatalf("err = %v, want *KeyReuseError through http.Client", err)
	}
	if reuse.Key != "k-422" || reuse.Method != "POST" || !strings.HasSuffix(reuse.URL, "/v1/payments") {
		t.Errorf("KeyReuseError = %+v", reuse)
	}
	if reuse.Problem.Type != "https://idemkit.dev/problems/idempotency-key-mismatch" || reuse.Problem.Status != 422 {
		t.Errorf("Problem = %+v", reuse.Problem)
	}
	if !strings.Contains(err.Error(), "bug") {
		t.Errorf("message %q does not say it is a bug", err)
	}
}

// onceReader is a body with no GetBody that can be read once.
type onceReader struct{ r io.Reader }

func (o *onceReader) Read(p []byte) (int, error) { return o.r.Read(p) }

func TestNonRewindableBodyIsBufferedAndReplayed(t *testing.T) {
	rec := &recorder{script: []int{500, 201}}
	srv := newServer(t, rec)
	const body = `{"amount":1}`
	req, _ := http.NewRequest(http.MethodPost, srv.URL, &onceReader{strings.NewReader(body)})
	if req.GetBody != nil {
		t.Fatal("test body must have no GetBody")
	}
	resp, err := newTransport(t, fastPolicy).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	for i, r := range rec.requests() {
		if r.body != body {
			t.Errorf("attempt %d body = %q, want %q", i+1, r.body, body)
		}
	}
}

// TestWrongContentLengthIsRefused checks that a body without GetBody whose
// ContentLength disagrees with its bytes is refused before sending. net/http
// refuses a body shorter than its ContentLength with the same error; the
// Transport, which holds the whole body, refuses a longer one too rather
// than send it cut.
func TestWrongContentLengthIsRefused(t *testing.T) {
	newReq := func(url string, cl int64) *http.Request {
		req, _ := http.NewRequest(http.MethodPost, url, &onceReader{r: strings.NewReader("abc")})
		req.ContentLength = cl
		return req
	}
	bare := newServer(t, &recorder{script: []int{201}})
	_, bareErr := newTransport(t, fastPolicy).Base.RoundTrip(newReq(bare.URL, 10))
	if bareErr == nil || !strings.Contains(bareErr.Error(), "http: ContentLength=10 with Body length 3") {
		t.Errorf("net/http alone: err = %v, want its ContentLength error", bareErr)
	}
	for _, cl := range []int64{2, 10} {
		rec := &recorder{script: []int{201}}
		srv := newServer(t, rec)
		_, err := newTransport(t, fastPolicy).RoundTrip(newReq(srv.URL, cl))
		want := "http: ContentLength=" + strconv.FormatInt(cl, 10) + " with Body length 3"
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ContentLength %d: err = %v, want %q", cl, err, want)
		}
		if n := len(rec.requests()); n != 0 {
			t.Errorf("ContentLength %d: the server saw %d requests, want none", cl, n)
		}
	}
}

func TestOversizedNonRewindableBodyIsSentOnce(t *testing.T) {
	rec := &recorder{script: []int{503, 201}}
	srv := newServer(t, rec)
	big := strings.Repeat("x", 100)
	req, _ := http.NewRequest(http.MethodPost, srv.URL, &onceReader{strings.NewReader(big)})
	tr := newTransport(t, fastPolicy)
	tr.MaxBufferedBody = 10
	_, err := tr.RoundTrip(req)
	if !errors.Is(err, ErrBodyNotReplayable) {
		t.Fatalf("err = %v, want ErrBodyNotReplayable", err)
	}
	reqs := rec.requests()
	if len(reqs) != 1 || reqs[0].body != big {
		t.Errorf("requests = %d, want the whole body sent once", len(reqs))
	}
}

func TestRetriedResponsesReuseConnections(t *testing.T) {
	rec := &recorder{script: []int{503, 503, 503, 201}}
	srv := httptest.NewUnstartedServer(rec)
	var conns atomic.Int32
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	tr := newTransport(t, fastPolicy)
	for range 3 {
		resp, err := post(t, tr, context.Background(), srv.URL, `{}`)
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, resp)
		rec.mu.Lock()
		rec.reqs = nil
		rec.mu.Unlock()
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("%d connections for 12 sequential attempts, want 1 (retried bodies drained)", n)
	}
}

func TestCallerRequestIsNotModified(t *testing.T) {
	rec := &recorder{script: []int{503, 201}}
	srv := newServer(t, rec)
	req, _ := http.NewRequest(http.MethodPost, srv.URL, bytes.NewReader([]byte(`{"a":1}`)))
	req.Header.Set("X-Test", "1")
	before := req.Header.Clone()
	resp, err := newTransport(t, fastPolicy).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if len(req.Header) != len(before) || req.Header.Get("Idempotency-Key") != "" {
		t.Errorf("caller's headers changed: %v", req.Header)
	}
	if resp.Request == req {
		t.Errorf("the response's Request is the caller's request, not a clone")
	}
	if resp.Request.Header.Get("Idempotency-Key") == "" {
		t.Errorf("the response's Request does not show the key sent")
	}
}

func TestConcurrentUseOfOneTransport(t *testing.T) {
	var mu sync.Mutex
	perKey := map[string]int{}
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		perKey[r.Header.Get("Idempotency-Key")]++
		n := perKey[r.Header.Get("Idempotency-Key")]
		mu.Unlock()
		if n == 1 {
			w.WriteHeader(503)
			return
		}
		w.WriteHeader(201)
	}))
	tr := newTransport(t, fastPolicy)
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			resp, err := post(t, tr, context.Background(), srv.URL, `{}`)
			if err != nil {
				t.Error(err)
				return
			}
			readAll(t, resp)
			if resp.StatusCode != 201 {
				t.Errorf("status %d", resp.StatusCode)
			}
		})
	}
	wg.Wait()
	if len(perKey) != 50 {
		t.Errorf("%d keys for 50 operations", len(perKey))
	}
	for k, n := range perKey {
		if n != 2 {
			t.Errorf("key %s sent %d times, want 2", k, n)
		}
	}
}

func TestSFStringKeyFormatAndCustomHeader(t *testing.T) {
	var got []string
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = r.Header.Values("PayPal-Request-Id")
		w.WriteHeader(201)
	}))
	tr := newTransport(t, fastPolicy)
	tr.KeyHeader, tr.KeyFormat = "PayPal-Request-Id", KeySFString
	resp, err := post(t, tr, WithKey(context.Background(), "abc-1"), srv.URL, `{}`)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if len(got) != 1 || got[0] != `"abc-1"` {
		t.Errorf("header = %q, want one sf-string", got)
	}
}

// TestSwitchingProtocols sends an upgrade through a Transport with an
// attempt timeout: the 101's body is still the upgraded connection (an
// io.ReadWriteCloser, as net/http promises), it outlives the attempt
// timeout, and closing it releases the attempt's context.
func TestSwitchingProtocols(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
		brw.Flush()
		if line, err := brw.ReadString('\n'); err == nil {
			brw.WriteString(line)
			brw.Flush()
		}
	}))
	defer srv.Close()
	hc := &http.Transport{}
	defer hc.CloseIdleConnections()
	var attempt context.Context
	p := fastPolicy
	p.AttemptTimeout = 20 * time.Millisecond
	tr := &Transport{Retry: p, Base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		attempt = r.Context()
		return hc.RoundTrip(r)
	})}
	req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "echo")
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	rw, ok := resp.Body.(io.ReadWriteCloser)
	if resp.StatusCode != http.StatusSwitchingProtocols || !ok {
		resp.Body.Close()
		t.Fatalf("status %d, body %T: want 101 and an io.ReadWriteCloser", resp.StatusCode, resp.Body)
	}
	time.Sleep(2 * p.AttemptTimeout) // longer than the attempt timeout: not cut
	if _, err := io.WriteString(rw, "ping\n"); err != nil {
		t.Fatalf("write to the upgraded connection: %v", err)
	}
	got := make([]byte, len("ping\n"))
	if _, err := io.ReadFull(rw, got); err != nil || string(got) != "ping\n" {
		t.Fatalf("echo %q, %v; want ping", got, err)
	}
	if attempt.Err() != nil {
		t.Fatalf("attempt context ended while the connection is open: %v", context.Cause(attempt))
	}
	rw.Close()
	if attempt.Err() == nil {
		t.Error("closing the upgraded connection left the attempt's context live")
	}
}

// BenchmarkTransportFirstTry measures the first-try path: one attempt
// answered 201 by an in-memory base, so that allocs/op is the Transport's
// own cost plus a constant for the request and the canned response.
func BenchmarkTransportFirstTry(b *testing.B) {
	created := []byte(`{"id":"pay_123"}`)
	base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		_, _ = io.Copy(io.Discard, req.Body)
		req.Body.Close()
		return &http.Response{
			Status: "201 Created", StatusCode: http.StatusCreated, Header: http.Header{},
			Body: io.NopCloser(bytes.NewReader(created)), ContentLength: int64(len(created)), Request: req,
		}, nil
	})
	payload := []byte(`{"amount":4200,"currency":"usd","customer":"cus_123"}`)
	for _, bc := range []struct {
		name   string
		method string
		policy RetryPolicy
	}{
		{"keyed", http.MethodPost, RetryPolicy{}},
		{"keyed AttemptTimeout", http.MethodPost, RetryPolicy{AttemptTimeout: time.Minute}},
		{"unkeyed", http.MethodPut, RetryPolicy{}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			tr := &Transport{Base: base, Retry: bc.policy}
			b.ReportAllocs()
			for b.Loop() {
				req, err := http.NewRequest(bc.method, "http://stub.invalid/v1/payments", bytes.NewReader(payload))
				if err != nil {
					b.Fatal(err)
				}
				req.Header["Content-Type"] = []string{"application/json"}
				resp, err := tr.RoundTrip(req)
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
}

// TestAttemptContextReleasedOnBodyClose checks that the context an attempt
// gets of its own (under AttemptTimeout, or under MaxElapsedTime, which
// bounds the headers of every retry, and of the first attempt too when set
// explicitly) is released once
// the caller closes the final response's body. Left live, it stays
// registered with a long-lived cancelable request context, one per
// operation, until that context ends: a leak in a worker that sends every
// payment under one signal.NotifyContext.
func TestAttemptContextReleasedOnBodyClose(t *testing.T) {
	for _, tt := range []struct {
		name   string
		policy RetryPolicy
		script []int
	}{
		{"AttemptTimeout", RetryPolicy{AttemptTimeout: time.Minute}, []int{201}},
		{"default policy, after a retry", RetryPolicy{InitialInterval: time.Millisecond}, []int{503, 201}},
		{"MaxElapsedTime, first try", RetryPolicy{MaxElapsedTime: time.Minute}, []int{201}},
		{"MaxElapsedTime, after a retry", RetryPolicy{MaxElapsedTime: time.Minute, InitialInterval: time.Millisecond}, []int{503, 201}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, &recorder{script: tt.script})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var actxs []context.Context
			base := newTransport(t, RetryPolicy{}).Base
			tr := &Transport{Retry: tt.policy, DisableBudget: true, Base: roundTripFunc(func(req *http.Request) (*http.Response, error) {
				actxs = append(actxs, req.Context())
				return base.RoundTrip(req)
			})}
			resp, err := post(t, tr, ctx, srv.URL, `{"amount":4200}`)
			if err != nil {
				t.Fatal(err)
			}
			if body := readAll(t, resp); resp.StatusCode != http.StatusCreated || body == "" {
				t.Fatalf("got %s %q, want 201 with its body read in full", resp.Status, body)
			}
			for i, actx := range actxs {
				if actx.(*attemptContext).Context == ctx {
					continue // no context of its own: it is the caller's
				}
				if actx.Err() == nil {
					t.Errorf("attempt %d of %d: its context is still live after the body was closed", i+1, len(actxs))
				}
			}
		})
	}
}

// TestBaseReturningNothingIsAnError checks that a base RoundTripper that
// returns neither a response nor an error fails the call, as http.Client
// does, instead of crashing the caller's process with a nil dereference.
func TestBaseReturningNothingIsAnError(t *testing.T) {
	tr := &Transport{Base: roundTripFunc(func(*http.Request) (*http.Response, error) { return nil, nil })}
	resp, err := post(t, tr, context.Background(), "http://127.0.0.1:1/v1/payments", `{}`)
	if resp != nil || !errors.Is(err, errNilResponse) {
		t.Errorf("got %v, %v; want no response and errNilResponse", resp, err)
	}
}
