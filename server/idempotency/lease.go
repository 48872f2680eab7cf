package idempotency

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"
)

// keepLease renews the lease of c on store every third of lease until the
// returned keeper's stop is called, which waits for a renewal under way
// to end. It
// is how the owner of a key (a request's handler, a [Sweeper]'s hook)
// keeps it for as long as it works. A renewal that finds the key taken
// over cancels ctx's work through cancel with [ErrLeaseLost] and stops
// renewing. A renewal that fails otherwise (the store unreachable) is
// logged and tried again at the next tick: the lease runs out only when
// no renewal reaches the store for a whole lease. A lease of zero or less
// never runs out, and is not renewed: keepLease returns nil, whose stop
// does nothing. event receives [EventRenewed] and [EventLeaseLost].
func keepLease(ctx context.Context, store Store, c Claim, lease time.Duration, cancel context.CancelCauseFunc, event func(Event), log *slog.Logger) *leaseKeeper {
	if lease <= 0 {
		return nil
	}
	// The renewals outlive the client (like the completion) but not the
	// owner's work: stop cancels the one under way. No goroutine runs
	// until a renewal is due, which most requests never see: a timer's
	// function starts each one and arms the next.
	k := &leaseKeeper{base: context.WithoutCancel(ctx), period: max(lease/3, time.Millisecond),
		store: store, claim: c, cancel: cancel, event: event, log: log}
	k.mu.Lock()
	k.timer = time.AfterFunc(k.period, k.renew)
	k.mu.Unlock()
	return k
}

// leaseKeeper is the state of keepLease's renewals.
type leaseKeeper struct {
	base   context.Context // the renewals' context, without the request's cancellation
	period time.Duration
	store  Store
	claim  Claim
	cancel context.CancelCauseFunc
	event  func(Event)
	log    *slog.Logger

	mu      sync.Mutex
	timer   *time.Timer        // arms the next renewal
	stopped bool               // stop was called: renew no more
	abort   context.CancelFunc // cancels the renewal under way; nil when none
	ended   chan struct{}      // closed when the renewal under way ends
}

// renew renews the lease once, unless stopped, and arms the next renewal
// one period after this one began (at once if it took longer, as a ticker
// would), unless the lease was lost.
func (k *leaseKeeper) renew() {
	k.mu.Lock()
	if k.stopped {
		k.mu.Unlock()
		return
	}
	began := time.Now()
	rctx, abort := context.WithCancel(k.base)
	ended := make(chan struct{})
	k.abort, k.ended = abort, ended
	k.mu.Unlock()

	again := k.renewOnce(rctx)
	abort()
	k.mu.Lock()
	k.abort, k.ended = nil, nil
	if again && !k.stopped {
		k.timer.Reset(max(k.period-time.Since(began), 0))
	}
	k.mu.Unlock()
	close(ended)
}

// renewOnce renews the lease on rctx and reports whether to renew again.
func (k *leaseKeeper) renewOnce(rctx context.Context) bool {
	switch err := k.store.Renew(rctx, k.claim); {
	case err == nil:
		k.event(EventRenewed)
		return true
	case errors.Is(err, ErrFenced):
		if rctx.Err() != nil {
			return false // stopped meanwhile: the work finished
		}
		k.event(EventLeaseLost)
		// The message is the middleware's, which log readers
		// count (examples/chaos); a sweeper's logger says it is one.
		k.log.Warn("idempotency: lease lost: the key was taken over while its request ran; cancelling the handler",
			"operation", k.claim.OperationID)
		k.cancel(ErrLeaseLost)
		return false
	case rctx.Err() != nil:
		return false
	default:
		k.log.Error("idempotency: renewing the lease failed; retrying at the next tick", "err", err, "operation", k.claim.OperationID)
		return true
	}
}

// stop ends the renewals: none starts after it, and it waits for the one
// under way, which it cancels, to end. On nil, it does nothing.
func (k *leaseKeeper) stop() {
	if k == nil {
		return
	}
	k.mu.Lock()
	k.stopped = true
	k.timer.Stop()
	abort, ended := k.abort, k.ended
	k.mu.Unlock()
	if abort != nil {
		abort()
		<-ended
	}
}
