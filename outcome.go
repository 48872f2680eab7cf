package idem

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"reflect"
	"strings"
)

// An Outcome says whether an operation may have taken effect on the
// server, as far as its caller can know: [OutcomeOf] tells it from what a
// call returned. It is what decides between sending the operation again
// with the same key, and sending it elsewhere with a new one. The zero
// value is OutcomeUnknown.
type Outcome int

const (
	// OutcomeUnknown: the request may have reached the server, and no
	// final answer came back (a connection broken after the request was
	// written, a timeout, a 5xx, a 409 still running, …). Send it again
	// with the same key ([WithKey]), to this server only, to learn what
	// happened; a new key, or another server, could perform it twice.
	OutcomeUnknown Outcome = iota
	// OutcomeNotSent: no attempt of the operation reached the server (a
	// refused connection, a name that did not resolve, a Base that refused
	// to send, idem's own refusal before sending, …). Nothing happened:
	// the operation may go elsewhere, under a new key.
	OutcomeNotSent
	// OutcomeDone: the server gave its final answer (a success, a definite
	// rejection, a replay): the operation took effect or never will, and
	// the answer says which.
	OutcomeDone
)

// String returns "unknown", "not sent" or "done".
func (o Outcome) String() string {
	switch o {
	case OutcomeNotSent:
		return "not sent"
	case OutcomeDone:
		return "done"
	}
	return "unknown"
}

// ErrNotSent marks the error of a [Transport.Base] that refused an attempt
// without sending anything, such as a circuit breaker that is open, a rate
// limiter or a bulkhead: wrap the refusal with it, as
//
//	return nil, fmt.Errorf("%w: %w", idem.ErrNotSent, err)
//
// The Transport does not retry such an error, and [OutcomeOf] takes it as
// [OutcomeNotSent]. A Base that returns it vouches that nothing of the
// attempt reached the server: one that retries inside (a failsafe-go retry
// policy, say) must not, since an earlier try may have.
var ErrNotSent = errors.New("idem: not sent")

// OutcomeOf returns the outcome of a call that returned resp and err: a
// call to [Transport.RoundTrip], to an [http.Client] whose Transport is a
// Transport, or to a [Client] method. docs/outcome.md ("Did it happen?") has the
// whole table:
//
//   - A response: OutcomeDone, but for 408, 409, 429 and 5xx, which are
//     OutcomeUnknown: no final answer (the server, or an earlier attempt,
//     may have acted); and for any other 4xx that answered a retry after
//     an attempt that may have reached the server: a refusal of the retry
//     (401, 403, 404, …) is no word on what the earlier attempt did.
//   - A [*KeyReuseError] to the first attempt, or after attempts that
//     were all not sent: OutcomeDone; to a retry: OutcomeUnknown.
//   - An [*AnswerLostError] (a 2xx whose body was lost): OutcomeDone,
//     whatever came after it.
//   - An [*InProgressError]: OutcomeUnknown.
//   - A [*RetryError]: OutcomeNotSent if no attempt was sent (each failed
//     to connect or was refused before sending, and net/http's trace, when
//     the Base reports to it, saw no headers written), else
//     OutcomeUnknown.
//   - An [*APIError]: as a response of its status.
//   - An error before anything was sent (an invalid key, one longer than
//     the Provider takes, a body that cannot carry it or could not be
//     read, a ContentLength that disagrees with an in-memory body, a
//     context done before the first attempt): OutcomeNotSent.
//   - Any other error: OutcomeNotSent if [ErrNotSent] is in its chain,
//     else OutcomeUnknown.
//
// A nil err with a nil resp is OutcomeDone.
func OutcomeOf(resp *http.Response, err error) Outcome {
	if resp != nil {
		return answerOutcome(resp.StatusCode, afterReached(resp))
	}
	if err == nil {
		return OutcomeDone
	}
	var o interface{ outcome() Outcome }
	if errors.As(err, &o) {
		return o.outcome()
	}
	if errors.Is(err, ErrNotSent) {
		return OutcomeNotSent
	}
	return OutcomeUnknown
}

// statusOutcome is the outcome of a final answer of status code: done,
// but for the statuses that are no final word on the operation.
func statusOutcome(code int) Outcome {
	switch {
	case code == http.StatusRequestTimeout, code == http.StatusConflict,
		code == http.StatusTooManyRequests, code >= 500:
		return OutcomeUnknown
	}
	return OutcomeDone
}

func (e *RetryError) outcome() Outcome {
	if e.notSent {
		return OutcomeNotSent
	}
	return OutcomeUnknown
}

func (e *KeyReuseError) outcome() Outcome {
	if e.Attempts <= 1 || e.earlierNotSent {
		return OutcomeDone
	}
	return OutcomeUnknown
}

func (*InProgressError) outcome() Outcome { return OutcomeUnknown }

func (e *APIError) outcome() Outcome { return answerOutcome(e.StatusCode, e.afterReached) }

// answerOutcome is the outcome of an answer of status code that came to
// an attempt, after one that may have reached the server (afterReached)
// or not: a 4xx refuses the attempt it answers, and says nothing of what
// an earlier one did.
func answerOutcome(code int, afterReached bool) Outcome {
	if afterReached && code >= 400 && code < 500 {
		return OutcomeUnknown
	}
	return statusOutcome(code)
}

// attemptNumber returns the number of the attempt resp answered, or 0 if
// it did not come from a Transport.
func attemptNumber(resp *http.Response) int {
	if resp.Request == nil {
		return 0
	}
	c, _ := resp.Request.Context().Value(attemptContextKey{}).(*attemptContext)
	if c == nil {
		return 0
	}
	return int(c.number)
}

// afterReached reports whether resp answered an attempt of a Transport
// after one that may have reached the server, as the attempt's context
// (the response's Request's) says.
func afterReached(resp *http.Response) bool {
	if resp.Request == nil {
		return false
	}
	c, ok := resp.Request.Context().Value(attemptContextKey{}).(*attemptContext)
	return ok && c.flags.Load()&flagAfterReached != 0
}

// refusedError is an error returned before anything was sent: an invalid
// key, a body that cannot carry it or could not be read. Its message is
// its cause's.
type refusedError struct{ err error }

// refused marks err, returned before anything was sent, as such.
func refused(err error) error { return &refusedError{err} }

func (e *refusedError) Error() string  { return e.err.Error() }
func (e *refusedError) Unwrap() error  { return e.err }
func (*refusedError) outcome() Outcome { return OutcomeNotSent }

// notSent reports whether the attempt req, sent with body, that failed
// with err surely never reached the server. It must be sure: an operation
// said not sent may go to another server under a new key.
//
// The error must be of a kind that comes before a request is written: a
// failed dial (connection refused, no route) or name lookup, a server
// certificate the client refused, an HTTP/2 stream the server refused
// (REFUSED_STREAM: "prior to any processing"); or a Base's refusal
// (ErrNotSent), which is enough. The others are not enough alone:
// http.Transport re-sends a request by itself after a write when it looks
// replayable (a keep-alive race, a connection the server closed, an
// HTTP/2 stream reset with PROTOCOL_ERROR, golang/go#47635), and returns
// the last try's error, a dial error if the server is gone.
//
// When the Base reports to httptrace (net/http does, and so do the
// wrappers that pass the request's context on), the attempt's wire trace
// says it: the attempt is not sent only if no try of it wrote its
// headers. A Body the server never read proves nothing: a server can act
// on the headers alone (a POST with Expect: 100-continue, answered by a
// cut connection, then re-sent by net/http on a new one that is refused).
//
// Without a trace, the body is the evidence: a re-send reads the body, and
// before it the first try did; so the attempt is not sent only if its body
// is an in-memory reader that is still unread and the request does not
// ask for 100-continue, or if there is no body (or none that can be told)
// and http.Transport would not re-send the request after a write. HTTP/2's
// own re-sends are of requests the server did not process, by its
// protocol, but for a reset with PROTOCOL_ERROR, which an unread body
// covers as for HTTP/1.
func notSent(req *http.Request, body io.ReadCloser, err error, w *wireTrace) bool {
	if errors.Is(err, ErrNotSent) {
		// The Base vouches for it. It may have read the body all the same:
		// failsafe-go's round tripper buffers it before its policies run.
		// But not against net/http's word: headers written by a try
		// before the refusal (a Base that retries inside) may have
		// reached the server.
		return w == nil || w.wrote.Load() == 0
	}
	var local *localError
	if !beforeWrite(err) && !errors.As(err, &local) {
		return false
	}
	if w != nil && w.conns.Load() > 0 {
		return w.wrote.Load() == 0
	}
	if local != nil || expectsContinue(req) {
		// A body that failed was being sent; one that waits for
		// 100-continue waits for a server that may act without it.
		return false
	}
	switch unread(body, req.ContentLength) {
	case yes:
		return true
	case no:
		return false
	}
	return !replayedAfterWrite(req)
}

// expectsContinue reports whether req asks for 100-continue: its body is
// sent only once the server has its headers.
func expectsContinue(req *http.Request) bool {
	for _, v := range req.Header["Expect"] {
		if strings.EqualFold(strings.TrimSpace(v), "100-continue") {
			return true
		}
	}
	return false
}

// beforeWrite reports whether err is of a kind that comes before any byte
// of a request is written.
func beforeWrite(err error) bool {
	var opErr *net.OpError
	if errors.As(err, &opErr) && (opErr.Op == "dial" || opErr.Op == "proxyconnect") {
		return true
	}
	var (
		dnsErr      *net.DNSError
		certErr     *tls.CertificateVerificationError
		unknownAuth x509.UnknownAuthorityError
		hostErr     x509.HostnameError
		invalidErr  x509.CertificateInvalidError
	)
	return errors.As(err, &dnsErr) || errors.As(err, &certErr) || errors.As(err, &unknownAuth) ||
		errors.As(err, &hostErr) || errors.As(err, &invalidErr) || refusedStream(err)
}

// refusedStream reports whether err holds an HTTP/2 stream error of code
// REFUSED_STREAM (7), of net/http's bundled HTTP/2 or golang.org/x/net's,
// found as http2Reason finds them (their types are not reachable by
// errors.As).
func refusedStream(err error) bool {
	const refusedStreamCode = 0x7
	for _, e := range errorChain(err) {
		v := reflect.ValueOf(e)
		if v.Kind() == reflect.Pointer {
			v = v.Elem()
		}
		if v.Kind() != reflect.Struct || http2Reason(e) != "HTTP/2 stream reset" {
			continue
		}
		if code := v.FieldByName("Code"); code.IsValid() && code.CanUint() && code.Uint() == refusedStreamCode {
			return true
		}
	}
	return false
}

// replayedAfterWrite reports whether http.Transport may re-send req after
// writing it: when it is replayable in its eyes (isReplayable in
// net/http's request.go): a body it can rewind (or none), and a method
// that is idempotent or an Idempotency-Key or X-Idempotency-Key header.
func replayedAfterWrite(req *http.Request) bool {
	if req.Body != nil && req.Body != http.NoBody && req.GetBody == nil {
		return false
	}
	switch req.Method {
	case "", http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	_, a := req.Header["Idempotency-Key"]
	_, b := req.Header["X-Idempotency-Key"]
	return a || b
}

// The types of io.NopCloser's results, with and without WriteTo.
var (
	nopCloserType         = reflect.TypeOf(io.NopCloser(nil))
	nopCloserWriterToType = reflect.TypeOf(io.NopCloser(struct {
		io.Reader
		io.WriterTo
	}{}))
)

// tristate is yes, no, or cannot tell.
type tristate int

const (
	unsure tristate = iota
	yes
	no
)

// unread says whether an attempt's body, of the given length (-1 or 0 if
// unknown), is still unread: yes for an in-memory reader (see inMemory) at
// its start; no for one that has moved; unsure for any other body, or
// none.
func unread(body io.ReadCloser, length int64) tristate {
	left, size, ok := inMemory(body, length)
	switch {
	case !ok, size <= 0:
		return unsure
	case left == size:
		return yes
	}
	return no
}

// inMemory reports whether body is an in-memory reader (bytes.Reader,
// strings.Reader, idem's own; a bytes.Buffer, whose size is taken to be
// length), bare or under io.NopCloser, and returns what is left to read of
// it and its size. Only these: another type's Len could mean anything.
func inMemory(body io.ReadCloser, length int64) (left, size int64, ok bool) {
	if body == nil || body == http.NoBody {
		return 0, 0, false // nothing to read tells nothing
	}
	var r any = body
	// io.NopCloser's types are unexported structs of package io with the
	// reader as their one field; net/http unwraps them the same way
	// (unwrapNopCloser in transfer.go). Their types are compared, not
	// their names: that costs two words, where reading the package path
	// and the fields' names costs hundreds of instructions per request.
	switch reflect.TypeOf(body) {
	case nopCloserType, nopCloserWriterToType:
		r = reflect.ValueOf(body).Field(0).Interface()
	}
	switch r := r.(type) {
	case *bytes.Reader:
		return int64(r.Len()), r.Size(), true
	case *bytesBody:
		return int64(r.Len()), r.Size(), true
	case *strings.Reader:
		return int64(r.Len()), r.Size(), true
	case *bytes.Buffer:
		return int64(r.Len()), length, true
	}
	return 0, 0, false
}
