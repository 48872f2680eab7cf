package idem

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Defaults of [RetryPolicy], used for its zero fields. They follow the
// peers that have run payment traffic longest; docs/retries.md ("Defaults") gives
// the reason for each.
const (
	// DefaultMaxAttempts: the first attempt and three retries, as the AWS
	// SDK's standard retryer (3 attempts) and stripe-go (2 retries) do,
	// with one more because every retry here is made safe by the key.
	DefaultMaxAttempts = 4
	// DefaultInitialInterval is the first backoff wait, stripe-go's minimum
	// retry delay.
	DefaultInitialInterval = 500 * time.Millisecond
	// DefaultMaxInterval caps one computed wait, jitter included.
	DefaultMaxInterval = 10 * time.Second
	// DefaultMultiplier grows the wait between retries.
	DefaultMultiplier = 2.0
	// DefaultJitter randomises each wait by ±50%: a wait of w becomes a
	// uniform value in [w/2, 3w/2] (then capped by MaxInterval). Jitter is
	// always on; it keeps clients that failed together from retrying
	// together.
	DefaultJitter = 0.5
	// DefaultMaxElapsedTime caps the whole operation, waits and retries
	// included: no wait is begun that would end past it, and no retry
	// waits for its response past it. Unlike a MaxElapsedTime set
	// explicitly, it does not cut the first attempt (that would cost a
	// timer on every call): bound that with AttemptTimeout or the
	// context's deadline.
	DefaultMaxElapsedTime = time.Minute
	// DefaultMaxRetryAfter is the longest Retry-After honoured. A server
	// that asks for a longer wait ends the operation at once and the caller
	// gets its response, instead of a client stalled for hours.
	DefaultMaxRetryAfter = 30 * time.Second
	// DefaultConflictTimeout is the time budget for waiting out 409
	// Conflict (the first request with the key still running). It is three
	// times the default lock timeout of idem's server library (10s), after
	// which a crashed request's key is taken over, so a crashed first
	// attempt is recovered within one call.
	DefaultConflictTimeout = 30 * time.Second
	// DefaultMaxConflictRetries caps the retries made on 409 answers.
	DefaultMaxConflictRetries = 30
)

// RetryPolicy says when and how long [Transport] waits before sending an
// operation again. Its zero value is usable: each zero field takes the
// default named in its comment. Defaults are applied when the Transport
// uses the policy, never written back into it.
type RetryPolicy struct {
	// MaxAttempts is the number of attempts in all, the first included.
	// Answers of 409 Conflict do not count. Defaults to
	// DefaultMaxAttempts; 1 disables retries.
	MaxAttempts int
	// InitialInterval is the first backoff wait. Defaults to
	// DefaultInitialInterval.
	InitialInterval time.Duration
	// MaxInterval caps one computed backoff wait, jitter included. A
	// Retry-After from the server may exceed it, up to MaxRetryAfter.
	// Defaults to DefaultMaxInterval.
	MaxInterval time.Duration
	// Multiplier grows the backoff wait after each retry. Defaults to
	// DefaultMultiplier; values below 1 are taken as 1.
	Multiplier float64
	// Jitter is the randomization factor in (0, 1]: a wait w becomes a
	// uniform value in [w×(1-Jitter), w×(1+Jitter)]. Defaults to
	// DefaultJitter; it cannot be turned off.
	Jitter float64
	// MaxElapsedTime caps the whole operation, from the start of the first
	// attempt: no wait is begun that would end past it (the operation ends
	// at once instead), and each attempt's deadline for its response
	// headers is at most the operation's end. An attempt cut there ends the
	// operation with a [*RetryError] carrying the key, with
	// context.DeadlineExceeded in its chain; a response whose headers came
	// in time is returned, its body not cut. The request context's deadline
	// caps the operation the same way. Defaults to DefaultMaxElapsedTime,
	// which does not cut the first attempt.
	MaxElapsedTime time.Duration
	// AttemptTimeout bounds each attempt, up to the end of the response
	// headers, or of a 2xx answer to a keyed request read inside the
	// attempt ([Transport.MaxBufferedResponse]); the body of any other
	// final response may be read for longer. An attempt that times out is
	// retried. Zero means no per-attempt timeout.
	AttemptTimeout time.Duration
	// MaxRetryAfter is the longest Retry-After honoured; a longer one ends
	// the operation at once with the response that carried it. Defaults to
	// DefaultMaxRetryAfter.
	MaxRetryAfter time.Duration
	// ConflictTimeout is the time budget for waiting on 409 Conflict
	// answers to a keyed request, separate from MaxAttempts and the retry
	// budget. When it runs out, RoundTrip returns an [*InProgressError].
	// Defaults to DefaultConflictTimeout.
	ConflictTimeout time.Duration
	// MaxConflictRetries caps the retries made on 409 answers. Defaults to
	// DefaultMaxConflictRetries.
	MaxConflictRetries int
}

// withDefaults returns a copy of p with the defaults in its zero fields.
func (p RetryPolicy) withDefaults() RetryPolicy {
	if p.MaxAttempts <= 0 {
		p.MaxAttempts = DefaultMaxAttempts
	}
	if p.InitialInterval <= 0 {
		p.InitialInterval = DefaultInitialInterval
	}
	if p.MaxInterval <= 0 {
		p.MaxInterval = DefaultMaxInterval
	}
	if p.Multiplier == 0 {
		p.Multiplier = DefaultMultiplier
	}
	if !(p.Multiplier >= 1) { // below 1, or NaN from a parsed config
		p.Multiplier = 1
	}
	if !(p.Jitter > 0 && p.Jitter <= 1) { // out of range, or NaN
		p.Jitter = DefaultJitter
	}
	if p.MaxElapsedTime <= 0 {
		p.MaxElapsedTime = DefaultMaxElapsedTime
	}
	if p.MaxRetryAfter <= 0 {
		p.MaxRetryAfter = DefaultMaxRetryAfter
	}
	if p.ConflictTimeout <= 0 {
		p.ConflictTimeout = DefaultConflictTimeout
	}
	if p.MaxConflictRetries <= 0 {
		p.MaxConflictRetries = DefaultMaxConflictRetries
	}
	return p
}

// verdict is what one attempt's outcome calls for.
type verdict int

const (
	// done: hand the response or error to the caller.
	done verdict = iota
	// retry: back off and send again (spends an attempt and budget).
	retry
	// conflict: the first request with the key is still running; wait and
	// send again (spends the conflict budget only).
	conflict
	// keyReuse: 422 to a keyed request; the caller gets a KeyReuseError.
	keyReuse
	// keyExpired: a Provider's answer that the key expired; the caller
	// gets a KeyExpiredError.
	keyExpired
)

// decide is the retry decision for one attempt's outcome: resp or err, for
// a request that is keyed (POST and PATCH) or not. It looks at nothing but
// its arguments; context and budgets are the caller's to check. The reason
// names the outcome for logs and [Attempt.Reason].
func decide(keyed bool, resp *http.Response, err error) (v verdict, reason string) {
	if err != nil {
		if retryableError(err) {
			return retry, errorReason(err)
		}
		return done, errorReason(err)
	}
	switch code := resp.StatusCode; code {
	case http.StatusRequestTimeout, http.StatusTooManyRequests,
		http.StatusInternalServerError, http.StatusBadGateway,
		http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return retry, resp.Status
	case http.StatusConflict:
		if keyed {
			return conflict, resp.Status
		}
	case http.StatusUnprocessableEntity:
		if keyed {
			// RFC 9110's phrase, whatever the server's status line says
			// (Go's servers still send "Unprocessable Entity").
			return keyReuse, "422 Unprocessable Content"
		}
	}
	return done, resp.Status
}

// retryableError reports whether an attempt's error may be retried. Every
// error before a response is, but those known to recur or to be the
// caller's: the caller's cancellation, a certificate or TLS handshake the
// server refuses, a name that does not resolve, a Base that refused to
// send ([ErrNotSent]: a circuit breaker, say, which a retry would defeat)
// or returned nothing, a request body whose own Read failed or whose length
// disagreed with its ContentLength (a localError, which would fail again),
// and idem's own errors from a Base that is itself a Transport.
//
// The list is of what not to retry, not of what to retry, because
// net/http's errors after a request was written are plain strings: an
// answer it cannot parse ("malformed HTTP status code"), headers over
// MaxResponseHeaderBytes, a server that closed an idle connection as the
// request went out, an HTTP/2 connection whose pings went unanswered
// ("client connection lost"). The server may have acted on such a request,
// and only a retry with its key can tell. Its refusals before sending (an
// unsupported scheme, an invalid header) are plain strings too, and are
// retried alike: in vain, but safely.
func retryableError(err error) bool {
	if errors.Is(err, ErrAttemptTimeout) {
		return true
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var (
		certErr     *tls.CertificateVerificationError
		unknownAuth x509.UnknownAuthorityError
		hostErr     x509.HostnameError
		invalidErr  x509.CertificateInvalidError
		recordErr   tls.RecordHeaderError
		alertErr    tls.AlertError
	)
	if errors.As(err, &certErr) || errors.As(err, &unknownAuth) || errors.As(err, &hostErr) ||
		errors.As(err, &invalidErr) || errors.As(err, &recordErr) || errors.As(err, &alertErr) {
		return false
	}
	var dnsErr *net.DNSError
	if errors.As(err, &dnsErr) {
		return dnsErr.IsTimeout || dnsErr.IsTemporary
	}
	var local *localError
	if errors.Is(err, ErrNotSent) || errors.Is(err, errNilResponse) || errors.As(err, &local) || idemError(err) {
		return false
	}
	return true
}

// idemError reports whether err holds one of idem's own outcomes, which a
// Base that is itself a Transport returns: retrying them again would
// multiply the retries, or retry a key reuse.
func idemError(err error) bool {
	var (
		retryErr    *RetryError
		reuseErr    *KeyReuseError
		progressErr *InProgressError
		lostErr     *AnswerLostError
		expiredErr  *KeyExpiredError
	)
	return errors.As(err, &retryErr) || errors.As(err, &reuseErr) || errors.As(err, &progressErr) ||
		errors.As(err, &lostErr) || errors.As(err, &expiredErr) ||
		errors.Is(err, ErrBodyNotReplayable) || errors.Is(err, ErrBudgetExhausted) || errors.Is(err, ErrKeyBodyField)
}

func errorReason(err error) string {
	switch {
	case errors.Is(err, ErrAttemptTimeout):
		return "attempt timed out"
	case errors.As(err, new(*localError)):
		return "request body"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused"
	case errors.Is(err, syscall.ECONNRESET):
		return "connection reset"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "connection closed before response"
	case http2Reason(err) != "":
		return http2Reason(err)
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline exceeded"
	}
	return "error"
}

// http2Errors names the HTTP/2 client errors that end a stream before its
// response, by the package that defines them and the type's name, with
// the reason they give: net/http's bundled HTTP/2 client, its future home
// inside the standard library, and golang.org/x/net/http2 (a Transport of
// that package as the Base).
var http2Errors = map[[2]string]string{
	{"net/http", "http2StreamError"}:               "HTTP/2 stream reset",
	{"net/http", "http2GoAwayError"}:               "HTTP/2 GOAWAY",
	{"net/http/internal/http2", "StreamError"}:     "HTTP/2 stream reset",
	{"net/http/internal/http2", "GoAwayError"}:     "HTTP/2 GOAWAY",
	{"golang.org/x/net/http2", "StreamError"}:      "HTTP/2 stream reset",
	{"golang.org/x/net/http2", "GoAwayError"}:      "HTTP/2 GOAWAY",
	{"golang.org/x/net/http2", "ConnectionError"}:  "HTTP/2 connection error",
	{"net/http", "http2ConnectionError"}:           "HTTP/2 connection error",
	{"net/http/internal/http2", "ConnectionError"}: "HTTP/2 connection error",
}

// http2Reason returns the reason for an HTTP/2 stream reset (RST_STREAM),
// GOAWAY followed by a close, or connection error in err's chain, or "" if
// there is none. net/http's HTTP/2 error types are unexported and have no
// method to test for (only Error), so neither errors.As nor an interface
// reaches them; golang.org/x/net/http2 exports its own, distinct types,
// which match none of net/http's. The check is therefore on the dynamic
// type's package and name, not on the message: it holds whatever the
// message says, and breaks only if the type is renamed, which the wire
// tests (TestHTTP2FaultsAreRetried) would catch.
func http2Reason(err error) string {
	for _, e := range errorChain(err) {
		t := reflect.TypeOf(e)
		if t.Kind() == reflect.Pointer {
			t = t.Elem()
		}
		if why, ok := http2Errors[[2]string{t.PkgPath(), t.Name()}]; ok {
			return why
		}
	}
	return ""
}

// errorChain returns err and every error it wraps, depth first, as
// errors.Is walks them.
func errorChain(err error) []error {
	var chain []error
	for err != nil {
		chain = append(chain, err)
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				chain = append(chain, errorChain(e)...)
			}
			return chain
		default:
			return chain
		}
	}
	return chain
}

// maxRetryAfterSeconds bounds the parsed value so the Duration cannot
// overflow; anything that large is far past any MaxRetryAfter.
const maxRetryAfterSeconds = math.MaxInt64 / int64(time.Second)

// parseRetryAfter parses a Retry-After value (RFC 9110, section 10.2.3):
// delay-seconds or an HTTP-date, taken relative to now. A date in the past
// is a wait of zero. It reports false for a missing or malformed value.
func parseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if v[0] >= '0' && v[0] <= '9' {
		secs, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			var numErr *strconv.NumError
			if errors.As(err, &numErr) && numErr.Err == strconv.ErrRange {
				return time.Duration(math.MaxInt64), true
			}
			return 0, false
		}
		return time.Duration(min(secs, maxRetryAfterSeconds)) * time.Second, true
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	return max(t.Sub(now), 0), true
}
