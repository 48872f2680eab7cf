package idempotency

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

// keepLease renews the lease of c on store every third of lease until the
// returned stop is called; stop waits for a renewal under way to end. It
// is how the owner of a key (a request's handler, a [Sweeper]'s hook)
// keeps it for as long as it works. A renewal that finds the key taken
// over cancels ctx's work through cancel with [ErrLeaseLost] and stops
// renewing. A renewal that fails otherwise (the store unreachable) is
// logged and tried again at the next tick: the lease runs out only when
// no renewal reaches the store for a whole lease. A lease of zero or less
// never runs out, and is not renewed. event receives [EventRenewed] and
// [EventLeaseLost].
func keepLease(ctx context.Context, store Store, c Claim, lease time.Duration, cancel context.CancelCauseFunc, event func(Event), log *slog.Logger) (stop func()) {
	if lease <= 0 {
		return func() {}
	}
	// The renewals outlive the client (like the completion) but not the
	// owner's work: stop cancels this context.
	rctx, stopCtx := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(max(lease/3, time.Millisecond))
		defer t.Stop()
		for {
			select {
			case <-rctx.Done():
				return
			case <-t.C:
			}
			switch err := store.Renew(rctx, c); {
			case err == nil:
				event(EventRenewed)
			case errors.Is(err, ErrFenced):
				if rctx.Err() != nil {
					return // stopped meanwhile: the work finished
				}
				event(EventLeaseLost)
				// The message is the middleware's, which log readers
				// count (examples/chaos); a sweeper's logger says it is one.
				log.Warn("idempotency: lease lost: the key was taken over while its request ran; cancelling the handler",
					"operation", c.OperationID)
				cancel(ErrLeaseLost)
				return
			case rctx.Err() != nil:
				return
			default:
				log.Error("idempotency: renewing the lease failed; retrying at the next tick", "err", err, "operation", c.OperationID)
			}
		}
	}()
	return func() {
		stopCtx()
		<-done
	}
}
