package idem

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestOutcomeOfResponses: a response is done, but for the statuses that
// are no final word on the operation.
func TestOutcomeOfResponses(t *testing.T) {
	for code, want := range map[int]Outcome{
		200: OutcomeDone, 201: OutcomeDone, 204: OutcomeDone, 301: OutcomeDone,
		400: OutcomeDone, 401: OutcomeDone, 404: OutcomeDone, 422: OutcomeDone,
		408: OutcomeUnknown, 409: OutcomeUnknown, 429: OutcomeUnknown,
		500: OutcomeUnknown, 502: OutcomeUnknown, 503: OutcomeUnknown, 504: OutcomeUnknown, 501: OutcomeUnknown,
	} {
		assert.Equal(t, want, OutcomeOf(statusResponse(code), nil), "status %d", code)
		assert.Equal(t, want, OutcomeOf(nil, &APIError{StatusCode: code}), "APIError %d", code)
	}
	assert.Equal(t, OutcomeDone, OutcomeOf(nil, nil))
	assert.Equal(t, OutcomeUnknown, OutcomeOf(nil, errors.New("something")))
	assert.Equal(t, OutcomeNotSent, OutcomeOf(nil, fmt.Errorf("breaker: %w", ErrNotSent)))
	assert.Equal(t, OutcomeUnknown, OutcomeOf(nil, &RetryError{Attempts: 2}), "a RetryError made by hand is unknown")
	assert.Equal(t, OutcomeUnknown, OutcomeOf(nil, &KeyReuseError{Attempts: 2}), "a 422 to a retry, made by hand, is unknown")
	assert.Equal(t, OutcomeDone, OutcomeOf(nil, &KeyReuseError{Attempts: 1}))
	assert.Equal(t, OutcomeUnknown, OutcomeOf(nil, &InProgressError{}))
	assert.Equal(t, "not sent", OutcomeNotSent.String())
	assert.Equal(t, "done", OutcomeDone.String())
	assert.Equal(t, "unknown", OutcomeUnknown.String())
}

// unsentBase fails every attempt with err without reading its body, as a
// failed dial does; it counts the attempts.
func unsentBase(err error, n *atomic.Int32) roundTripFunc {
	return func(req *http.Request) (*http.Response, error) {
		n.Add(1)
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
}

// readingBase is unsentBase that reads the body first, as a Base (or
// http.Transport) that wrote the request, then re-sent it and failed, does.
func readingBase(err error, n *atomic.Int32) roundTripFunc {
	return func(req *http.Request) (*http.Response, error) {
		n.Add(1)
		if req.Body != nil {
			_, _ = io.Copy(io.Discard, req.Body)
			req.Body.Close()
		}
		return nil, err
	}
}

// script answers the attempts in turn (the last repeats).
func script(answers ...roundTripFunc) roundTripFunc {
	var n int
	return func(req *http.Request) (*http.Response, error) {
		a := answers[min(n, len(answers)-1)]
		n++
		return a(req)
	}
}

func answering(code int) roundTripFunc {
	return func(req *http.Request) (*http.Response, error) { return reply(code)(req) }
}

// refusedStreamErr returns net/http's own HTTP/2 stream error, taken from
// a real reset, with its code made REFUSED_STREAM.
func refusedStreamErr(t *testing.T) error {
	t.Helper()
	srv := newHTTP2Server(t, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		panic(http.ErrAbortHandler)
	}))
	req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
	_, err := srv.Client().Transport.RoundTrip(req)
	require.Error(t, err)
	for _, e := range errorChain(err) {
		if http2Reason(e) != "HTTP/2 stream reset" {
			continue
		}
		v := reflect.New(reflect.TypeOf(e)).Elem()
		v.Set(reflect.ValueOf(e))
		v.FieldByName("Code").SetUint(0x7)
		return urlErr(v.Interface().(error))
	}
	t.Fatalf("no stream error in %v", err)
	return nil
}

// TestSynctestOutcomeOfErrors checks every way a keyed call ends on an
// error against the outcome it must give.
func TestSynctestOutcomeOfErrors(t *testing.T) {
	refused := dialErr(syscall.ECONNREFUSED)
	reset := readErr(syscall.ECONNRESET)
	dns := urlErr(&net.OpError{Op: "dial", Net: "tcp", Err: &net.DNSError{Err: "no such host", Name: "api.example.invalid", IsNotFound: true}})
	cert := urlErr(&tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}})
	breaker := fmt.Errorf("%w: %w", ErrNotSent, errors.New("circuit breaker open"))
	stream := refusedStreamErr(t)

	type row struct {
		name     string
		base     func(n *atomic.Int32) roundTripFunc
		tr       func(tr *Transport)
		req      func(ctx context.Context) *http.Request
		want     Outcome
		attempts int32 // that reached the base
	}
	post := func(body io.Reader, header ...string) func(ctx context.Context) *http.Request {
		return func(ctx context.Context) *http.Request {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, mockURL, body)
			for i := 0; i+1 < len(header); i += 2 {
				req.Header.Set(header[i], header[i+1])
			}
			return req
		}
	}
	in := func() io.Reader { return strings.NewReader(`{"amount":4200}`) }
	hidden := func() io.Reader { return bodyOnly{strings.NewReader(`{"amount":4200}`)} } // no GetBody, nor a type to inspect
	rows := []row{
		{"dial refused every time", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) }, nil, nil, OutcomeNotSent, 4},
		{"name not found", func(n *atomic.Int32) roundTripFunc { return unsentBase(dns, n) }, nil, nil, OutcomeNotSent, 1},
		{"certificate refused", func(n *atomic.Int32) roundTripFunc { return unsentBase(cert, n) }, nil, nil, OutcomeNotSent, 1},
		{"HTTP/2 REFUSED_STREAM", func(n *atomic.Int32) roundTripFunc { return unsentBase(stream, n) }, nil, nil, OutcomeNotSent, 4},
		{"Base refused (ErrNotSent), not retried", func(n *atomic.Int32) roundTripFunc { return unsentBase(breaker, n) }, nil, nil, OutcomeNotSent, 1},
		{"503, then dial refused", func(n *atomic.Int32) roundTripFunc {
			return script(func(r *http.Request) (*http.Response, error) { n.Add(1); return answering(503)(r) }, unsentBase(refused, n))
		}, nil, nil, OutcomeUnknown, 4},
		{"reset, then dial refused", func(n *atomic.Int32) roundTripFunc {
			return script(unsentBase(reset, n), unsentBase(refused, n))
		}, nil, nil, OutcomeUnknown, 4},
		{"dial refused after the body was read (a re-send inside the Base)", func(n *atomic.Int32) roundTripFunc { return readingBase(refused, n) }, nil, nil, OutcomeUnknown, 4},
		// failsafe-go's round tripper reads the body before its circuit
		// breaker refuses: the Base vouches that nothing was sent.
		{"ErrNotSent after the body was read", func(n *atomic.Int32) roundTripFunc { return readingBase(breaker, n) }, nil, nil, OutcomeNotSent, 1},
		{"dial refused, body of unknown kind, Idempotency-Key", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) },
			func(tr *Transport) { tr.MaxBufferedBody = -1 }, post(hidden()), OutcomeNotSent, 1},
		{"dial refused, a caller's GetBody of unknown kind, Idempotency-Key", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) },
			nil, func(ctx context.Context) *http.Request {
				req := post(hidden())(ctx)
				req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(hidden()), nil }
				return req
			}, OutcomeUnknown, 4},
		{"dial refused, a caller's GetBody of unknown kind, PayPal-Request-Id", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) },
			func(tr *Transport) { tr.KeyHeader = "PayPal-Request-Id" }, func(ctx context.Context) *http.Request {
				req := post(hidden())(ctx)
				req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(hidden()), nil }
				return req
			}, OutcomeNotSent, 4},
		{"dial refused, bytes.Buffer body, Idempotency-Key", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) }, nil,
			post(bytes.NewBufferString(`{"amount":4200}`)), OutcomeNotSent, 4},
		{"dial refused, no body, Idempotency-Key", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) }, nil, post(nil), OutcomeUnknown, 4},
		{"dial refused, no body, PayPal-Request-Id", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) },
			func(tr *Transport) { tr.KeyHeader = "PayPal-Request-Id" }, post(nil), OutcomeNotSent, 4},
		{"dial refused, key in the body", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) },
			func(tr *Transport) { tr.KeyBodyField = "idempotency_key" }, nil, OutcomeNotSent, 4},
		{"budget spent on dial refusals", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) },
			func(tr *Transport) { tr.DisableBudget, tr.Budget = false, NewRetryBudget(1, 0) }, nil, OutcomeNotSent, 2},
		{"budget spent after a 503", func(n *atomic.Int32) roundTripFunc {
			return func(r *http.Request) (*http.Response, error) { n.Add(1); return answering(503)(r) }
		}, func(tr *Transport) { tr.DisableBudget, tr.Budget = false, NewRetryBudget(1, 0) }, nil, OutcomeUnknown, 2},
		{"body not replayable after a dial refusal", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) },
			func(tr *Transport) { tr.MaxBufferedBody = 4 }, post(hidden()), OutcomeNotSent, 1},
		{"context done before the first attempt", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) }, nil,
			func(context.Context) *http.Request {
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				return post(in())(ctx)
			}, OutcomeNotSent, 0},
		{"context done during the attempt", func(n *atomic.Int32) roundTripFunc {
			return func(r *http.Request) (*http.Response, error) { n.Add(1); return blockUntilDone(r) }
		}, nil, func(context.Context) *http.Request {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = cancel
			return post(in())(ctx)
		}, OutcomeUnknown, 1},
		{"attempt timeouts", func(n *atomic.Int32) roundTripFunc {
			return func(r *http.Request) (*http.Response, error) { n.Add(1); return blockUntilDone(r) }
		}, func(tr *Transport) { tr.Retry.AttemptTimeout = time.Second }, nil, OutcomeUnknown, 4},
		{"GetBody fails after a dial refusal", func(n *atomic.Int32) roundTripFunc { return unsentBase(refused, n) }, nil,
			func(ctx context.Context) *http.Request {
				req := post(in())(ctx)
				req.GetBody = func() (io.ReadCloser, error) { return nil, errors.New("gone") }
				return req
			}, OutcomeNotSent, 1},
		{"GetBody fails after a 503", func(n *atomic.Int32) roundTripFunc {
			return func(r *http.Request) (*http.Response, error) { n.Add(1); return answering(503)(r) }
		}, nil, func(ctx context.Context) *http.Request {
			req := post(in())(ctx)
			req.GetBody = func() (io.ReadCloser, error) { return nil, errors.New("gone") }
			return req
		}, OutcomeUnknown, 1},
	}
	for _, tt := range rows {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var n atomic.Int32
				tr := &Transport{Base: tt.base(&n), DisableBudget: true}
				if tt.tr != nil {
					tt.tr(tr)
				}
				mk := tt.req
				if mk == nil {
					mk = post(in())
				}
				resp, err := tr.RoundTrip(mk(context.Background()))
				require.Nil(t, resp)
				var rerr *RetryError
				require.ErrorAs(t, err, &rerr, "got %v", err)
				assert.NotEmpty(t, rerr.Key)
				assert.Equal(t, tt.want, OutcomeOf(resp, err), "%v", err)
				assert.Equal(t, tt.attempts, n.Load(), "attempts that reached the base")
				// Through http.Client, the same.
				assert.Equal(t, tt.want, OutcomeOf(nil, urlErr(err)))
			})
		})
	}
}

// TestSynctestOutcomeOfKeyReuse: a 422 is a definite answer to the
// first attempt, and to a retry after attempts none of which was sent;
// to a retry after one that may have reached the server, it is not.
func TestSynctestOutcomeOfKeyReuse(t *testing.T) {
	for _, tt := range []struct {
		name string
		base roundTripFunc
		want Outcome
	}{
		{"first attempt", answering(422), OutcomeDone},
		{"after a dial refusal", script(unsentBase(dialErr(syscall.ECONNREFUSED), new(atomic.Int32)), answering(422)), OutcomeDone},
		{"after a 503", script(answering(503), answering(422)), OutcomeUnknown},
		{"after a reset", script(unsentBase(readErr(syscall.ECONNRESET), new(atomic.Int32)), answering(422)), OutcomeUnknown},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				_, err := fakePost(t, &Transport{Base: tt.base}, context.Background())
				var reuse *KeyReuseError
				require.ErrorAs(t, err, &reuse)
				assert.Equal(t, tt.want, OutcomeOf(nil, err))
				if tt.want == OutcomeDone {
					assert.Contains(t, err.Error(), "a bug in the caller")
				} else {
					assert.Contains(t, err.Error(), "may have taken effect")
				}
			})
		})
	}
}

// TestSynctestOutcomeOfOtherEnds covers the rest: a response, an
// InProgressError, and the refusals before anything is sent.
func TestSynctestOutcomeOfOtherEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		resp, err := fakePost(t, &Transport{Base: answering(201)}, context.Background())
		assert.Equal(t, OutcomeDone, OutcomeOf(resp, err))
		resp.Body.Close()
		resp, err = fakePost(t, &Transport{Base: answering(503)}, context.Background())
		assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err), "attempts ran out on a 503")
		resp.Body.Close()

		_, err = fakePost(t, &Transport{Base: answering(409), Retry: RetryPolicy{MaxConflictRetries: 2}}, context.Background())
		var inprog *InProgressError
		require.ErrorAs(t, err, &inprog)
		assert.Equal(t, OutcomeUnknown, OutcomeOf(nil, err))
	})

	var n atomic.Int32
	base := readingBase(errors.New("must not be sent"), &n)
	for name, send := range map[string]func() error{
		"invalid key header": func() error {
			req, _ := http.NewRequest(http.MethodPost, mockURL, strings.NewReader(`{}`))
			req.Header.Set(DefaultKeyHeader, "bad key with spaces")
			_, err := (&Transport{Base: base}).RoundTrip(req)
			return err
		},
		"body that cannot carry the key": func() error {
			req, _ := http.NewRequest(http.MethodPost, mockURL, strings.NewReader(`[1]`))
			_, err := (&Transport{Base: base, KeyBodyField: "idempotency_key"}).RoundTrip(req)
			assert.ErrorIs(t, err, ErrKeyBodyField)
			return err
		},
		"body that cannot be read": func() error {
			req, _ := http.NewRequest(http.MethodPost, mockURL, bodyOnly{iotestErrReader{}})
			_, err := (&Transport{Base: base}).RoundTrip(req)
			return err
		},
		"Client: input that cannot be encoded": func() error {
			_, err := (&Client{BaseURL: mockURL, HTTPClient: &http.Client{Transport: &Transport{Base: base}}}).Post(context.Background(), "/", make(chan int), nil)
			return err
		},
	} {
		require.Error(t, send(), name)
		assert.Equal(t, OutcomeNotSent, OutcomeOf(nil, send()), name)
	}
	assert.Zero(t, n.Load(), "nothing reached the base")
}

// iotestErrReader fails every read.
type iotestErrReader struct{}

func (iotestErrReader) Read([]byte) (int, error) { return 0, errors.New("disk gone") }

// TestOutcomeOfClient: a Client's APIError and a 2xx it cannot decode.
func TestOutcomeOfClient(t *testing.T) {
	url, _ := apiServer(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/bad":
			answerJSON(400, "application/problem+json", `{"title":"Bad Request"}`)(w, r)
		case "/down":
			answerJSON(503, "application/problem+json", `{"title":"Unavailable"}`)(w, r)
		default:
			answerJSON(201, "application/json", `{"id":`)(w, r)
		}
	})
	c := newClient(t, url)
	c.HTTPClient.Transport.(*Transport).Retry.MaxAttempts = 2
	for path, want := range map[string]Outcome{"/bad": OutcomeDone, "/down": OutcomeUnknown, "/cut": OutcomeDone} {
		var out payment
		resp, err := c.Post(context.Background(), path, payment{Amount: 5}, &out)
		require.Error(t, err, path)
		assert.Equal(t, want, OutcomeOf(resp, err), path)
	}
}

// TestOutcomeOfTheWire checks the outcome of attempts that failed on the
// wire: a refused dial and a refused certificate are not sent; a payment
// that reached a server that then died, and that http.Transport re-sent
// on its own to find the port closed, is unknown, though the error it
// returns is a refused dial.
func TestOutcomeOfTheWire(t *testing.T) {
	t.Run("connection refused", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		addr := ln.Addr().String()
		ln.Close()
		tr := newTransport(t, fastPolicy)
		_, err = post(t, tr, context.Background(), "http://"+addr+"/v1/payments", `{"amount":4200}`)
		require.ErrorIs(t, err, syscall.ECONNREFUSED)
		assert.Equal(t, OutcomeNotSent, OutcomeOf(nil, err))
	})

	t.Run("certificate refused", func(t *testing.T) {
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
			t.Error("the request reached the handler")
		}))
		srv.Config.ErrorLog = discardLog()
		srv.StartTLS()
		t.Cleanup(srv.Close)
		tr := newTransport(t, fastPolicy) // trusts the system roots, not the test certificate
		_, err := post(t, tr, context.Background(), srv.URL, `{"amount":4200}`)
		var certErr *tls.CertificateVerificationError
		require.ErrorAs(t, err, &certErr)
		assert.Equal(t, OutcomeNotSent, OutcomeOf(nil, err))
	})

	t.Run("server died after reading, re-sent by net/http, port closed", func(t *testing.T) {
		var got atomic.Int32
		var srv *httptest.Server
		srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet {
				return // the warm-up
			}
			_, _ = io.Copy(io.Discard, r.Body)
			got.Add(1)
			// The payment is made; the process dies before answering.
			srv.Listener.Close()
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				conn.Close()
			}
		}))
		srv.Config.ErrorLog = discardLog()
		t.Cleanup(srv.Close)
		base := &http.Transport{}
		t.Cleanup(base.CloseIdleConnections)
		// A request first, so that the payment goes on a reused
		// connection: net/http re-sends a replayable request (it has an
		// Idempotency-Key) only then.
		warm, err := http.NewRequest(http.MethodGet, srv.URL, nil)
		require.NoError(t, err)
		resp, err := base.RoundTrip(warm)
		require.NoError(t, err)
		resp.Body.Close()

		var first error
		tr := &Transport{Base: base, Retry: fastPolicy, OnAttempt: func(a Attempt) {
			if a.Number == 1 {
				first = a.Err
			}
		}}
		_, err = post(t, tr, context.Background(), srv.URL+"/v1/payments", `{"amount":4200}`)
		require.Error(t, err)
		assert.Equal(t, int32(1), got.Load(), "the server got the payment once")
		require.ErrorIs(t, first, syscall.ECONNREFUSED, "net/http re-sent the first attempt and returned the re-send's dial error")
		assert.Equal(t, OutcomeUnknown, OutcomeOf(nil, err), "the first attempt reached the server: %v", err)
	})
}

// TestInMemory: the in-memory readers are told, bare and under either of
// the types io.NopCloser returns, with what is left of them; any other
// reader, wrapped or not, is not.
func TestInMemory(t *testing.T) {
	half := bytes.NewReader([]byte("hello"))
	_, _ = half.Read(make([]byte, 2))
	req, err := http.NewRequest(http.MethodPost, "https://api.example.com/", strings.NewReader("hello"))
	require.NoError(t, err)
	for _, tt := range []struct {
		name       string
		body       io.ReadCloser
		length     int64
		left, size int64
		ok         bool
	}{
		{"nil", nil, 0, 0, 0, false},
		{"http.NoBody", http.NoBody, 0, 0, 0, false},
		{"http.NewRequest's", req.Body, 5, 5, 5, true},
		{"bytes.Reader under NopCloser", io.NopCloser(bytes.NewReader([]byte("hello"))), 5, 5, 5, true},
		{"bytes.Reader half read", io.NopCloser(half), 5, 3, 5, true},
		{"bytes.Buffer, sized by length", io.NopCloser(bytes.NewBufferString("hello")), 7, 5, 7, true},
		{"idem's own", func() io.ReadCloser { b := new(bytesBody); b.Reset([]byte("hello")); return b }(), 5, 5, 5, true},
		{"a reader without WriteTo under NopCloser", io.NopCloser(io.LimitReader(strings.NewReader("hello"), 5)), 5, 0, 0, false},
		{"an in-memory reader hidden in a struct", io.NopCloser(struct{ io.Reader }{strings.NewReader("hello")}), 5, 0, 0, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			left, size, ok := inMemory(tt.body, tt.length)
			assert.Equal(t, tt.ok, ok)
			assert.Equal(t, tt.left, left, "left")
			assert.Equal(t, tt.size, size, "size")
		})
	}
}
