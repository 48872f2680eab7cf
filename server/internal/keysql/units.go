package keysql

import (
	"context"
	"sync"

	"github.com/idemkit/idem/server/idempotency"
)

// Unit is a store's unit of work, as [Units] keeps it.
type Unit interface {
	comparable
	// Rollback rolls back the unit's transaction (see
	// idempotency.Tx.Rollback).
	Rollback(ctx context.Context) error
}

// Units are the units of work of a store's process that are still open,
// by their claim: those of claims made in one transaction, which Begin,
// Renew and Release look up, and any others the store looks up by claim.
// The zero value is ready; it is safe for concurrent use.
type Units[U Unit] struct {
	mu sync.Mutex
	m  map[int64]unitEntry[U] // by the claim's token
}

type unitEntry[U Unit] struct {
	claim  idempotency.Claim
	unit   U
	opened bool // Open returned it
}

// Add adds u, the unit of c; opened says whether it is open already
// (Begin returned it), as a unit of a claim in one transaction is not
// until Begin opens it.
func (us *Units[U]) Add(c idempotency.Claim, u U, opened bool) {
	us.mu.Lock()
	defer us.mu.Unlock()
	if us.m == nil {
		us.m = make(map[int64]unitEntry[U])
	}
	us.m[c.Token] = unitEntry[U]{claim: c, unit: u, opened: opened}
}

// Remove drops u, the unit of c, which is over.
func (us *Units[U]) Remove(c idempotency.Claim, u U) {
	us.mu.Lock()
	defer us.mu.Unlock()
	if e, ok := us.m[c.Token]; ok && e.unit == u {
		delete(us.m, c.Token)
	}
}

// Of returns the unit of c, if it is still open.
func (us *Units[U]) Of(c idempotency.Claim) (U, bool) {
	us.mu.Lock()
	defer us.mu.Unlock()
	if e, ok := us.m[c.Token]; ok && e.claim == c {
		return e.unit, true
	}
	var zero U
	return zero, false
}

// Open returns the unit of c, a claim made in one transaction, the first
// time it is asked for while the unit is open; false later, or once it
// ended (Begin then returns a unit that owns nothing).
func (us *Units[U]) Open(c idempotency.Claim) (U, bool) {
	us.mu.Lock()
	defer us.mu.Unlock()
	if e, ok := us.m[c.Token]; ok && e.claim == c && !e.opened {
		e.opened = true
		us.m[c.Token] = e
		return e.unit, true
	}
	var zero U
	return zero, false
}

// Renew implements Renew for c, a claim made in one transaction, which
// has no lease: nil while its unit is open, ErrFenced after.
func (us *Units[U]) Renew(ctx context.Context, c idempotency.Claim) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if _, ok := us.Of(c); !ok {
		return idempotency.ErrFenced
	}
	return nil
}

// Release implements Release for c, a claim made in one transaction: it
// rolls back the claim's unit, key and all, or returns ErrFenced once that
// has ended.
func (us *Units[U]) Release(ctx context.Context, c idempotency.Claim) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	u, ok := us.Of(c)
	if !ok {
		return idempotency.ErrFenced
	}
	return u.Rollback(ctx)
}
