package idem

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/httpstatus"
)

// Sentinel errors found in the chain of the errors idem returns; test them
// with [errors.Is].
var (
	// ErrAttemptTimeout is in the chain of an attempt that ran longer than
	// [RetryPolicy.AttemptTimeout]. Such an attempt is retried; it is told
	// apart from the caller's own cancellation, which is never retried.
	ErrAttemptTimeout = errors.New("idem: attempt timed out")
	// ErrBudgetExhausted is in the chain of a [*RetryError] returned because
	// the Transport's [RetryBudget] had no token left for a retry.
	ErrBudgetExhausted = errors.New("idem: retry budget exhausted")
	// ErrBodyNotReplayable is in the chain of a [*RetryError] returned
	// because an attempt's outcome called for a retry, which would have
	// been made, but the request body was larger than
	// [Transport.MaxBufferedBody] and had no GetBody, so it could not be
	// sent again. The chain also holds the attempt's outcome.
	ErrBodyNotReplayable = errors.New("idem: request body cannot be replayed")
)

// RetryError is returned by [Transport.RoundTrip] when an operation ends on
// an error after it was retried, or when an error that would be retried
// could not be: attempts, time or retry budget ran out, the context ended
// while waiting, the request body could not be reopened (GetBody failed),
// or MaxElapsedTime cut an attempt short. Every error that ends a keyed
// request is one (the request's context ending its first attempt, or an
// error that is not retried, such as a certificate the client refuses), so
// that the key to retry it with is at hand. Err is the
// reason, with the last attempt's outcome in its chain, so errors.Is(err,
// context.DeadlineExceeded) and the like work through it. Attempts counts
// only the attempts sent.
//
// [OutcomeOf] tells whether any attempt may have reached the server: a
// RetryError none of whose attempts did (each failed to connect, say) is
// [OutcomeNotSent], any other [OutcomeUnknown].
//
// When an operation ends on an HTTP status instead, RoundTrip returns the
// last response and no error; only an empty retry budget
// ([ErrBudgetExhausted]) and a body that cannot be sent again
// ([ErrBodyNotReplayable]) turn a status into a RetryError. A caller writes:
//
//	var rerr *idem.RetryError
//	switch {
//	case errors.As(err, &rerr) && errors.Is(err, idem.ErrBudgetExhausted):
//		// the API is failing for many operations: back off at a higher level
//	case errors.As(err, &rerr) && idem.OutcomeOf(nil, err) == idem.OutcomeNotSent:
//		// nothing reached the server: the operation may go elsewhere
//	case errors.As(err, &rerr):
//		// the outcome is unknown: retry later with the same key (idem.WithKey)
//	}
type RetryError struct {
	Attempts int    // attempts sent, the first included
	Key      string // the operation's idempotency key; "" for unkeyed requests
	Err      error

	notSent bool // no attempt reached the server; see OutcomeOf
}

// Error returns a message with the attempt count and the reason.
func (e *RetryError) Error() string {
	return fmt.Sprintf("idem: giving up after %d attempt%s: %v", e.Attempts, plural(e.Attempts), e.Err)
}

// Unwrap returns e.Err.
func (e *RetryError) Unwrap() error { return e.Err }

// Timeout reports whether a timeout ended the operation: the last
// attempt's ([RetryPolicy.AttemptTimeout], or a network timeout), the
// operation's ([RetryPolicy.MaxElapsedTime]) or the context's deadline.
// Through [http.Client], the *url.Error's Timeout says the same.
func (e *RetryError) Timeout() bool {
	if errors.Is(e.Err, ErrAttemptTimeout) || errors.Is(e.Err, context.DeadlineExceeded) {
		return true
	}
	var ne net.Error
	return errors.As(e.Err, &ne) && ne.Timeout()
}

// InProgressError is returned by [Transport.RoundTrip] when a keyed
// operation ends on 409 Conflict (the first request with the key is still
// running), or on what the Transport's [Provider] reads as such: the
// conflict budget ([RetryPolicy.ConflictTimeout],
// [RetryPolicy.MaxConflictRetries]) ran out, the next wait would pass
// [RetryPolicy.MaxElapsedTime], [RetryPolicy.MaxRetryAfter] or the context's
// deadline, or the context or MaxElapsedTime ended the wait or the next
// poll (the attempt after a 409). The outcome of the operation is unknown:
// it may yet complete. Retry it later with the same key ([WithKey](ctx,
// e.Key)) to learn its outcome; never with a new key, which could perform
// it twice.
type InProgressError struct {
	Key     string
	Method  string
	URL     string
	Polls   int           // 409 answers received
	Waited  time.Duration // time spent waiting on them
	Problem *Problem      // the last 409's problem details, if any
	// Err is the context's error when the context ended the waiting, or
	// the cut poll's error, so that errors.Is(err,
	// context.DeadlineExceeded) holds; else nil.
	Err error

	reason string // why the waiting stopped, for Error
}

func (*InProgressError) namesRequest() {}

// Error returns a message with the key, why the waiting stopped and what to do.
func (e *InProgressError) Error() string {
	why := ""
	if e.reason != "" {
		why = " (" + e.reason + ")"
	}
	return fmt.Sprintf("idem: %s %s with idempotency key %s is still in progress after %d conflict%s over %s%s; its outcome is unknown: retry later with the same key",
		e.Method, e.URL, e.Key, e.Polls, plural(e.Polls), e.Waited.Round(time.Millisecond), why)
}

// Unwrap returns e.Err.
func (e *InProgressError) Unwrap() error { return e.Err }

// KeyReuseError is returned by [Transport.RoundTrip] when the server answers
// 422 Unprocessable Content to a keyed request, or what the Transport's
// [Provider] reads as such (Stripe's 400 idempotency_error, say): the
// idempotency key was already used for a different request (another body,
// method or path). It is a bug in the caller, never retried: a key belongs
// to one logical operation, and a new operation needs [NewKey]. Through
// [http.Client] it arrives inside a *url.Error; reach it with errors.As:
//
//	var reuse *idem.KeyReuseError
//	if errors.As(err, &reuse) {
//		log.Printf("bug: key %s reused: %s", reuse.Key, reuse.Problem.Detail)
//	}
//
// A 422 to a retry (Attempts > 1) is not proof that nothing happened: the
// attempts before it sent the same key and body, and one whose answer was
// lost (a timeout, a broken connection, a 5xx) may have been processed,
// the 422 coming from a server or proxy that compares something that
// changed between attempts. Learn the outcome with the same key before
// sending the operation again under a new one. [OutcomeOf] says which: a
// 422 to the first attempt, or after attempts none of which was sent, is
// [OutcomeDone]; one to a retry after an attempt that may have reached the
// server is [OutcomeUnknown].
type KeyReuseError struct {
	Key     string
	Method  string
	URL     string
	Problem *Problem // the server's problem details; never nil
	// Attempts counts the attempts sent with the key by the call, the one
	// answered 422 included: 1 when the first attempt got it.
	Attempts int

	earlierNotSent bool // no attempt before the 422 reached the server
}

func (*KeyReuseError) namesRequest() {}

// Error returns a message that names the key, the method and URL, says
// once what went wrong, and ends with the server's detail, if any:
//
//	idem: POST https://api.example.com/v1/payments with idempotency key 8e03…: the key was used for a different request (a bug in the caller): The key was first used with another request body.
func (e *KeyReuseError) Error() string {
	why := "a bug in the caller"
	if e.outcome() == OutcomeUnknown {
		why = fmt.Sprintf("answered to attempt %d: an earlier attempt of this call may have taken effect", e.Attempts)
	}
	msg := fmt.Sprintf("idem: %s %s with idempotency key %s: the key was used for a different request (%s)", e.Method, e.URL, e.Key, why)
	if e.Problem == nil {
		return msg
	}
	if d := cmp.Or(e.Problem.Detail, e.Problem.Title); d != "" {
		msg += ": " + d
	}
	return msg
}

// AnswerLostError is returned when a keyed operation took effect, as a 2xx
// answer said, but the body of that answer was lost: cut while
// [Transport] read it inside its attempt, after which the retries with the
// same key that would have read the server's replay did not get it (a
// refusal, a 5xx, an error, the attempts or the time ran out); or, from
// [Client], a 2xx answer whose body could not be read or decoded. The
// operation is done: it happened ([OutcomeOf] says [OutcomeDone]), whatever
// came after, and must never be sent again under a new key. Ask again with
// the same key ([WithKey]) for the answer:
//
//	var lost *idem.AnswerLostError
//	if errors.As(err, &lost) {
//		// paid (lost.StatusCode); fetch the receipt again with lost.Key
//	}
type AnswerLostError struct {
	Key        string
	Method     string
	URL        string
	StatusCode int // the 2xx status the server answered
	// Attempts counts the attempts sent by the call (0 when unknown).
	Attempts int
	// Err is how the answer's body was lost: the error of its read (or
	// decoding, from Client).
	Err error
	// Last is how the attempts after it ended: a status (an error whose
	// message is the status line), or the error the call would have
	// ended with (a *RetryError, a *KeyReuseError, …); nil when none came
	// after it. It is not in the error's chain: what came after does not
	// undo the 2xx, and errors.As must not find a refusal in it.
	Last error
}

func (*AnswerLostError) namesRequest() {}

// Error returns a message that names the key and the 2xx status, says that
// the operation took effect and how to get its answer, and ends with how
// the body was lost and how the retries ended.
func (e *AnswerLostError) Error() string {
	msg := fmt.Sprintf("idem: %s %s with idempotency key %s: the server answered %d %s, so the operation took effect, but the answer was lost (%v)",
		e.Method, e.URL, e.Key, e.StatusCode, httpstatus.Text(e.StatusCode), e.Err)
	if e.Last != nil {
		msg += " and asking again with the key got " + briefly(e.Last)
	}
	return msg + "; ask again with the same key for the answer"
}

// briefly describes an error that ended a call, without the request and
// key its message may repeat.
func briefly(err error) string {
	var (
		reuse    *KeyReuseError
		progress *InProgressError
		expired  *KeyExpiredError
	)
	switch {
	case errors.As(err, &reuse):
		return "422: the key was used for a different request"
	case errors.As(err, &progress):
		return "409: still in progress"
	case errors.As(err, &expired):
		return "410: the key expired"
	}
	return err.Error()
}

// Unwrap returns Err.
func (e *AnswerLostError) Unwrap() error { return e.Err }

func (*AnswerLostError) outcome() Outcome { return OutcomeDone }

// Problem holds RFC 9457 problem details, as sent in an
// application/problem+json body.
type Problem struct {
	Type     string `json:"type,omitempty"`
	Title    string `json:"title,omitempty"`
	Status   int    `json:"status,omitempty"`
	Detail   string `json:"detail,omitempty"`
	Instance string `json:"instance,omitempty"`
}

func (p *Problem) describe() string {
	switch {
	case p == nil:
		return ""
	case p.Title != "" && p.Detail != "":
		return p.Title + ": " + p.Detail
	case p.Detail != "":
		return p.Detail
	default:
		return p.Title
	}
}

// APIError is returned by [Client] for a response whose status is not 2xx
// (and not handled by the Transport). Problem holds the body's problem
// details when the server sent JSON, else nil; Body holds the first bytes of
// the body as sent.
type APIError struct {
	StatusCode int
	Method     string
	URL        string
	Key        string // the idempotency key sent; "" for unkeyed methods
	Problem    *Problem
	Body       []byte

	afterReached bool // it answered a retry after an attempt that may have reached the server
}

// Error returns a message with the request, the status and the problem details.
func (e *APIError) Error() string {
	msg := fmt.Sprintf("idem: %s %s: %d %s", e.Method, e.URL, e.StatusCode, httpstatus.Text(e.StatusCode))
	if d := e.Problem.describe(); d != "" {
		msg += ": " + d
	}
	return msg
}

// maxErrorBody bounds what is read of an error response's body.
const maxErrorBody = 64 << 10

// readProblem reads (at most maxErrorBody bytes, within the given time if
// it is positive) and closes resp's body and parses it as problem details.
// It returns a Problem in every case: when the body is not JSON, Title is
// the status text and Detail the start of the body.
func readProblem(resp *http.Response, within time.Duration) (*Problem, []byte) {
	var buf bytes.Buffer
	readBody(&buf, resp, maxErrorBody, within)
	body := buf.Bytes()
	p := new(Problem)
	if isJSON(resp.Header.Get("Content-Type")) && json.Unmarshal(body, p) == nil {
		if p.Status == 0 {
			p.Status = resp.StatusCode
		}
		return p, body
	}
	p.Status = resp.StatusCode
	p.Title = httpstatus.Text(resp.StatusCode)
	p.Detail = strings.TrimSpace(string(body[:min(len(body), 200)]))
	return p, body
}

// isJSON reports whether a Content-Type is JSON: application/json,
// application/problem+json or any other +json type.
func isJSON(contentType string) bool {
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return false
	}
	return mt == "application/json" || strings.HasSuffix(mt, "+json")
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}
