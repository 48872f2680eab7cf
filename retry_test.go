package idem

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// statusResponse returns a response with code and its standard status line,
// as net/http would produce it.
func statusResponse(code int) *http.Response {
	return &http.Response{
		StatusCode: code,
		Status:     fmt.Sprintf("%d %s", code, http.StatusText(code)),
		Header:     http.Header{},
		Body:       http.NoBody,
	}
}

func TestDecideStatus(t *testing.T) {
	tests := []struct {
		code           int
		keyed, unkeyed verdict
	}{
		// 1xx, 2xx, 3xx: a definitive answer.
		{100, done, done},
		{101, done, done},
		{200, done, done},
		{201, done, done},
		{202, done, done},
		{204, done, done},
		{301, done, done},
		{302, done, done},
		{304, done, done},
		{307, done, done},
		// 4xx: the caller's mistake, except the few that say "try again".
		{400, done, done},
		{401, done, done},
		{403, done, done},
		{404, done, done},
		{405, done, done},
		{408, retry, retry},
		{409, conflict, done},
		{410, done, done},
		{412, done, done},
		{413, done, done},
		{422, keyReuse, done},
		{425, done, done},
		{428, done, done},
		{429, retry, retry},
		{451, done, done},
		// 5xx: transient ones only.
		{500, retry, retry},
		{501, done, done},
		{502, retry, retry},
		{503, retry, retry},
		{504, retry, retry},
		{505, done, done},
		{507, done, done},
		{511, done, done},
	}
	for _, tt := range tests {
		for _, keyed := range []bool{true, false} {
			want := tt.unkeyed
			if keyed {
				want = tt.keyed
			}
			resp := statusResponse(tt.code)
			v, reason := decide(keyed, resp, nil)
			if v != want {
				t.Errorf("decide(keyed=%t, %d) = %v, want %v", keyed, tt.code, v, want)
			}
			wantReason := resp.Status
			if v == keyReuse {
				wantReason = "422 Unprocessable Content" // RFC 9110's phrase
			}
			if reason != wantReason {
				t.Errorf("decide(keyed=%t, %d) reason = %q, want %q", keyed, tt.code, reason, wantReason)
			}
		}
	}
}

func TestDecideError(t *testing.T) {
	tests := []struct {
		name   string
		err    error
		want   verdict
		reason string
	}{
		{"connection refused", dialErr(syscall.ECONNREFUSED), retry, "connection refused"},
		{"connection reset", readErr(syscall.ECONNRESET), retry, "connection reset"},
		{"EOF", urlErr(io.EOF), retry, "connection closed before response"},
		{"unexpected EOF", urlErr(io.ErrUnexpectedEOF), retry, "connection closed before response"},
		{"attempt timeout", fmt.Errorf("%w after 2s (%v)", ErrAttemptTimeout, context.Canceled), retry, "attempt timed out"},
		{"canceled", urlErr(context.Canceled), done, "canceled"},
		{"deadline", urlErr(context.DeadlineExceeded), done, "deadline exceeded"},
		{"bad certificate", urlErr(&tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}), done, "error"},
		{"unsupported scheme", urlErr(errors.New(`unsupported protocol scheme "ftp"`)), retry, "error"},
		{"malformed answer", urlErr(errors.New(`net/http: HTTP/1.x transport connection broken: malformed HTTP status code "2O1"`)), retry, "error"},
	}
	for _, tt := range tests {
		for _, keyed := range []bool{true, false} {
			v, reason := decide(keyed, nil, tt.err)
			if v != tt.want || reason != tt.reason {
				t.Errorf("%s: decide(keyed=%t, %v) = %v, %q; want %v, %q", tt.name, keyed, tt.err, v, reason, tt.want, tt.reason)
			}
		}
	}
}

func (v verdict) String() string {
	switch v {
	case done:
		return "done"
	case retry:
		return "retry"
	case conflict:
		return "conflict"
	case keyReuse:
		return "keyReuse"
	}
	return "verdict(" + strconv.Itoa(int(v)) + ")"
}

// urlErr wraps err as http.Client does.
func urlErr(err error) error {
	return &url.Error{Op: "Post", URL: "https://api.example.com/v1/payments", Err: err}
}

// dialErr is errno as net.Dial returns it.
func dialErr(errno syscall.Errno) error {
	return urlErr(&net.OpError{Op: "dial", Net: "tcp", Addr: tcpAddr(), Err: os.NewSyscallError("connect", errno)})
}

// readErr is errno as a read on an established connection returns it.
func readErr(errno syscall.Errno) error {
	return urlErr(&net.OpError{Op: "read", Net: "tcp", Addr: tcpAddr(), Err: os.NewSyscallError("read", errno)})
}

func tcpAddr() net.Addr { return &net.TCPAddr{IP: net.IPv4(192, 0, 2, 1), Port: 443} }

// netError is a net.Error whose Timeout is set by the test.
type netError struct{ timeout bool }

func (e netError) Error() string   { return fmt.Sprintf("net error (timeout=%t)", e.timeout) }
func (e netError) Timeout() bool   { return e.timeout }
func (e netError) Temporary() bool { return e.timeout }

var retryableErrorTests = []struct {
	name string
	err  error
	want bool
}{
	// The connection failed or broke: the request may not have arrived,
	// or its answer was lost. The key makes sending it again safe.
	{"ECONNREFUSED dialing", dialErr(syscall.ECONNREFUSED), true},
	{"ECONNRESET reading", readErr(syscall.ECONNRESET), true},
	{"ECONNRESET writing", urlErr(&net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", syscall.ECONNRESET)}), true},
	{"bare ECONNRESET", syscall.ECONNRESET, true},
	{"ECONNABORTED", readErr(syscall.ECONNABORTED), true},
	{"EPIPE", urlErr(&net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", syscall.EPIPE)}), true},
	{"ETIMEDOUT", dialErr(syscall.ETIMEDOUT), true},
	{"EHOSTUNREACH", dialErr(syscall.EHOSTUNREACH), true},
	{"ENETUNREACH", dialErr(syscall.ENETUNREACH), true},
	{"ENETDOWN", dialErr(syscall.ENETDOWN), true},
	{"io.EOF", io.EOF, true},
	{"io.EOF in url.Error", urlErr(io.EOF), true},
	{"io.ErrUnexpectedEOF", io.ErrUnexpectedEOF, true},
	{"wrapped io.ErrUnexpectedEOF", urlErr(fmt.Errorf("reading response: %w", io.ErrUnexpectedEOF)), true},
	{"dial error of another kind", urlErr(&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("socket: too many open files")}), true},
	{"net.Error with Timeout", urlErr(netError{timeout: true}), true},
	{"net.Error without Timeout", urlErr(netError{timeout: false}), true},
	{"read deadline", urlErr(&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}), true},
	{"read error of another kind", urlErr(&net.OpError{Op: "read", Net: "tcp", Err: errors.New("use of closed network connection")}), true},

	// DNS: a missing name will stay missing; a slow resolver may recover.
	{"DNS not found", urlErr(&net.OpError{Op: "dial", Net: "tcp", Err: &net.DNSError{Err: "no such host", Name: "api.example.invalid", IsNotFound: true}}), false},
	{"bare DNS not found", &net.DNSError{Err: "no such host", Name: "api.example.invalid", IsNotFound: true}, false},
	{"DNS timeout", urlErr(&net.OpError{Op: "dial", Net: "tcp", Err: &net.DNSError{Err: "i/o timeout", Name: "api.example.com", IsTimeout: true}}), true},
	{"DNS temporary", &net.DNSError{Err: "server misbehaving", Name: "api.example.com", IsTemporary: true}, true},

	// TLS and certificates: the same handshake fails the same way again,
	// even inside a dial error.
	{"unknown authority", urlErr(&tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}), false},
	{"bare unknown authority", x509.UnknownAuthorityError{}, false},
	{"hostname mismatch", urlErr(&tls.CertificateVerificationError{Err: x509.HostnameError{Host: "api.example.com"}}), false},
	{"bare hostname mismatch", x509.HostnameError{Host: "api.example.com"}, false},
	{"TLS record header", urlErr(tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"}), false},
	{"certificate error in a dial error", urlErr(&net.OpError{Op: "dial", Net: "tcp", Err: &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}}), false},
	{"expired certificate", urlErr(x509.CertificateInvalidError{Reason: x509.Expired}), false},
	{"TLS alert from the server", urlErr(tls.AlertError(40)), false},

	// The caller gave up: never retried, though DeadlineExceeded is a
	// net.Error whose Timeout is true.
	{"context.Canceled", context.Canceled, false},
	{"context.Canceled in url.Error", urlErr(context.Canceled), false},
	{"context.DeadlineExceeded", context.DeadlineExceeded, false},
	{"context.DeadlineExceeded in url.Error", urlErr(context.DeadlineExceeded), false},
	{"cause of a canceled context", urlErr(fmt.Errorf("request canceled: %w", context.Canceled)), false},

	// The attempt's own timeout is retried, even when the chain also holds
	// the cancellation it caused.
	{"ErrAttemptTimeout", ErrAttemptTimeout, true},
	{"ErrAttemptTimeout as send wraps it", fmt.Errorf("%w after 2s (%v)", ErrAttemptTimeout, context.Canceled), true},
	{"ErrAttemptTimeout with Canceled in chain", fmt.Errorf("%w: %w", ErrAttemptTimeout, context.Canceled), true},
	{"ErrAttemptTimeout with DeadlineExceeded in chain", urlErr(fmt.Errorf("%w: %w", ErrAttemptTimeout, context.DeadlineExceeded)), true},

	// net/http's errors after the request was written are plain strings:
	// the server may have acted on the request, and only a retry with its
	// key tells. Its refusals before sending are plain strings too, and are
	// retried alike (in vain, but safely).
	{"malformed status code", urlErr(errors.New(`net/http: HTTP/1.x transport connection broken: malformed HTTP status code "2O1"`)), true},
	{"headers over the limit", urlErr(errors.New("net/http: server response headers exceeded 1024 bytes; aborted")), true},
	{"server closed idle connection", urlErr(errors.New("http: server closed idle connection")), true},
	{"HTTP/2 connection lost", urlErr(errors.New("http2: client connection lost")), true},
	{"unsupported scheme", urlErr(errors.New(`unsupported protocol scheme "ftp"`)), true},
	{"malformed header", errors.New(`net/http: invalid header field name "bad header"`), true},

	// A broken Base, and idem's own outcomes from a Base that is a
	// Transport too: retrying them would multiply retries.
	{"nil response", errNilResponse, false},
	{"body not replayable", ErrBodyNotReplayable, false},
	{"budget exhausted", fmt.Errorf("%w; last attempt: 503", ErrBudgetExhausted), false},
	{"key body field", fmt.Errorf("%w \"id\": not JSON", ErrKeyBodyField), false},
	{"retry error", urlErr(&RetryError{Attempts: 4, Key: "k", Err: io.EOF}), false},
	{"key reuse", urlErr(&KeyReuseError{Key: "k"}), false},
	{"in progress", urlErr(&InProgressError{Key: "k"}), false},
}

func TestRetryableError(t *testing.T) {
	for _, tt := range retryableErrorTests {
		if got := retryableError(tt.err); got != tt.want {
			t.Errorf("%s: retryableError(%v) = %t, want %t", tt.name, tt.err, got, tt.want)
		}
	}
}

// TestRetryableErrorFromTheWire classifies errors made by real connections
// on the loopback interface, not built by hand.
func TestRetryableErrorFromTheWire(t *testing.T) {
	t.Run("connection refused", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close()
		conn, err := net.Dial("tcp", addr)
		if err == nil {
			conn.Close()
			t.Skip("something listens on the closed port")
		}
		if !errors.Is(err, syscall.ECONNREFUSED) || !retryableError(err) {
			t.Errorf("retryableError(%v) = %t, want a retryable ECONNREFUSED", err, retryableError(err))
		}
	})

	t.Run("read timeout", func(t *testing.T) {
		srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
		defer srv.Close()
		conn, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetReadDeadline(time.Now().Add(-time.Second))
		_, err = conn.Read(make([]byte, 1))
		if !retryableError(err) {
			t.Errorf("retryableError(%v) = false, want true", err)
		}
	})

	t.Run("untrusted certificate", func(t *testing.T) {
		srv := httptest.NewTLSServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
		srv.Config.ErrorLog = discardLog() // the server logs the handshake failure
		defer srv.Close()
		tr := &http.Transport{} // trusts the system roots, not the test certificate
		defer tr.CloseIdleConnections()
		req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
		_, err := tr.RoundTrip(req)
		var certErr *tls.CertificateVerificationError
		if !errors.As(err, &certErr) {
			t.Fatalf("err = %v, want a certificate error", err)
		}
		if retryableError(err) {
			t.Errorf("retryableError(%v) = true, want false", err)
		}
	})

	t.Run("TLS to a plain HTTP server", func(t *testing.T) {
		srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
		defer srv.Close()
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		req, _ := http.NewRequest(http.MethodGet, "https://"+srv.Listener.Addr().String(), nil)
		_, err := tr.RoundTrip(req)
		if err == nil {
			t.Fatal("no error")
		}
		if retryableError(err) {
			t.Errorf("retryableError(%v) = true, want false", err)
		}
	})
}

// parseNow is the fixed "now" of the Retry-After table: a Sunday.
var parseNow = time.Date(2026, time.March, 1, 12, 0, 0, 0, time.UTC)

var parseRetryAfterTests = []struct {
	in   string
	want time.Duration
	ok   bool
}{
	// delay-seconds
	{"0", 0, true},
	{"1", time.Second, true},
	{"5", 5 * time.Second, true},
	{"120", 2 * time.Minute, true},
	{"007", 7 * time.Second, true},
	{" 7 ", 7 * time.Second, true},
	{"\t30\r\n", 30 * time.Second, true},
	{"86400", 24 * time.Hour, true},
	{"9223372036", 9223372036 * time.Second, true}, // the largest that fits
	{"9223372037", time.Duration(maxRetryAfterSeconds) * time.Second, true},
	{"99999999999", time.Duration(maxRetryAfterSeconds) * time.Second, true},
	{"9223372036854775807", time.Duration(maxRetryAfterSeconds) * time.Second, true},
	{"99999999999999999999999999", time.Duration(math.MaxInt64), true}, // past int64

	// HTTP-date, in the three formats of RFC 9110, section 5.6.7.
	{"Sun, 01 Mar 2026 12:00:30 GMT", 30 * time.Second, true},  // IMF-fixdate
	{"Sunday, 01-Mar-26 12:01:30 GMT", 90 * time.Second, true}, // RFC 850
	{"Sun Mar  1 12:02:00 2026", 2 * time.Minute, true},        // asctime
	{"  Sun, 01 Mar 2026 12:00:30 GMT  ", 30 * time.Second, true},
	{"Sun, 01 Mar 2026 12:00:00 GMT", 0, true},                            // now
	{"Sun, 06 Nov 1994 08:49:37 GMT", 0, true},                            // past
	{"Sunday, 06-Nov-94 08:49:37 GMT", 0, true},                           // past
	{"Sun Nov  6 08:49:37 1994", 0, true},                                 // past
	{"Fri, 31 Dec 9999 23:59:59 GMT", time.Duration(math.MaxInt64), true}, // beyond Duration

	// Malformed or missing.
	{"", 0, false},
	{"   ", 0, false},
	{"-1", 0, false},
	{"-0", 0, false},
	{"-99999999999999999999", 0, false},
	{"+5", 0, false},
	{"1.5", 0, false},
	{"5s", 0, false},
	{"1e3", 0, false},
	{"0x10", 0, false},
	{"1_000", 0, false},
	{"1 2", 0, false},
	{"abc", 0, false},
	{"soon", 0, false},
	{"Sunday", 0, false},
	{"Sun, 01 Mar 2026", 0, false},
	{"Sun, 01 Mar 2026 12:00:30 PST", 0, false},
	{"Sun, 32 Mar 2026 12:00:30 GMT", 0, false},
	{"2026-03-01T12:00:30Z", 0, false},
}

func TestParseRetryAfter(t *testing.T) {
	for _, tt := range parseRetryAfterTests {
		got, ok := parseRetryAfter(tt.in, parseNow)
		if got != tt.want || ok != tt.ok {
			t.Errorf("parseRetryAfter(%q) = %v, %t; want %v, %t", tt.in, got, ok, tt.want, tt.ok)
		}
	}
}

// FuzzParseRetryAfter checks that no value makes parseRetryAfter panic or
// return a negative wait, that delay-seconds round-trip, and that a date it
// accepts means the same wait when written back as an IMF-fixdate.
// Seeds: the unit-test table and testdata/fuzz/FuzzParseRetryAfter.
func FuzzParseRetryAfter(f *testing.F) {
	for _, tt := range parseRetryAfterTests {
		f.Add(tt.in)
	}
	f.Fuzz(func(t *testing.T, in string) {
		d, ok := parseRetryAfter(in, parseNow)
		if d < 0 {
			t.Fatalf("parseRetryAfter(%q) = %v, a negative wait", in, d)
		}
		if !ok {
			if d != 0 {
				t.Fatalf("parseRetryAfter(%q) = %v, false; want 0 with false", in, d)
			}
			return
		}
		v := strings.TrimSpace(in)
		if isDigits(v) {
			n, err := strconv.ParseInt(v, 10, 64)
			switch {
			case err != nil: // past int64
				if d != math.MaxInt64 {
					t.Fatalf("parseRetryAfter(%q) = %v, want the largest Duration", in, d)
				}
			case n <= maxRetryAfterSeconds:
				if d%time.Second != 0 || int64(d/time.Second) != n {
					t.Fatalf("parseRetryAfter(%q) = %v, want exactly %d seconds", in, d, n)
				}
			default:
				if d != time.Duration(maxRetryAfterSeconds)*time.Second {
					t.Fatalf("parseRetryAfter(%q) = %v, want the cap %d seconds", in, d, maxRetryAfterSeconds)
				}
			}
			return
		}
		if !strings.ContainsAny(v, "0123456789") {
			t.Fatalf("parseRetryAfter(%q) accepted a value with no digit", in)
		}
		if d > 0 && d < math.MaxInt64 {
			again := parseNow.Add(d).Format(http.TimeFormat)
			if d2, ok := parseRetryAfter(again, parseNow); !ok || d2 != d.Truncate(time.Second) {
				t.Fatalf("parseRetryAfter(%q) = %v, but its IMF-fixdate %q gives %v, %t", in, d, again, d2, ok)
			}
		}
	})
}

func isDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

func TestRetryPolicyWithDefaults(t *testing.T) {
	defaults := RetryPolicy{
		MaxAttempts:        DefaultMaxAttempts,
		InitialInterval:    DefaultInitialInterval,
		MaxInterval:        DefaultMaxInterval,
		Multiplier:         DefaultMultiplier,
		Jitter:             DefaultJitter,
		MaxElapsedTime:     DefaultMaxElapsedTime,
		AttemptTimeout:     0, // no per-attempt timeout
		MaxRetryAfter:      DefaultMaxRetryAfter,
		ConflictTimeout:    DefaultConflictTimeout,
		MaxConflictRetries: DefaultMaxConflictRetries,
	}
	with := func(f func(*RetryPolicy)) RetryPolicy {
		p := defaults
		f(&p)
		return p
	}
	set := RetryPolicy{
		MaxAttempts:        7,
		InitialInterval:    3 * time.Millisecond,
		MaxInterval:        4 * time.Second,
		Multiplier:         1.5,
		Jitter:             0.2,
		MaxElapsedTime:     5 * time.Minute,
		AttemptTimeout:     6 * time.Second,
		MaxRetryAfter:      7 * time.Second,
		ConflictTimeout:    8 * time.Second,
		MaxConflictRetries: 9,
	}
	negative := RetryPolicy{
		MaxAttempts:        -1,
		InitialInterval:    -1,
		MaxInterval:        -1,
		MaxElapsedTime:     -1,
		MaxRetryAfter:      -1,
		ConflictTimeout:    -1,
		MaxConflictRetries: -1,
	}
	tests := []struct {
		name string
		in   RetryPolicy
		want RetryPolicy
		bug  string // the regression a failure of this row means
	}{
		{"zero", RetryPolicy{}, defaults, ""},
		{"all set", set, set, ""},
		{"negatives", negative, defaults, ""},
		{"retries disabled", RetryPolicy{MaxAttempts: 1}, with(func(p *RetryPolicy) { p.MaxAttempts = 1 }), ""},
		{"multiplier below 1", RetryPolicy{Multiplier: 0.5}, with(func(p *RetryPolicy) { p.Multiplier = 1 }), ""},
		{"negative multiplier", RetryPolicy{Multiplier: -3}, with(func(p *RetryPolicy) { p.Multiplier = 1 }), ""},
		{"multiplier 1", RetryPolicy{Multiplier: 1}, with(func(p *RetryPolicy) { p.Multiplier = 1 }), ""},
		{"jitter 1", RetryPolicy{Jitter: 1}, with(func(p *RetryPolicy) { p.Jitter = 1 }), ""},
		{"small jitter", RetryPolicy{Jitter: 0.01}, with(func(p *RetryPolicy) { p.Jitter = 0.01 }), ""},
		{"negative jitter", RetryPolicy{Jitter: -0.3}, defaults, ""},
		{"jitter above 1", RetryPolicy{Jitter: 1.5}, defaults, ""},
		{"infinite jitter", RetryPolicy{Jitter: math.Inf(1)}, defaults, ""},
		{"negative infinite jitter", RetryPolicy{Jitter: math.Inf(-1)}, defaults, ""},
		{"NaN jitter", RetryPolicy{Jitter: math.NaN()}, defaults,
			"a NaN Jitter is outside (0, 1] yet kept: withDefaults tests p.Jitter <= 0 || p.Jitter > 1, both false for NaN, and the backoff then computes Duration(NaN), a negative wait: retries are sent with no wait at all"},
		{"NaN multiplier", RetryPolicy{Multiplier: math.NaN()}, with(func(p *RetryPolicy) { p.Multiplier = 1 }),
			"a NaN Multiplier is kept (max(NaN, 1) is NaN), and from the second retry on the backoff computes Duration(NaN), a negative wait: retries are sent with no wait at all"},
		{"attempt timeout kept", RetryPolicy{AttemptTimeout: time.Second}, with(func(p *RetryPolicy) { p.AttemptTimeout = time.Second }), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := tt.in
			got := in.withDefaults()
			if !samePolicy(got, tt.want) {
				if tt.bug != "" {
					t.Errorf("regression: %s\nwithDefaults(%+v) = %+v, want %+v", tt.bug, tt.in, got, tt.want)
				}
				t.Errorf("withDefaults(%+v) =\n%+v, want\n%+v", tt.in, got, tt.want)
			}
			if !samePolicy(in, tt.in) {
				t.Errorf("withDefaults changed its receiver: %+v, was %+v", in, tt.in)
			}
		})
	}
}

// samePolicy is == with NaN equal to itself.
func samePolicy(a, b RetryPolicy) bool {
	nan := func(p RetryPolicy) RetryPolicy {
		if math.IsNaN(p.Jitter) {
			p.Jitter = -42
		}
		if math.IsNaN(p.Multiplier) {
			p.Multiplier = -42
		}
		return p
	}
	return nan(a) == nan(b)
}

// TestTransportDoesNotWriteDefaultsBack checks the Transport's use of its
// policy, budget and key header leaves its exported fields as they were.
func TestTransportDoesNotWriteDefaultsBack(t *testing.T) {
	tr := &Transport{Base: roundTripFunc(func(req *http.Request) (*http.Response, error) {
		resp := statusResponse(http.StatusCreated)
		resp.Request = req
		return resp, nil
	})}
	req, _ := http.NewRequest(http.MethodPost, "https://api.example.com/v1/payments", strings.NewReader(`{}`))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if tr.Retry != (RetryPolicy{}) {
		t.Errorf("Transport.Retry = %+v after use, want the zero policy", tr.Retry)
	}
	if tr.KeyHeader != "" || tr.NewKey != nil || tr.Budget != nil || tr.MaxBufferedBody != 0 {
		t.Errorf("Transport fields were filled in: KeyHeader %q, NewKey set %t, Budget %v, MaxBufferedBody %d",
			tr.KeyHeader, tr.NewKey != nil, tr.Budget, tr.MaxBufferedBody)
	}
}

// discardLog is a server error log that keeps expected failures out of the
// test output.
func discardLog() *log.Logger { return log.New(io.Discard, "", 0) }
