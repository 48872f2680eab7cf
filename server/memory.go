package server

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
)

// ErrDuplicatePayment is returned by [Tx.Complete] of a [MemoryStore] when a
// staged payment repeats the ID or the (client, operation) of a stored one;
// nothing of the unit of work is applied then.
var ErrDuplicatePayment = errors.New("server: duplicate payment")

// errTxDone is returned when a finished unit of work is used again.
var errTxDone = errors.New("server: unit of work already completed or rolled back")

// MemoryStore is an in-memory [Store], [PaymentStore] and [ChargeStore] with
// the same semantics as the PostgreSQL store: an atomic claim, takeover of a
// stale started key with a matching fingerprint under a new fencing token,
// a release that keeps the operation for the retry of the same request,
// retention that is exact at lookup, fenced completion that applies the
// staged payments together with the key's completion or not at all, and a
// bounded purge. It keeps everything in process memory, so it serves the
// embedded default of idem-server and fast tests; its contents die with the
// process.
//
// The zero value is not usable; call [NewMemoryStore]. A MemoryStore is safe
// for concurrent use by many goroutines (one mutex guards it all).
type MemoryStore struct {
	now func() time.Time // test seam; time.Now by default

	mu        sync.Mutex
	keys      map[keyRef]*memKey
	lastToken int64
	payments  map[string]Payment // by ID
	paymentOp map[[2]string]bool // (client, operation ID) of stored payments
	charges   map[string]Charge  // by idempotency key
}

// keyRef is the primary key of a stored idempotency key.
type keyRef struct{ client, key string }

// memKey is one stored idempotency key.
type memKey struct {
	rec         Record
	token       int64
	operationID string
	release     ReleaseKind // of the last release; meaningful while released
}

// NewMemoryStore returns an empty store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{
		now:       time.Now,
		keys:      make(map[keyRef]*memKey),
		payments:  make(map[string]Payment),
		paymentOp: make(map[[2]string]bool),
		charges:   make(map[string]Charge),
	}
}

// expired reports whether k counts as absent for the given retention.
func expired(k *memKey, now time.Time, retention time.Duration) bool {
	return retention > 0 && now.Sub(k.rec.CreatedAt) > retention
}

// Claim implements [Store.Claim].
func (s *MemoryStore) Claim(ctx context.Context, req ClaimRequest) (ClaimResult, error) {
	if err := ctx.Err(); err != nil {
		return ClaimResult{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	ref := keyRef{req.ClientID, req.Key}
	k := s.keys[ref]
	sameVersion := k != nil && k.rec.FingerprintVersion == req.FingerprintVersion
	sameRequest := sameVersion && bytes.Equal(k.rec.Fingerprint, req.Fingerprint)
	switch {
	case k == nil:
	case expired(k, now, req.Retention),
		k.rec.Status == StatusReleased && k.release == ReleaseRejected && sameVersion && !sameRequest:
		// Absent, or free for another request: a new operation replaces it.
		delete(s.keys, ref)
		k = nil
	case k.rec.Status == StatusReleased && sameRequest:
		// The retry of the released request resumes its operation.
		s.lastToken++
		k.token = s.lastToken
		k.rec.Status = StatusStarted
		k.rec.LockedAt = now
		return ClaimResult{Outcome: Claimed, Claim: k.claim()}, nil
	case k.rec.Status == StatusStarted && sameRequest &&
		req.LockTimeout > 0 && now.Sub(k.rec.LockedAt) > req.LockTimeout:
		s.lastToken++
		k.token = s.lastToken
		k.rec.LockedAt = now
		return ClaimResult{Outcome: TookOver, Claim: k.claim()}, nil
	}
	if k == nil {
		s.lastToken++
		k = &memKey{
			rec: Record{
				ClientID:           req.ClientID,
				Key:                req.Key,
				Method:             req.Method,
				Path:               req.Path,
				Fingerprint:        bytes.Clone(req.Fingerprint),
				FingerprintVersion: req.FingerprintVersion,
				Status:             StatusStarted,
				CreatedAt:          now,
				LockedAt:           now,
			},
			token:       s.lastToken,
			operationID: uuid.NewString(), // a UUIDv4, like the PostgreSQL store's
		}
		s.keys[ref] = k
		return ClaimResult{Outcome: Claimed, Claim: k.claim()}, nil
	}
	rec := k.rec.clone()
	return ClaimResult{Outcome: Exists, Record: &rec}, nil
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
// taken over, released, completed, purged or has expired. A memKey created
// by the same claim always has c's token, since tokens are never reused.
func (s *MemoryStore) owned(c Claim) *memKey {
	k := s.keys[keyRef{c.ClientID, c.Key}]
	if k == nil || k.token != c.Token || k.rec.Status != StatusStarted {
		return nil
	}
	return k
}

// Begin implements [Store.Begin]. The returned [Tx] stages the payments
// created through it until [Tx.Complete].
func (s *MemoryStore) Begin(ctx context.Context, c Claim) (Tx, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return &memTx{store: s, claim: c}, nil
}

// Release implements [Store.Release]: the key is marked released, with
// kind, and keeps its operation ID, fingerprint and creation time (and its
// token, which no longer owns it: ownership needs a started key).
func (s *MemoryStore) Release(ctx context.Context, c Claim, kind ReleaseKind) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := s.owned(c)
	if k == nil {
		return ErrFenced
	}
	k.rec.Status = StatusReleased
	k.release = kind
	return nil
}

// Purge implements [Store.Purge]: it deletes the oldest of the keys created
// more than retention ago, whatever their status, at most limit of them. A
// retention or limit that is zero or negative purges nothing.
func (s *MemoryStore) Purge(ctx context.Context, retention time.Duration, limit int) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	if retention <= 0 || limit <= 0 {
		return 0, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	var old []keyRef
	for ref, k := range s.keys {
		if expired(k, now, retention) {
			old = append(old, ref)
		}
	}
	slices.SortFunc(old, func(a, b keyRef) int {
		return s.keys[a].rec.CreatedAt.Compare(s.keys[b].rec.CreatedAt)
	})
	old = old[:min(len(old), limit)]
	for _, ref := range old {
		delete(s.keys, ref)
	}
	return int64(len(old)), nil
}

// CreatePayment implements [PaymentStore.CreatePayment]: it stages p on tx,
// which must come from s.Begin. The payment is checked and applied by
// tx.Complete.
func (s *MemoryStore) CreatePayment(ctx context.Context, tx Tx, p Payment) error {
	mtx, ok := tx.(*memTx)
	if !ok || mtx.store != s {
		return errors.New("server: CreatePayment needs a Tx from the same MemoryStore")
	}
	mtx.mu.Lock()
	defer mtx.mu.Unlock()
	if mtx.done {
		return errTxDone
	}
	mtx.payments = append(mtx.payments, p)
	return nil
}

// InsertPayment implements [PaymentInserter]: it stores p at once, after
// the same checks as [Tx.Complete]. A payment without CreatedAt gets the
// current time.
func (s *MemoryStore) InsertPayment(ctx context.Context, p Payment) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.CreatedAt.IsZero() {
		p.CreatedAt = s.now()
	}
	return s.applyPayments([]Payment{p})
}

// GetPayment implements [PaymentStore.GetPayment].
func (s *MemoryStore) GetPayment(ctx context.Context, clientID, id string) (Payment, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.payments[id]
	if !ok || p.ClientID != clientID {
		return Payment{}, ErrNotFound
	}
	return p, nil
}

// CreateCharge implements [ChargeStore.CreateCharge]. A charge with no
// CreatedAt gets the current time.
func (s *MemoryStore) CreateCharge(ctx context.Context, c Charge) (Charge, bool, error) {
	if err := ctx.Err(); err != nil {
		return Charge{}, false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if stored, ok := s.charges[c.IdempotencyKey]; ok {
		return stored, false, nil
	}
	if c.CreatedAt.IsZero() {
		c.CreatedAt = s.now()
	}
	s.charges[c.IdempotencyKey] = c
	return c, true, nil
}

// Charges returns every charge the store holds, oldest first; tests use it
// to count what reached the card processor.
func (s *MemoryStore) Charges() []Charge {
	s.mu.Lock()
	defer s.mu.Unlock()
	all := slices.Collect(maps.Values(s.charges))
	slices.SortFunc(all, func(a, b Charge) int {
		return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), cmp.Compare(a.ID, b.ID))
	})
	return all
}

// Payments returns every committed payment the store holds, oldest first;
// tests and the example scenarios use it to count what was really paid.
// Payments staged on a unit of work that has not completed are not in it.
func (s *MemoryStore) Payments() []Payment {
	s.mu.Lock()
	defer s.mu.Unlock()
	all := slices.Collect(maps.Values(s.payments))
	slices.SortFunc(all, func(a, b Payment) int {
		return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), cmp.Compare(a.ID, b.ID))
	})
	return all
}

// memTx is the unit of work of a claim on a MemoryStore.
type memTx struct {
	store *MemoryStore
	claim Claim

	mu       sync.Mutex
	done     bool
	payments []Payment // staged by CreatePayment
}

// Complete implements [Tx.Complete]: under the store's lock it checks that
// the claim still owns the key and that the staged payments are new, then
// applies them and completes the key, or applies nothing.
func (tx *memTx) Complete(ctx context.Context, resp StoredResponse) error {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	if tx.done {
		return errTxDone
	}
	tx.done = true
	staged := tx.payments
	tx.payments = nil
	s := tx.store
	s.mu.Lock()
	defer s.mu.Unlock()
	k := s.owned(tx.claim)
	if k == nil {
		return ErrFenced
	}
	if err := s.applyPayments(staged); err != nil {
		return err
	}
	resp.Header = maps.Clone(resp.Header)
	resp.Body = bytes.Clone(resp.Body)
	k.rec.Status = StatusCompleted
	k.rec.Response = &resp
	return nil
}

// applyPayments stores payments, all or none: it returns
// ErrDuplicatePayment, and stores nothing, when one repeats the ID or the
// (client, operation) of a stored payment or of another in the list. The
// caller holds s.mu.
func (s *MemoryStore) applyPayments(payments []Payment) error {
	ids := make(map[string]bool, len(payments))
	ops := make(map[[2]string]bool, len(payments))
	for _, p := range payments {
		op := [2]string{p.ClientID, p.OperationID}
		_, dupID := s.payments[p.ID]
		if dupID || ids[p.ID] || (p.OperationID != "" && (s.paymentOp[op] || ops[op])) {
			return ErrDuplicatePayment
		}
		ids[p.ID], ops[op] = true, true
	}
	for _, p := range payments {
		s.payments[p.ID] = p
		if p.OperationID != "" {
			s.paymentOp[[2]string{p.ClientID, p.OperationID}] = true
		}
	}
	return nil
}

// Rollback implements [Tx.Rollback]: it drops the staged payments.
func (tx *memTx) Rollback(ctx context.Context) error {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	tx.done = true
	tx.payments = nil
	return nil
}
