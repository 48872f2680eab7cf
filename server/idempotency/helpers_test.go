package idempotency

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine outlives them.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testLogger discards logs unless IDEM_TEST_LOG is set.
func testLogger(t *testing.T) *slog.Logger {
	if os.Getenv("IDEM_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// withClient authenticates every request as client "c", unless opts has a
// ClientID of its own.
func withClient(h http.Handler, opts Options) http.Handler {
	if opts.ClientID != nil {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r.WithContext(WithClientID(r.Context(), "c")))
	})
}

// middleware returns h behind Middleware on store, its requests
// authenticated as client "c" unless opts.ClientID says otherwise, logging
// to the test.
func testHandler(t *testing.T, store Store, opts Options, h http.HandlerFunc) http.Handler {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = testLogger(t)
	}
	return withClient(Middleware(store, opts)(h), opts)
}

// testServer is a handler behind an httptest.Server.
type testServer struct {
	URL     string
	client  *http.Client
	handler http.Handler // what the server serves, for requests served in process
}

// mwServer serves h behind Middleware on store (see testHandler), stopped
// when the test ends.
func mwServer(t *testing.T, store Store, opts Options, h http.HandlerFunc) *testServer {
	t.Helper()
	handler := testHandler(t, store, opts, h)
	hs := httptest.NewServer(handler)
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(func() {
		client.CloseIdleConnections()
		hs.Close()
	})
	return &testServer{URL: hs.URL, client: client, handler: handler}
}

// call is one raw request; the zero fields mean: POST /v1/payments with no
// key and a JSON body.
type call struct {
	method      string
	path        string
	keys        []string // Idempotency-Key header lines
	contentType string
	body        string
}

func keyed(key, body string) call { return call{keys: []string{key}, body: body} }

// request returns c as a request to base (a server's URL, or "" for a
// request served in process).
func (c call) request(t *testing.T, base string) *http.Request {
	t.Helper()
	method := c.method
	if method == "" {
		method = http.MethodPost
	}
	path := c.path
	if path == "" {
		path = "/v1/payments"
	}
	var body io.Reader
	if c.body != "" {
		body = strings.NewReader(c.body)
	}
	var req *http.Request
	if base == "" {
		req = httptest.NewRequest(method, path, body)
	} else {
		var err error
		if req, err = http.NewRequest(method, base+path, body); err != nil {
			t.Fatal(err)
		}
	}
	for _, k := range c.keys {
		req.Header.Add("Idempotency-Key", k)
	}
	if c.body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.contentType != "" {
		req.Header.Set("Content-Type", c.contentType)
	}
	return req
}

// reply is a response read whole.
type reply struct {
	status int
	header http.Header
	body   []byte
	err    error
}

func (r reply) replayed() bool { return r.header.Get("Idempotent-Replayed") == "true" }

// problem decodes the body as problem details.
func (r reply) problem(t *testing.T) problem {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("Content-Type = %q, want application/problem+json; body %s", ct, r.body)
	}
	var p problem
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("problem body %s: %v", r.body, err)
	}
	if p.Status != r.status || p.Title == "" || p.Detail == "" {
		t.Errorf("incomplete problem %+v for status %d", p, r.status)
	}
	return p
}

// send makes one raw request (no retries) and reads the response.
func (ts *testServer) send(t *testing.T, c call) reply {
	t.Helper()
	resp, err := ts.client.Do(c.request(t, ts.URL))
	if err != nil {
		return reply{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: b, err: err}
}

// mustSend is send for requests that must get an answer.
func (ts *testServer) mustSend(t *testing.T, c call) reply {
	t.Helper()
	r := ts.send(t, c)
	if r.err != nil {
		t.Fatalf("%s %s: %v", c.method, c.path, r.err)
	}
	return r
}

// serve serves c with h in process, without a network, as the tests that
// run in a synctest bubble need.
func serve(t *testing.T, h http.Handler, c call) reply {
	t.Helper()
	return serveRequest(t, h, c.request(t, ""))
}

// serveRequest serves req with h in process.
func serveRequest(t *testing.T, h http.Handler, req *http.Request) reply {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	resp := rec.Result()
	b, _ := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: b}
}
