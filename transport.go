package idem

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net/http"
	"net/textproto"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// DefaultMaxBufferedBody is the largest request body without GetBody that
// [Transport] buffers in memory so it can send it again: 1 MiB.
const DefaultMaxBufferedBody = 1 << 20

// DefaultMaxBufferedResponse is the largest 2xx answer to a keyed request
// that [Transport] reads whole inside its attempt: 64 KiB.
const DefaultMaxBufferedResponse = 64 << 10

// maxDrain bounds how much of a retried response's body is read before it
// is closed, so that its connection can be reused without reading a large
// error page to the end.
const maxDrain = 64 << 10

// maxDrainTime bounds the time spent reading the body of a response that is
// not returned: a retried answer, or a 409's or 422's problem details. A
// body that stalls longer is given up and its connection closed.
const maxDrainTime = time.Second

// Transport is an [http.RoundTripper] that makes payment-style calls safe to
// retry. Each call to RoundTrip is one logical operation:
//
//   - POST and PATCH get an idempotency key: the one already in the
//     request's key header, else the one pinned with [WithKey], else a new
//     UUIDv4. Every attempt sends the same key and the same body bytes.
//     With [Transport.KeyBodyField] the key is also, or only, a field of
//     the JSON body, and a key already in that field comes first.
//   - GET, HEAD, OPTIONS, TRACE, PUT and DELETE get no key and are retried
//     as idempotent. Other methods are sent once.
//   - Errors before a response (connection errors, answers that cannot be
//     read, HTTP/2 stream resets, GOAWAY and lost connections), attempt
//     timeouts, 408, 429, 500, 502, 503 and 504 are retried with
//     exponential backoff and jitter, within
//     [RetryPolicy.MaxAttempts], [RetryPolicy.MaxElapsedTime], the request
//     context and the [RetryBudget]. Retry-After (seconds or HTTP-date) is
//     honoured on any retried answer, up to [RetryPolicy.MaxRetryAfter];
//     one that would wait past the operation's time ends it at once.
//   - 409 Conflict to a keyed request means the first request with the key
//     is still running: the Transport waits and asks again with the same
//     key, within [RetryPolicy.ConflictTimeout], and returns an
//     [*InProgressError] when that runs out.
//   - 422 to a keyed request means the key was used for another request:
//     RoundTrip returns a [*KeyReuseError] without retrying.
//   - 410 Gone to a keyed request, with the problem type of an expired
//     key, means the server no longer keeps the key of an operation first
//     sent longer ago than its retention: RoundTrip returns a
//     [*KeyExpiredError] (the outcome is unknown) without retrying.
//   - A [Transport.Provider] reads the answers of an API that speaks
//     otherwise, such as Stripe's 400 idempotency_error (key reuse) or
//     PayPal's 422 UNPROCESSABLE_ENTITY (a refused request, returned).
//   - A keyed request's 2xx answer of at most MaxBufferedResponse bytes
//     is read whole inside its attempt: one cut while it is read is
//     retried with the same key, and the server's replay completes it.
//     Once such a 2xx was seen, the operation took effect: if no later
//     attempt brings a whole 2xx (a refusal, a 5xx, an error), RoundTrip
//     returns an [*AnswerLostError] with the status seen, never the
//     refusal.
//   - When attempts run out on a status, RoundTrip returns that last
//     response as it came; when they run out on an error, a [*RetryError].
//     Errors not retried are those known to recur (a certificate the
//     client refuses, a TLS alert, a name that does not resolve, a
//     request body whose own Read fails or that disagrees with its
//     ContentLength) and the context's; a keyed request's come in a
//     RetryError too, with the key.
//
// Nothing is retried once the request's context is done. The request
// passed in is never modified; each attempt is a clone. Bodies of retried
// responses are drained (up to 64 KiB, for at most a second, less than
// AttemptTimeout and the operation's time left) and closed so their
// connections are reused; a body that stalls is closed, with its connection. RoundTrip starts no goroutine that outlives it.
//
// The zero value is ready to use. A Transport is safe for concurrent use by
// multiple goroutines; like [http.Transport], it should be reused rather
// than created per request, and must not be copied after first use (its
// retry budget is shared by all its operations).
type Transport struct {
	// Base sends each attempt. If nil, http.DefaultTransport is used.
	Base http.RoundTripper

	// Retry says when and how long to wait between attempts. Its zero
	// fields take the documented defaults.
	Retry RetryPolicy

	// KeyHeader names the header that carries the key. If empty, the
	// Provider's is used; if that is empty too, DefaultKeyHeader
	// ("Idempotency-Key") is used, unless a KeyBodyField is set: then no
	// key header is sent. Some APIs use another name, such as
	// "PayPal-Request-Id".
	KeyHeader string

	// KeyBodyField names a top-level field of the JSON object request body
	// that carries the key, for APIs that take it there, such as Square's
	// "idempotency_key" or the "ClientToken" of AWS APIs. If empty, the
	// Provider's is used; if that is empty too, the key goes only in the
	// header and the body is sent as it is.
	//
	// When set, the body of a keyed request must be a JSON object of at
	// most MaxBufferedBody bytes (GetBody or not); it is read once per
	// operation, and any other body, an empty one included, is refused
	// before sending with [ErrKeyBodyField] in the error's chain. A string
	// already in the field is the key, and the body is sent as it is: it
	// wins over a key header, [WithKey] and NewKey. Without the field,
	// idem's key is written as the object's first member, `"field":"key",`
	// just after the brace, and no other byte changes. Names match exactly
	// once unescaped; nested objects do not count; a field named twice or
	// holding something other than a string is refused. A key header is
	// sent only if KeyHeader is set, or, without KeyHeader, if the request
	// has an Idempotency-Key header: its key is then the operation's, and
	// must agree with the field.
	KeyBodyField string

	// KeyFormat says how new and pinned keys are written: KeyBare (the
	// zero value, as Stripe expects) or KeySFString (the IETF draft's
	// quoted form). If KeyBare, the Provider's KeyFormat is used. A key
	// header already on the request is sent as it is.
	KeyFormat KeyFormat

	// Provider is the dialect of the API called, such as [Stripe] or
	// [PayPal]: where it takes the key, and what its answers for a reused
	// key, a request still running, "retry" and "do not retry" look like
	// (see [Provider]). The zero value is the IETF draft's dialect, the
	// rules of the [Transport] documentation (docs/retries.md). KeyHeader, KeyBodyField, KeyFormat and Classify set on
	// the Transport win over the Provider's.
	Provider Provider

	// NewKey makes the key of an operation that has none. If nil, [NewKey]
	// (a random UUIDv4) is used. It must return a fresh key on every call.
	NewKey func() string

	// Budget limits retries across operations. If nil, the Transport uses
	// a budget of its own, made by NewRetryBudget(0, 0) on first use.
	Budget *RetryBudget

	// DisableBudget turns the retry budget off: every operation may make
	// all the retries its RetryPolicy allows, even during an outage.
	DisableBudget bool

	// MaxBufferedBody is the largest request body without GetBody that is
	// buffered in memory to be sent again. A larger one is sent once: when
	// its attempt's outcome calls for a retry that would otherwise be made,
	// the operation ends with a RetryError holding ErrBodyNotReplayable and
	// the outcome; when no retry would be made anyway (attempts or time
	// used up, a status not retried), the outcome is returned as it is. If zero,
	// DefaultMaxBufferedBody is used; a negative value buffers nothing.
	// Requests made by http.NewRequest from a bytes.Buffer, bytes.Reader or
	// strings.Reader have GetBody and are never buffered.
	MaxBufferedBody int64

	// MaxBufferedResponse is the largest 2xx answer to a keyed request
	// (POST, PATCH) that is read whole inside its attempt, when its
	// Content-Length says it is no larger: an answer cut while it is read
	// is then retried with the same key, and the server's replay of the
	// stored answer completes it, instead of leaving the caller a read
	// error and an unknown outcome. AttemptTimeout bounds the read, and a
	// read that stalls past it is retried too. A larger answer, one of
	// unknown length (chunked, which may be a stream that must not be held
	// up), and the answers to unkeyed requests are handed over unread. If
	// zero, DefaultMaxBufferedResponse is used; a negative value reads none.
	//
	// An answer of up to DefaultMaxBufferedResponse is read into a pooled
	// buffer, which closing the body gives back: as with net/http's bodies,
	// a Read after Close returns an error. Close the body of every
	// response, as always: a body never closed leaves its buffer to the
	// garbage collector instead.
	MaxBufferedResponse int64

	// FirstSentHeader names the header in which every attempt of a keyed
	// operation says when the operation was first sent, an HTTP-date, the
	// same on every retry: when RoundTrip began, or the time pinned with
	// [WithFirstSent]; a request that carries the header already, under
	// any spelling, is sent as it is. A server that keeps keys for a limited time can then tell
	// a retry that comes after it let the key go, and refuse it instead of
	// running the operation again: idem's server side answers it 410,
	// which ends the call in a [*KeyExpiredError]. If empty,
	// "Repeatability-First-Sent" ([DefaultFirstSentHeader], OASIS
	// Repeatable Requests) is used.
	FirstSentHeader string

	// FirstSentMemory is how long the Transport remembers, in memory, the
	// first-sent time of each key it sent, per host: a key sent again to
	// the same host without [WithFirstSent] ([WithKey] alone, or a key
	// header or body field of the caller's) carries the time it was first
	// sent with, not the time of its new call, so a server that let the
	// key go refuses it instead of running the operation again. A key made for an operation
	// ([NewKey]) is remembered only if the operation did not end in a 2xx.
	// At most [MaxRememberedKeys] keys are remembered, and a key is
	// forgotten once its first-sent time is older than FirstSentMemory.
	// Nothing of it survives the process: an application that asks again
	// about an operation after a restart, or later than this, must store
	// the key and the first-sent time with the operation and pin both
	// ([WithKey], [WithFirstSent]). If zero, [DefaultFirstSentMemory] (24
	// hours) is used; a negative value remembers nothing.
	FirstSentMemory time.Duration

	// NoFirstSent sends no first-sent time (see FirstSentHeader): a retry
	// that reaches a server after it purged the key may then run the
	// operation again.
	NoFirstSent bool

	// Classify, if not nil, sees each attempt's outcome, a response or an
	// error (the other is nil), and may override what the Transport makes
	// of it: retry, stop, wait out a conflict, or end on key reuse (see
	// [Verdict]). VerdictDefault keeps the Transport's own decision, the
	// Provider's verdict included. It is called from the goroutine that
	// called RoundTrip, and must not read or close the response body: it
	// decides on the status and headers, such as Stripe's
	// Stripe-Should-Retry. Whatever it says, nothing is sent once the
	// request's context is done, methods that are not retried are sent
	// once, and MaxAttempts, the time limits and the retry budget hold.
	Classify func(resp *http.Response, err error) Verdict

	// OnAttempt, if not nil, is called after every attempt, from the
	// goroutine that called RoundTrip, with what happened and what comes
	// next. It must not read or close the response body.
	OnAttempt func(Attempt)

	// Logger, if not nil, receives one record per attempt: Info for a
	// retry, Warn for the last one when the operation ends on an error or
	// a status of 400 or more, Debug for the last one otherwise. Records carry the key and attempt number; never a body.
	Logger *slog.Logger

	budgetOnce sync.Once
	budget     *RetryBudget
	sentCache  atomic.Pointer[sentStamp] // the first-sent value of the current second
	spareKit   atomic.Pointer[kit]       // the kit last given back, for the next attempt (attempt.go)
	shapes     headerShapes              // the names of the last request headers walked (headershape.go)
	sent       sentMemory                // the first-sent time of each key sent (sentmemory.go)
}

// Attempt describes one attempt of a logical operation. [Transport.OnAttempt]
// gets it after each attempt, with every field set. The base transport sees
// it while it sends the attempt, through [AttemptFromContext] on the
// request's context, with Number and Key set and the other fields zero.
type Attempt struct {
	Request  *http.Request  // the attempt as sent; do not modify it
	Key      string         // the operation's key; "" when unkeyed
	Number   int            // 1 for the first attempt
	Response *http.Response // nil when Err is set; do not touch its body
	Err      error
	Retry    bool          // whether another attempt follows
	Wait     time.Duration // the wait before it
	// Reason says why. When Retry is true it names the wait: "backoff",
	// "Retry-After", or "409: still running, " and either. When the
	// operation ends with this attempt it is the response's status line
	// (Response.Status) or the error's kind ("connection reset", …) if the
	// outcome called for no retry, or why no retry could be made:
	// "attempts exhausted", "retry budget exhausted", "conflict budget
	// exhausted", "wait would pass MaxElapsedTime", "422 Unprocessable
	// Content: key used for another request", and so on. A verdict of the
	// Provider or Classify names them: "400 Bad Request (Stripe)".
	Reason string
}

// Replayed reports whether resp is a replay of an earlier outcome: the
// server answered a retry from its stored result (Idempotent-Replayed: true)
// instead of running the operation again.
func Replayed(resp *http.Response) bool {
	v := strings.TrimSpace(resp.Header.Get("Idempotent-Replayed"))
	return strings.EqualFold(v, "true") || v == "?1"
}

func (t *Transport) base() http.RoundTripper {
	if t.Base != nil {
		return t.Base
	}
	return http.DefaultTransport
}

// keyHeader returns the name of the key header in its canonical form:
// DefaultKeyHeader as it is, or the Transport's KeyHeader (else the
// Provider's) canonicalized.
func (t *Transport) keyHeader() string {
	if t.KeyHeader == "" && t.Provider.KeyHeader == "" {
		return DefaultKeyHeader // the common case, inlined
	}
	return t.canonicalKeyHeader()
}

func (t *Transport) canonicalKeyHeader() string {
	return textproto.CanonicalMIMEHeaderKey(t.keyHeaderName()) // provider.go
}

func (t *Transport) retryBudget() *RetryBudget {
	switch {
	case t.DisableBudget:
		return nil
	case t.Budget != nil:
		return t.Budget
	}
	return t.ownBudget() // the checks above inline
}

func (t *Transport) ownBudget() *RetryBudget {
	t.budgetOnce.Do(func() { t.budget = NewRetryBudget(0, 0) })
	return t.budget
}

// CloseIdleConnections closes the idle connections of the base transport,
// if it has such a method.
func (t *Transport) CloseIdleConnections() {
	type closeIdler interface{ CloseIdleConnections() }
	if ci, ok := t.base().(closeIdler); ok {
		ci.CloseIdleConnections()
	}
}

// errNilResponse is the error of an attempt whose base transport returned
// neither a response nor an error.
var errNilResponse = errors.New("idem: the base RoundTripper returned a nil *Response with a nil error")

// errAttemptTimedOut is the cancellation cause of an attempt that ran past
// RetryPolicy.AttemptTimeout.
var errAttemptTimedOut = errors.New("attempt timeout")

// errOperationTimedOut is the cancellation cause of an attempt cut at the
// operation's end (RetryPolicy.MaxElapsedTime), and is in the chain of the
// error that ends the operation then. It wraps context.DeadlineExceeded,
// like the error of a request whose context's deadline passed.
var errOperationTimedOut = fmt.Errorf("idem: operation time is up: %w", context.DeadlineExceeded)

// RoundTrip sends req as one logical operation, retrying as the
// [Transport] documentation says. It returns the final response, or a
// [*KeyReuseError], [*InProgressError], [*KeyExpiredError],
// [*AnswerLostError] or [*RetryError], or, for an unkeyed
// request, the error of a single attempt that is not retried. It always
// closes req.Body.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	// Field by field: a composite literal is built in a temporary and
	// copied, 416 bytes more to move on every call.
	var op operation
	op.t, op.req, op.ctx = t, req, req.Context()
	resp, err := op.attemptAll()
	op.rememberNewKey(err != nil || resp.StatusCode/100 != 2) // sentmemory.go
	if op.lostCode == 0 || (err == nil && resp.StatusCode/100 == 2) {
		return resp, err
	}
	// A 2xx answer's body was lost, and no later attempt brought one whole:
	// the operation ends with that answer's status, never with a later
	// refusal (see AnswerLostError).
	return op.answerLost(resp, err)
}

// epoch is the origin of operation start times: time.Since(epoch) reads
// only the monotonic clock, where time.Now reads the wall clock too, and an
// operation's times are all durations, compared on that clock.
var epoch = time.Now()

// elapsed returns the time since the operation started.
func (op *operation) elapsed() time.Duration {
	return time.Since(epoch) - op.start
}

// retryPolicy returns the Transport's policy with the defaults in its zero
// fields, filled in on first use. A first-try success needs none of them:
// it reads only AttemptTimeout, which has no default (t.Retry's), and
// MaxElapsedTime only when set.
func (op *operation) retryPolicy() *RetryPolicy {
	if !op.filled {
		op.policy, op.filled = op.t.Retry.withDefaults(), true
	}
	return &op.policy
}

// operation holds the state of one RoundTrip; it lives on its stack.
type operation struct {
	t      *Transport
	req    *http.Request
	ctx    context.Context
	policy RetryPolicy // t.Retry with its defaults, once retryPolicy filled it
	filled bool        // whether it did
	// start is when the operation started, as time.Since(epoch): just
	// before its first attempt is prepared.
	start time.Duration
	// reached says an attempt may have reached the server: it got a
	// response, or an error that does not prove otherwise (see notSent).
	reached bool
	// newKey says the operation's key was made for it (NewKey), not
	// pinned by the caller.
	newKey bool
	// lostCode is the status of the first 2xx answer whose body was lost
	// while it was read inside its attempt, lostErr how; 0 if none was.
	lostCode int
	lostErr  error

	keyed, idempotent bool
	header, key, val  string
	respelt           bool // the request has the key header under another spelling too
	// The first-sent time (firstsent.go): its header, "" when the
	// attempts carry none of the Transport's; its value; the time.
	sentHeader string
	sentValue  []string
	sentAt     time.Time

	body            body
	problem         *Problem        // of the last 409
	indefinite      bool            // the last outcome called for a retry the context stopped
	ownCtx          bool            // the last attempt has a context of its own, released by cancel
	last            *attemptRequest // the last attempt sent
	attempts        int             // attempts sent
	conflicts       int             // of which answered 409
	firstConflict   time.Time
	backoff         *backoff.ExponentialBackOff
	conflictBackoff *backoff.ExponentialBackOff
}

// answerLost ends an operation that saw a 2xx answer whose body was lost,
// and whose retries, which would have read it again, ended in resp or err.
func (op *operation) answerLost(resp *http.Response, err error) (*http.Response, error) {
	last := err
	if resp != nil {
		last = errors.New(resp.Status)
		op.drain(resp)
	}
	return nil, &AnswerLostError{
		Key: op.key, Method: cmp.Or(op.req.Method, http.MethodGet), URL: redact(op.req),
		StatusCode: op.lostCode, Attempts: op.attempts, Err: op.lostErr, Last: last,
	}
}

func (op *operation) attemptAll() (*http.Response, error) {
	req := op.req
	method := req.Method // cmp.Or's loop costs a dozen instructions more
	if method == "" {
		method = http.MethodGet
	}
	op.keyed = method == http.MethodPost || method == http.MethodPatch
	op.idempotent = op.keyed || isIdempotent(method)
	bodyKey := op.keyed && op.t.keyBodyField() != ""
	var hs headerScan // the key header (but with a KeyBodyField) and the first-sent header
	sentName := ""
	if op.keyed {
		sentName = op.t.firstSentHeader() // firstsent.go
	}
	if op.keyed && !bodyKey {
		op.header = op.t.keyHeader()
		if !hs.recall(req.Header, &op.t.shapes, op.header, sentName) { // headershape.go
			hs.scan(req.Header, op.header, sentName)
			op.t.shapes.remember(&hs, op.header, sentName)
		}
		vs := hs.key
		op.respelt = hs.respelt
		var err error
		op.key, op.val, op.newKey, err = keyFor(req, vs, op.header, op.t.keyFormat(), op.t.NewKey)
		if err == nil {
			err = op.t.checkKeyLen(op.key) // provider.go
		}
		if err != nil {
			closeBody(req)
			return nil, refused(err)
		}
	}
	if bodyKey && sentName != "" {
		hs.scan(req.Header, "", sentName) // initBodyKey reads the key header
	}
	if !op.keyed || !op.initFirstSent(sentName, hs.sent, hs.hasSent) { // firstsent.go
		op.start = time.Since(epoch)
	}
	if bodyKey {
		if err := op.initBodyKey(); err != nil { // bodykey.go
			return nil, refused(err)
		}
		if err := op.t.checkKeyLen(op.key); err != nil { // provider.go
			return nil, refused(err)
		}
	} else if err := op.body.init(req, op.t.maxBuffered()); err != nil {
		return nil, refused(err)
	}
	if op.keyed {
		op.recallFirstSent() // sentmemory.go
	}
	if err := op.ctx.Err(); err != nil {
		// Done before anything was sent.
		closeBody(req)
		if op.key != "" {
			return nil, op.retryError(err)
		}
		return nil, refused(err)
	}
	var last error          // the outcome of the last attempt sent, before a retry
	var lastVerdict verdict // and what it called for
	for {
		if op.attempts > 0 && op.elapsed() >= op.retryPolicy().MaxElapsedTime {
			// The wait overran into the operation's end.
			if lastVerdict == conflict {
				return op.inProgress(nil, func() {}, "MaxElapsedTime reached", nil)
			}
			return nil, op.retryError(fmt.Errorf("%w before attempt %d; last attempt: %w", errOperationTimedOut, op.attempts+1, last))
		}
		body, err := op.body.open(op.attempts + 1)
		if err != nil {
			// GetBody failed: the attempt is not sent, nor counted.
			return nil, op.retryError(fmt.Errorf("idem: reopening request body: %w; last attempt: %w", err, last))
		}
		reachedBefore := op.reached
		resp, cancel, err := op.send(body)
		if err != nil && lastVerdict == conflict && (op.ctx.Err() != nil || errors.Is(err, errOperationTimedOut)) {
			// A poll cut short: the last the server said is that the
			// key's request is still running.
			op.report(nil, err, false, 0, "409: "+errorReason(err)+" during the next poll")
			return op.inProgress(nil, cancel, "409: "+errorReason(err)+" during the next poll", err)
		}
		if err != nil && errors.Is(err, errOperationTimedOut) {
			return op.finish(nil, err, cancel, "MaxElapsedTime reached during the attempt", true)
		}
		v, reason := op.classify(resp, err)
		if v == conflict {
			op.polled()
			// A keyed operation that ends on a 409 ends with an
			// InProgressError, which carries the last problem details.
			var body []byte
			op.problem, body = readProblem(resp, op.drainTime())
			op.describe(op.problem, body) // provider.go
			resp.Body = http.NoBody
			if op.ctx.Err() != nil {
				return op.inProgress(resp, cancel, "409: "+errorReason(op.ctx.Err()), op.ctx.Err())
			}
		}
		if v == retry && op.ctx.Err() != nil {
			// The caller has given up: nothing more is sent. The outcome
			// is not a definitive answer, so it earns the budget nothing.
			op.indefinite = true
			v = done
		}
		if v == done && resp != nil && resp.StatusCode == http.StatusGone && op.keyed {
			if expired := op.expired(resp, method); expired != nil { // firstsent.go
				cancel()
				op.report(resp, nil, false, 0, "410 Gone: key expired")
				return nil, expired
			}
		}
		switch v {
		case done:
			return op.finish(resp, err, cancel, reason, false)
		case keyReuse:
			problem, body := readProblem(resp, op.drainTime())
			op.describe(problem, body) // provider.go
			cancel()
			op.report(resp, nil, false, 0, reason+": key used for another request")
			return nil, &KeyReuseError{Key: op.key, Method: method, URL: redact(req), Problem: problem, Attempts: op.attempts, earlierNotSent: !reachedBefore}
		case keyExpired:
			problem, body := readProblem(resp, op.drainTime())
			op.describe(problem, body) // provider.go
			cancel()
			op.report(resp, nil, false, 0, reason+": key expired")
			return nil, &KeyExpiredError{Key: op.key, Method: method, URL: redact(req), FirstSent: op.sentAt, Problem: problem}
		}
		wait, why, end := op.plan(v, resp)
		switch end {
		case endFinish:
			return op.finish(resp, err, cancel, why, true)
		case endInProgress:
			return op.inProgress(resp, cancel, why, nil)
		case endBudget:
			return op.fail(ErrBudgetExhausted, resp, err, cancel, why)
		case endNotReplayable:
			return op.fail(ErrBodyNotReplayable, resp, err, cancel, why)
		}
		last, lastVerdict = err, v
		if resp != nil {
			last = errors.New(resp.Status)
			op.drain(resp)
			if k := op.last.untrace(); k != nil {
				k.giveBack() // the Base is done with the request
			}
		}
		cancel()
		op.report(resp, err, true, wait, why)
		if err := op.sleep(wait); err != nil {
			if v == conflict {
				return op.inProgress(nil, func() {}, "409: "+errorReason(err)+" while waiting", err)
			}
			return nil, op.retryError(fmt.Errorf("%w while waiting to retry; last attempt: %w", err, last))
		}
	}
}

// ending says how plan ends an operation that cannot go on.
type ending int

const (
	goOn             ending = iota // no ending: wait and send again
	endFinish                      // hand the last outcome to the caller
	endInProgress                  // 409 waits cannot go on
	endBudget                      // the retry budget is empty
	endNotReplayable               // the body cannot be sent again
)

// plan returns how long to wait before the next attempt and why, or, when
// no further attempt may be sent, how to end the operation. (An enum rather
// than a method value keeps the operation on RoundTrip's stack.) A 409 that
// cannot be waited out, for whatever reason, ends in progress.
func (op *operation) plan(v verdict, resp *http.Response) (time.Duration, string, ending) {
	wait, why, end := op.planNext(v, resp)
	if v == conflict && end != goOn {
		end = endInProgress
	}
	return wait, why, end
}

func (op *operation) planNext(v verdict, resp *http.Response) (time.Duration, string, ending) {
	p := op.retryPolicy()
	if !op.idempotent {
		return 0, op.req.Method + " is not retried", endFinish
	}
	ra, hasRA := time.Duration(0), false
	if resp != nil {
		ra, hasRA = parseRetryAfter(resp.Header.Get("Retry-After"), time.Now())
	}
	var wait time.Duration
	why := "backoff"
	if hasRA {
		wait, why = ra, "Retry-After"
	}
	if v == conflict {
		if !hasRA {
			wait = next(&op.conflictBackoff, p)
		}
		why = "409: still running, " + why
		if op.conflicts > p.MaxConflictRetries || exceeds(time.Since(op.firstConflict), wait, p.ConflictTimeout) {
			return 0, "conflict budget exhausted", endInProgress
		}
	} else {
		if op.attempts-op.conflicts >= p.MaxAttempts {
			return 0, "attempts exhausted", endFinish
		}
		if !hasRA {
			wait = next(&op.backoff, p)
		}
	}
	if hasRA && ra > p.MaxRetryAfter {
		return 0, fmt.Sprintf("Retry-After %s exceeds MaxRetryAfter", ra), endFinish
	}
	if exceeds(op.elapsed(), wait, p.MaxElapsedTime-1) {
		// The wait would end at or past MaxElapsedTime, leaving the next
		// attempt no time.
		return 0, "wait would pass MaxElapsedTime", endFinish
	}
	if d, ok := op.ctx.Deadline(); ok && time.Now().Add(wait).After(d) {
		return 0, "wait would pass the context deadline", endFinish
	}
	if !op.body.replayable {
		// Checked last: when no retry would be made anyway, the
		// outcome is returned as it is.
		return 0, "body cannot be replayed", endNotReplayable
	}
	if v == retry {
		if b := op.t.retryBudget(); b != nil && !b.spend() {
			return 0, "retry budget exhausted", endBudget
		}
	}
	return wait, why, goOn
}

// exceeds reports whether waiting wait after elapsed would pass limit,
// without computing elapsed+wait, which overflows for a huge Retry-After.
// elapsed and wait are never negative.
func exceeds(elapsed, wait, limit time.Duration) bool {
	return wait > limit-elapsed
}

// next returns the next computed backoff wait, jittered and capped by
// MaxInterval. The backoff is made on first use: a first-try success
// allocates none.
func next(b **backoff.ExponentialBackOff, p *RetryPolicy) time.Duration {
	if *b == nil {
		*b = &backoff.ExponentialBackOff{
			InitialInterval:     p.InitialInterval,
			RandomizationFactor: p.Jitter,
			Multiplier:          p.Multiplier,
			MaxInterval:         p.MaxInterval,
			MaxElapsedTime:      0, // the operation keeps its own time
			Stop:                backoff.Stop,
			Clock:               backoff.SystemClock,
		}
		(*b).Reset()
	}
	d := (*b).NextBackOff()
	if d < 0 {
		// The jittered wait overflowed time.Duration (intervals of
		// centuries); backoff.Stop is never returned without a
		// MaxElapsedTime. Wait the longest instead of not at all.
		return p.MaxInterval
	}
	return min(d, p.MaxInterval)
}

// send sends one attempt with the given body. cancel releases the
// attempt's context; for a returned response it must run only once the
// caller closes the body.
func (op *operation) send(body io.ReadCloser) (resp *http.Response, cancel func(), err error) {
	op.attempts++
	ar := &attemptRequest{ctx: attemptContext{Context: op.ctx, number: int32(op.attempts), key: op.key}}
	if op.reached {
		ar.ctx.flags.Store(flagAfterReached)
	}
	kit := ar.borrowKit(op.ctx, &op.t.spareKit) // attempt.go
	actx := &ar.ctx
	cancel = func() {}
	var timer *time.Timer
	d, cause := op.attemptLimit()
	op.ownCtx = d > 0
	if d > 0 {
		var cancelCause context.CancelCauseFunc
		actx.Context, cancelCause = context.WithCancelCause(op.ctx)
		// A timer rather than WithTimeout: it is stopped once the headers
		// are in (and an answer read inside the attempt), so a slow read
		// of the final body is not cut off.
		timer = time.AfterFunc(d, func() { cancelCause(cause) })
		cancel = func() { timer.Stop(); cancelCause(context.Canceled) }
	}
	// A shallow copy with a header of its own, rather than req.Clone: no
	// RoundTripper may modify a request, so the URL and the rest can be
	// shared, and a first-try success saves the allocations of a deep copy.
	// The caller's request is never modified either way.
	ar.req = *op.req.WithContext(actx)
	areq := &ar.req
	if op.header != "" || op.sentHeader != "" {
		areq.Header = op.attemptHeader(&actx.keyValue)
	}
	var tracked *trackedBody
	areq.Body = track(body, op.attempts == 1 && op.body.firstMem, &tracked) // localerr.go
	areq.GetBody = op.body.getBody
	if op.body.length >= 0 {
		areq.ContentLength = op.body.length
	}
	resp, err = op.t.base().RoundTrip(areq)
	err = tracked.local(err, areq.ContentLength)
	if resp == nil && err == nil {
		// A broken base; http.Client refuses the same, rather than crash.
		err = errNilResponse
	}
	if resp != nil && resp.Request != areq && (resp.Request == nil || !isAttempt(resp.Request.Context(), actx)) {
		// As net/http's: the attempt sent. OutcomeOf reads its context,
		// which a Base that answered with another request's may lack.
		resp.Request = areq
	}
	if resp != nil && resp.Body == nil {
		// As http.Client takes it: an empty body, unless it should not be.
		if resp.ContentLength > 0 && areq.Method != http.MethodHead {
			resp, err = nil, fmt.Errorf("idem: the base RoundTripper (%T) returned a *Response with content length %d but a nil Body", op.t.base(), resp.ContentLength)
		} else {
			resp.Body = http.NoBody
		}
	}
	if resp != nil || !notSent(areq, body, err, &kit.wire) { // outcome.go
		op.reached = true
	}
	if resp != nil && op.key != "" && resp.StatusCode/100 == 2 && resp.ContentLength > 0 && resp.ContentLength <= op.t.maxAnswer() {
		// Read inside the attempt, under its timer: a cut is retried.
		code := resp.StatusCode
		var closed bool
		closed, err = readAnswer(resp, ar) // answer.go
		if closed {
			// The Base is done with the request: the kit goes back now,
			// or, with an answer read whole, once the caller closes it.
			ar.untrace()
		}
		if err != nil {
			resp = nil
			if op.lostCode == 0 {
				op.lostCode, op.lostErr = code, err // the operation took effect
			}
			kit.giveBack()
		}
	} else {
		kit.dropBuf() // the Base may still use the request, and the kit's hooks
	}
	if timer != nil && !timer.Stop() && op.ctx.Err() == nil {
		// The attempt ran out of time: the headers came too late, or not
		// at all. Its context is canceled either way.
		if resp != nil {
			op.drain(resp)
			resp = nil
		}
		if cause == errOperationTimedOut {
			err = fmt.Errorf("%w (MaxElapsedTime %s) during attempt %d (%v)", errOperationTimedOut, op.retryPolicy().MaxElapsedTime, op.attempts, err)
		} else {
			err = fmt.Errorf("%w after %s (%v)", ErrAttemptTimeout, op.t.Retry.AttemptTimeout, err)
		}
	}
	op.last = ar
	return resp, cancel, err
}

// attemptLimit returns how long the next attempt may wait for its response
// headers, or 0 for no limit, and the cancellation cause when it runs out:
// AttemptTimeout, or the operation's end (MaxElapsedTime) if it comes
// first. The operation's end is not enforced on a first attempt under the
// default MaxElapsedTime, which would cost a timer on every call; nor when
// the context's deadline comes first, which net/http enforces.
func (op *operation) attemptLimit() (time.Duration, error) {
	d, cause := op.t.Retry.AttemptTimeout, errAttemptTimedOut
	if op.attempts == 1 && op.t.Retry.MaxElapsedTime <= 0 {
		return d, cause
	}
	left := op.retryPolicy().MaxElapsedTime - op.elapsed() // until the operation's end
	if dl, ok := op.ctx.Deadline(); ok && time.Until(dl) <= left {
		return d, cause
	}
	if left = max(left, time.Nanosecond); d <= 0 || left < d {
		d, cause = left, errOperationTimedOut
	}
	return d, cause
}

// finish hands the outcome of the last attempt to the caller. gaveUp says
// the outcome called for a retry that could not be made; an error is then a
// RetryError, as it is after any retry, and so is every error of a keyed
// operation: its request may have reached the server (its context ended
// it, an answer could not be read, …), and the caller needs the key to
// learn what happened. Only the error of an unkeyed request's first
// attempt that is not retried comes back as it is.
func (op *operation) finish(resp *http.Response, err error, cancel func(), why string, gaveUp bool) (*http.Response, error) {
	if err != nil {
		cancel()
		op.report(nil, err, false, 0, why)
		if op.attempts > 1 || gaveUp || op.key != "" {
			return nil, op.retryError(err)
		}
		return nil, err
	}
	if b := op.t.retryBudget(); b != nil && !gaveUp && !op.indefinite {
		b.succeed() // a definitive answer, not a failure given up on
	}
	op.report(resp, nil, false, 0, why)
	if op.ownCtx {
		// The attempt's context (AttemptTimeout, or the operation's end
		// under an explicit MaxElapsedTime) is released when the caller
		// closes the body; else it would stay registered with the
		// request's context until that ends.
		if rw, ok := resp.Body.(io.ReadWriteCloser); ok && resp.StatusCode == http.StatusSwitchingProtocols {
			resp.Body = &cancelOnCloseRW{ReadWriteCloser: rw, cancel: cancel}
		} else if _, read := resp.Body.(*answerBody); read || resp.Body == http.NoBody {
			cancel() // nothing left to read
		} else {
			resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: cancel}
		}
	}
	return resp, nil
}

// fail ends the operation with a RetryError whose chain holds sentinel and
// the last attempt's outcome.
func (op *operation) fail(sentinel error, resp *http.Response, err error, cancel func(), why string) (*http.Response, error) {
	if resp != nil {
		op.drain(resp)
	}
	cancel()
	op.report(resp, err, false, 0, why)
	if err != nil {
		err = fmt.Errorf("%w; last attempt: %w", sentinel, err)
	} else {
		err = fmt.Errorf("%w; last attempt: %s", sentinel, resp.Status)
	}
	return nil, op.retryError(err)
}

// inProgress ends an operation on a 409 that cannot be waited out: the
// conflict budget, the operation's time or the context ran out (err is the
// context's error, if that is why).
func (op *operation) inProgress(resp *http.Response, cancel func(), why string, err error) (*http.Response, error) {
	cancel()
	if resp != nil {
		op.report(resp, nil, false, 0, why)
	}
	waited := time.Duration(0)
	if op.conflicts > 0 {
		waited = time.Since(op.firstConflict)
	}
	return nil, &InProgressError{
		Key: op.key, Method: op.req.Method, URL: redact(op.req),
		Polls: max(op.conflicts, 1), Waited: waited, Problem: op.problem, Err: err, reason: why,
	}
}

// retryError returns a RetryError of the operation with the given reason,
// which says whether any attempt may have reached the server.
func (op *operation) retryError(err error) *RetryError {
	return &RetryError{Attempts: op.attempts, Key: op.key, Err: err, notSent: !op.reached}
}

// polled counts a 409 (or what Classify takes as one), as it arrives.
func (op *operation) polled() {
	op.conflicts++
	if op.conflicts == 1 {
		op.firstConflict = time.Now()
	}
}

// sleep waits d, or less if the request's context ends first, in which
// case it returns the context's error.
func (op *operation) sleep(d time.Duration) error {
	if d <= 0 {
		return op.ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-op.ctx.Done():
		return op.ctx.Err()
	}
}

// report tells OnAttempt and the Logger, if either is set, about the last
// attempt (notify). Small enough to inline: most Transports set neither.
func (op *operation) report(resp *http.Response, err error, retry bool, wait time.Duration, why string) {
	if op.t.OnAttempt != nil || op.t.Logger != nil {
		op.notify(resp, err, retry, wait, why)
	}
}

func (op *operation) notify(resp *http.Response, err error, retry bool, wait time.Duration, why string) {
	t := op.t
	a := Attempt{
		Key: op.key, Number: op.attempts,
		Response: resp, Err: err, Retry: retry, Wait: wait, Reason: why,
	}
	if op.last != nil {
		a.Request = &op.last.req
	}
	if t.OnAttempt != nil {
		t.OnAttempt(a)
	}
	if t.Logger != nil {
		level := slog.LevelDebug
		switch {
		case retry:
			level = slog.LevelInfo
		case err != nil || (resp != nil && resp.StatusCode >= 400):
			level = slog.LevelWarn
		}
		t.Logger.LogAttrs(op.ctx, level, "idem: attempt",
			slog.String("method", op.req.Method),
			slog.String("url", redact(op.req)),
			slog.String("key", op.key),
			slog.Int("attempt", op.attempts),
			slog.String("outcome", outcome(resp, err)),
			slog.Bool("retry", retry),
			slog.Duration("wait", wait),
			slog.String("reason", why),
		)
	}
}

// outcome names an attempt's result: its status line or its error.
func outcome(resp *http.Response, err error) string {
	if err != nil {
		return err.Error()
	}
	if resp != nil {
		return resp.Status
	}
	return "no response"
}

func (t *Transport) maxBuffered() int64 {
	if t.MaxBufferedBody == 0 {
		return DefaultMaxBufferedBody
	}
	return t.MaxBufferedBody
}

// body gives every attempt of an operation the same request body bytes.
type body struct {
	first      io.ReadCloser // for the first attempt
	firstMem   bool          // first is an in-memory reader (see inMemory)
	getBody    func() (io.ReadCloser, error)
	length     int64 // the length to send, or -1 to keep the request's
	replayable bool
}

// init prepares the body of req: no body; the request's own GetBody; or a
// buffered copy of a body without one, up to limit bytes.
func (b *body) init(req *http.Request, limit int64) error {
	b.length = -1
	b.replayable = true
	left, _, mem := inMemory(req.Body, req.ContentLength) // outcome.go
	if err := checkLength(req, left, mem); err != nil {   // localerr.go
		closeBody(req)
		return err
	}
	b.first, b.firstMem = req.Body, mem
	if req.Body == nil || req.Body == http.NoBody {
		return nil
	}
	if req.GetBody != nil {
		b.getBody = req.GetBody
		return nil
	}
	if limit < 0 {
		b.replayable = false
		return nil
	}
	size := plusOne(limit)
	if req.ContentLength > 0 && req.ContentLength <= limit {
		size = plusOne(req.ContentLength) // +1 to see io.EOF without growing
	}
	buf := bytes.NewBuffer(make([]byte, 0, min(size, 64<<10)))
	n, err := copyUntilDone(req.Context(), buf, io.LimitReader(req.Body, plusOne(limit)), req.Body)
	if err != nil {
		req.Body.Close()
		return fmt.Errorf("idem: reading request body: %w", err)
	}
	if n > limit {
		// Too large to keep: send what was read and the rest, once.
		b.first = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf.Bytes()), req.Body), req.Body}
		b.replayable = false
		return nil
	}
	req.Body.Close()
	if req.ContentLength > 0 && req.ContentLength != n {
		// net/http refuses such a request; so does the Transport,
		// rather than send the real length.
		return fmt.Errorf("idem: http: ContentLength=%d with Body length %d", req.ContentLength, n)
	}
	data := buf.Bytes()
	b.length = int64(len(data))
	b.getBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }
	b.first, _ = b.getBody()
	b.firstMem = true
	return nil
}

// plusOne returns n+1, or n if that would overflow: a read limit of
// limit+1 bytes tells a body over limit from one of limit bytes, and none
// is over math.MaxInt64.
func plusOne(n int64) int64 {
	if n == math.MaxInt64 {
		return n
	}
	return n + 1
}

// copyUntilDone copies src to dst until EOF, an error, or the end of ctx.
// When ctx ends first it closes body, the source's closer, under the read,
// as net/http does with a request body it stops sending: a pipe or a
// connection then returns at once. It returns the context's error (its
// cause) in that case. No goroutine outlives it.
func copyUntilDone(ctx context.Context, dst io.Writer, src io.Reader, body io.Closer) (int64, error) {
	if err := context.Cause(ctx); err != nil {
		return 0, err
	}
	if ctx.Done() == nil {
		return io.Copy(dst, src)
	}
	closed := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		body.Close()
		close(closed)
	})
	n, err := io.Copy(dst, src)
	if !stop() {
		<-closed
		return n, context.Cause(ctx)
	}
	return n, err
}

// open returns the body for the given attempt number.
func (b *body) open(attempt int) (io.ReadCloser, error) {
	if attempt == 1 || b.getBody == nil {
		return b.first, nil
	}
	return b.getBody()
}

// cancelOnClose releases an attempt's context when the caller closes the
// final response's body.
type cancelOnClose struct {
	io.ReadCloser
	cancel func()
}

func (c *cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}

// cancelOnCloseRW is cancelOnClose for the body of a 101 Switching
// Protocols response, which net/http makes the upgraded connection, an
// io.ReadWriteCloser: the caller's type assertion still holds, and closing
// the connection releases the attempt's context.
type cancelOnCloseRW struct {
	io.ReadWriteCloser
	cancel func()
}

func (c *cancelOnCloseRW) Close() error {
	err := c.ReadWriteCloser.Close()
	c.cancel()
	return err
}

// attemptHeader returns the header of an attempt: a copy of the request's
// with the key header (op.header, in canonical form) set to the single
// value op.val, held in slot, and the first-sent time. A key header the
// request also has under another spelling (op.respelt) is left out of the
// copy: the key is sent once.
//
// The copy is maps.Clone's, which copies the map's memory without walking
// or hashing it, and its value slices are the caller's: no RoundTripper may
// modify a request, and an unkeyed attempt sends the caller's header
// itself.
func (op *operation) attemptHeader(slot *[1]string) http.Header {
	out := maps.Clone(op.req.Header)
	if out == nil {
		out = make(http.Header, 2)
	}
	if key := op.header; key != "" {
		if op.respelt {
			for k := range out {
				if k != key && strings.EqualFold(k, key) {
					delete(out, k)
				}
			}
		}
		slot[0] = op.val
		out[key] = slot[:]
	}
	if op.sentHeader != "" {
		out[op.sentHeader] = op.sentValue
	}
	return out
}

// drain reads (bounded in size and time) and closes the body of a response
// that will not be returned, so its connection can serve the next attempt.
func (op *operation) drain(resp *http.Response) {
	readBody(io.Discard, resp, maxDrain, op.drainTime())
}

// drainTime is how long the body of a response that will not be returned
// may be read: maxDrainTime, or less if AttemptTimeout is shorter or the
// operation's time ends sooner.
func (op *operation) drainTime() time.Duration {
	d := min(maxDrainTime, op.retryPolicy().MaxElapsedTime-op.elapsed())
	if t := op.t.Retry.AttemptTimeout; t > 0 {
		d = min(d, t)
	}
	return max(d, time.Nanosecond) // 0 would mean no bound
}

// readBody copies at most n bytes of resp's body to w, then closes the
// body. If within is positive and the copy takes longer, the body is
// closed under the read, which ends it; http.Transport then closes the
// connection instead of reusing it. No goroutine outlives readBody.
func readBody(w io.Writer, resp *http.Response, n int64, within time.Duration) {
	if within <= 0 {
		_, _ = io.CopyN(w, resp.Body, n)
		resp.Body.Close()
		return
	}
	closed := make(chan struct{})
	timer := time.AfterFunc(within, func() {
		resp.Body.Close()
		close(closed)
	})
	_, _ = io.CopyN(w, resp.Body, n)
	if timer.Stop() {
		resp.Body.Close()
	} else {
		<-closed // the timer closed the body: wait for its goroutine
	}
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

func isIdempotent(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace,
		http.MethodPut, http.MethodDelete:
		return true
	}
	return false
}

// redact returns the request URL without user info and query, which may
// hold secrets, for errors and logs.
func redact(req *http.Request) string {
	if req.URL == nil {
		return ""
	}
	u := *req.URL
	u.User, u.RawQuery, u.Fragment = nil, "", ""
	return u.String()
}
