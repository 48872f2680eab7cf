package server

import (
	"context"
	"sync/atomic"
)

type ctxKey int

const (
	clientIDKey ctxKey = iota
	runKey
)

// WithClientID returns a copy of ctx carrying the authenticated client id.
// Authentication middleware ([BearerAuth]) calls it; [Idempotency] scopes
// keys by the id it finds with [ClientIDFromContext].
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
	// crashed is set by the payments API's injected crash
	// ([Config.AfterCharge]): the middleware then leaves the key as a
	// crashed process would, started until the lock timeout, so tests and
	// scenarios exercise the takeover. No public handler can set it.
	crashed atomic.Bool
}

// simulateCrash marks the keyed request in ctx as crashed (see run.crashed).
// Outside a keyed request it does nothing.
func simulateCrash(ctx context.Context) {
	if r, ok := ctx.Value(runKey).(*run); ok {
		r.crashed.Store(true)
	}
}

// TxFromContext returns the unit of work of the claimed key whose request
// the handler serves, as opened by [Idempotency] with [Store.Begin]. Business
// writes made through it commit together with the key's completion, or not
// at all. It returns false outside a keyed request. The handler must not
// call Complete or Rollback itself: the middleware decides from the status.
func TxFromContext(ctx context.Context) (Tx, bool) {
	r, ok := ctx.Value(runKey).(*run)
	if !ok {
		return nil, false
	}
	return r.tx, true
}

// ClaimFromContext returns the claim of the key whose request the handler
// serves; its [Claim.OperationID] is the value to derive downstream
// idempotency keys from. It returns false outside a keyed request.
func ClaimFromContext(ctx context.Context) (Claim, bool) {
	r, ok := ctx.Value(runKey).(*run)
	if !ok {
		return Claim{}, false
	}
	return r.claim, true
}
