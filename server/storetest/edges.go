package storetest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// The edges below are sequences a store gets wrong when it stamps a time
// with the start of a transaction it runs in, rather than with the time of
// the event: a unit of work whose first write begins a transaction that
// stays open for longer than the key's retention, as a handler that holds
// its transaction across a slow downstream call does. Aging the keys
// (Backend.Elapse) cannot age an open transaction, so these tests let real
// time pass: a unit of work is held for hold, on a key kept for
// heldRetention.

const (
	heldRetention = 200 * time.Millisecond
	hold          = 300 * time.Millisecond
)

// holdUnit claims req, opens its unit of work, writes name in it, and holds
// it open for longer than heldRetention before returning it.
func holdUnit(t *testing.T, b Backend, req idempotency.ClaimRequest, name string) (idempotency.Claim, idempotency.Tx) {
	t.Helper()
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	tx, wctx := begin(t, b, c)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if err := b.Write(wctx, name); err != nil {
		t.Fatalf("Write(%s): %v", name, err)
	}
	time.Sleep(hold) // the unit of work stays open past the retention
	return c, tx
}

// testHeldUnitRetention completes a unit of work that was held open, after
// its first write, for longer than the key's retention: the key is kept a
// retention from the completion, so the immediate retry replays it and
// finds the one write, and only a retention later is the key absent.
func testHeldUnitRetention(t *testing.T, b Backend) {
	judged(t, func(key string) bool {
		req := with(request("cli_a", key, "a"), long, heldRetention)
		_, tx := holdUnit(t, b, req, key+"-w")
		start := time.Now()
		if err := tx.Complete(context.Background(), created("ord_1")); err != nil {
			t.Fatalf("Complete of a unit of work held past the retention: %v", err)
		}
		res := try(t, b.Store, req)
		if !before(start, heldRetention) {
			return false
		}
		if res.Outcome != idempotency.Exists || res.Record.Status != idempotency.StatusCompleted || res.Record.Response == nil {
			t.Fatalf("retry right after the completion of a unit of work held past the retention: %s (record %+v); "+
				"want Exists, completed: the retention counts from the completion, not from the unit's first write",
				res.Outcome, res.Record)
		}
		mustBeWritten(t, b, key+"-w", true)
		elapse(t, b, pause)
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
		req := with(request("cli_a", key, "a"), long, heldRetention)
		c, tx := holdUnit(t, b, req, key+"-w1")
		start := time.Now()
		if err := tx.Rollback(context.Background()); err != nil {
			t.Fatalf("Rollback: %v", err)
		}
		release(t, b.Store, c, idempotency.ReleaseFailed)
		res := try(t, b.Store, req)
		if !before(start, heldRetention) {
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

// attempts is how many keys a check that cannot be judged on a stalled
// machine tries before it gives up.
const attempts = 5

// judged runs check on a new key each time until it returns true: check
// returns false when the machine stalled past one of the suite's timeouts,
// so that its result proves nothing either way (see [before]).
func judged(t *testing.T, check func(key string) bool) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		if check(fmt.Sprintf("key-%d", attempt)) {
			return
		}
		if attempt == attempts {
			t.Fatalf("%d attempts, each stalled past the suite's timeouts: the check cannot be judged on this machine", attempts)
		}
		t.Logf("attempt %d stalled past the suite's timeouts; running it again on a new key", attempt)
	}
}

// before reports whether less than d passed since start. Taken before a
// store call that stamps a time and after a later check, it bounds from
// above the time the store saw between the two: when it reports true, the
// store saw less than d.
func before(start time.Time, d time.Duration) bool {
	return time.Since(start) < d
}

// try claims req, failing the test only on an error: the caller judges the
// outcome once it knows whether the machine stalled.
func try(t *testing.T, s idempotency.Store, req idempotency.ClaimRequest) idempotency.ClaimResult {
	t.Helper()
	res, err := s.Claim(context.Background(), req)
	if err != nil {
		t.Fatalf("Claim(%s, %s): %v", req.ClientID, req.Key, err)
	}
	return res
}
