package idempotency

import (
	"context"
	"errors"
)

type ctxKey int

const (
	clientIDKey ctxKey = iota
	runKey
)

// ErrLeaseLost is the cause of a handler's context cancelled because its
// claim was taken from it: a renewal of its lease found the key taken over,
// which happens when the renewals stopped reaching the store for longer than
// the lock timeout. Whatever the handler still writes is rolled back (its
// completion is fenced), so it may stop early; [context.Cause] tells this
// cancellation from the client's.
var ErrLeaseLost = errors.New("idempotency: the claim's lease was lost to a takeover")

// WithClientID returns a copy of ctx carrying the authenticated client id.
// An authentication middleware in front of [Middleware] calls it, and the
// default [Options.ClientID] reads it back with [ClientIDFromContext].
func WithClientID(ctx context.Context, clientID string) context.Context {
	return context.WithValue(ctx, clientIDKey, clientID)
}

// ClientIDFromContext returns the client id stored by [WithClientID].
func ClientIDFromContext(ctx context.Context) (string, bool) {
	id, ok := ctx.Value(clientIDKey).(string)
	return id, ok
}

// run is what the middleware hands to the handler of a claimed key.
type run struct {
	tx    Tx
	claim Claim
}

// NewContext returns a copy of ctx carrying a claim and its unit of work, as
// [Middleware] hands them to the handler of a request that owns its key:
// [ClaimFromContext], [TxFromContext] and the stores' own accessors
// (pgstore.Tx, [MemoryStore.Stage]) read them. A middleware of
// one's own, or a test of a handler, uses it with a [Store]'s Claim and
// Begin.
func NewContext(ctx context.Context, c Claim, tx Tx) context.Context {
	return &runContext{Context: ctx, run: run{tx: tx, claim: c}}
}

// newRunContext is NewContext and [WithClientID] with the claim's client,
// as the middleware hands them to a handler.
func newRunContext(ctx context.Context, c Claim, tx Tx) context.Context {
	return &runContext{Context: ctx, run: run{tx: tx, claim: c}, clientID: c.ClientID}
}

// runContext carries a [run] and, unless clientID is nil, a client id, as
// context.WithValue would: in one allocation (two with the client) where
// WithValue takes one for each value and one more for each boxed value.
type runContext struct {
	context.Context
	run      run
	clientID any // a string; nil: the parent's
}

func (c *runContext) Value(key any) any {
	switch key {
	case runKey:
		return &c.run
	case clientIDKey:
		if c.clientID != nil {
			return c.clientID
		}
	}
	return c.Context.Value(key)
}

// TxFromContext returns the unit of work of the claimed key whose request
// the handler serves, as opened by [Middleware] with [Store.Begin]. It
// returns false outside a request that owns its key. Handlers usually reach
// it through their store's accessor (pgstore.Tx for a real
// pgx.Tx, [MemoryStore.Stage]); they must not call Complete or Rollback
// themselves: the middleware decides from the status.
//
// It returns the store's own unit of work: a Tx that wraps another and
// says so with an Unwrap() Tx method, as [Sealed]'s does, is unwrapped, so
// that a store's accessor finds its own type.
func TxFromContext(ctx context.Context) (Tx, bool) {
	r, ok := ctx.Value(runKey).(*run)
	if !ok {
		return nil, false
	}
	tx := r.tx
	for {
		w, ok := tx.(interface{ Unwrap() Tx })
		if !ok {
			return tx, true
		}
		tx = w.Unwrap()
	}
}

// ClaimFromContext returns the claim of the key whose request the handler
// serves; its [Claim.OperationID] is the value to derive downstream
// idempotency keys from. It returns false outside a request that owns its
// key.
func ClaimFromContext(ctx context.Context) (Claim, bool) {
	r, ok := ctx.Value(runKey).(*run)
	if !ok {
		return Claim{}, false
	}
	return r.claim, true
}
