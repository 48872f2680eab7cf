package idempotency

import (
	"context"
	"crypto/sha1"
	"encoding/binary"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
)

// Status is the state of a stored idempotency key.
type Status string

const (
	// StatusStarted marks a key whose request has been claimed and is still
	// running, its owner renewing its lease ([Store.Renew]), or whose owner
	// crashed (see [ClaimRequest.LockTimeout]).
	StatusStarted Status = "started"
	// StatusCompleted marks a key whose outcome is stored and is replayed to
	// every later request with the same key and fingerprint.
	StatusCompleted Status = "completed"
	// StatusReleased marks a key whose owner gave it up with
	// [Store.Release]: nothing of its request was committed, and it keeps
	// its [Claim.OperationID] for the retry of the same request (see
	// [Store.Claim]). A [Record] shows this status when the key was
	// released with [ReleaseFailed] and the request is another one (a
	// mismatch).
	StatusReleased Status = "released"
)

// ReleaseKind says what a request that gives up its key may have left
// behind, and so which request may claim the key next (see [Store.Claim]).
type ReleaseKind int

const (
	// ReleaseFailed: the request failed after it may have done work keyed
	// by its operation outside its unit of work (a downstream charge whose
	// answer was lost, then a 5xx, a panic or a failed completion). Only
	// the same request may claim the key again, and it resumes the
	// operation, so the work is found, not done twice. Another request gets
	// [Exists], a mismatch: claiming it as a new operation would leave the
	// work behind, a charge with no payment, or do it a second time. It is
	// the zero value, the safe one.
	ReleaseFailed ReleaseKind = iota
	// ReleaseRejected: the request was refused before it did anything (a
	// 400, 401, 404, 409, 429, ...). Any request may claim the key next: a
	// corrected one, after a 400, is a new operation.
	ReleaseRejected
)

// String returns "failed" or "rejected".
func (k ReleaseKind) String() string {
	if k == ReleaseRejected {
		return "rejected"
	}
	return "failed"
}

// Sentinel errors spoken by every [Store]. Stores translate their driver's
// errors to these in one place; callers test them with [errors.Is].
var (
	// ErrFenced is returned by [Tx.Complete], [Store.Renew] and
	// [Store.Release] when the claim is no longer the current owner of the
	// key: it was taken over after its lease ran out, released, completed,
	// or its expired row was claimed anew. Complete writes nothing of the
	// unit of work (the business writes included) before returning it.
	ErrFenced = errors.New("idempotency: claim no longer owns the key")
	// ErrInvalidText is returned (wrapped) by a store asked to keep text
	// that is not valid UTF-8 or holds a NUL byte, which PostgreSQL's text
	// columns refuse; every store refuses the same values (see
	// [ValidText]).
	ErrInvalidText = errors.New("idempotency: text is not valid UTF-8 or holds a NUL byte")
	// ErrInvalidKey is returned (wrapped) by [Store.Claim] asked to claim
	// an empty key or one longer than 255 bytes; every store refuses the
	// same keys, and [Middleware], which takes 1 to 255 visible ASCII
	// characters, never asks.
	ErrInvalidKey = errors.New("idempotency: key is empty or longer than 255 bytes")
	// ErrInvalidStatus is returned (wrapped) by [Tx.Complete] asked to
	// store a status outside 100 to 599, the HTTP status codes (RFC 9110,
	// section 15); every store refuses the same values, and [Middleware]
	// never asks (see [ValidStatus]).
	ErrInvalidStatus = errors.New("idempotency: status is not an HTTP status code (100 to 599)")
	// ErrReadOnly is returned (wrapped) by a store whose database refuses
	// writes: a standby in recovery, or a session or database with
	// default_transaction_read_only. Nothing was written; [Middleware]
	// answers a claim that gets it with 503 and Retry-After, and runs
	// nothing.
	ErrReadOnly = errors.New("idempotency: the store's database is read-only (a standby, or default_transaction_read_only is on)")
	// ErrUnitEnded is returned (wrapped) by [Tx.Complete] and
	// [Tx.Rollback] when the handler ended its unit of work itself (a
	// COMMIT, a ROLLBACK, a COMMIT AND CHAIN, its driver's Commit): what
	// it wrote may have been committed without the key's outcome. The
	// store has then completed the key with [UnitEndedResponse], under
	// the claim's token, so that nothing runs again under it: it fails
	// closed. [Middleware] answers that response and releases nothing.
	ErrUnitEnded = errors.New("idempotency: the handler ended its unit of work itself; what it wrote may have been committed without the key's outcome")
)

// ClaimRequest asks a [Store] to claim a key for one request.
type ClaimRequest struct {
	ClientID string // authenticated client; keys are scoped by it
	Key      string // the Idempotency-Key, already parsed and validated
	Method   string
	Path     string
	// Fingerprint is the SHA-256 of the canonical request (method, path,
	// query, canonical body; see [Fingerprint]).
	Fingerprint []byte
	// LockTimeout is the lease of the claim: the key stays the caller's
	// for this long after the claim and after each [Store.Renew], and a
	// started key whose lease ran out (its owner stopped renewing: it
	// crashed or was cut off) may be taken over by a request with the same
	// fingerprint. It is stored with the key, so replicas with different
	// settings agree on every key. Zero: the lease never runs out (no
	// takeover).
	LockTimeout time.Duration
	// Retention is how long the key is kept once its request finished
	// (completed or released), stored with the key: the key expires that
	// long after it finished, and an expired key counts as absent, even if
	// the purge has not deleted it yet. A started key never expires while
	// its lease is renewed; one whose owner died expires Retention after
	// its lease ran out. Zero: the key never expires.
	Retention time.Duration
	// FirstSent, when not zero, bars the claim from beginning a new
	// operation for a request that may belong to an operation whose key
	// expired or was purged ([Options.IgnoreFirstSent] says why). A store
	// that does not know the field never refuses, and serves such a
	// request as a new operation.
	FirstSent FirstSentCheck
}

// operationSpace is the name space of the operation IDs that
// [ClaimRequest.OperationID] derives (a version 5 UUID's namespace).
var operationSpace = uuid.MustParse("44ca1d8f-53c5-4dc9-84cc-4e4417ee037c")

// OperationID returns the operation that a claim of req begins when it
// begins one (see [Claim.OperationID]): a UUID derived from the client,
// the key, the fingerprint and the first-sent time (FirstSent.Sent), never
// drawn at random. Every execution of one operation under one key gets the
// same one, on every replica (the fingerprint has one canonical form,
// whatever the [Options]), even after the key's row is gone (purged, lost
// in a failover, restored from an older backup), so that work keyed by it downstream is
// found, not done again; another request under a reused key, or the same
// request first sent at another time, gets another. See docs/server.md,
// "Operation IDs", for what this gives and what it cannot.
func (req ClaimRequest) OperationID() string {
	// A version 5 UUID (RFC 9562, section 5.5), as uuid.NewSHA1 makes
	// one, hashed from a buffer on the stack: no allocation but the text.
	var buf [512]byte
	b := append(buf[:0], operationSpace[:]...)
	b = binary.AppendUvarint(b, uint64(len(req.ClientID)))
	b = append(b, req.ClientID...)
	b = binary.AppendUvarint(b, uint64(len(req.Key)))
	b = append(b, req.Key...)
	b = binary.AppendUvarint(b, uint64(len(req.Fingerprint)))
	b = append(b, req.Fingerprint...)
	if !req.FirstSent.Sent.IsZero() {
		b = binary.AppendVarint(b, req.FirstSent.Sent.Unix())
	}
	sum := sha1.Sum(b)
	var id uuid.UUID
	copy(id[:], sum[:])
	id[6] = id[6]&0x0f | 0x50 // version 5
	id[8] = id[8]&0x3f | 0x80 // RFC 9562 variant
	return id.String()
}

// FirstSentCheck is what the first-sent time of a request tells a
// [Store.Claim] about the key it may have had: the claim returns
// [Refused], changing nothing, when it would begin a new operation because
// the key is absent or expired and either rule below says the request may
// be a retry of the operation the key was kept for. A key that is present
// and not expired is claimed (or found) as without it.
type FirstSentCheck struct {
	// Stale reports that the request's operation was first sent longer
	// ago than the key is kept: an absent or expired key may have been
	// its own.
	Stale bool
	// EarliestBegin is the first-sent time less the allowance for a
	// client clock that runs ahead: an expired key whose operation began
	// at or after it ([Record.CreatedAt]) was begun by this request's
	// operation, and let go of before the client asked again. Zero: no
	// such rule.
	EarliestBegin time.Time
	// Sent is the request's first-sent time, to the second; zero when it
	// sent none. It is part of the operation's identity
	// ([ClaimRequest.OperationID]).
	Sent time.Time
}

// Outcome says what [Store.Claim] did.
type Outcome int

const (
	// Claimed: no earlier owner of the key is alive, and the key now
	// belongs to the caller, started, under a new fencing token. The key
	// was absent or expired (a new operation), or released (the same
	// operation when the fingerprint matches, a new one otherwise; see
	// [Store.Claim]).
	Claimed Outcome = iota + 1
	// TookOver: a started row whose lease ran out, with the same
	// fingerprint, now belongs to the caller under a new fencing token and
	// the same operation. The previous owner, presumed dead, is fenced: its
	// renewal, completion and release fail with [ErrFenced].
	TookOver
	// Exists: a live row belongs to someone else (started with a live
	// lease, or completed), or its fingerprint differs;
	// [ClaimResult.Record] holds it.
	Exists
	// Refused: the key is absent or expired, and the request's first-sent
	// time says it may belong to the operation the key was kept for
	// ([ClaimRequest.FirstSent]); nothing changed.
	Refused
	// Busy: the key has no committed row, and another request holds it
	// in a unit of work that claimed it in one transaction
	// ([TxClaimer.ClaimInTx]) and has not ended. Nothing of that
	// request can be read until it commits, not even its fingerprint;
	// the caller answers as for a started key (409, or a wait) and
	// claims again later. A claim in a commit of its own gets it too, so
	// that two handlers never run one key at once. Only a store that
	// claims in one transaction returns it.
	Busy
)

// String returns "claimed", "took over", "exists", "refused" or "busy".
func (o Outcome) String() string {
	switch o {
	case Claimed:
		return "claimed"
	case TookOver:
		return "took over"
	case Exists:
		return "exists"
	case Refused:
		return "refused"
	case Busy:
		return "busy"
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// ClaimResult is the answer of [Store.Claim].
type ClaimResult struct {
	Outcome Outcome
	// Claim is set when Outcome is Claimed or TookOver.
	Claim Claim
	// Record is set when Outcome is Exists.
	Record *Record
}

// Claim is the ownership of a started key. The Token fences the owner: every
// renewal, completion or release checks that it is still current.
type Claim struct {
	ClientID string
	Key      string
	Token    int64
	// OperationID identifies the logical operation behind the key:
	// [ClaimRequest.OperationID] of the claim that began it, kept across
	// takeovers and across a release followed by a claim with the same
	// fingerprint, so work keyed by it downstream (a card processor's
	// idempotency key) is done once even when a request is taken over, or
	// fails after that work and is retried. Being derived, not drawn, it is
	// the same again when the key's row is lost and the same request
	// claims the key anew. A key released with [ReleaseRejected] and
	// claimed by another request gets another one.
	OperationID string
	// Resumed reports a claim that went on with an operation that may have
	// done work (a key released as failed, or taken over), rather than one
	// that began an operation (a new, expired or replaced key, or one
	// released as rejected).
	Resumed bool
	// OneTransaction reports a claim made in its unit of work
	// ([TxClaimer.ClaimInTx]), which changes what Begin, Renew and
	// Release do with it (see [TxClaimer]).
	OneTransaction bool
}

// unrunRelease is the kind of release of claim c when its request ran
// nothing: ReleaseRejected for a claim that began its operation, which
// lets a corrected request replace it, ReleaseFailed for one that resumed
// an operation that may have done work.
func (c Claim) unrunRelease() ReleaseKind {
	if c.Resumed {
		return ReleaseFailed
	}
	return ReleaseRejected
}

// Record is a stored key as a duplicate request sees it.
type Record struct {
	ClientID    string
	Key         string
	Method      string
	Path        string
	Fingerprint []byte
	Status      Status          // StatusReleased: see StatusReleased
	Response    *StoredResponse // set when Status is StatusCompleted
	CreatedAt   time.Time       // when its operation began
	LockedAt    time.Time       // the last claim or renewal of its lease; once it finished, when it finished
	OperationID string          // the operation the key holds ([Claim.OperationID])
	Retention   time.Duration   // how long the key is kept once finished, as stored with it; zero: forever
}

// StoredResponse is the outcome replayed for a completed key, byte for byte.
type StoredResponse struct {
	// Status is the HTTP status, 100 to 599 (see [ErrInvalidStatus]).
	Status      int
	ContentType string
	// Header holds the other headers worth replaying (Location), each
	// with its values joined by ", ".
	Header map[string]string
	Body   []byte
}

// Store keeps idempotency keys. Implementations are safe for concurrent use
// by many goroutines and, for a shared database, many processes. Package
// storetest is the conformance suite every Store passes.
//
// A method called with a context that is already done returns the
// context's error and changes nothing ([Middleware] calls Release and
// Complete with [context.WithoutCancel], so a request whose client left
// still finishes its key).
type Store interface {
	// Claim atomically claims the key, takes over a started row whose
	// lease ran out, or returns the live row as it is. Exactly one of many
	// concurrent callers with the same key gets Claimed or TookOver. By the
	// row it finds:
	//
	//   - none, or an expired one, whatever its state: Claimed, a new
	//     operation (new OperationID, created now); or Refused, changing
	//     nothing, when req.FirstSent says the request may be a retry of
	//     the operation the key was kept for (see [FirstSentCheck]);
	//   - released, same fingerprint: Claimed, the same operation (same
	//     OperationID and creation time), so downstream work keyed by it is
	//     found, not redone;
	//   - released with [ReleaseRejected], other fingerprint: Claimed, a
	//     new operation replacing the old: the released request did
	//     nothing, and a corrected request (after a 400, say) is a new
	//     request;
	//   - released with [ReleaseFailed], other fingerprint: Exists, a
	//     mismatch: the released request may have done work keyed by its
	//     operation, which only its own retry finishes;
	//   - started, lease run out, same fingerprint: TookOver, the same
	//     operation;
	//   - otherwise (started with a live lease, completed, or another
	//     fingerprint): Exists.
	//
	// Every claim stores req.LockTimeout and req.Retention with the key.
	// A store refuses, with an error wrapping [ErrInvalidText], a client,
	// key, method or path that is not valid text.
	Claim(ctx context.Context, req ClaimRequest) (ClaimResult, error)
	// Begin opens the unit of work of a claim: the business writes made
	// through it commit together with the key's completion. It runs
	// before the handler, which may call slow downstream systems, so it
	// must not hold scarce resources (a pooled connection, a lock) until
	// they are needed: the PostgreSQL store begins its transaction on its
	// first use, the memory store stages writes and applies them in
	// Complete. For a claim made in one transaction, see [TxClaimer].
	Begin(ctx context.Context, c Claim) (Tx, error)
	// Renew extends the lease of a started key still owned by c by the
	// lock timeout it was claimed with, counted from now, and pushes its
	// expiry back with it. It returns ErrFenced when c no longer owns the
	// key; then it changes nothing. The middleware renews every third of
	// the lock timeout while the handler runs. A claim made in one
	// transaction has no lease: Renew returns nil while its unit of work
	// is open, ErrFenced after.
	Renew(ctx context.Context, c Claim) error
	// Release gives up a started key still owned by c, without an outcome,
	// so the next request with it runs (validation failures, server errors,
	// panics, failed completions, clean shutdown). kind says which request
	// that may be: any, or only the same one (see [ReleaseKind]). The key
	// expires its retention after the release. It returns ErrFenced when c
	// no longer owns the key (taken over, completed, released by an
	// operator, expired and claimed anew); then it changes nothing. A key
	// c released already (an earlier Release, or Tx.Complete after a lost
	// commit) is left as it is, and Release returns nil: releasing is
	// idempotent, as renewing is.
	//
	// The key is marked [StatusReleased], not deleted: it keeps its
	// OperationID and creation time, so the retry of the same request
	// resumes the operation (see Claim). That is what makes a release safe
	// after irreversible work keyed by the OperationID: a request that
	// charged a card and then failed is retried under the same downstream
	// key, and the processor returns the existing charge instead of
	// charging again. Deleting the key would give the retry a new
	// OperationID, and so a second charge. Work done under a released
	// operation is found again only by a retry of the same request, which
	// is why a key released with [ReleaseFailed] refuses every other
	// request.
	// For a claim made in one transaction, see [TxClaimer].
	Release(ctx context.Context, c Claim, kind ReleaseKind) error
	// Purge deletes at most limit expired keys (see
	// [ClaimRequest.Retention]), whatever their status, those that expired
	// first first (or about so: a store may order them by a bound on their
	// expiry), and returns how many it deleted. A key whose lease is
	// live is never expired, and so never purged. A key an operator
	// expired early ([Inspector.Expire]) is kept, expired, until its
	// retention has passed since its operation began ([Record.CreatedAt]),
	// so that a claim's first-sent check refuses the retries of that
	// operation by the key ([FirstSentCheck.EarliestBegin]) until the check
	// refuses them as stale without it; a key that expired by its
	// retention is past that already. A limit of zero or less deletes
	// nothing.
	Purge(ctx context.Context, limit int) (int64, error)
}

// Tx is the unit of work of one claimed key.
type Tx interface {
	// Complete stores resp as the key's outcome, expiring its retention
	// from now (the time of the completion, however long the unit of work
	// was open), and commits it with the business writes; or it rolls
	// everything back and returns ErrFenced when the claim no longer owns
	// the key, or another error when the writes or the outcome could not
	// be committed: one wrapping [ErrInvalidStatus] for a status outside
	// 100 to 599, [ErrInvalidText] for a header or content type a store
	// cannot keep. After an error the key stays started, or, when the
	// connection was lost under a commit that may still be on its way, is
	// released under the claim's token (so that the commit, should it
	// arrive, is fenced; the caller's Release then returns nil);
	// the key of a claim made in one transaction, which Complete writes,
	// completed, with the outcome, is absent.
	Complete(ctx context.Context, resp StoredResponse) error
	// Rollback abandons the unit of work and its writes; the key stays
	// started, or, for a claim made in one transaction, goes with them.
	// Safe to call after Complete (it does nothing then) and more than
	// once.
	Rollback(ctx context.Context) error
}

// TxClaimer is a [Store] that can also claim a key in the unit of work of
// its request ([Options.OneTransaction]): the key, the handler's writes
// and the outcome commit together, and nothing of the request is visible
// before. A store offers it when it can; [MemoryStore], pgstore and
// sqlstore do.
type TxClaimer interface {
	Store
	// ClaimInTx claims a key that has no row in a unit of work that it
	// opens, as [Claim.OneTransaction] says: the key exists only in it,
	// and another claim of the key, of either kind, gets [Busy] at once
	// until it ends. A key that has a row (live, released or expired) is
	// claimed, or found, as by [Store.Claim], in a commit of its own.
	//
	// A claim made in one transaction has no lease, and its row is seen
	// by no one until its unit of work commits: [Store.Begin] returns the unit of work the
	// claim opened (once that has ended, one whose Complete returns
	// [ErrFenced]); [Store.Renew] returns nil while it is open and
	// ErrFenced after; [Store.Release] rolls it back, begun or not, which
	// takes the key with it, and returns nil (ErrFenced once it has
	// ended); [Tx.Complete] completes the key with the outcome.
	// A retry after a rollback claims the key anew with the same
	// OperationID ([ClaimRequest.OperationID]). A store that wraps
	// another one that cannot claim in one transaction claims in a commit
	// of its own; the claim says which it got.
	ClaimInTx(ctx context.Context, req ClaimRequest) (ClaimResult, error)
}

// ValidStatus reports whether status is an HTTP status code a [Store]
// keeps: 100 to 599.
func ValidStatus(status int) bool {
	return status >= 100 && status <= 599
}

// validKey reports whether key has a length a [Store] keeps (see
// [ErrInvalidKey]).
func validKey(key string) bool {
	return len(key) >= 1 && len(key) <= 255
}

// ValidText reports whether s can be stored in a text column: valid UTF-8
// without a NUL byte. Every [Store] refuses other values with
// [ErrInvalidText]; a handler should check the text it will write with it
// before any side effect, and answer 400.
func ValidText(s string) bool {
	return utf8.ValidString(s) && strings.IndexByte(s, 0) < 0
}

// refuses reports whether c bars a new operation on a key that expired,
// whose operation began at began.
func (c FirstSentCheck) refuses(began time.Time) bool {
	return c.Stale || (!c.EarliestBegin.IsZero() && !began.Before(c.EarliestBegin))
}

// UnitEndedResponse is the outcome a [Store] completes a key with when
// its handler ended the unit of work itself (see [ErrUnitEnded]): a 500
// problem that says so, replayed to every retry, since running the request
// again could repeat writes that were committed.
func UnitEndedResponse() StoredResponse {
	body, _ := json.Marshal(problem{Type: ProblemInternal, Title: problemTitles[ProblemInternal], Status: http.StatusInternalServerError, Detail: "The service's handler ended the transaction of this request itself, so part of what it wrote may have been " +
		"committed without this answer. The request is not run again under this key: ask the service's operators what was done."})
	return StoredResponse{Status: http.StatusInternalServerError, ContentType: "application/problem+json", Body: body}
}
