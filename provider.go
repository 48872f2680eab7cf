package idem

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"time"
)

// ProviderBodyLimit is the most a [Transport] reads of a response body for
// its [Provider] to judge: 4 KiB, enough for the error object of every
// built-in provider. What is read is given back, in front of the rest of
// the body, when the response is returned.
const ProviderBodyLimit = 4 << 10

// Provider is an API's idempotency dialect: where the API takes the key, and
// how it answers "this key was used for another request", "the first
// request with this key is still running" and "retry" or "do not retry".
// Set one on [Transport.Provider]:
//
//	client := &http.Client{Transport: &idem.Transport{Provider: idem.Stripe}}
//
// The zero value is the dialect of the IETF draft
// (draft-ietf-httpapi-idempotency-key-header), which the Transport speaks
// without a Provider: the key in the Idempotency-Key header, 409 while the
// first request with the key runs, 422 for a key used for another request.
// [Stripe], [Adyen], [PayPal], [Square], [AWS] and [Azure] are built in;
// docs/providers.md ("How each provider answers") lists their rules, each with the page of
// the provider's documentation it comes from. A Provider for another API is
// a value of this type with the fields that API needs.
//
// Settings made on the Transport win over the Provider's, each on its own:
// a KeyHeader, KeyBodyField or KeyFormat set on the Transport replaces the
// Provider's, and a Transport.Classify that returns anything but
// VerdictDefault overrides the Provider's verdict.
//
// The Transport only reads a Provider; the built-in ones must not be
// modified (copy one and change the copy instead). A Provider's functions
// may be called from many goroutines at once.
type Provider struct {
	// Name names the API in [Attempt.Reason] and logs, such as "Stripe".
	Name string

	// KeyHeader names the header that carries the key, as
	// [Transport.KeyHeader] does.
	KeyHeader string

	// KeyBodyField names the top-level field of the JSON request body that
	// carries the key, as [Transport.KeyBodyField] does.
	KeyBodyField string

	// KeyFormat says how new and pinned keys are written, as
	// [Transport.KeyFormat] does.
	KeyFormat KeyFormat

	// MaxKeyLen is the longest key the API takes, in characters (keys are
	// ASCII): a longer key is refused before anything is sent, with
	// [ErrKeyTooLong] in the error's chain, rather than sent and refused by
	// the API. Zero means idem's own limit, [MaxKeyLen]. A new key (a UUID,
	// 36 characters) fits every built-in provider; a pinned key may not.
	MaxKeyLen int

	// BodyStatuses lists the 4xx statuses whose bodies Classify needs. For
	// a response with one of them, the Transport reads the start of the
	// body, at most ProviderBodyLimit bytes, before calling Classify, and
	// puts it back in front of the rest of the body, so that a caller who
	// gets the response reads the whole body as the server sent it. The
	// bodies of other responses, 2xx among them, are never read for the
	// Provider; statuses outside 400–499 are ignored here. The read is
	// bounded in time as a drain is (one second at most, less if
	// AttemptTimeout or the operation's time left is shorter); a body that
	// stalls longer is closed, and reading the returned body then ends,
	// after the bytes that arrived, with an error that says so.
	BodyStatuses []int

	// Classify, if not nil, gives the API's verdict on a response whose
	// status is 400 or more, as [Transport.Classify] does: retry, stop,
	// wait out a request still running, or end on key reuse (see
	// [Verdict]); VerdictDefault keeps the Transport's table. body is the
	// start of the body if the status is in BodyStatuses, else nil; it may
	// be cut short of the end of the body, and must not be kept. Classify
	// must not read or close resp.Body. It is called from the goroutine
	// that called RoundTrip.
	Classify func(resp *http.Response, body []byte) Verdict

	// Message, if not nil, returns the API's own error message from a
	// response body (up to 64 KiB of it), or "" if there is none. A
	// [*KeyReuseError] or [*InProgressError] whose body holds no RFC 9457
	// detail carries it as Problem.Detail.
	Message func(body []byte) string
}

// ErrKeyTooLong is in the chain of the error of a keyed request whose key
// is longer than its [Provider] takes ([Provider.MaxKeyLen]): nothing was
// sent ([OutcomeNotSent]). Shorten the key, or derive a shorter one (a
// UUID fits every built-in provider).
var ErrKeyTooLong = errors.New("idem: idempotency key too long for the provider")

// checkKeyLen refuses a key longer than the Provider takes.
func (t *Transport) checkKeyLen(key string) error {
	if n := t.Provider.MaxKeyLen; n > 0 && len(key) > n {
		return t.keyTooLong(key) // the check inlines
	}
	return nil
}

func (t *Transport) keyTooLong(key string) error {
	return fmt.Errorf("%w: %s takes keys of at most %d characters, and key %.20q… has %d", ErrKeyTooLong, t.Provider.name(), t.Provider.MaxKeyLen, key, len(key))
}

// name returns the provider's name for Attempt.Reason.
func (p *Provider) name() string {
	return cmp.Or(p.Name, "Provider")
}

// keyHeaderName returns the name of the key header as set: the
// Transport's, else the Provider's, else "".
func (t *Transport) keyHeaderName() string {
	return cmp.Or(t.KeyHeader, t.Provider.KeyHeader)
}

// keyBodyField returns the key's body field: the Transport's, else the
// Provider's, else "".
func (t *Transport) keyBodyField() string {
	if t.KeyBodyField != "" { // as cmp.Or, without its loop: every request asks
		return t.KeyBodyField
	}
	return t.Provider.KeyBodyField
}

// keyFormat returns how keys are written: the Transport's KeyFormat if it
// is set (not KeyBare, the zero value), else the Provider's.
func (t *Transport) keyFormat() KeyFormat {
	if t.KeyFormat != KeyBare {
		return t.KeyFormat
	}
	return t.Provider.KeyFormat
}

// providerVerdict returns the Provider's verdict on resp, a response whose
// status is 400 or more, reading the start of its body first if the
// Provider needs it.
func (op *operation) providerVerdict(resp *http.Response) Verdict {
	p := &op.t.Provider
	var body []byte
	if resp.StatusCode < 500 && slices.Contains(p.BodyStatuses, resp.StatusCode) {
		body = peekBody(resp, ProviderBodyLimit, op.drainTime())
	}
	return p.Classify(resp, body)
}

// describe gives problem details taken from a body that holds no RFC 9457
// detail the Provider's reading of the body: the API's own message.
func (op *operation) describe(p *Problem, body []byte) {
	if m := op.t.Provider.Message; m != nil && p.Detail == "" {
		p.Detail = m(body)
	}
}

// peekBody reads the start of resp's body, up to n bytes (fewer if the
// response says it has fewer), within the given time, and replaces the body
// with one that gives those bytes back, then the rest. If the read takes
// longer, the body is closed under it, as readBody does; the replacement
// then ends after the bytes read with an error that says so. No goroutine
// outlives peekBody. It returns the bytes read.
func peekBody(resp *http.Response, n int, within time.Duration) []byte {
	if resp.Body == nil || resp.Body == http.NoBody {
		return nil
	}
	if cl := resp.ContentLength; cl >= 0 && cl < int64(n) {
		n = int(cl)
	}
	if n == 0 {
		return nil
	}
	buf := make([]byte, n)
	closed := make(chan struct{})
	timer := time.AfterFunc(within, func() {
		resp.Body.Close()
		close(closed)
	})
	got, err := io.ReadFull(resp.Body, buf)
	if !timer.Stop() {
		<-closed // the timer closed the body: wait for its goroutine
		err = fmt.Errorf("idem: the response body stalled for more than %s while its start was read for its Provider, and was closed", within)
	}
	if err == io.ErrUnexpectedEOF {
		err = io.EOF // the body is shorter than n: it ends here
	}
	resp.Body = &peekedBody{prefix: buf[:got], rest: resp.Body, err: err}
	return buf[:got]
}

// peekedBody is a response body whose start was read by peekBody: it gives
// that start back, then the rest of the body, or, if reading the start
// ended the body (its end, an error), that ending.
type peekedBody struct {
	prefix []byte
	rest   io.ReadCloser
	err    error // how the body ended while its start was read; nil if it did not
}

func (b *peekedBody) Read(p []byte) (int, error) {
	if len(b.prefix) > 0 {
		n := copy(p, b.prefix)
		b.prefix = b.prefix[n:]
		return n, nil
	}
	if b.err != nil {
		return 0, b.err
	}
	return b.rest.Read(p)
}

func (b *peekedBody) Close() error {
	return b.rest.Close()
}
