package idempotency

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem/internal/keyheader"
)

// Defaults of [Options].
const (
	// DefaultKeyHeader is the header of the key ([Options.KeyHeader]), the
	// IETF draft's and Stripe's.
	DefaultKeyHeader = "Idempotency-Key"
	// DefaultLockTimeout is short because a live request renews its lease
	// every third of it: it bounds only how long a crashed request's key
	// keeps its client waiting, and a false takeover (a request cut off
	// from the store for that long) is harmless, since the cut-off request
	// is fenced. 10s is far above a renewal's round trip and a GC pause,
	// and well below the SDK's default conflict budget (30s), so a
	// client waiting out the 409s of a crashed key gets through in one call.
	DefaultLockTimeout  = 10 * time.Second
	DefaultRetention    = 24 * time.Hour // how long a finished key is kept ([Options.Retention])
	DefaultRetryAfter   = time.Second    // the Retry-After of a 409 ([Options.RetryAfter])
	DefaultMaxBodyBytes = 1 << 20        // the largest request body read, 1 MiB ([Options.MaxBodyBytes])
	// DefaultFirstSentHeader is the header of the first-sent time, from
	// OASIS Repeatable Requests 1.0, as Azure's APIs use it.
	DefaultFirstSentHeader = "Repeatability-First-Sent"
	// DefaultMaxFirstSentSkew caps the default allowance for a client
	// clock that runs ahead ([Options.FirstSentSkew]).
	DefaultMaxFirstSentSkew = 5 * time.Minute
	// MinFirstSentRetention is the shortest Retention under which the
	// first-sent policy runs ([Options.FirstSentHeader]): the header has a
	// precision of one second, and a shorter retention leaves no room
	// between it, the allowance and the retention (tests' retentions of a
	// second or two turn the policy off).
	MinFirstSentRetention = 3 * time.Second
	// RetentionHeader is the response header that advertises, on every
	// keyed response, how long the key is kept after its request finishes,
	// in seconds, as proposed in the IETF draft's issue #49
	// (ietf-wg-httpapi/idempotency): "Idempotency-TTL: 86400".
	RetentionHeader = "Idempotency-TTL"
)

// Options configures [New] and [Middleware]. The zero value is ready to
// use: every zero field takes the default it documents, applied on a copy.
// docs/server.md ("Options in detail") gives each field's edge cases.
type Options struct {
	// KeyHeader is the request header carrying the key, echoed on every
	// keyed response. Defaults to "Idempotency-Key".
	KeyHeader string

	// LockTimeout is the lease of a claimed key, renewed every third of it
	// while the handler runs; a key whose owner stopped renewing it this
	// long is taken over by a retry. Defaults to 10s; negative: never.
	LockTimeout time.Duration

	// Retention is how long a key is kept after its request finished;
	// then it counts as absent and [Purger] deletes it. Defaults to 24h;
	// negative: forever.
	Retention time.Duration

	// RetryAfter is the Retry-After of a 409, in whole seconds, at least
	// 1. Defaults to 1s.
	RetryAfter time.Duration

	// StoreServerErrors stores and replays a handler's 5xx, as Stripe
	// does, instead of releasing the key so that the retry runs again.
	StoreServerErrors bool

	// WaitForCompletion is how long a duplicate of a running request waits
	// for it to finish (then gets its replay) before it gets 409. Zero:
	// 409 at once, as the IETF draft describes.
	WaitForCompletion time.Duration

	// MaxBodyBytes caps the request body, buffered to be fingerprinted;
	// larger gets 413. Defaults to 1 MiB; negative: no limit.
	MaxBodyBytes int64

	// ClientID returns the authenticated client of a request, which scopes
	// its keys; without one the request gets 401. Defaults to
	// [ClientIDFromContext].
	ClientID func(*http.Request) (string, bool)

	// Validate, if not nil, checks a keyed request (its body buffered)
	// before its key is claimed; to refuse it, it writes the answer (a
	// 400) and returns false, and the key stays unused.
	Validate func(w http.ResponseWriter, r *http.Request) bool

	// FirstSentHeader names the header carrying when the client first sent
	// the operation (an HTTP-date); a retry whose key is gone or expired
	// and that may belong to the key's operation gets 410
	// [ProblemKeyExpired]. Defaults to "Repeatability-First-Sent".
	FirstSentHeader string

	// FirstSentSkew is the allowance for a client clock that runs ahead;
	// it must be less than half the Retention, or [New] returns an error.
	// Defaults to a tenth of the Retention, within 1s to 5 minutes.
	FirstSentSkew time.Duration

	// IgnoreFirstSent turns the first-sent policy off. It is off too when
	// keys never expire, or under a Retention shorter than
	// [MinFirstSentRetention].
	IgnoreFirstSent bool

	// BodyFormat says how request bodies are read to be fingerprinted.
	// Defaults to [BodyByContentType]; [New] refuses a format it does not
	// know.
	BodyFormat BodyFormat

	// StoredHeaders lists the response headers stored and replayed with an
	// outcome, besides Content-Type; credentials are never stored. Nil:
	// [DefaultStoredHeaders]; empty: none.
	StoredHeaders []string

	// Redact, if not nil, returns the response to store in place of the
	// one the first client gets (a card number masked); replays of a
	// changed response carry [RedactedHeader].
	Redact func(r *http.Request, resp StoredResponse) StoredResponse

	// MaxStoredBodyBytes caps a stored body; a larger one is stored as a
	// [ProblemResponseTooLarge] and never run again. Defaults to 1 MiB;
	// negative: no cap.
	MaxStoredBodyBytes int64

	// OneTransaction claims each new key in the handler's own transaction,
	// for routes that write only to the key's database: one commit per
	// first execution, no lease, a connection held from claim to answer.
	OneTransaction bool

	// Logger receives what an operator must act on (Warn, Error) and
	// per-request outcomes (Debug); bodies are never logged. Defaults to
	// [slog.Default].
	Logger *slog.Logger

	// OnEvent, if not nil, is called once for each [Event] of a keyed
	// request, from several goroutines: wire it to your metrics.
	OnEvent func(Event)
}

// Event is something [Middleware] did with a keyed request, reported to
// [Options.OnEvent], or that a [Sweeper] or an operator ([Admin]) did with
// a stored key, reported to their OnEvent.
type Event int

// Events reported to [Options.OnEvent].
const (
	EventClaimed      Event = iota + 1 // the key was new, expired or released: the handler runs
	EventTookOver                      // a stale started key was taken over: the handler runs
	EventCompleted                     // the outcome was stored with the business writes
	EventReplayed                      // a stored outcome was replayed
	EventConflict                      // 409: the key's first request is still running
	EventMismatch                      // 422: the key was used with another request
	EventReleased                      // the outcome was not stored and the key was freed
	EventFenced                        // the completion lost the key to a takeover
	EventRejected                      // 400/401/413/415 before the claim: nothing stored
	EventRenewed                       // the lease of a running request was renewed
	EventLeaseLost                     // a renewal found the key taken over: the handler's context is cancelled
	EventCancelled                     // 503: the request's context ended before its handler answered: nothing stored
	EventExpiredRetry                  // 410: a request first sent longer ago than its key is kept found its key gone or expired: nothing run

	// The keys' lifecycle beyond a request: the sweeper, the operators.
	EventSwept         // a [Sweeper] took an abandoned key over and handed it to its hook
	EventSettled       // a [Sweeper]'s hook settled an abandoned key: completed or released
	EventForceReleased // an operator released a key ([Admin.ForceRelease])
	EventExpired       // an operator expired a key ([Admin.Expire])
)

var eventNames = [...]string{
	EventClaimed:      "claimed",
	EventTookOver:     "took_over",
	EventCompleted:    "completed",
	EventReplayed:     "replayed",
	EventConflict:     "conflict",
	EventMismatch:     "mismatch",
	EventReleased:     "released",
	EventFenced:       "fenced",
	EventRejected:     "rejected",
	EventRenewed:      "renewed",
	EventLeaseLost:    "lease_lost",
	EventCancelled:    "cancelled",
	EventExpiredRetry: "expired_retry",

	// The keys' lifecycle beyond a request: the sweeper, the operators.
	EventSwept:         "swept",
	EventSettled:       "settled",
	EventForceReleased: "force_released",
	EventExpired:       "expired",
}

// String returns the event's name, as used in logs and metric names.
func (e Event) String() string {
	if e > 0 && int(e) < len(eventNames) {
		return eventNames[e]
	}
	return "event(" + strconv.Itoa(int(e)) + ")"
}

// New returns middleware that makes POST and PATCH requests safe to
// retry with an Idempotency-Key header, as the IETF draft
// (draft-ietf-httpapi-idempotency-key-header) and Stripe's API describe;
// other methods pass through. Put it behind the authentication that
// identifies the client. It is safe for concurrent use; store must be too.
//
// A request is refused (400, 401, 413, 415) before its key is used when
// its key, client or body is wrong; otherwise it claims the key and runs,
// or gets the stored outcome replayed, 409 while the first request runs,
// or 422 for another request with the key. The handler's 2xx, 3xx and
// definitive 4xx are stored with its writes; other answers release the key
// for the retry (see [ReleaseKind]). docs/server.md gives the full table.
//
// New returns an error for a nil store and for options that cannot work
// (see [Options.FirstSentSkew] and [Options.BodyFormat]).
func New(store Store, opts Options) (func(http.Handler) http.Handler, error) {
	if store == nil {
		return nil, errors.New("idempotency: the Store is nil")
	}
	if !knownBodyFormat(opts.BodyFormat) {
		return nil, fmt.Errorf("idempotency: Options.BodyFormat %d is not a format this package knows", opts.BodyFormat)
	}
	m := &middleware{store: store, opts: opts, claim: store.Claim}
	m.onEvent = m.event
	if tc, ok := store.(TxClaimer); ok && opts.OneTransaction {
		m.claim = tc.ClaimInTx
	}
	m.keyHeader = http.CanonicalHeaderKey(cmp.Or(opts.KeyHeader, DefaultKeyHeader))
	m.lockTimeout = durationOpt(opts.LockTimeout, DefaultLockTimeout)
	m.retention = durationOpt(opts.Retention, DefaultRetention)
	m.retryAfter = strconv.Itoa(max(1, int(math.Ceil(cmp.Or(opts.RetryAfter, DefaultRetryAfter).Seconds()))))
	m.maxBody = opts.MaxBodyBytes
	if m.maxBody == 0 {
		m.maxBody = DefaultMaxBodyBytes
	}
	m.firstSentHeader = http.CanonicalHeaderKey(cmp.Or(opts.FirstSentHeader, DefaultFirstSentHeader))
	m.skew = opts.FirstSentSkew
	if m.skew == 0 {
		m.skew = min(max(m.retention/10, time.Second), DefaultMaxFirstSentSkew)
	}
	m.firstSent = !opts.IgnoreFirstSent && m.retention >= MinFirstSentRetention
	if m.firstSent && !(m.skew > 0 && m.skew < m.retention/2) {
		return nil, fmt.Errorf("idempotency: Options.FirstSentSkew %v must be positive and less than half the Retention (%v)", opts.FirstSentSkew, m.retention)
	}
	if m.retention > 0 {
		m.ttl = retentionSeconds(m.retention)
	}
	m.clientID = opts.ClientID
	if m.clientID == nil {
		m.clientID = func(r *http.Request) (string, bool) { return ClientIDFromContext(r.Context()) }
	}
	m.log = cmp.Or(opts.Logger, slog.Default())
	var ignored []string
	if m.keep, ignored = newKeepPolicy(opts, m.keyHeader); len(ignored) > 0 {
		m.log.Warn("idempotency: Options.StoredHeaders lists headers that are never stored", "headers", ignored)
	}
	return m.wrap, nil
}

// Middleware is like [New] but panics when New returns an error, as
// regexp.MustCompile does: for a store and options fixed in code.
func Middleware(store Store, opts Options) func(http.Handler) http.Handler {
	mw, err := New(store, opts)
	if err != nil {
		panic(err)
	}
	return mw
}

// wrap puts the middleware in front of next.
func (m *middleware) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost && r.Method != http.MethodPatch {
			next.ServeHTTP(w, r)
			return
		}
		m.serve(w, r, next)
	})
}

// retentionKey is [RetentionHeader] as a key of http.Header.
var retentionKey = http.CanonicalHeaderKey(RetentionHeader)

// retentionSeconds returns the value of [RetentionHeader] for a retention.
func retentionSeconds(d time.Duration) string {
	return strconv.FormatInt(int64(math.Ceil(d.Seconds())), 10)
}

// durationOpt maps an option to a store argument: zero takes the default,
// negative means "never" (zero for the store).
func durationOpt(d, def time.Duration) time.Duration {
	switch {
	case d == 0:
		return def
	case d < 0:
		return 0
	}
	return d
}

type middleware struct {
	store Store
	// claim is store's Claim, or its ClaimInTx with Options.OneTransaction.
	claim       func(context.Context, ClaimRequest) (ClaimResult, error)
	opts        Options
	keyHeader   string
	lockTimeout time.Duration
	retention   time.Duration
	retryAfter  string
	maxBody     int64
	// The first-sent policy: on, its header and its allowance.
	firstSent       bool
	firstSentHeader string
	skew            time.Duration
	ttl             string // RetentionHeader's value; "" when keys never expire
	keep            keepPolicy
	clientID        func(*http.Request) (string, bool)
	log             *slog.Logger
	nested          sync.Once   // logs a Middleware nested in another once
	onEvent         func(Event) // m.event, made once rather than per request
}

func (m *middleware) event(e Event) {
	if m.opts.OnEvent != nil {
		m.opts.OnEvent(e)
	}
}

// keyDetails tells the developer what to do about each key error.
var keyDetails = []struct {
	err    error
	detail string
}{
	{keyheader.ErrMultiple, "Send the Idempotency-Key header once, on a single line."},
	{keyheader.ErrEmpty, "The Idempotency-Key header is empty. Send a unique key per operation, such as a random UUIDv4."},
	{keyheader.ErrTooLong, fmt.Sprintf("The Idempotency-Key is longer than %d characters. Use a random UUIDv4.", keyheader.MaxLen)},
	{keyheader.ErrInvalid, "The Idempotency-Key may hold only visible ASCII characters (0x21 to 0x7E). Use a random UUIDv4."},
	{keyheader.ErrParams, `The Idempotency-Key carries structured-field parameters (;name=value), which are not part of the key. Send the key alone, bare or as one quoted string such as "8e03978e-40d5-43e8-bc93-6894a57f9324".`},
	{keyheader.ErrSyntax, `The Idempotency-Key header starts with a double quote but is not a valid structured-field string. Send the bare key, or one quoted string such as "8e03978e-40d5-43e8-bc93-6894a57f9324".`},
}

// serve reads like the contract's table: a request is refused before its
// key is used, or claims the key and then runs, or is answered from the
// key's record.
func (m *middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	if _, ok := r.Context().Value(runKey).(*run); ok {
		// Behind another Middleware that already owns the key (a router
		// group's and a route's): claiming it again would find it started
		// by the outer one, and answer 409 until the outer one gave up.
		m.nested.Do(func() {
			m.log.Error("idempotency: Middleware is applied twice on this route (a router group's and the route's?); the inner one passes requests through: remove one",
				"method", r.Method, "path", r.URL.Path)
		})
		next.ServeHTTP(w, r)
		return
	}
	req, log, ok := m.admitKey(w, r)
	if !ok {
		return
	}
	body, ok := m.admitBody(w, r, &req, log)
	if !ok {
		return
	}
	m.claimAndServe(w, r, next, req, body, log)
}

// admitKey finds the client, parses the key and the first-sent time, and
// checks what the claim will store, refusing the request when any is
// wrong; nothing is stored. Once the key parses, every response carries it
// back, with the retention.
func (m *middleware) admitKey(w http.ResponseWriter, r *http.Request) (req ClaimRequest, log *slog.Logger, ok bool) {
	clientID, ok := m.clientID(r)
	if !ok {
		m.refuse(w, r, http.StatusUnauthorized, ProblemUnauthorized, "Authenticate first: idempotency keys are scoped by client.")
		return req, nil, false
	}
	values := r.Header.Values(m.keyHeader)
	key, err := keyheader.Parse(values)
	if err != nil {
		m.refuseKey(w, r, err)
		return req, nil, false
	}
	// Set as Header.Set would (both names are canonical), the values in
	// one allocation.
	h := w.Header()
	vs := make([]string, 2)
	vs[0] = strings.Trim(values[0], " \t")
	h[m.keyHeader] = vs[0:1:1]
	if m.ttl != "" {
		vs[1] = m.ttl
		h[retentionKey] = vs[1:2:2]
	}
	log = newRequestLog(m.log, clientID, key, r.Method, r.URL.Path)
	firstSent, bad := m.firstSentCheck(r)
	if bad != "" {
		m.refuse(w, r, http.StatusBadRequest, ProblemInvalidRequest, bad)
		return req, nil, false
	}
	if !ValidText(clientID) {
		log.Error("idempotency: the client id is not valid UTF-8 text; check Options.ClientID")
		writeProblem(w, r, ProblemInternal, http.StatusInternalServerError, "The server could not identify the client. Retry later.")
		return req, nil, false
	}
	if !ValidText(r.URL.Path) {
		m.refuse(w, r, http.StatusBadRequest, ProblemInvalidRequest,
			"The request path is not valid UTF-8 text, or holds a NUL character. Fix the path; the key was not used.")
		return req, nil, false
	}
	return ClaimRequest{
		ClientID:    clientID,
		Key:         key,
		Method:      r.Method,
		Path:        r.URL.Path,
		LockTimeout: m.lockTimeout,
		Retention:   m.retention,
		FirstSent:   firstSent,
	}, log, true
}

// refuse answers a request refused before its body was read.
func (m *middleware) refuse(w http.ResponseWriter, r *http.Request, status int, typ, detail string) {
	m.event(EventRejected)
	refuseUnread(w, r)
	writeProblem(w, r, typ, status, detail)
}

// refuseKey answers 400 a request whose key header does not parse (err).
func (m *middleware) refuseKey(w http.ResponseWriter, r *http.Request, err error) {
	if errors.Is(err, keyheader.ErrMissing) {
		m.refuse(w, r, http.StatusBadRequest, ProblemKeyMissing, fmt.Sprintf(
			"%s requests need an %s header: generate a unique key (a random UUIDv4) per operation and send the same key on every retry of it.",
			r.Method, m.keyHeader))
		return
	}
	detail := err.Error()
	for _, d := range keyDetails {
		if errors.Is(err, d.err) {
			detail = d.detail
			break
		}
	}
	m.refuse(w, r, http.StatusBadRequest, ProblemKeyInvalid, detail)
}

// admitBody reads the body (415, 413, 400), lets [Options.Validate] refuse
// the request, and fingerprints it into req (400); nothing is stored.
func (m *middleware) admitBody(w http.ResponseWriter, r *http.Request, req *ClaimRequest, log *slog.Logger) (body []byte, ok bool) {
	contentType, ok := m.opts.BodyFormat.contentType(r.Header.Get("Content-Type"))
	if !ok {
		m.event(EventRejected)
		refuseMediaType(w, r)
		return nil, false
	}
	body, err := m.readBody(w, r)
	if err != nil {
		m.event(EventRejected)
		if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
			writeProblem(w, r, ProblemTooLarge, http.StatusRequestEntityTooLarge, fmt.Sprintf(
				"The request body is larger than %d bytes. Send a smaller body.", mbe.Limit))
			return nil, false
		}
		log.Debug("idempotency: reading the body failed", "err", err)
		writeProblem(w, r, ProblemInvalidRequest, http.StatusBadRequest, "The request body could not be read. Retry with the same key.")
		return nil, false
	}
	if m.opts.Validate != nil {
		setBody(r, body)
		if !m.opts.Validate(w, r) {
			m.event(EventRejected)
			return nil, false
		}
	}
	req.Fingerprint, err = Fingerprint(r.Method, r.URL.Path, r.URL.RawQuery, contentType, body)
	if err != nil {
		m.event(EventRejected)
		writeProblem(w, r, ProblemInvalidRequest, http.StatusBadRequest, fmt.Sprintf(
			"%s. Fix the body and retry; the key was not used.", err))
		return nil, false
	}
	return body, true
}

// claimAndServe claims the key, and runs the request when it owns the
// key, or answers it from the key's record: a replay, 422, 410, or, while
// the key's first request runs, 409 (after waiting for it, with
// [Options.WaitForCompletion]).
func (m *middleware) claimAndServe(w http.ResponseWriter, r *http.Request, next http.Handler, req ClaimRequest, body []byte, log *slog.Logger) {
	ctx := r.Context()
	var deadline time.Time
	if m.opts.WaitForCompletion > 0 {
		deadline = time.Now().Add(m.opts.WaitForCompletion)
	}
	wait := 10 * time.Millisecond
	for {
		if ctx.Err() != nil {
			m.notRun(w, r) // nothing was claimed
			return
		}
		// The claim does not end with the client: a claim cancelled
		// while its answer travels back may have committed (a database
		// commits what it received), leaving the key started with no owner
		// to release it, a 409 to every retry until the lease runs out
		// (forever without a lease). Run to its end, it is released below
		// if the client is gone.
		res, err := m.claim(context.WithoutCancel(ctx), req)
		if err != nil {
			m.claimFailed(w, r, err, log)
			return
		}
		switch res.Outcome {
		case Claimed, TookOver:
			m.owned(w, r, next, res, body, log)
			return
		case Exists:
			if m.answerRecord(w, r, res.Record, req, log) {
				return
			}
		case Busy:
			// Held in another request's unit of work, not committed
			// (Options.OneTransaction): as a started key.
		case Refused:
			m.refuseExpired(w, r, req, log)
			return
		default:
			log.Error("idempotency: store returned an unknown outcome", "outcome", res.Outcome)
			writeProblem(w, r, ProblemInternal, http.StatusInternalServerError, "Retry later with the same key.")
			return
		}
		// The key's first request is still running.
		if m.waitFirst(ctx, deadline, &wait) {
			continue
		}
		m.conflict(w, r)
		return
	}
}

// claimFailed answers a request whose claim failed: 503 on a read-only
// database, 500 otherwise.
func (m *middleware) claimFailed(w http.ResponseWriter, r *http.Request, err error, log *slog.Logger) {
	if errors.Is(err, ErrReadOnly) {
		log.Error("idempotency: the key store's database is read-only: point this replica at the primary "+
			"(a multi-host URL with target_session_attrs=read-write follows a failover)", "err", err)
		w.Header().Set("Retry-After", m.retryAfter)
		writeProblem(w, r, ProblemUnavailable, http.StatusServiceUnavailable, fmt.Sprintf(
			"The server's key database is read-only for now (a failover, or maintenance), and nothing was done. Retry later with the same %s.", m.keyHeader))
		return
	}
	log.Error("idempotency: claim failed", "err", err)
	writeProblem(w, r, ProblemInternal, http.StatusInternalServerError,
		"The key could not be checked. Retry later with the same key.")
}

// owned runs a request that claimed its key, unless its client went away
// during the claim.
func (m *middleware) owned(w http.ResponseWriter, r *http.Request, next http.Handler, res ClaimResult, body []byte, log *slog.Logger) {
	if res.Outcome == TookOver {
		m.event(EventTookOver)
		log.Warn("idempotency: took over a key whose owner stopped renewing its lease", "operation", res.Claim.OperationID, "token", res.Claim.Token)
	} else {
		m.event(EventClaimed)
	}
	if ctx := r.Context(); ctx.Err() != nil {
		// The client went away during the claim: nothing ran.
		// Released as failed when the claim resumed or took over
		// an operation that may have done work (see run).
		m.release(context.WithoutCancel(ctx), res.Claim, res.Claim.unrunRelease(), log)
		m.notRun(w, r)
		return
	}
	setBody(r, body)
	m.run(w, r, next, res.Claim, log)
}

// answerRecord answers a request from its key's record: 422 for another
// request, the replay of a completed one, 500 for a record that should
// have been claimed. It returns false, having written nothing but headers,
// for a key whose first request is still running.
func (m *middleware) answerRecord(w http.ResponseWriter, r *http.Request, rec *Record, req ClaimRequest, log *slog.Logger) (answered bool) {
	// The key's own retention, as stored with it, whatever this
	// replica's: a replay, a 409 or a 422 tells the client how long
	// this key is kept.
	switch {
	case rec.Retention == m.retention:
		// Set already (see admitKey).
	case rec.Retention > 0:
		w.Header().Set(RetentionHeader, retentionSeconds(rec.Retention))
	default:
		w.Header().Del(RetentionHeader)
	}
	if !bytes.Equal(rec.Fingerprint, req.Fingerprint) {
		m.mismatch(w, r, rec, log)
		return true
	}
	if rec.Status == StatusCompleted && rec.Response != nil {
		if m.unopened(w, r, rec.Response, log) {
			return true
		}
		m.event(EventReplayed)
		writeStored(w, rec.Response, &m.keep)
		return true
	}
	if rec.Status != StatusStarted {
		// A store claims a released key for its own request (the
		// same fingerprint); waiting on it would wait forever.
		log.Error("idempotency: store returned a key it should have claimed or replayed", "status", rec.Status)
		writeProblem(w, r, ProblemInternal, http.StatusInternalServerError, "Retry later with the same key.")
		return true
	}
	return false
}

// mismatch answers 422 a request whose key was used with another one.
func (m *middleware) mismatch(w http.ResponseWriter, r *http.Request, rec *Record, log *slog.Logger) {
	m.event(EventMismatch)
	log.Debug("idempotency: key reused with another request", "stored_method", rec.Method, "stored_path", rec.Path, "stored_status", rec.Status)
	detail := fmt.Sprintf(
		"This %s was already used with another request (%s %s, with a different query or body). Use a new key for a new operation, and resend exactly the same request when you retry one.",
		m.keyHeader, rec.Method, rec.Path)
	if rec.Status == StatusReleased {
		// Released as failed (see ReleaseFailed): its request may
		// have done work that only its own retry finishes.
		detail = fmt.Sprintf(
			"The request first sent with this %s (%s %s, with a different query or body) failed after it may have taken effect, and only that request can finish it. Resend exactly that request with this key, or use a new key for a new operation.",
			m.keyHeader, rec.Method, rec.Path)
	}
	writeProblem(w, r, ProblemKeyMismatch, http.StatusUnprocessableEntity, detail)
}

// refuseExpired answers 410 a request the first-sent policy refused,
// saying which rule refused it: the age of the request, or a key let go
// of (expired, by its retention or an operator) after its operation began.
func (m *middleware) refuseExpired(w http.ResponseWriter, r *http.Request, req ClaimRequest, log *slog.Logger) {
	m.event(EventExpiredRetry)
	why := fmt.Sprintf("was first sent longer ago than its %s is kept (%s), and the key is gone", m.keyHeader, m.retention)
	if !req.FirstSent.Stale {
		why = fmt.Sprintf("belongs to an operation whose %s was let go of (it expired, or an operator expired it) after the operation began", m.keyHeader)
	}
	log.Info("idempotency: refused a retry of an operation whose key is gone or expired", "first_sent", r.Header.Get(m.firstSentHeader),
		"stale", req.FirstSent.Stale)
	writeProblem(w, r, ProblemKeyExpired, http.StatusGone, "This request "+why+
		": the outcome of its operation is unknown and can no longer be looked up. Nothing was done now. Check whether the operation took effect before you send it again with a new key.")
}

// waitFirst waits for the first request of a key that is still running,
// for the next interval of the wait ([Options.WaitForCompletion]), which
// it then grows. It returns false, at once, when the wait is over
// (no deadline, or past it), or when ctx ends during it: whatever ended
// it (a deadline in front, a shutdown), the first request is still
// running, and the caller answers 409.
func (m *middleware) waitFirst(ctx context.Context, deadline time.Time, wait *time.Duration) bool {
	if deadline.IsZero() {
		return false
	}
	left := time.Until(deadline)
	if left <= 0 {
		return false
	}
	t := time.NewTimer(min(*wait, left))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
	}
	*wait = min(2**wait, 250*time.Millisecond)
	return true
}

// conflict answers a duplicate of a request still running: 409 with
// Retry-After.
func (m *middleware) conflict(w http.ResponseWriter, r *http.Request) {
	m.event(EventConflict)
	w.Header().Set("Retry-After", m.retryAfter)
	writeProblem(w, r, ProblemKeyInUse, http.StatusConflict, fmt.Sprintf(
		"A request with this %s is still being processed. Retry the same request with the same key after the Retry-After delay.", m.keyHeader))
}

// notRun answers a request whose context ended before it ran, or before
// its handler answered anything: 503 with Retry-After, never the empty 200
// that net/http sends for a handler that wrote nothing, which a client
// would take for a success. Nothing of the request was stored; when a
// client is still there to read it (a deadline in front of the
// middleware ended the context, not the client), it retries with the same
// key.
func (m *middleware) notRun(w http.ResponseWriter, r *http.Request) {
	m.event(EventCancelled)
	w.Header().Set("Retry-After", m.retryAfter)
	writeProblem(w, r, ProblemUnavailable, http.StatusServiceUnavailable, fmt.Sprintf(
		"The request ended before it was processed (its deadline passed, or the server is shutting down), and nothing of it was done. Retry the same request with the same %s.", m.keyHeader))
}

// firstSentCheck reads the request's first-sent time into the check its
// claim makes (see [Options.FirstSentHeader]); the zero check without the
// header. With the policy off, only the time itself, which the operation
// ID derives from, and never a 400. bad, when not empty, says what is
// wrong with the header: the detail of a 400.
func (m *middleware) firstSentCheck(r *http.Request) (c FirstSentCheck, bad string) {
	values := r.Header.Values(m.firstSentHeader)
	if !m.firstSent {
		if len(values) == 1 {
			c.Sent, _ = http.ParseTime(strings.TrimSpace(values[0])) // zero when it does not parse
		}
		return c, ""
	}
	switch len(values) {
	case 0:
		return c, ""
	case 1:
	default:
		return c, fmt.Sprintf("Send the %s header once; the key was not used.", m.firstSentHeader)
	}
	sent, err := http.ParseTime(strings.TrimSpace(values[0]))
	if err != nil {
		return c, fmt.Sprintf("The %s header is not an HTTP-date such as %q; the key was not used.",
			m.firstSentHeader, "Tue, 01 Dec 2026 10:00:00 GMT")
	}
	now := time.Now()
	if sent.After(now.Add(m.skew)) {
		return c, fmt.Sprintf("The %s time is %s ahead of the server's clock, more than the %s allowed: check the client's clock; the key was not used.",
			m.firstSentHeader, sent.Sub(now).Round(time.Second), m.skew)
	}
	return FirstSentCheck{
		Stale:         now.Sub(sent) > m.retention-m.skew,
		EarliestBegin: sent.Add(-m.skew),
		Sent:          sent,
	}, ""
}

// refuseUnread prepares the answer to a request refused before its body
// was read: when it has one, the connection is closed after the answer,
// and no more of the body is read, so a client that sends a large body
// slowly (or never) does not hold the connection while net/http drains it.
func refuseUnread(w http.ResponseWriter, r *http.Request) {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return
	}
	w.Header().Set("Connection", "close")
	_ = http.NewResponseController(w).SetReadDeadline(time.Now())
}

// readBody reads the whole body under the size limit. Only a limit bounds
// the buffer of a declared length: without one, a client could declare
// any (net/http's server takes it as it comes) and send nothing.
func (m *middleware) readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	if n := r.ContentLength; n > 0 && m.maxBody > 0 && n <= m.maxBody {
		return readAll(r.Body, n, m.maxBody)
	}
	body := r.Body
	if m.maxBody > 0 {
		body = http.MaxBytesReader(w, r.Body, m.maxBody)
	}
	return io.ReadAll(body)
}

// preallocated bounds the buffer readAll allocates for a declared length.
const preallocated = 32 << 10

// readAll reads body, whose length is declared as n, in one allocation of
// n bytes and one more, so that the read of its end needs no other, for a
// body of up to preallocated bytes; a longer one grows as it arrives, so
// that a client that declares much and sends little costs what it sent.
// It reads no more than limit bytes when limit is positive: a body longer
// than it is said to be (which net/http's server never hands over) gets
// the error of [http.MaxBytesReader].
func readAll(body io.Reader, n, limit int64) ([]byte, error) {
	b := make([]byte, 0, min(n, preallocated)+1)
	for {
		k, err := body.Read(b[len(b):cap(b)])
		b = b[:len(b)+k]
		if limit > 0 && int64(len(b)) > limit {
			return b[:limit], &http.MaxBytesError{Limit: limit}
		}
		switch {
		case err == io.EOF:
			return b, nil
		case err != nil:
			return b, err
		case len(b) == cap(b):
			b = append(b, 0)[:len(b)]
		}
	}
}

// bufferedBody is a request body read whole, handed to the handler.
type bufferedBody struct{ bytes.Reader }

func (*bufferedBody) Close() error { return nil }

// setBody hands body, read whole, to [Options.Validate] or the handler as
// the request's body, rewound if it is already; GetBody returns it again.
func setBody(r *http.Request, body []byte) {
	b, ok := r.Body.(*bufferedBody)
	if !ok {
		b = new(bufferedBody)
		r.Body = b
		r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	}
	b.Reset(body)
	r.ContentLength = int64(len(body))
}

// run serves a request that owns its key and decides what becomes of it.
func (m *middleware) run(w http.ResponseWriter, r *http.Request, next http.Handler, claim Claim, log *slog.Logger) {
	detached := context.WithoutCancel(r.Context())
	tx, err := m.store.Begin(r.Context(), claim)
	if err != nil {
		log.Error("idempotency: begin failed", "err", err)
		// The handler did not run, but the claim may have resumed a
		// released operation or taken over a dead one, which may have done
		// work keyed by its OperationID: released as failed, so only the
		// same request may claim the key next and finish that work.
		m.release(detached, claim, ReleaseFailed, log)
		writeProblem(w, r, ProblemInternal, http.StatusInternalServerError,
			"The operation could not be started. Retry with the same key.")
		return
	}
	// The handler reads the client the key is scoped by, however the
	// service authenticates ([Options.ClientID] included).
	ctx, cancel := context.WithCancelCause(newRunContext(r.Context(), claim, tx))
	defer cancel(nil)
	lease := m.renew(ctx, claim, cancel, log)
	rec := newRecorder()
	returned := false
	defer func() {
		if returned {
			return
		}
		// The handler panicked (or called runtime.Goexit).
		lease.stop()
		p := recover()
		if p != http.ErrAbortHandler {
			log.Error("idempotency: handler panicked", "panic", p)
		}
		m.abandon(w, detached, tx, claim, ReleaseFailed, log) // ended or not, the panic goes on
		if p != nil {
			panic(p)
		}
	}()
	next.ServeHTTP(rec, r.WithContext(ctx))
	returned = true
	lease.stop()

	if !rec.wroteHeader && rec.body.Len() == 0 && ctx.Err() != nil {
		// The handler answered nothing, its context done (the client
		// gone, a deadline, a shutdown, a lost lease): net/http would send
		// an empty 200, and storing it would replay a success to every
		// retry of an operation that may not have been done.
		if !m.abandon(w, detached, tx, claim, ReleaseFailed, log) {
			m.notRun(w, r)
		}
		return
	}
	status := rec.result()
	if !ValidStatus(status) {
		log.Error("idempotency: the handler answered a status outside 100-599, which is not stored; the key is released", "status", status)
	}
	if !m.storable(status) {
		kind := ReleaseRejected
		if status >= 500 {
			kind = ReleaseFailed
		}
		if !m.abandon(w, detached, tx, claim, kind, log) {
			writeRecorded(w, rec)
		}
		return
	}
	resp, err := m.storedResponse(r, rec, log)
	if err != nil {
		log.Error("idempotency: the response could not be prepared for storing; the key is released", "err", err)
		if !m.abandon(w, detached, tx, claim, ReleaseFailed, log) {
			writeProblem(w, r, ProblemInternal, http.StatusInternalServerError,
				"The outcome could not be saved, and nothing of this request was committed. Retry the same request with the same key.")
		}
		return
	}
	switch err := tx.Complete(detached, resp); {
	case err == nil:
		m.event(EventCompleted)
		// Attrs, not key-value pairs, which would be boxed even when the
		// level is off.
		log.LogAttrs(detached, slog.LevelDebug, "idempotency: outcome stored", slog.Int("status", status), slog.String("operation", claim.OperationID))
		writeRecorded(w, rec)
	case errors.Is(err, ErrFenced) && errors.Is(err, ErrUnitEnded):
		// The handler ended the unit of work, which let a retry take the
		// key before the store could fail it closed.
		m.event(EventFenced)
		log.Error("idempotency: the handler ended the key's transaction itself, and a retry took the key meanwhile: fix the handler", "err", err)
		w.Header().Set("Retry-After", m.retryAfter)
		writeProblem(w, r, ProblemKeyInUse, http.StatusConflict, fmt.Sprintf(
			"This request's handler ended the transaction of its %s, and a retry with the same key took the key meanwhile. Retry the same request with the same key to get the outcome.", m.keyHeader))
	case errors.Is(err, ErrFenced):
		m.event(EventFenced)
		log.Warn("idempotency: completion fenced: the request was taken over; its writes were rolled back", "operation", claim.OperationID)
		w.Header().Set("Retry-After", m.retryAfter)
		writeProblem(w, r, ProblemKeyInUse, http.StatusConflict, fmt.Sprintf(
			"This request lost its hold on the %s (it could not renew it in time) and a retry with the same key took it over; nothing of this request was committed. Retry the same request with the same key to get the outcome.", m.keyHeader))
	case errors.Is(err, ErrUnitEnded):
		m.unitEnded(w, err, log)
	default:
		log.Error("idempotency: completion failed", "err", err)
		if !m.abandon(w, detached, tx, claim, ReleaseFailed, log) {
			writeProblem(w, r, ProblemInternal, http.StatusInternalServerError,
				"The outcome could not be saved, and nothing of this request was committed. Retry the same request with the same key.")
		}
	}
}

// renew renews the claim's lease while the handler runs (see keepLease).
func (m *middleware) renew(ctx context.Context, c Claim, cancel context.CancelCauseFunc, log *slog.Logger) *leaseKeeper {
	if c.OneTransaction { // no lease to renew
		return nil
	}
	return keepLease(ctx, m.store, c, m.lockTimeout, cancel, m.onEvent, log)
}

// storable reports whether a handler's status is the key's final outcome.
func (m *middleware) storable(status int) bool {
	return storableStatus(status, m.opts.StoreServerErrors)
}

// abandon rolls back the unit of work and releases the key, keeping its
// operation for the retry (see [Store.Release]). The key of a claim made
// in one transaction goes with the rollback: nothing is left to release.
// ended reports a unit of work that the handler ended itself: the store
// completed the key with [UnitEndedResponse] instead, which abandon has
// written to w; the caller writes nothing more.
func (m *middleware) abandon(w http.ResponseWriter, ctx context.Context, tx Tx, c Claim, kind ReleaseKind, log *slog.Logger) (ended bool) {
	switch err := tx.Rollback(ctx); {
	case errors.Is(err, ErrUnitEnded):
		m.unitEnded(w, err, log)
		return true
	case err != nil:
		log.Error("idempotency: rollback failed", "err", err)
	}
	if c.OneTransaction {
		m.event(EventReleased)
		return false
	}
	m.release(ctx, c, kind, log)
	return false
}

// unitEnded answers a request whose handler ended its unit of work
// itself (err wraps [ErrUnitEnded]): the store completed the key with
// [UnitEndedResponse], which every retry gets too.
func (m *middleware) unitEnded(w http.ResponseWriter, err error, log *slog.Logger) {
	m.event(EventCompleted)
	log.Error("idempotency: the handler ended the key's transaction itself, so what it wrote may be committed without "+
		"the key's outcome; the key is completed with a 500 and never runs again: fix the handler", "err", err)
	resp := UnitEndedResponse()
	w.Header().Set("Content-Type", resp.ContentType)
	w.WriteHeader(resp.Status)
	w.Write(resp.Body)
}

func (m *middleware) release(ctx context.Context, c Claim, kind ReleaseKind, log *slog.Logger) {
	switch err := m.store.Release(ctx, c, kind); {
	case err == nil:
		m.event(EventReleased)
	case errors.Is(err, ErrFenced):
		log.Debug("idempotency: key no longer owned (taken over or completed); nothing to release")
	default:
		log.Error("idempotency: release failed; the key stays started until its lease runs out", "err", err)
	}
}
