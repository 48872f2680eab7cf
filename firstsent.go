package idem

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

// DefaultFirstSentHeader is the header that carries when a keyed
// operation was first sent: Repeatability-First-Sent, from OASIS
// Repeatable Requests 1.0, as Azure's APIs read it.
const DefaultFirstSentHeader = "Repeatability-First-Sent"

// ProblemKeyExpired is the problem type of a server's refusal to run a
// request first sent longer ago than its key is kept (see
// [KeyExpiredError]), as idem's server side (server/idempotency) answers it.
const ProblemKeyExpired = "https://idemkit.dev/problems/idempotency-key-expired"

type firstSentContextKey struct{}

// WithFirstSent returns a copy of ctx that pins when the operation sent
// with it was first sent. Every attempt of a keyed operation carries that
// time ([Transport.FirstSentHeader]), so a server can refuse a retry that
// comes after it let the key go, rather than run it again: store the key
// and the time of the first call with your order, and pin both
// ([WithKey], WithFirstSent) on every later call for it. Without it, an
// operation's first-sent time is when its RoundTrip began.
func WithFirstSent(ctx context.Context, t time.Time) context.Context {
	return context.WithValue(ctx, firstSentContextKey{}, t)
}

// FirstSentFromContext returns the time pinned on ctx by [WithFirstSent].
func FirstSentFromContext(ctx context.Context) (time.Time, bool) {
	t, ok := ctx.Value(firstSentContextKey{}).(time.Time)
	return t, ok
}

// KeyExpiredError is returned by [Transport.RoundTrip] (wrapped in a
// *url.Error by http.Client) when the server refused a keyed request
// because it was first sent longer ago than the server keeps keys, and the
// key is gone: 410 Gone with the problem type [ProblemKeyExpired]. The
// request was not run now, but the operation may have taken effect when it
// was first sent, and the server can no longer say: its outcome is
// unknown ([OutcomeOf]). Check whether it took effect (look the resource
// up) before you send it again under a new key. It is not retried.
//
//	var expired *idem.KeyExpiredError
//	if errors.As(err, &expired) {
//		// look the payment up by other means before paying again
//	}
type KeyExpiredError struct {
	Key       string
	Method    string
	URL       string
	FirstSent time.Time // the first-sent time the request carried
	Problem   *Problem  // the server's problem details
}

func (*KeyExpiredError) namesRequest() {}

// Error returns a message that names the key, the method and URL and the
// first-sent time, says that the outcome can no longer be looked up and
// what to do, and ends with the server's detail, if any.
func (e *KeyExpiredError) Error() string {
	msg := fmt.Sprintf("idem: %s %s: key %q expired: the operation was first sent at %s, longer ago than the server keeps keys, and its outcome can no longer be looked up; check whether it took effect before sending it again with a new key",
		e.Method, e.URL, e.Key, e.FirstSent.UTC().Format(time.RFC3339))
	if d := e.Problem.describe(); d != "" {
		msg += " (" + d + ")"
	}
	return msg
}

func (*KeyExpiredError) outcome() Outcome { return OutcomeUnknown }

// firstSentHeader is the header name of the first-sent time; "" when the
// Transport sends none.
func (t *Transport) firstSentHeader() string {
	switch {
	case t.NoFirstSent:
		return ""
	case t.FirstSentHeader == "":
		return DefaultFirstSentHeader
	}
	return http.CanonicalHeaderKey(t.FirstSentHeader)
}

// sentStamp is a first-sent time formatted as an HTTP-date, as a header
// value, for one second of the clock.
type sentStamp struct {
	unix  int64
	value []string
}

// firstSentValue returns the header value of an operation first sent at
// at. With a cache, the value of the current second is kept there, so that
// operations started within one second share one: a header value is never
// modified by a RoundTripper.
func (t *Transport) firstSentValue(at time.Time, cache *atomic.Pointer[sentStamp]) []string {
	sec := at.Unix()
	if cache == nil {
		return []string{at.UTC().Format(http.TimeFormat)}
	}
	if s := cache.Load(); s != nil && s.unix == sec {
		return s.value
	}
	s := &sentStamp{unix: sec, value: []string{at.UTC().Format(http.TimeFormat)}}
	cache.Store(s)
	return s.value
}

// initFirstSent sets the first-sent header name of a keyed operation,
// unless name is "" (the Transport sends none) or the request carries one
// already (carried says so, under any spelling, with its values), which
// is sent as it is. When it reads the clock for the first-sent time, it
// sets the operation's start from the same reading, and reports true.
func (op *operation) initFirstSent(name string, values []string, carried bool) (started bool) {
	if name == "" {
		return false
	}
	if carried {
		if len(values) > 0 {
			op.sentAt, _ = http.ParseTime(strings.TrimSpace(values[0]))
		}
		return false
	}
	op.sentHeader = name
	if at, ok := FirstSentFromContext(op.ctx); ok {
		op.sentAt = at
		op.sentValue = op.t.firstSentValue(at, nil)
		return false
	}
	now := time.Now()
	op.start = now.Sub(epoch) // on the monotonic clock, as time.Since
	op.sentAt = now
	op.sentValue = op.t.firstSentValue(now, &op.t.sentCache)
	return true
}

// expired returns the KeyExpiredError of a keyed operation's 410 that
// says its key expired, or nil for another 410, whose body is then left
// whole for the caller.
func (op *operation) expired(resp *http.Response, method string) error {
	if !isJSON(resp.Header.Get("Content-Type")) {
		return nil
	}
	start := peekBody(resp, ProviderBodyLimit, op.drainTime())
	var p struct {
		Type string `json:"type"`
	}
	if !strings.Contains(string(start), ProblemKeyExpired) || json.Unmarshal(start, &p) != nil || p.Type != ProblemKeyExpired {
		return nil
	}
	problem, _ := readProblem(resp, op.drainTime())
	return &KeyExpiredError{Key: op.key, Method: method, URL: redact(op.req), FirstSent: op.sentAt, Problem: problem}
}
