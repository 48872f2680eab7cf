package idem

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jarcoal/httpmock"

	"github.com/idemkit/idem/internal/keyheader"
)

// The tests in this file script sequences of answers with httpmock, where
// a list of responses reads more clearly than a handler.

const mockURL = "https://api.example.com/v1/payments"

// mockTransport returns a Transport over a fresh httpmock transport with
// short real waits.
func mockTransport(t *testing.T) (*Transport, *httpmock.MockTransport) {
	t.Helper()
	mock := httpmock.NewMockTransport()
	return &Transport{Base: mock, Retry: RetryPolicy{InitialInterval: time.Millisecond, MaxInterval: 2 * time.Millisecond}}, mock
}

// sequence chains responders: each answers once, the last one repeats.
func sequence(first httpmock.Responder, rest ...httpmock.Responder) httpmock.Responder {
	r := first
	for _, next := range rest {
		r = r.Then(next)
	}
	return r
}

func mockSend(t *testing.T, tr *Transport, method, body string) (*http.Response, error) {
	t.Helper()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(context.Background(), method, mockURL, r)
	if err != nil {
		t.Fatal(err)
	}
	return tr.RoundTrip(req)
}

func calls(mock *httpmock.MockTransport, method string) int {
	return mock.GetCallCountInfo()[method+" "+mockURL]
}

// keyLog is a responder wrapper that records the key header lines and the
// body of every request.
type keyLog struct {
	mu     sync.Mutex
	keys   [][]string
	bodies []string
}

func (l *keyLog) wrap(r httpmock.Responder) httpmock.Responder {
	return func(req *http.Request) (*http.Response, error) {
		var body []byte
		if req.Body != nil {
			body, _ = io.ReadAll(req.Body)
		}
		l.mu.Lock()
		l.keys = append(l.keys, req.Header.Values(DefaultKeyHeader))
		l.bodies = append(l.bodies, string(body))
		l.mu.Unlock()
		return r(req)
	}
}

func TestMockRetriedSequences(t *testing.T) {
	retryAfter0 := http.Header{"Retry-After": {"0"}}
	tests := []struct {
		name      string
		method    string
		responder httpmock.Responder
		want      int
		calls     int
		wantBody  string // if not empty
	}{
		{"429 with Retry-After then 201", http.MethodPost, sequence(
			httpmock.NewStringResponder(429, `{"title":"slow down"}`).HeaderSet(retryAfter0),
			httpmock.NewStringResponder(201, `{"id":"pay_1"}`),
		), 201, 2, ""},
		{"500, 502, 504 then 201", http.MethodPost, sequence(
			httpmock.NewStringResponder(500, "boom"),
			httpmock.NewStringResponder(502, "bad gateway"),
			httpmock.NewStringResponder(504, "gateway timeout"),
			httpmock.NewStringResponder(201, `{"id":"pay_1"}`),
		), 201, 4, ""},
		{"408 then 201", http.MethodPost, sequence(
			httpmock.NewStringResponder(408, ""),
			httpmock.NewStringResponder(201, `{"id":"pay_1"}`),
		), 201, 2, ""},
		{"connection reset then 201", http.MethodPost, sequence(
			httpmock.NewErrorResponder(readErr(syscall.ECONNRESET)),
			httpmock.NewStringResponder(201, `{"id":"pay_1"}`),
		), 201, 2, ""},
		{"unkeyed DELETE: 503 then 204", http.MethodDelete, sequence(
			httpmock.NewStringResponder(503, ""),
			httpmock.NewStringResponder(204, ""),
		), 204, 2, ""},
		{"unkeyed GET: EOF then 200", http.MethodGet, sequence(
			httpmock.NewErrorResponder(io.ErrUnexpectedEOF),
			httpmock.NewStringResponder(200, `{"id":"pay_1"}`),
		), 200, 2, ""},
		{"five 503s: the fourth is returned", http.MethodPost, httpmock.ResponderFromMultipleResponses([]*http.Response{
			httpmock.NewStringResponse(503, "1"),
			httpmock.NewStringResponse(503, "2"),
			httpmock.NewStringResponse(503, "3"),
			httpmock.NewStringResponse(503, "4"),
			httpmock.NewStringResponse(503, "5"),
		}), 503, DefaultMaxAttempts, "4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr, mock := mockTransport(t)
			mock.RegisterResponder(tt.method, mockURL, tt.responder)
			resp, err := mockSend(t, tr, tt.method, "")
			if err != nil {
				t.Fatal(err)
			}
			body := readAll(t, resp)
			if resp.StatusCode != tt.want || calls(mock, tt.method) != tt.calls {
				t.Errorf("status %d after %d calls, want %d after %d", resp.StatusCode, calls(mock, tt.method), tt.want, tt.calls)
			}
			if tt.wantBody != "" && body != tt.wantBody {
				t.Errorf("body = %q, want %q", body, tt.wantBody)
			}
		})
	}
}

func TestMockNotRetried(t *testing.T) {
	tests := []struct {
		name   string
		method string
		status int
	}{
		{"400 keyed", http.MethodPost, 400},
		{"401 keyed", http.MethodPost, 401},
		{"404 keyed", http.MethodPost, 404},
		{"404 unkeyed", http.MethodGet, 404},
		{"409 on an unkeyed PUT", http.MethodPut, 409},
		{"409 on an unkeyed DELETE", http.MethodDelete, 409},
		{"422 on an unkeyed PUT", http.MethodPut, 422},
		{"422 on an unkeyed GET", http.MethodGet, 422},
		{"501 keyed", http.MethodPost, 501},
		{"503 on a method that is not idempotent", "PURGE", 503},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr, mock := mockTransport(t)
			body := `{"title":"` + http.StatusText(tt.status) + `"}`
			mock.RegisterResponder(tt.method, mockURL, sequence(
				httpmock.NewStringResponder(tt.status, body),
				httpmock.NewStringResponder(200, "retried"),
			))
			resp, err := mockSend(t, tr, tt.method, "")
			if err != nil {
				t.Fatalf("err = %v, want the %d as a response", err, tt.status)
			}
			if resp.StatusCode != tt.status || readAll(t, resp) != body {
				t.Errorf("got %d, want the %d as it came", resp.StatusCode, tt.status)
			}
			if n := calls(mock, tt.method); n != 1 {
				t.Errorf("%d calls, want 1", n)
			}
		})
	}
}

func TestMockNotRetriedError(t *testing.T) {
	tr, mock := mockTransport(t)
	mock.RegisterResponder(http.MethodPost, mockURL, sequence(
		httpmock.NewErrorResponder(urlErr(context.DeadlineExceeded)),
		httpmock.NewStringResponder(201, ""),
	))
	// A keyed call: the error comes in a RetryError with the key, as the
	// request may have reached the server.
	_, err := mockSend(t, tr, http.MethodPost, `{}`)
	var rerr *RetryError
	if !errors.Is(err, context.DeadlineExceeded) || !errors.As(err, &rerr) || rerr.Attempts != 1 || rerr.Key == "" {
		t.Errorf("err = %v, want the attempt's own error in a RetryError with the key", err)
	}
	if n := calls(mock, http.MethodPost); n != 1 {
		t.Errorf("%d calls, want 1", n)
	}

	// An unkeyed one: the attempt's own error, as it came.
	mock.RegisterResponder(http.MethodGet, mockURL, httpmock.NewErrorResponder(urlErr(context.DeadlineExceeded)))
	_, err = mockSend(t, tr, http.MethodGet, "")
	if !errors.Is(err, context.DeadlineExceeded) || errors.As(err, &rerr) {
		t.Errorf("err = %v, want the attempt's own error, not a RetryError", err)
	}
}

func TestMockKeyIdenticalOnEveryKeyedAttempt(t *testing.T) {
	for _, method := range []string{http.MethodPost, http.MethodPatch} {
		t.Run(method, func(t *testing.T) {
			tr, mock := mockTransport(t)
			var log keyLog
			mock.RegisterResponder(method, mockURL, log.wrap(sequence(
				httpmock.NewStringResponder(503, ""),
				httpmock.NewErrorResponder(readErr(syscall.ECONNRESET)),
				httpmock.NewStringResponder(409, "").HeaderSet(http.Header{"Retry-After": {"0"}}),
				httpmock.NewStringResponder(200, `{"id":"pay_1"}`),
			)))
			const body = `{"amount":4200,"currency":"usd"}`
			resp, err := mockSend(t, tr, method, body)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 200 || len(log.keys) != 4 {
				t.Fatalf("status %d after %d calls, want 200 after 4", resp.StatusCode, len(log.keys))
			}
			key := log.keys[0]
			if len(key) != 1 {
				t.Fatalf("first attempt sent key lines %q, want one", key)
			}
			if u, err := uuid.Parse(key[0]); err != nil || u.Version() != 4 {
				t.Errorf("key %q is not a UUIDv4", key[0])
			}
			for i := range log.keys {
				if len(log.keys[i]) != 1 || log.keys[i][0] != key[0] || log.bodies[i] != body {
					t.Errorf("attempt %d sent key %q, body %q; want key %q and the same body", i+1, log.keys[i], log.bodies[i], key[0])
				}
			}
			if got := resp.Request.Header.Get(DefaultKeyHeader); got != key[0] {
				t.Errorf("resp.Request carries key %q, want %q", got, key[0])
			}
		})
	}
}

func TestMockUnkeyedMethodsSendNoKey(t *testing.T) {
	for _, method := range []string{http.MethodGet, http.MethodPut, http.MethodDelete, http.MethodHead, http.MethodOptions} {
		tr, mock := mockTransport(t)
		var log keyLog
		mock.RegisterResponder(method, mockURL, log.wrap(sequence(
			httpmock.NewStringResponder(502, ""),
			httpmock.NewStringResponder(200, ""),
		)))
		resp, err := mockSend(t, tr, method, "")
		if err != nil {
			t.Fatalf("%s: %v", method, err)
		}
		resp.Body.Close()
		if len(log.keys) != 2 || log.keys[0] != nil || log.keys[1] != nil {
			t.Errorf("%s: key lines %q, want two attempts with no key", method, log.keys)
		}
	}
}

// closeTracker is a request body that records whether it was closed.
type closeTracker struct {
	io.Reader
	closed bool
}

func (c *closeTracker) Close() error { c.closed = true; return nil }

func TestMockInvalidKeyHeaderFailsBeforeSending(t *testing.T) {
	tests := []struct {
		name   string
		values []string
		want   error
	}{
		{"empty", []string{""}, keyheader.ErrEmpty},
		{"space inside", []string{"order 42"}, keyheader.ErrInvalid},
		{"non-ASCII", []string{"clé-42"}, keyheader.ErrInvalid},
		{"too long", []string{strings.Repeat("k", MaxKeyLen+1)}, keyheader.ErrTooLong},
		{"two lines", []string{"a", "b"}, keyheader.ErrMultiple},
		{"unterminated sf-string", []string{`"abc`}, keyheader.ErrSyntax},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr, mock := mockTransport(t)
			mock.RegisterResponder(http.MethodPost, mockURL, httpmock.NewStringResponder(201, ""))
			body := &closeTracker{Reader: strings.NewReader(`{}`)}
			req, _ := http.NewRequest(http.MethodPost, mockURL, body)
			req.Header[DefaultKeyHeader] = tt.values
			resp, err := tr.RoundTrip(req)
			if resp != nil || !errors.Is(err, tt.want) {
				t.Errorf("RoundTrip = %v, %v; want no response and %v", resp, err, tt.want)
			}
			if err != nil && !strings.Contains(err.Error(), DefaultKeyHeader) {
				t.Errorf("error %q does not name the header", err)
			}
			if n := mock.GetTotalCallCount(); n != 0 {
				t.Errorf("%d requests sent, want none", n)
			}
			if !body.closed {
				t.Errorf("the request body was not closed")
			}
		})
	}
}

func TestMockKeyReuseAfterOneRequest(t *testing.T) {
	tr, mock := mockTransport(t)
	problem := httpmock.NewStringResponse(422, `{"title":"Idempotency key reused","detail":"The key was first used with another body."}`)
	problem.Header.Set("Content-Type", "application/problem+json")
	mock.RegisterResponder(http.MethodPatch, mockURL, sequence(httpmock.ResponderFromResponse(problem), httpmock.NewStringResponder(200, "")))
	req, _ := http.NewRequestWithContext(WithKey(context.Background(), "order-42"), http.MethodPatch, mockURL, strings.NewReader(`{}`))
	resp, err := tr.RoundTrip(req)
	var reuse *KeyReuseError
	if resp != nil || !errors.As(err, &reuse) {
		t.Fatalf("RoundTrip = %v, %v; want nil, *KeyReuseError", resp, err)
	}
	if reuse.Key != "order-42" || reuse.Method != http.MethodPatch || reuse.URL != mockURL || reuse.Problem.Status != 422 || reuse.Problem.Detail != "The key was first used with another body." {
		t.Errorf("KeyReuseError = %+v, Problem %+v", reuse, reuse.Problem)
	}
	if n := calls(mock, http.MethodPatch); n != 1 {
		t.Errorf("%d calls, want 1", n)
	}
}

func TestMockRequestKeyHeaderSentAsIs(t *testing.T) {
	tests := []struct {
		value  string
		format KeyFormat
	}{
		{`"order-42"`, KeyBare},   // an RFC 9651 sf-string is not unquoted
		{"order-42", KeySFString}, // a bare key is not quoted
	}
	for _, tt := range tests {
		tr, mock := mockTransport(t)
		tr.KeyFormat = tt.format
		var log keyLog
		mock.RegisterResponder(http.MethodPost, mockURL, log.wrap(httpmock.NewStringResponder(503, "")))
		req, _ := http.NewRequest(http.MethodPost, mockURL, strings.NewReader(`{}`))
		req.Header.Set(DefaultKeyHeader, tt.value)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if len(log.keys) != DefaultMaxAttempts {
			t.Fatalf("%d calls, want %d", len(log.keys), DefaultMaxAttempts)
		}
		for i, k := range log.keys {
			if len(k) != 1 || k[0] != tt.value {
				t.Errorf("%s: attempt %d sent key lines %q, want the request's own value", tt.value, i+1, k)
			}
		}
	}
}

func TestMockNewKeyAndKeyHeader(t *testing.T) {
	tr, mock := mockTransport(t)
	n := 0
	tr.NewKey = func() string { n++; return "op-" + strings.Repeat("x", n) }
	tr.KeyHeader = "PayPal-Request-Id"
	var (
		mu   sync.Mutex
		sent []string
	)
	mock.RegisterResponder(http.MethodPost, mockURL, func(req *http.Request) (*http.Response, error) {
		mu.Lock()
		sent = append(sent, req.Header.Get("PayPal-Request-Id")+"|"+req.Header.Get(DefaultKeyHeader))
		mu.Unlock()
		return httpmock.NewStringResponse(503, ""), nil
	})
	for range 2 {
		tr.Retry.MaxAttempts = 2
		resp, err := mockSend(t, tr, http.MethodPost, `{}`)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	want := []string{"op-x|", "op-x|", "op-xx|", "op-xx|"}
	if strings.Join(sent, " ") != strings.Join(want, " ") {
		t.Errorf("sent %q, want %q: one NewKey call per operation, in KeyHeader only", sent, want)
	}
}
