package idempotency

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/idemkit/idem/server/internal/testhooks"
)

// errTxDone is returned when a finished unit of work is used again.
var errTxDone = errors.New("idempotency: unit of work already completed or rolled back")

// MemoryStore is an in-memory [Store] with the same semantics as the
// PostgreSQL store (package pgstore): an atomic claim, a lease renewed while
// the request runs, takeover of a started key whose lease ran out under a
// new fencing token, a release that keeps the operation for the retry of the
// same request, retention stored with each key and exact at lookup, fenced
// completion that applies the staged writes ([MemoryStore.Stage]) together
// with the key's completion or not at all, a bounded purge, and the same
// refusal of text PostgreSQL cannot store. It emulates claims in one
// transaction ([MemoryStore.ClaimInTx]): such a claim of an absent key
// holds the key apart, where other claims of it see [Busy], until the unit of
// work completes (the key is then stored, completed, with the staged writes)
// or ends otherwise (the key is forgotten). It keeps everything in process
// memory, so it serves demos and fast tests; its contents die with the
// process.
//
// The zero value is not usable; call [NewMemoryStore]. A MemoryStore is safe
// for concurrent use by many goroutines (one mutex guards it all).
type MemoryStore struct {
	now func() time.Time // test seam; time.Now by default

	mu        sync.Mutex
	keys      map[keyRef]*memKey
	pending   map[keyRef]*memKey // claimed in one transaction, not completed: Busy to other claims
	lastToken int64
}

// keyRef is the primary key of a stored idempotency key.
type keyRef struct{ client, key string }

// memKey is one stored idempotency key.
type memKey struct {
	rec         Record
	token       int64
	operationID string
	release     ReleaseKind   // of the last release; meaningful while released
	lease       time.Duration // stored with the key; 0: never runs out
	retention   time.Duration // stored with the key; 0: never expires
	expiresAt   time.Time     // zero: never
}

// NewMemoryStore returns an empty store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{now: time.Now, keys: make(map[keyRef]*memKey), pending: make(map[keyRef]*memKey)}
}

func init() {
	testhooks.ElapseMemoryStore = func(s any, d time.Duration) { s.(*MemoryStore).elapse(d) }
}

// elapse makes every time s has stamped on its keys d earlier, as if d
// had passed for them: a test seam (see testhooks.ElapseMemoryStore).
func (s *MemoryStore) elapse(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, keys := range []map[keyRef]*memKey{s.keys, s.pending} {
		for _, k := range keys {
			k.rec.CreatedAt = k.rec.CreatedAt.Add(-d)
			k.rec.LockedAt = k.rec.LockedAt.Add(-d)
			if !k.expiresAt.IsZero() {
				k.expiresAt = k.expiresAt.Add(-d)
			}
		}
	}
}

// expired reports whether k counts as absent.
func (k *memKey) expired(now time.Time) bool {
	return !k.expiresAt.IsZero() && now.After(k.expiresAt)
}

// purgeable reports whether the purge may delete k at now: it is expired,
// and its operation began longer than its retention ago. A key that
// expired by its retention always did, as it expired the retention after
// its last claim, renewal or finish; one an operator expired
// ([MemoryStore.Expire]) is kept until then, as the PostgreSQL stores keep
// it (see [Store.Purge]).
func (k *memKey) purgeable(now time.Time) bool {
	return k.expired(now) && (k.retention == 0 || now.After(k.rec.CreatedAt.Add(k.retention)))
}

// stale reports whether k is started and its lease ran out.
func (k *memKey) stale(now time.Time) bool {
	return k.rec.Status == StatusStarted && k.lease > 0 && now.Sub(k.rec.LockedAt) > k.lease
}

// lock starts (or renews) k's lease at now; a started key expires its
// retention after the lease runs out.
func (k *memKey) lock(now time.Time) {
	k.rec.LockedAt = now
	k.expiresAt = time.Time{}
	if k.lease > 0 && k.retention > 0 {
		k.expiresAt = now.Add(k.lease).Add(k.retention)
	}
}

// finish marks k finished at now: it expires its retention later.
func (k *memKey) finish(now time.Time) {
	k.rec.LockedAt = now
	k.expiresAt = time.Time{}
	if k.retention > 0 {
		k.expiresAt = now.Add(k.retention)
	}
}

// checkText refuses the values PostgreSQL's text columns refuse.
func checkText(fields ...string) error {
	for _, f := range fields {
		if !ValidText(f) {
			return fmt.Errorf("%w: %q", ErrInvalidText, f)
		}
	}
	return nil
}

// Claim implements [Store.Claim].
func (s *MemoryStore) Claim(ctx context.Context, req ClaimRequest) (ClaimResult, error) {
	return s.claim(ctx, req, false)
}

var _ TxClaimer = (*MemoryStore)(nil)

// ClaimInTx implements [TxClaimer.ClaimInTx].
func (s *MemoryStore) ClaimInTx(ctx context.Context, req ClaimRequest) (ClaimResult, error) {
	return s.claim(ctx, req, true)
}

// claim claims req's key, an absent one in one transaction when inTx is
// true.
func (s *MemoryStore) claim(ctx context.Context, req ClaimRequest, inTx bool) (ClaimResult, error) {
	if err := ctx.Err(); err != nil {
		return ClaimResult{}, err
	}
	if err := checkText(req.ClientID, req.Key, req.Method, req.Path); err != nil {
		return ClaimResult{}, err
	}
	if !validKey(req.Key) {
		return ClaimResult{}, fmt.Errorf("%w: %d bytes", ErrInvalidKey, len(req.Key))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	ref := keyRef{req.ClientID, req.Key}
	k := s.keys[ref]
	sameRequest := k != nil && bytes.Equal(k.rec.Fingerprint, req.Fingerprint)
	switch {
	case k == nil && req.FirstSent.Stale:
		return ClaimResult{Outcome: Refused}, nil
	case k == nil && inTx:
		return s.claimApart(ref, req, now), nil
	case k == nil:
	case k.expired(now) && req.FirstSent.refuses(k.rec.CreatedAt):
		return ClaimResult{Outcome: Refused}, nil
	case k.expired(now),
		k.rec.Status == StatusReleased && k.release == ReleaseRejected && !sameRequest:
		// Absent, or free for another request: a new operation replaces it.
		delete(s.keys, ref)
		k = nil
	case k.rec.Status == StatusReleased && sameRequest:
		// The retry of the released request resumes its operation.
		s.own(k, req, now)
		c := k.claim()
		c.Resumed = k.release == ReleaseFailed
		return ClaimResult{Outcome: Claimed, Claim: c}, nil
	case sameRequest && k.stale(now):
		s.own(k, req, now)
		c := k.claim()
		c.Resumed = true
		return ClaimResult{Outcome: TookOver, Claim: c}, nil
	}
	if k == nil {
		if s.pending[ref] != nil {
			// Held by a claim in one transaction: its key is not stored
			// yet, and a claim in a commit of its own must not run it
			// beside it.
			return ClaimResult{Outcome: Busy}, nil
		}
		k = s.newKey(req, now)
		s.keys[ref] = k
		return ClaimResult{Outcome: Claimed, Claim: k.claim()}, nil
	}
	rec := k.rec.clone()
	rec.OperationID, rec.Retention = k.operationID, k.retention
	return ClaimResult{Outcome: Exists, Record: &rec}, nil
}

// newKey returns a new operation on req's key, started at now under a new
// token.
func (s *MemoryStore) newKey(req ClaimRequest, now time.Time) *memKey {
	k := &memKey{
		rec: Record{
			ClientID:    req.ClientID,
			Key:         req.Key,
			Method:      req.Method,
			Path:        req.Path,
			Fingerprint: bytes.Clone(req.Fingerprint),
			CreatedAt:   now,
		},
		operationID: req.OperationID(),
	}
	s.own(k, req, now)
	return k
}

// claimApart claims the absent key ref in one transaction: the new key is
// kept apart from the stored ones until its unit of work completes, and
// other claims of it in one transaction meanwhile get Busy, as PostgreSQL's
// store answers them while the claiming transaction is open. A claim in a
// commit of its own does not see it, and stores the key, which fences the
// completion of the claim kept apart, as in PostgreSQL.
func (s *MemoryStore) claimApart(ref keyRef, req ClaimRequest, now time.Time) ClaimResult {
	if s.pending[ref] != nil {
		return ClaimResult{Outcome: Busy}
	}
	k := s.newKey(req, now)
	s.pending[ref] = k
	c := k.claim()
	c.OneTransaction = true
	return ClaimResult{Outcome: Claimed, Claim: c}
}

// apart returns the key that c claimed in one transaction and that is
// still kept apart, or nil once its unit of work ended.
func (s *MemoryStore) apart(c Claim) *memKey {
	k := s.pending[keyRef{c.ClientID, c.Key}]
	if k == nil || k.token != c.Token {
		return nil
	}
	return k
}

// dropApart forgets the key that c claimed in one transaction, if it is
// still kept apart.
func (s *MemoryStore) dropApart(c Claim) {
	if s.apart(c) != nil {
		delete(s.pending, keyRef{c.ClientID, c.Key})
	}
}

// own makes k started under a new token, with req's lease and retention.
func (s *MemoryStore) own(k *memKey, req ClaimRequest, now time.Time) {
	s.lastToken++
	k.token = s.lastToken
	k.rec.Status = StatusStarted
	k.rec.Response = nil
	k.lease = max(req.LockTimeout, 0)
	k.retention = max(req.Retention, 0)
	k.lock(now)
}

func (k *memKey) claim() Claim {
	return Claim{ClientID: k.rec.ClientID, Key: k.rec.Key, Token: k.token, OperationID: k.operationID}
}

// clone returns a deep copy of r.
func (r Record) clone() Record {
	r.Fingerprint = bytes.Clone(r.Fingerprint)
	if r.Response != nil {
		resp := *r.Response
		resp.Header = maps.Clone(resp.Header)
		resp.Body = bytes.Clone(resp.Body)
		r.Response = &resp
	}
	return r
}

// owned returns the key c owns, or nil when c no longer owns it: the key was
// taken over, released, completed, purged, or expired and claimed anew. A
// memKey created by the same claim always has c's token, since tokens are
// never reused.
func (s *MemoryStore) owned(c Claim) *memKey {
	k := s.keys[keyRef{c.ClientID, c.Key}]
	if k == nil || k.token != c.Token || k.rec.Status != StatusStarted {
		return nil
	}
	return k
}

// Begin implements [Store.Begin]. The returned [Tx] holds the writes
// staged with [MemoryStore.Stage] until Complete.
func (s *MemoryStore) Begin(ctx context.Context, c Claim) (Tx, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return &memTx{store: s, claim: c}, nil
}

// Renew implements [Store.Renew].
func (s *MemoryStore) Renew(ctx context.Context, c Claim) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if c.OneTransaction { // no lease
		if s.apart(c) == nil {
			return ErrFenced
		}
		return nil
	}
	k := s.owned(c)
	if k == nil {
		return ErrFenced
	}
	k.lock(s.now())
	return nil
}

// Release implements [Store.Release]: the key is marked released, with
// kind, and keeps its operation ID, fingerprint and creation time (and its
// token, which no longer owns it: ownership needs a started key). A key
// c released already is left as it is. A claim in one transaction is
// forgotten, and its staged writes with it.
func (s *MemoryStore) Release(ctx context.Context, c Claim, kind ReleaseKind) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if c.OneTransaction {
		if s.apart(c) == nil {
			return ErrFenced
		}
		s.dropApart(c)
		return nil
	}
	k := s.owned(c)
	if k == nil {
		if k := s.keys[keyRef{c.ClientID, c.Key}]; k != nil && k.token == c.Token && k.rec.Status == StatusReleased {
			return nil // released by c already
		}
		return ErrFenced
	}
	k.rec.Status = StatusReleased
	k.release = kind
	k.finish(s.now())
	return nil
}

// Purge implements [Store.Purge].
func (s *MemoryStore) Purge(ctx context.Context, limit int) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	if limit <= 0 {
		return 0, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	var old []keyRef
	for ref, k := range s.keys {
		if k.purgeable(now) {
			old = append(old, ref)
		}
	}
	slices.SortFunc(old, func(a, b keyRef) int {
		return s.keys[a].expiresAt.Compare(s.keys[b].expiresAt)
	})
	old = old[:min(len(old), limit)]
	for _, ref := range old {
		delete(s.keys, ref)
	}
	return int64(len(old)), nil
}

// Stage adds apply to the unit of work of the request in ctx, when that is a
// unit of work of s (see [NewContext]): apply runs when the key completes,
// under the store's lock and after the check that the claim still owns the
// key, so what it writes becomes visible together with the stored outcome,
// and never when the outcome is not stored (a released key, a fenced
// completion). Stage returns false, and keeps nothing, outside such a
// request: the caller then writes at once, as without idempotency.
//
// Staged functions run in the order they were staged. One that returns an
// error fails the completion with it (the key is not completed; the
// middleware releases it); the functions that ran before it are not undone,
// so stage one function per unit of work that checks everything before it
// changes anything, as a single INSERT would. apply must not call s.
func (s *MemoryStore) Stage(ctx context.Context, apply func() error) bool {
	tx, ok := TxFromContext(ctx)
	if !ok {
		return false
	}
	mtx, ok := tx.(*memTx)
	if !ok || mtx.store != s {
		return false
	}
	mtx.mu.Lock()
	defer mtx.mu.Unlock()
	if mtx.done {
		return false
	}
	mtx.staged = append(mtx.staged, apply)
	return true
}

// memTx is the unit of work of a claim on a MemoryStore.
type memTx struct {
	store *MemoryStore
	claim Claim

	mu     sync.Mutex
	done   bool
	staged []func() error
}

// Complete implements [Tx.Complete]: under the store's lock it checks that
// the claim still owns the key and that the response is storable, runs the
// staged writes, and completes the key; or it applies nothing. The key of
// a claim in one transaction is stored then, completed, unless a claim in a
// commit of its own stored the key meanwhile (ErrFenced); after an error it
// is forgotten.
func (tx *memTx) Complete(ctx context.Context, resp StoredResponse) error {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	if tx.done {
		return errTxDone
	}
	tx.done = true
	if tx.claim.OneTransaction {
		defer tx.store.forgetApart(tx.claim) // the unit of work is over
	}
	staged := tx.staged
	tx.staged = nil
	if err := ctx.Err(); err != nil {
		return err
	}
	if !ValidStatus(resp.Status) {
		return fmt.Errorf("%w: %d", ErrInvalidStatus, resp.Status)
	}
	if err := checkText(resp.ContentType); err != nil {
		return err
	}
	for name, v := range resp.Header {
		if err := checkText(name, v); err != nil {
			return err
		}
	}
	s := tx.store
	s.mu.Lock()
	defer s.mu.Unlock()
	k := s.owned(tx.claim)
	if tx.claim.OneTransaction {
		k = s.apart(tx.claim)
		ref := keyRef{tx.claim.ClientID, tx.claim.Key}
		if k != nil && s.keys[ref] != nil {
			k = nil // stored meanwhile by a claim in a commit of its own
		}
	}
	if k == nil {
		return ErrFenced
	}
	for _, apply := range staged {
		if err := apply(); err != nil {
			return err
		}
	}
	resp.Header = maps.Clone(resp.Header)
	resp.Body = bytes.Clone(resp.Body)
	k.rec.Status = StatusCompleted
	k.rec.Response = &resp
	k.finish(s.now())
	if tx.claim.OneTransaction {
		s.dropApart(tx.claim)
		s.keys[keyRef{tx.claim.ClientID, tx.claim.Key}] = k
	}
	return nil
}

// forgetApart is dropApart under the store's lock.
func (s *MemoryStore) forgetApart(c Claim) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dropApart(c)
}

// Rollback implements [Tx.Rollback]: it drops the staged writes, and the
// key of a claim in one transaction.
func (tx *memTx) Rollback(ctx context.Context) error {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	if !tx.done && tx.claim.OneTransaction {
		tx.store.forgetApart(tx.claim)
	}
	tx.done = true
	tx.staged = nil
	return nil
}
