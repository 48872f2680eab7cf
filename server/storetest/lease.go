package storetest

import (
	"context"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
)

// testFencedCompletion lets a taken-over owner finish first, after the
// takeover: fenced, and nothing of its unit of work is visible; the taker
// completes.
func testFencedCompletion(t *testing.T, b Backend) {
	req := withLockTimeout(request("cli_a", "key-1", "a"))
	slow := stale(t, b, req)
	taker := claim(t, b.Store, req, idempotency.TookOver).Claim

	mustFence(t, "Complete of the taken-over claim", complete(t, b, slow, created("ord_slow"), "w_slow"))
	mustBeWritten(t, b, "w_slow", false)
	if st := peek(t, b.Store, req).Status; st != idempotency.StatusStarted {
		t.Errorf("after the fenced completion: status %q, want started", st)
	}

	if err := complete(t, b, taker, created("ord_taker"), "w_taker"); err != nil {
		t.Fatalf("Complete of the taker: %v", err)
	}
	mustBeWritten(t, b, "w_taker", true)
	rec := claim(t, b.Store, req, idempotency.Exists).Record
	if rec.Status != idempotency.StatusCompleted || rec.Response == nil || string(rec.Response.Body) != `{"id":"ord_taker"}` {
		t.Errorf("record %+v, want the taker's response", rec)
	}
}

// testFencedAfterTakerCompleted lets the taker complete first: the slow
// original's completion, with a write of its own, is fenced before its
// writes are applied.
func testFencedAfterTakerCompleted(t *testing.T, b Backend) {
	req := withLockTimeout(request("cli_a", "key-1", "a"))
	slow := stale(t, b, req)
	taker := claim(t, b.Store, req, idempotency.TookOver).Claim
	if err := complete(t, b, taker, created("ord_taker"), "w_taker"); err != nil {
		t.Fatalf("Complete of the taker: %v", err)
	}
	mustFence(t, "Complete of the taken-over claim", complete(t, b, slow, created("ord_slow"), "w_slow"))
	mustBeWritten(t, b, "w_slow", false)
	mustBeWritten(t, b, "w_taker", true)
	if rec := claim(t, b.Store, req, idempotency.Exists).Record; rec.Response == nil || string(rec.Response.Body) != `{"id":"ord_taker"}` {
		t.Errorf("stored response %+v, want the taker's", rec.Response)
	}
}

// testLeaseStoredWithKey checks that the lease a key was claimed with
// decides its takeover, whatever the lock timeout of the request that finds
// it: replicas started with different flags agree on every key.
func testLeaseStoredWithKey(t *testing.T, b Backend) {
	longReq := with(request("cli_a", "long", "a"), long, 0)
	shortReq := withLockTimeout(request("cli_a", "short", "a"))
	neverReq := request("cli_a", "never", "a") // no lease: never taken over
	claim(t, b.Store, longReq, idempotency.Claimed)
	short := claim(t, b.Store, shortReq, idempotency.Claimed).Claim
	claim(t, b.Store, neverReq, idempotency.Claimed)
	elapse(t, b, pause)

	// A replica with a short lock timeout takes over neither the key
	// claimed with a long lease nor the one claimed with none.
	if rec := claim(t, b.Store, withLockTimeout(longReq), idempotency.Exists).Record; rec.Status != idempotency.StatusStarted {
		t.Errorf("key with a long lease, claimed with a short one: status %q, want started", rec.Status)
	}
	if rec := claim(t, b.Store, withLockTimeout(neverReq), idempotency.Exists).Record; rec.Status != idempotency.StatusStarted {
		t.Errorf("key without a lease, claimed with a short one: status %q, want started", rec.Status)
	}
	// A replica with a long lock timeout takes over the key whose short
	// lease ran out.
	took := claim(t, b.Store, with(request("cli_a", "short", "a"), long, 0), idempotency.TookOver).Claim
	if took.OperationID != short.OperationID {
		t.Errorf("takeover of the short lease: operation %q, want %q", took.OperationID, short.OperationID)
	}
	// And the taker's long lease is now the key's: it outlives the short
	// lock timeout.
	elapse(t, b, pause)
	claim(t, b.Store, withLockTimeout(request("cli_a", "short", "a")), idempotency.Exists)
	if err := complete(t, b, took, created("ord_1")); err != nil {
		t.Errorf("Complete of the taker with the long lease: %v", err)
	}
}

// testRenewExtendsLease renews one of two keys claimed together, again
// and again, until both are older than their lock timeout: the renewed key
// is not taken over, the other one is. The renewed key's record shows the
// renewal, and its owner still completes.
func testRenewExtendsLease(t *testing.T, b Backend) {
	ctx := context.Background()
	renewedReq := withLockTimeout(request("cli_a", "key-renewed", "a"))
	idleReq := withLockTimeout(request("cli_a", "key-idle", "a"))
	renewed := claim(t, b.Store, renewedReq, idempotency.Claimed).Claim
	idle := claim(t, b.Store, idleReq, idempotency.Claimed).Claim
	for range 4 {
		elapse(t, b, lockTimeout/2)
		if err := b.Store.Renew(ctx, renewed); err != nil {
			t.Fatalf("Renew of the live claim: %v", err)
		}
	}
	rec := claim(t, b.Store, renewedReq, idempotency.Exists).Record
	if rec.Status != idempotency.StatusStarted {
		t.Fatalf("renewed key claimed past its lock timeout: status %q, want started", rec.Status)
	}
	if !rec.LockedAt.After(rec.CreatedAt) {
		t.Errorf("renewed key: locked at %v, created at %v; want the renewal after the creation", rec.LockedAt, rec.CreatedAt)
	}
	took := claim(t, b.Store, idleReq, idempotency.TookOver).Claim
	if took.OperationID != idle.OperationID {
		t.Errorf("takeover of the idle key: operation %q, want %q", took.OperationID, idle.OperationID)
	}
	if err := complete(t, b, renewed, created("ord_renewed"), "w"); err != nil {
		t.Errorf("Complete of the renewed claim: %v", err)
	}
	mustBeWritten(t, b, "w", true)
}

// testRenewFenced renews claims that no longer own their key: taken over,
// completed, released, or never claimed. Each gets ErrFenced and changes
// nothing.
func testRenewFenced(t *testing.T, b Backend) {
	ctx := context.Background()

	// Taken over.
	req := withLockTimeout(request("cli_a", "key-took", "a"))
	first := stale(t, b, req)
	second := claim(t, b.Store, req, idempotency.TookOver).Claim
	mustFence(t, "Renew of the taken-over claim", b.Store.Renew(ctx, first))
	if err := b.Store.Renew(ctx, second); err != nil {
		t.Fatalf("Renew of the taker: %v", err)
	}
	if err := complete(t, b, second, created("ord_1")); err != nil {
		t.Fatalf("Complete of the taker after the fenced renewal: %v", err)
	}

	// Completed.
	mustFence(t, "Renew of a completed key", b.Store.Renew(ctx, second))
	if st := status(t, b.Store, req); st != idempotency.StatusCompleted {
		t.Errorf("completed key after a renewal: status %q, want completed", st)
	}

	// Released: the renewal does not revive the key, which another
	// request still finds released (as failed), and the released request
	// still resumes.
	rel := claim(t, b.Store, request("cli_a", "key-rel", "a"), idempotency.Claimed).Claim
	if err := b.Store.Release(ctx, rel, idempotency.ReleaseFailed); err != nil {
		t.Fatal(err)
	}
	mustFence(t, "Renew of a released key", b.Store.Renew(ctx, rel))
	if st := status(t, b.Store, request("cli_a", "key-rel", "b")); st != idempotency.StatusReleased {
		t.Errorf("released key after a renewal: status %q, want released", st)
	}
	resumed := claim(t, b.Store, request("cli_a", "key-rel", "a"), idempotency.Claimed).Claim
	mustFence(t, "Renew of the released claim after the resume", b.Store.Renew(ctx, rel))
	if err := b.Store.Renew(ctx, resumed); err != nil {
		t.Errorf("Renew of the resumed claim: %v", err)
	}

	// Never claimed.
	mustFence(t, "Renew of an unknown key", b.Store.Renew(ctx, idempotency.Claim{
		ClientID: "cli_a", Key: "key-unknown", Token: second.Token, OperationID: second.OperationID,
	}))
	claim(t, b.Store, request("cli_a", "key-unknown", "a"), idempotency.Claimed)
}
