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
	tx           Tx
	claim        Claim
	irreversible atomic.Bool
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

// MarkIrreversible records that the handler of the keyed request in ctx has
// done, or may have done, work outside its unit of work that a rerun must not
// repeat under a new operation: typically a downstream charge keyed by
// [Claim.OperationID]. From then on a failure of the request (a 5xx that is
// not stored, a panic, a lost client, a failed completion) no longer releases
// the key, because a released key would be claimed again under a new
// OperationID and charged again downstream. The key stays started instead,
// and after the lock timeout the next retry takes it over with the same
// OperationID, so the downstream work is found and reused. Outside a keyed
// request MarkIrreversible does nothing. It is safe for concurrent use.
func MarkIrreversible(ctx context.Context) {
	if r, ok := ctx.Value(runKey).(*run); ok {
		r.irreversible.Store(true)
	}
}
