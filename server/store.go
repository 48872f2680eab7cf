package server

import (
	"context"
	"errors"
	"time"
)

// Status is the state of a stored idempotency key.
type Status string

const (
	// StatusStarted marks a key whose first request has been claimed and is
	// still running (or crashed; see [ClaimRequest.LockTimeout]).
	StatusStarted Status = "started"
	// StatusCompleted marks a key whose outcome is stored and is replayed to
	// every later request with the same key and fingerprint.
	StatusCompleted Status = "completed"
	// StatusReleased marks a key whose owner gave it up with
	// [Store.Release]: nothing of its request was committed, and it keeps
	// its [Claim.OperationID] for the retry of the same request (see
	// [Store.Claim]). A [Record] shows this status when its fingerprint
	// version differs from the request's (the caller compares in the stored
	// version and claims again), or when the key was released with
	// [ReleaseFailed] and the request is another one (a mismatch).
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
	// ErrFenced is returned by [Tx.Complete] and [Store.Release] when the claim
	// is no longer the current owner of the key: it was taken over after the
	// lock timeout, released, or its expired row was claimed anew. Complete
	// writes nothing of the unit of work (the business writes included)
	// before returning it. (A key that merely expired, with no new claim,
	// still completes: retention is checked when a key is claimed.)
	ErrFenced = errors.New("server: claim no longer owns the key")
	// ErrNotFound is returned by lookups that find nothing.
	ErrNotFound = errors.New("server: not found")
)

// ClaimRequest asks a [Store] to claim a key for one request.
type ClaimRequest struct {
	ClientID string // authenticated client; keys are scoped by it
	Key      string // the Idempotency-Key, already parsed and validated
	Method   string
	Path     string
	// Fingerprint is the SHA-256 of the canonical request (method, path,
	// canonical body), computed with FingerprintVersion of the canonical form.
	Fingerprint        []byte
	FingerprintVersion int
	// LockTimeout: a started key whose lock is older than this may be taken
	// over by this request (only when the fingerprint matches). Zero: never.
	LockTimeout time.Duration
	// Retention: a key created longer ago than this counts as absent, even
	// if the purge job has not deleted it yet. Zero: keys never expire.
	Retention time.Duration
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
	// TookOver: a started row older than the lock timeout, with the same
	// fingerprint, now belongs to the caller under a new fencing token and
	// the same operation. The previous owner, presumed dead, is fenced: its
	// completion and its release fail with [ErrFenced].
	TookOver
	// Exists: a live row belongs to someone else (started and not stale, or
	// completed), or its fingerprint differs, or it was released under
	// another fingerprint version; [ClaimResult.Record] holds it.
	Exists
)

// ClaimResult is the answer of [Store.Claim].
type ClaimResult struct {
	Outcome Outcome
	// Claim is set when Outcome is Claimed or TookOver.
	Claim Claim
	// Record is set when Outcome is Exists.
	Record *Record
}

// Claim is the ownership of a started key. The Token fences the owner: every
// completion or release checks that it is still current.
type Claim struct {
	ClientID string
	Key      string
	Token    int64
	// OperationID identifies the logical operation behind the key. It is
	// chosen at the first claim and kept across takeovers and across a
	// release followed by a claim with the same fingerprint, so work keyed
	// by it downstream (the card processor's idempotency key) is done once
	// even when a request is taken over, or fails after that work and is
	// retried. A key that expired and is used again, or that was released
	// with [ReleaseRejected] and is claimed by another request, gets a new
	// one.
	OperationID string
}

// Record is a stored key as a duplicate request sees it.
type Record struct {
	ClientID           string
	Key                string
	Method             string
	Path               string
	Fingerprint        []byte
	FingerprintVersion int
	Status             Status          // StatusReleased: see StatusReleased
	Response           *StoredResponse // set when Status is StatusCompleted
	CreatedAt          time.Time
	LockedAt           time.Time
}

// StoredResponse is the outcome replayed for a completed key, byte for byte.
type StoredResponse struct {
	Status      int
	ContentType string
	// Header holds the other headers worth replaying (Location).
	Header map[string]string
	Body   []byte
}

// Store keeps idempotency keys. Implementations are safe for concurrent use
// by many goroutines and, for the PostgreSQL store, many processes.
type Store interface {
	// Claim atomically claims the key, takes over a stale started row, or
	// returns the live row as it is. Exactly one of many concurrent callers
	// with the same key gets Claimed or TookOver. By the row it finds:
	//
	//   - none, or one created longer ago than req.Retention, whatever its
	//     state: Claimed, a new operation (new OperationID, created now);
	//   - released, same fingerprint and version: Claimed, the same
	//     operation (same OperationID and creation time), so downstream
	//     work keyed by it is found, not redone;
	//   - released with [ReleaseRejected], same version, other fingerprint:
	//     Claimed, a new operation replacing the old: the released request
	//     did nothing, and a corrected request (after a 400, say) is a new
	//     request;
	//   - released with [ReleaseFailed], same version, other fingerprint:
	//     Exists, a mismatch: the released request may have done work
	//     keyed by its operation, which only its own retry finishes;
	//   - released under another fingerprint version: Exists, so the caller
	//     can compare in the stored version and claim again;
	//   - started, lock older than req.LockTimeout, same fingerprint and
	//     version: TookOver, the same operation;
	//   - otherwise (started and fresh, completed, or another fingerprint):
	//     Exists.
	//
	// A released key is answered Exists for a request of its fingerprint
	// version only when the request differs from the released one, so a
	// duplicate never waits on it.
	Claim(ctx context.Context, req ClaimRequest) (ClaimResult, error)
	// Begin opens the unit of work of a claim: the business writes made
	// through the returned Tx commit together with the key's completion.
	// It runs before the handler, which may call slow downstream systems,
	// so it must not hold scarce resources (a pooled connection, a lock)
	// until Complete: stores stage the writes and apply them in Complete.
	Begin(ctx context.Context, c Claim) (Tx, error)
	// Release gives up a started key still owned by c, without an outcome,
	// so the next request with it runs (validation failures, server errors,
	// panics, failed completions, clean shutdown). kind says which request
	// that may be: any, or only the same one (see [ReleaseKind]). It
	// returns ErrFenced when c no longer owns the key (taken over,
	// completed, released, expired and claimed anew); then it changes
	// nothing.
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
	Release(ctx context.Context, c Claim, kind ReleaseKind) error
	// Purge deletes at most limit keys created before now minus retention,
	// whatever their status (released ones included), oldest first, and
	// returns how many it deleted. A retention or limit of zero or less
	// deletes nothing.
	Purge(ctx context.Context, retention time.Duration, limit int) (int64, error)
}

// Tx is the unit of work of one claimed key.
type Tx interface {
	// Complete stores resp as the key's outcome and commits it with the
	// business writes, or rolls everything back and returns ErrFenced when
	// the claim no longer owns the key.
	Complete(ctx context.Context, resp StoredResponse) error
	// Rollback abandons the unit of work; the key stays started. Safe to
	// call after Complete (it does nothing then).
	Rollback(ctx context.Context) error
}

// Payment is one payment of the reference API.
type Payment struct {
	ID             string
	ClientID       string
	Customer       string
	Amount         int64
	Currency       string
	IdempotencyKey string // the key the payment was created with; "" without one ([PaymentInserter])
	OperationID    string // [Claim.OperationID]; unique per client: the safety net once the key is purged
	ChargeID       string // the card processor's charge
	CreatedAt      time.Time
}

// PaymentStore keeps payments. The memory and PostgreSQL stores implement it
// next to [Store], so a payment and its key commit together.
type PaymentStore interface {
	// CreatePayment inserts p in the unit of work tx (which must come from
	// the same store's Begin); it is visible only once tx.Complete commits.
	CreatePayment(ctx context.Context, tx Tx, p Payment) error
	// GetPayment returns the client's payment, or ErrNotFound (also for
	// another client's payment).
	GetPayment(ctx context.Context, clientID, id string) (Payment, error)
}

// PaymentInserter stores a payment on its own, in one write that commits
// at once, outside the unit of work of any key. It is what the payments
// API of [Config.NoIdempotency] uses, to measure the same insert without
// the idempotency layer; a payment stored this way has no key, and nothing
// guards it against a retry. Both stores of this package implement it.
type PaymentInserter interface {
	// InsertPayment stores p and commits it. It returns an error matching
	// [ErrDuplicatePayment] when p repeats the ID or the (client,
	// operation) of a stored payment; nothing is stored then.
	InsertPayment(ctx context.Context, p Payment) error
}

// Charge is one charge made by the fake card processor.
type Charge struct {
	ID             string
	IdempotencyKey string // derived by the payments API from (client, operation)
	Amount         int64
	Currency       string
	CreatedAt      time.Time
}

// ChargeStore keeps the fake card processor's charges.
type ChargeStore interface {
	// CreateCharge inserts c, or returns the charge already stored under
	// c.IdempotencyKey with created false. It is atomic: concurrent calls
	// with one key create one charge.
	CreateCharge(ctx context.Context, c Charge) (stored Charge, created bool, err error)
}
