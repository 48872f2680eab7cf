package storetest

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// The edges below are sequences a store gets wrong when it stamps a time
// with the start of a transaction it runs in, rather than with the time of
// the event: a unit of work whose first write begins a transaction that
// stays open for longer than the key's retention, as a handler that holds
// its transaction across a slow downstream call does.

// holdUnit claims req, opens its unit of work, writes name in it, and holds
// it open (for longer than the suite's retention) before returning it.
func holdUnit(t *testing.T, b Backend, req idempotency.ClaimRequest, name string) (idempotency.Claim, idempotency.Tx) {
	t.Helper()
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	tx, wctx := begin(t, b, c)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if err := b.Write(wctx, name); err != nil {
		t.Fatalf("Write(%s): %v", name, err)
	}
	time.Sleep(pause) // the unit of work stays open past the retention
	return c, tx
}

// testHeldUnitRetention completes a unit of work that was held open, after
// its first write, for longer than the key's retention: the key is kept a
// retention from the completion, so the immediate retry replays it and
// finds the one write, and only a retention later is the key absent.
func testHeldUnitRetention(t *testing.T, b Backend) {
	judged(t, func(key string) bool {
		req := with(request("cli_a", key, "a"), long, retention)
		_, tx := holdUnit(t, b, req, key+"-w")
		start := time.Now()
		if err := tx.Complete(context.Background(), created("ord_1")); err != nil {
			t.Fatalf("Complete of a unit of work held past the retention: %v", err)
		}
		res := try(t, b.Store, req)
		if !before(start, retention) {
			return false
		}
		if res.Outcome != idempotency.Exists || res.Record.Status != idempotency.StatusCompleted || res.Record.Response == nil {
			t.Fatalf("retry right after the completion of a unit of work held past the retention: %s (record %+v); "+
				"want Exists, completed: the retention counts from the completion, not from the unit's first write",
				res.Outcome, res.Record)
		}
		mustBeWritten(t, b, key+"-w", true)
		time.Sleep(pause)
		// A new operation on the key; the same request derives the same
		// operation ID (see idempotency.ClaimRequest.OperationID).
		if again := claim(t, b.Store, req, idempotency.Claimed).Claim; again.OperationID != req.OperationID() {
			t.Errorf("key a retention after its completion claimed under operation %q, want the request's %q",
				again.OperationID, req.OperationID())
		}
		return true
	})
}

// testHeldUnitRelease rolls back a unit of work held open past the
// retention after a write, and releases its key, as the middleware
// abandons a request that failed: the write is gone, and the immediate
// retry of the same request resumes the operation (the release's retention
// counts from the release), whose new unit of work completes with its own
// write.
func testHeldUnitRelease(t *testing.T, b Backend) {
	judged(t, func(key string) bool {
		req := with(request("cli_a", key, "a"), long, retention)
		c, tx := holdUnit(t, b, req, key+"-w1")
		start := time.Now()
		if err := tx.Rollback(context.Background()); err != nil {
			t.Fatalf("Rollback: %v", err)
		}
		release(t, b.Store, c, idempotency.ReleaseFailed)
		res := try(t, b.Store, req)
		if !before(start, retention) {
			return false
		}
		if res.Outcome != idempotency.Claimed || res.Claim.OperationID != c.OperationID {
			t.Fatalf("retry right after the release of a unit of work held past the retention: %s, operation %q; want Claimed, the released %q",
				res.Outcome, res.Claim.OperationID, c.OperationID)
		}
		mustBeWritten(t, b, key+"-w1", false)
		if err := complete(t, b, res.Claim, created("ord_1"), key+"-w2"); err != nil {
			t.Fatalf("Complete of the resumed operation: %v", err)
		}
		mustBeWritten(t, b, key+"-w2", true)
		return true
	})
}
