package storetest

import (
	"bytes"
	"context"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
)

// release releases c as kind.
func release(t *testing.T, s idempotency.Store, c idempotency.Claim, kind idempotency.ReleaseKind) {
	t.Helper()
	if err := s.Release(context.Background(), c, kind); err != nil {
		t.Fatalf("Release(%s): %v", c.Key, err)
	}
}

// testRetentionCompleted completes a key and ages it past its retention:
// the key is absent although nothing purged it, whatever the retention of
// the request that finds it, and a new operation starts.
func testRetentionCompleted(t *testing.T, b Backend) {
	req := withRetention(request("cli_a", "key-1", "a"))
	first := claim(t, b.Store, req, idempotency.Claimed).Claim
	if err := complete(t, b, first, created("ord_1"), "w1"); err != nil {
		t.Fatal(err)
	}
	if st := status(t, b.Store, req); st != idempotency.StatusCompleted {
		t.Fatalf("completed key within its retention: status %q, want completed", st)
	}
	elapse(t, b, pause)

	// Expired, also for a request that asks for no retention: the
	// retention stored with the key decides.
	second := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Claimed).Claim
	if second.OperationID != first.OperationID || second.Token == first.Token {
		t.Errorf("claim after expiry %+v reuses the first claim's operation or token %+v", second, first)
	}
	if rec := claim(t, b.Store, req, idempotency.Exists).Record; rec.Status != idempotency.StatusStarted || rec.Response != nil {
		t.Errorf("key used again: %+v, want started without the old response", rec)
	}
	// The new operation makes its own writes; the first one's stay.
	if err := complete(t, b, second, created("ord_2"), "w2"); err != nil {
		t.Errorf("Complete of the new operation: %v", err)
	}
	mustBeWritten(t, b, "w1", true)
	mustBeWritten(t, b, "w2", true)
}

// testRetentionFromCompletion runs a request, under a live lease, for
// longer than its retention before it completes: the key does not expire
// while it runs, and expires its retention after the completion, not
// after the claim.
func testRetentionFromCompletion(t *testing.T, b Backend) {
	req := with(request("cli_a", "key-1", "a"), long, retention)
	first := claim(t, b.Store, req, idempotency.Claimed).Claim
	elapse(t, b, pause) // older than its retention, and running
	if rec := claim(t, b.Store, request("cli_a", "key-1", "b"), idempotency.Exists).Record; rec.Status != idempotency.StatusStarted {
		t.Fatalf("running key past its retention, another request: status %q, want started", rec.Status)
	}
	if st := status(t, b.Store, req); st != idempotency.StatusStarted {
		t.Fatalf("running key past its retention: status %q, want started", st)
	}
	if err := complete(t, b, first, created("ord_1")); err != nil {
		t.Fatalf("Complete of a claim older than its retention: %v", err)
	}
	if st := status(t, b.Store, req); st != idempotency.StatusCompleted {
		t.Fatalf("key completed less than its retention ago: status %q, want completed", st)
	}
	began := begunAt(t, b, req)
	elapse(t, b, pause)
	claim(t, b.Store, req, idempotency.Claimed)
	if !begunAt(t, b, req).After(began) {
		t.Errorf("key past its retention after completion kept its operation")
	}
}

// testRetentionStarted abandons a started key (its owner died): it is taken
// over while its lease has run out, and expires its retention after the
// lease ran out; then even another request claims it, as a new operation,
// and the dead owner is fenced.
func testRetentionStarted(t *testing.T, b Backend) {
	req := withRetention(withLockTimeout(request("cli_a", "key-1", "a")))
	other := withRetention(withLockTimeout(request("cli_a", "key-1", "b")))
	first := claim(t, b.Store, req, idempotency.Claimed).Claim
	elapse(t, b, pause) // past the lease
	if rec := claim(t, b.Store, other, idempotency.Exists).Record; rec.Status != idempotency.StatusStarted || !bytes.Equal(rec.Fingerprint, fingerprint("a")) {
		t.Fatalf("another request on an abandoned key within its retention: record %+v, want request a's started key", rec)
	}
	elapse(t, b, pause) // past the lease and the retention after it
	second := claim(t, b.Store, other, idempotency.Claimed).Claim
	if second.OperationID == first.OperationID {
		t.Errorf("expired key kept its operation %q", first.OperationID)
	}
	if rec := peek(t, b.Store, other); !bytes.Equal(rec.Fingerprint, fingerprint("b")) {
		t.Errorf("key used again has fingerprint %x, want the new request's", rec.Fingerprint)
	}
	mustFence(t, "Complete of the expired claim", complete(t, b, first, created("ord_1"), "w"))
	mustBeWritten(t, b, "w", false)
}

// testRetentionReleased releases a key that ran for longer than its
// retention: the retry resumes it (its retention counts from the release),
// and a retention after the release even the same request is a new
// operation.
func testRetentionReleased(t *testing.T, b Backend) {
	req := withRetention(request("cli_a", "key-1", "a")) // no lease: never taken over
	first := claim(t, b.Store, req, idempotency.Claimed).Claim
	elapse(t, b, pause) // older than its retention, and running
	release(t, b.Store, first, idempotency.ReleaseFailed)
	resumed := claim(t, b.Store, req, idempotency.Claimed).Claim
	if resumed.OperationID != first.OperationID || !resumed.Resumed {
		t.Fatalf("retry of a key released less than its retention ago: operation %q, resumed %v; want the released %q, resumed",
			resumed.OperationID, resumed.Resumed, first.OperationID)
	}
	release(t, b.Store, resumed, idempotency.ReleaseFailed)
	began := begunAt(t, b, req)
	elapse(t, b, pause)
	if claim(t, b.Store, req, idempotency.Claimed).Claim.Resumed {
		t.Errorf("claim of an expired released key reads as resumed, want a new operation")
	}
	if !begunAt(t, b, req).After(began) {
		t.Errorf("expired released key kept its operation %q", first.OperationID)
	}
}

// testRetentionResumed resumes a released key and keeps the resumed
// request running for longer than the retention (the double-charge of a
// retry that straddles the retention): the key does not expire while it
// runs, neither for the same request nor for another, and the purge spares
// it.
func testRetentionResumed(t *testing.T, b Backend) {
	req := with(request("cli_a", "key-1", "a"), long, retention)
	first := claim(t, b.Store, req, idempotency.Claimed).Claim
	release(t, b.Store, first, idempotency.ReleaseFailed)
	resumed := claim(t, b.Store, req, idempotency.Claimed).Claim
	if resumed.OperationID != first.OperationID {
		t.Fatalf("resume: operation %q, want %q", resumed.OperationID, first.OperationID)
	}
	elapse(t, b, pause) // past the release's retention, while the retry runs
	for _, body := range []string{"a", "b"} {
		if rec := claim(t, b.Store, request("cli_a", "key-1", body), idempotency.Exists).Record; rec.Status != idempotency.StatusStarted {
			t.Fatalf("request %s on a resumed key running past the retention: status %q, want started", body, rec.Status)
		}
	}
	purge(t, b.Store, 100, 0)
	if err := complete(t, b, resumed, created("ord_1"), "w"); err != nil {
		t.Fatalf("Complete of the resumed claim: %v", err)
	}
	if st := status(t, b.Store, req); st != idempotency.StatusCompleted {
		t.Fatalf("resumed key just completed: status %q, want completed", st)
	}
	mustBeWritten(t, b, "w", true)
}

// testRetentionRenewed renews a started key with a lease and a retention,
// again and again, until it is older than both: it never expires and the
// purge spares it, while its unrenewed twin expires and is purged.
func testRetentionRenewed(t *testing.T, b Backend) {
	ctx := context.Background()
	renewedReq := withRetention(withLockTimeout(request("cli_a", "key-renewed", "a")))
	idleReq := withRetention(withLockTimeout(request("cli_a", "key-idle", "a")))
	renewed := claim(t, b.Store, renewedReq, idempotency.Claimed).Claim
	claim(t, b.Store, idleReq, idempotency.Claimed)
	for range 8 {
		elapse(t, b, lockTimeout/2)
		if err := b.Store.Renew(ctx, renewed); err != nil {
			t.Fatalf("Renew of the live claim: %v", err)
		}
	}
	purge(t, b.Store, 100, 1) // the idle twin
	if rec := claim(t, b.Store, request("cli_a", "key-renewed", "b"), idempotency.Exists).Record; rec.Status != idempotency.StatusStarted {
		t.Fatalf("renewed key, older than its lease and retention, after a purge: status %q, want started", rec.Status)
	}
	// Claimed, not TookOver: purged (its operation ID is derived, the same).
	claim(t, b.Store, idleReq, idempotency.Claimed)
	if err := complete(t, b, renewed, created("ord_1"), "w"); err != nil {
		t.Errorf("Complete of the renewed claim: %v", err)
	}
	mustBeWritten(t, b, "w", true)
}

// testRetentionStoredWithKey checks that the retention a key was claimed
// with decides its expiry, whatever the retention of the request or the
// purge that finds it: a replica started with a short retention does not
// expire the keys of one with a long retention, nor the reverse.
func testRetentionStoredWithKey(t *testing.T, b Backend) {
	longC := claim(t, b.Store, with(request("cli_a", "long", "a"), 0, long), idempotency.Claimed).Claim
	if err := complete(t, b, longC, created("ord_long")); err != nil {
		t.Fatal(err)
	}
	shortC := claim(t, b.Store, withRetention(request("cli_a", "short", "a")), idempotency.Claimed).Claim
	if err := complete(t, b, shortC, created("ord_short")); err != nil {
		t.Fatal(err)
	}
	releasedC := claim(t, b.Store, withRetention(request("cli_a", "released", "a")), idempotency.Claimed).Claim
	release(t, b.Store, releasedC, idempotency.ReleaseFailed)
	releasedBegun := begun(t, b.Store, "cli_a", "released")
	elapse(t, b, pause)

	// A short-retention replica still replays the key kept long.
	if rec := claim(t, b.Store, withRetention(request("cli_a", "long", "a")), idempotency.Exists).Record; rec.Status != idempotency.StatusCompleted {
		t.Errorf("key kept long, claimed with a short retention: status %q, want completed", rec.Status)
	}
	// A long-retention replica finds the released key kept short expired.
	claim(t, b.Store, with(request("cli_a", "released", "a"), 0, long), idempotency.Claimed)
	if !begun(t, b.Store, "cli_a", "released").After(releasedBegun) {
		t.Errorf("released key kept short, claimed with a long retention: kept its operation %q", releasedC.OperationID)
	}
	// The purge deletes the completed key kept short only.
	purge(t, b.Store, 100, 1)
	if rec := claim(t, b.Store, request("cli_a", "long", "a"), idempotency.Exists).Record; rec.Status != idempotency.StatusCompleted {
		t.Errorf("key kept long after a purge: status %q, want completed", rec.Status)
	}
	claim(t, b.Store, with(request("cli_a", "short", "a"), 0, long), idempotency.Claimed) // not Exists: purged
}

// testPurge lets keys of every finished kind expire (completed, released,
// and started by an owner that died) and purges them in batches no larger
// than the limit; the keys still running and those kept long stay.
func testPurge(t *testing.T, b Backend) {
	old := []string{"old-0", "old-1", "old-2", "old-3", "old-4"}
	ops := map[string]string{}
	for i, key := range old {
		c := claim(t, b.Store, withRetention(request("cli_a", key, "a")), idempotency.Claimed).Claim
		ops[key] = c.OperationID
		if i%2 == 0 {
			if err := complete(t, b, c, created(key)); err != nil {
				t.Fatal(err)
			}
		} else {
			release(t, b.Store, c, idempotency.ReleaseFailed)
		}
	}
	dead := claim(t, b.Store, withRetention(withLockTimeout(request("cli_a", "dead", "a"))), idempotency.Claimed).Claim
	ops["dead"] = dead.OperationID
	elapse(t, b, 2*pause) // past every retention, and the dead key's lease with it

	running := []string{"new-0", "new-1"}
	for _, key := range running {
		claim(t, b.Store, with(request("cli_b", key, "a"), long, retention), idempotency.Claimed)
	}
	kept := claim(t, b.Store, with(request("cli_b", "kept", "a"), 0, long), idempotency.Claimed).Claim
	if err := complete(t, b, kept, created("kept")); err != nil {
		t.Fatal(err)
	}

	purge(t, b.Store, 3, 3) // no more than the limit
	purge(t, b.Store, 3, 3)
	purge(t, b.Store, 3, 0)
	for key, op := range ops {
		// Purged (counted above): a new operation, whose ID the same
		// request derives again (see idempotency.ClaimRequest.OperationID).
		if c := claim(t, b.Store, request("cli_a", key, "a"), idempotency.Claimed).Claim; c.OperationID != op {
			t.Errorf("purged key %s claimed again by the same request: operation %s, want %s", key, c.OperationID, op)
		}
	}
	for _, key := range running {
		if st := status(t, b.Store, request("cli_b", key, "a")); st != idempotency.StatusStarted {
			t.Errorf("running key %s after the purges: status %q, want started", key, st)
		}
	}
	if st := status(t, b.Store, request("cli_b", "kept", "a")); st != idempotency.StatusCompleted {
		t.Errorf("key kept long after the purges: status %q, want completed", st)
	}
}

// testPurgeReleased checks that Purge deletes released keys by the time of
// their release, and leaves the young ones, which keep their operation.
func testPurgeReleased(t *testing.T, b Backend) {
	var old []idempotency.Claim
	for _, k := range []string{"old-0", "old-1"} {
		c := claim(t, b.Store, withRetention(request("cli_a", k, "a")), idempotency.Claimed).Claim
		release(t, b.Store, c, idempotency.ReleaseFailed)
		old = append(old, c)
	}
	elapse(t, b, 2*pause)
	youngReq := withRetention(request("cli_a", "young", "a"))
	young := claim(t, b.Store, youngReq, idempotency.Claimed).Claim
	release(t, b.Store, young, idempotency.ReleaseFailed)
	purge(t, b.Store, 10, int64(len(old)))
	if c := claim(t, b.Store, youngReq, idempotency.Claimed).Claim; c.OperationID != young.OperationID {
		t.Errorf("young released key: operation %q; want %q (not purged)", c.OperationID, young.OperationID)
	}
	for _, c := range old {
		claim(t, b.Store, request("cli_a", c.Key, "a"), idempotency.Claimed) // purged: counted above
	}
}

// testPurgeSparesRunning purges, past their retention, keys whose requests
// are still running: under a long lease, under no lease at all, and
// resumed after a release. None is deleted, and each owner still completes.
func testPurgeSparesRunning(t *testing.T, b Backend) {
	var running []idempotency.Claim
	for _, req := range []idempotency.ClaimRequest{
		with(request("cli_a", "long-lease", "a"), long, retention),
		with(request("cli_a", "no-lease", "a"), 0, retention),
	} {
		running = append(running, claim(t, b.Store, req, idempotency.Claimed).Claim)
	}
	resumedReq := with(request("cli_a", "resumed", "a"), long, retention)
	released := claim(t, b.Store, resumedReq, idempotency.Claimed).Claim
	release(t, b.Store, released, idempotency.ReleaseFailed)
	running = append(running, claim(t, b.Store, resumedReq, idempotency.Claimed).Claim)
	finished := claim(t, b.Store, withRetention(request("cli_a", "finished", "a")), idempotency.Claimed).Claim
	if err := complete(t, b, finished, created("finished")); err != nil {
		t.Fatal(err)
	}
	elapse(t, b, pause)

	purge(t, b.Store, 100, 1) // the finished key only
	for _, c := range running {
		if st := status(t, b.Store, request("cli_a", c.Key, "a")); st != idempotency.StatusStarted {
			t.Errorf("running key %s after the purge: status %q, want started", c.Key, st)
		}
		if err := complete(t, b, c, created(c.Key), "w-"+c.Key); err != nil {
			t.Errorf("Complete of running key %s after the purge: %v", c.Key, err)
		}
		mustBeWritten(t, b, "w-"+c.Key, true)
	}
}

// testPurgeNothing checks that a limit of zero or less deletes nothing,
// and that a key without retention is never purged.
func testPurgeNothing(t *testing.T, b Backend) {
	forever := claim(t, b.Store, request("cli_a", "forever", "a"), idempotency.Claimed).Claim
	if err := complete(t, b, forever, created("forever")); err != nil {
		t.Fatal(err)
	}
	expired := claim(t, b.Store, withRetention(request("cli_a", "expired", "a")), idempotency.Claimed).Claim
	if err := complete(t, b, expired, created("expired")); err != nil {
		t.Fatal(err)
	}
	elapse(t, b, pause)
	purge(t, b.Store, 0, 0)
	purge(t, b.Store, -1, 0)
	purge(t, b.Store, 10, 1)
	purge(t, b.Store, 10, 0)
	if st := status(t, b.Store, request("cli_a", "forever", "a")); st != idempotency.StatusCompleted {
		t.Errorf("key without retention after purges: status %q, want completed", st)
	}
}
