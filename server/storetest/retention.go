package storetest

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

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

// release releases c as kind.
func release(t *testing.T, s idempotency.Store, c idempotency.Claim, kind idempotency.ReleaseKind) {
	t.Helper()
	if err := s.Release(context.Background(), c, kind); err != nil {
		t.Fatalf("Release(%s): %v", c.Key, err)
	}
}

// testRetentionCompleted completes a key and waits past its retention: the
// key is absent although nothing purged it, whatever the retention of the
// request that finds it, and a new operation starts.
func testRetentionCompleted(t *testing.T, b Backend) {
	judged(t, func(key string) bool {
		req := withRetention(request("cli_a", key, "a"))
		first := claim(t, b.Store, req, idempotency.Claimed).Claim
		start := time.Now()
		if err := complete(t, b, first, created("ord_1"), key+"-w1"); err != nil {
			t.Fatal(err)
		}
		res := try(t, b.Store, req)
		if !before(start, retention) {
			return false
		}
		if res.Outcome != idempotency.Exists || res.Record.Status != idempotency.StatusCompleted {
			t.Fatalf("completed key within its retention: %s (record %+v), want Exists, completed", res.Outcome, res.Record)
		}
		time.Sleep(pause)

		// Expired, also for a request that asks for no retention: the
		// retention stored with the key decides.
		second := claim(t, b.Store, request("cli_a", key, "a"), idempotency.Claimed).Claim
		if second.OperationID != first.OperationID || second.Token == first.Token {
			t.Errorf("claim after expiry %+v reuses the first claim's operation or token %+v", second, first)
		}
		if rec := claim(t, b.Store, req, idempotency.Exists).Record; rec.Status != idempotency.StatusStarted || rec.Response != nil {
			t.Errorf("key used again: %+v, want started without the old response", rec)
		}
		// The new operation makes its own writes; the first one's stay.
		if err := complete(t, b, second, created("ord_2"), key+"-w2"); err != nil {
			t.Errorf("Complete of the new operation: %v", err)
		}
		mustBeWritten(t, b, key+"-w1", true)
		mustBeWritten(t, b, key+"-w2", true)
		return true
	})
}

// testRetentionFromCompletion runs a request, under a live lease, for
// longer than its retention before it completes: the key does not expire
// while it runs, and expires its retention after the completion, not
// after the claim.
func testRetentionFromCompletion(t *testing.T, b Backend) {
	judged(t, func(key string) bool {
		req := with(request("cli_a", key, "a"), long, retention)
		first := claim(t, b.Store, req, idempotency.Claimed).Claim
		time.Sleep(pause) // older than its retention, and running
		if rec := claim(t, b.Store, request("cli_a", key, "b"), idempotency.Exists).Record; rec.Status != idempotency.StatusStarted {
			t.Fatalf("running key past its retention, another request: status %q, want started", rec.Status)
		}
		if st := status(t, b.Store, req); st != idempotency.StatusStarted {
			t.Fatalf("running key past its retention: status %q, want started", st)
		}
		start := time.Now()
		if err := complete(t, b, first, created("ord_1")); err != nil {
			t.Fatalf("Complete of a claim older than its retention: %v", err)
		}
		res := try(t, b.Store, req)
		if !before(start, retention) {
			return false
		}
		if res.Outcome != idempotency.Exists || res.Record.Status != idempotency.StatusCompleted {
			t.Fatalf("key completed less than its retention ago: %s (record %+v), want Exists, completed", res.Outcome, res.Record)
		}
		began := begunAt(t, b, req)
		time.Sleep(pause)
		claim(t, b.Store, req, idempotency.Claimed)
		if !begunAt(t, b, req).After(began) {
			t.Errorf("key past its retention after completion kept its operation")
		}
		return true
	})
}

// testRetentionStarted abandons a started key (its owner died): it is taken
// over while its lease has run out, and expires its retention after the
// lease ran out; then even another request claims it, as a new operation,
// and the dead owner is fenced.
func testRetentionStarted(t *testing.T, b Backend) {
	judged(t, func(key string) bool {
		req := withRetention(withLockTimeout(request("cli_a", key, "a")))
		other := withRetention(withLockTimeout(request("cli_a", key, "b")))
		start := time.Now()
		first := claim(t, b.Store, req, idempotency.Claimed).Claim
		time.Sleep(pause) // past the lease
		res := try(t, b.Store, other)
		if !before(start, lockTimeout+retention) {
			return false
		}
		if res.Outcome != idempotency.Exists || res.Record.Status != idempotency.StatusStarted || !bytes.Equal(res.Record.Fingerprint, fingerprint("a")) {
			t.Fatalf("another request on an abandoned key within its retention: %s (record %+v), want Exists, request a's started key", res.Outcome, res.Record)
		}
		time.Sleep(pause) // past the lease and the retention after it
		second := claim(t, b.Store, other, idempotency.Claimed).Claim
		if second.OperationID == first.OperationID {
			t.Errorf("expired key kept its operation %q", first.OperationID)
		}
		if rec := peek(t, b.Store, other); !bytes.Equal(rec.Fingerprint, fingerprint("b")) {
			t.Errorf("key used again has fingerprint %x, want the new request's", rec.Fingerprint)
		}
		mustFence(t, "Complete of the expired claim", complete(t, b, first, created("ord_1"), key+"-w"))
		mustBeWritten(t, b, key+"-w", false)
		return true
	})
}

// testRetentionReleased releases a key that ran for longer than its
// retention: the retry resumes it (its retention counts from the release),
// and a retention after the release even the same request is a new
// operation.
func testRetentionReleased(t *testing.T, b Backend) {
	judged(t, func(key string) bool {
		req := withRetention(request("cli_a", key, "a")) // no lease: never taken over
		first := claim(t, b.Store, req, idempotency.Claimed).Claim
		time.Sleep(pause) // older than its retention, and running
		start := time.Now()
		release(t, b.Store, first, idempotency.ReleaseFailed)
		res := try(t, b.Store, req)
		if !before(start, retention) {
			return false
		}
		if res.Outcome != idempotency.Claimed || res.Claim.OperationID != first.OperationID || !res.Claim.Resumed {
			t.Fatalf("retry of a key released less than its retention ago: %s, operation %q, resumed %v; want Claimed, the released %q, resumed",
				res.Outcome, res.Claim.OperationID, res.Claim.Resumed, first.OperationID)
		}
		release(t, b.Store, res.Claim, idempotency.ReleaseFailed)
		began := begunAt(t, b, req)
		time.Sleep(pause)
		if claim(t, b.Store, req, idempotency.Claimed).Claim.Resumed {
			t.Errorf("claim of an expired released key reads as resumed, want a new operation")
		}
		if !begunAt(t, b, req).After(began) {
			t.Errorf("expired released key kept its operation %q", first.OperationID)
		}
		return true
	})
}

// testRetentionResumed resumes a released key and keeps the resumed
// request running for longer than the retention (the double-charge of a
// retry that straddles the retention): the key does not expire while it
// runs, neither for the same request nor for another, and the purge spares
// it.
func testRetentionResumed(t *testing.T, b Backend) {
	judged(t, func(key string) bool {
		req := with(request("cli_a", key, "a"), long, retention)
		first := claim(t, b.Store, req, idempotency.Claimed).Claim
		release(t, b.Store, first, idempotency.ReleaseFailed)
		resumed := claim(t, b.Store, req, idempotency.Claimed).Claim
		if resumed.OperationID != first.OperationID {
			t.Fatalf("resume: operation %q, want %q", resumed.OperationID, first.OperationID)
		}
		time.Sleep(pause) // past the release's retention, while the retry runs
		for _, body := range []string{"a", "b"} {
			if rec := claim(t, b.Store, request("cli_a", key, body), idempotency.Exists).Record; rec.Status != idempotency.StatusStarted {
				t.Fatalf("request %s on a resumed key running past the retention: status %q, want started", body, rec.Status)
			}
		}
		purge(t, b.Store, 100, 0)
		start := time.Now()
		if err := complete(t, b, resumed, created("ord_1"), key+"-w"); err != nil {
			t.Fatalf("Complete of the resumed claim: %v", err)
		}
		res := try(t, b.Store, req)
		if !before(start, retention) {
			return false
		}
		if res.Outcome != idempotency.Exists || res.Record.Status != idempotency.StatusCompleted {
			t.Fatalf("resumed key just completed: %s (record %+v), want Exists, completed", res.Outcome, res.Record)
		}
		mustBeWritten(t, b, key+"-w", true)
		return true
	})
}

// testRetentionRenewed renews a started key with a short lease and a short
// retention for longer than both: however old, it never expires and the
// purge spares it, while its unrenewed twin expires and is purged.
func testRetentionRenewed(t *testing.T, b Backend) {
	ctx := context.Background()
	judged(t, func(key string) bool {
		renewedReq := withRetention(withLockTimeout(request("cli_a", key+"-renewed", "a")))
		idleReq := withRetention(withLockTimeout(request("cli_a", key+"-idle", "a")))
		last := time.Now()
		renewed := claim(t, b.Store, renewedReq, idempotency.Claimed).Claim
		claim(t, b.Store, idleReq, idempotency.Claimed)
		onTime := true
		for end := time.Now().Add(2 * pause); time.Now().Before(end); {
			time.Sleep(lockTimeout / 4)
			start := time.Now()
			if err := b.Store.Renew(ctx, renewed); err != nil {
				t.Fatalf("Renew of the live claim: %v", err)
			}
			onTime = onTime && before(last, lockTimeout)
			last = start
		}
		if _, err := b.Store.Purge(ctx, 100); err != nil {
			t.Fatalf("Purge: %v", err)
		}
		res := try(t, b.Store, request("cli_a", key+"-renewed", "b"))
		if !onTime || !before(last, lockTimeout) {
			return false
		}
		if res.Outcome != idempotency.Exists || res.Record.Status != idempotency.StatusStarted {
			t.Fatalf("renewed key, older than its lease and retention, after a purge: %s (record %+v), want Exists, started", res.Outcome, res.Record)
		}
		// Claimed, not TookOver: expired (its operation ID is derived, the same).
		claim(t, b.Store, idleReq, idempotency.Claimed)
		if err := complete(t, b, renewed, created("ord_1"), key+"-w"); err != nil {
			t.Errorf("Complete of the renewed claim: %v", err)
		}
		mustBeWritten(t, b, key+"-w", true)
		return true
	})
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
	time.Sleep(pause)

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
	time.Sleep(2 * pause) // past every retention, and the dead key's lease with it

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
	judged(t, func(key string) bool {
		var old []idempotency.Claim
		for _, k := range []string{key + "-old-0", key + "-old-1"} {
			c := claim(t, b.Store, withRetention(request("cli_a", k, "a")), idempotency.Claimed).Claim
			release(t, b.Store, c, idempotency.ReleaseFailed)
			old = append(old, c)
		}
		time.Sleep(2 * pause)
		youngReq := withRetention(request("cli_a", key+"-young", "a"))
		young := claim(t, b.Store, youngReq, idempotency.Claimed).Claim
		start := time.Now()
		release(t, b.Store, young, idempotency.ReleaseFailed)
		n, err := b.Store.Purge(context.Background(), 10)
		if err != nil {
			t.Fatal(err)
		}
		res := try(t, b.Store, youngReq) // leaves the young key started, never expiring
		if !before(start, retention) {
			return false
		}
		if n != int64(len(old)) {
			t.Errorf("Purge(10) = %d, want %d", n, len(old))
		}
		if res.Outcome != idempotency.Claimed || res.Claim.OperationID != young.OperationID {
			t.Errorf("young released key: %s, operation %q; want Claimed, %q (not purged)", res.Outcome, res.Claim.OperationID, young.OperationID)
		}
		for _, c := range old {
			claim(t, b.Store, request("cli_a", c.Key, "a"), idempotency.Claimed) // purged: counted above
		}
		return true
	})
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
	time.Sleep(pause)

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
	time.Sleep(pause)
	purge(t, b.Store, 0, 0)
	purge(t, b.Store, -1, 0)
	purge(t, b.Store, 10, 1)
	purge(t, b.Store, 10, 0)
	if st := status(t, b.Store, request("cli_a", "forever", "a")); st != idempotency.StatusCompleted {
		t.Errorf("key without retention after purges: status %q, want completed", st)
	}
}
