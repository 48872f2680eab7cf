package storetest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// ExerciseInspector runs the conformance suite of [idempotency.Inspector]
// for a store that implements it (the suite fails at once on one that
// does not). newBackend is as for [Exercise], its store ready to list and
// count keys (pgstore's and sqlstore's after their CreateOpenKeysIndex).
// The subtests run in parallel.
func ExerciseInspector(t *testing.T, newBackend func(t *testing.T) Backend) {
	tests := []struct {
		name string
		run  func(t *testing.T, b Backend, in idempotency.Inspector)
	}{
		{"LookupEveryStatus", testLookup},
		{"ListStuckAndReleased", testList},
		{"ForceRelease", testForceRelease},
		{"ForceReleaseRunningFencesOwner", testForceReleaseRunning},
		{"Expire", testExpire},
		{"ExpireRunningFencesOwner", testExpireRunning},
		{"ExpiredKeyKeptForRetries", testExpiredKeyKept},
		{"Stats", testStats},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := backendOf(t, newBackend)
			in, ok := b.Store.(idempotency.Inspector)
			if !ok {
				t.Fatalf("%T does not implement idempotency.Inspector", b.Store)
			}
			tt.run(t, b, in)
		})
	}
}

// lookup looks the key up, which must exist.
func lookup(t *testing.T, in idempotency.Inspector, client, key string, body bool) idempotency.KeyInfo {
	t.Helper()
	k, err := in.Lookup(context.Background(), client, key, body)
	if err != nil {
		t.Fatalf("Lookup(%s, %s): %v", client, key, err)
	}
	return k
}

// mustFail checks that err is want.
func mustFail(t *testing.T, what string, err, want error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Errorf("%s: %v, want %v", what, err, want)
	}
}

// testLookup: a key of each status shows what an operator needs, the
// stored body only when asked for; an absent key is ErrKeyNotFound.
func testLookup(t *testing.T, b Backend, in idempotency.Inspector) {
	ctx := context.Background()
	_, err := in.Lookup(ctx, "c", "absent", false)
	mustFail(t, "Lookup of an absent key", err, idempotency.ErrKeyNotFound)

	start := time.Now()
	c := claim(t, b.Store, with(request("c", "started", "a"), long, long), idempotency.Claimed).Claim
	k := lookup(t, in, "c", "started", false)
	if k.ClientID != "c" || k.Key != "started" || k.Method != "POST" || k.Path != "/v1/orders" ||
		k.Status != idempotency.StatusStarted || k.OperationID != c.OperationID || k.Token != c.Token ||
		k.Lease != long || k.Retention != long || !k.Running() || k.Lapsed || k.Expired ||
		k.CreatedAt.IsZero() || !k.LockedAt.Equal(k.CreatedAt) || !k.FinishedAt.IsZero() || k.Response != nil ||
		k.LeaseAge < 0 || k.LeaseAge > time.Since(start) {
		t.Errorf("started key: %+v", k)
	}

	done := claim(t, b.Store, with(request("c", "completed", "a"), long, long), idempotency.Claimed).Claim
	if err := complete(t, b, done, created("p1")); err != nil {
		t.Fatal(err)
	}
	k = lookup(t, in, "c", "completed", false)
	if k.Status != idempotency.StatusCompleted || k.Response == nil || k.Response.Status != 201 ||
		k.Response.ContentType != "application/json" || k.Response.Header["Location"] != "/v1/orders/p1" ||
		k.Response.Body != nil || k.Running() {
		t.Errorf("completed key without its body: %+v (response %+v)", k, k.Response)
	}
	if k.FinishedAt.Before(k.LockedAt) || !k.ExpiresAt.Equal(k.FinishedAt.Add(long)) {
		t.Errorf("completed key: locked at %v, finished at %v, expires at %v; want finished after locked, expiring its retention later",
			k.LockedAt, k.FinishedAt, k.ExpiresAt)
	}
	if k = lookup(t, in, "c", "completed", true); k.Response == nil || string(k.Response.Body) != `{"id":"p1"}` {
		t.Errorf("completed key with its body: %+v", k.Response)
	}

	for _, kind := range []idempotency.ReleaseKind{idempotency.ReleaseFailed, idempotency.ReleaseRejected} {
		key := "released-" + kind.String()
		r := released(t, b.Store, request("c", key, "a"), kind)
		if k = lookup(t, in, "c", key, false); k.Status != idempotency.StatusReleased || k.ReleaseKind != kind ||
			k.OperationID != r.OperationID || k.Running() || !k.ExpiresAt.IsZero() {
			t.Errorf("key released as %s, kept forever: %+v", kind, k)
		}
	}

	dead := lapsed(t, b, with(request("c", "lapsed", "a"), 0, long))
	if k = lookup(t, in, "c", "lapsed", false); !k.Lapsed || k.Running() || k.OperationID != dead.OperationID ||
		k.Lease != lockTimeout || k.LeaseAge < pause {
		t.Errorf("lapsed key: %+v", k)
	}

	gone := claim(t, b.Store, with(request("c", "expired", "a"), 0, retention), idempotency.Claimed).Claim
	if err := complete(t, b, gone, created("p2")); err != nil {
		t.Fatal(err)
	}
	elapse(t, b, pause)
	if k = lookup(t, in, "c", "expired", false); !k.Expired || k.Running() {
		t.Errorf("expired key, not purged yet: %+v", k)
	}
}

// testList: started keys past a threshold, and released keys, oldest
// first, by client; never completed or expired keys, never a body.
func testList(t *testing.T, b Backend, in idempotency.Inspector) {
	ctx := context.Background()
	list := func(f idempotency.ListFilter) []string {
		t.Helper()
		ks, err := in.List(ctx, f)
		if err != nil {
			t.Fatalf("List(%+v): %v", f, err)
		}
		var keys []string
		for _, k := range ks {
			if k.Response != nil {
				t.Errorf("List returned key %s with a response", k.Key)
			}
			keys = append(keys, k.ClientID+"/"+k.Key)
		}
		return keys
	}
	lapsed(t, b, with(request("c", "s1", "a"), 0, long))
	claim(t, b.Store, with(request("d", "s2", "a"), long, long), idempotency.Claimed)
	released(t, b.Store, with(request("c", "gone", "a"), 0, retention), idempotency.ReleaseFailed)
	elapse(t, b, pause)
	for _, kind := range []idempotency.ReleaseKind{idempotency.ReleaseFailed, idempotency.ReleaseRejected} {
		released(t, b.Store, request("c", "r-"+kind.String(), "a"), kind)
	}
	done := claim(t, b.Store, request("c", "done", "a"), idempotency.Claimed).Claim
	if err := complete(t, b, done, created("p")); err != nil {
		t.Fatal(err)
	}
	claim(t, b.Store, with(request("c", "s3", "a"), long, long), idempotency.Claimed)

	for _, tt := range []struct {
		f    idempotency.ListFilter
		want []string
	}{
		{idempotency.ListFilter{Status: idempotency.StatusStarted}, []string{"c/s1", "d/s2", "c/s3"}},
		{idempotency.ListFilter{Status: idempotency.StatusStarted, OlderThan: pause / 2}, []string{"c/s1", "d/s2"}},
		{idempotency.ListFilter{Status: idempotency.StatusStarted, OlderThan: long}, nil},
		{idempotency.ListFilter{Status: idempotency.StatusStarted, ClientID: "d"}, []string{"d/s2"}},
		{idempotency.ListFilter{Status: idempotency.StatusStarted, Limit: 1}, []string{"c/s1"}},
		{idempotency.ListFilter{Status: idempotency.StatusReleased}, []string{"c/r-failed", "c/r-rejected"}},
		{idempotency.ListFilter{Status: idempotency.StatusReleased, OlderThan: long}, nil},
		{idempotency.ListFilter{Status: idempotency.StatusCompleted}, nil},
	} {
		if got := list(tt.f); !slices.Equal(got, tt.want) {
			t.Errorf("List(%+v) = %v, want %v", tt.f, got, tt.want)
		}
	}
}

// testForceRelease: a lapsed key is released as failed without more ado,
// and its retry resumes its operation; a completed key is refused, an
// absent one not found, a released one left as it is.
func testForceRelease(t *testing.T, b Backend, in idempotency.Inspector) {
	ctx := context.Background()
	req := with(request("c", "lapsed", "a"), 0, long)
	dead := lapsed(t, b, req)
	was, err := in.ForceRelease(ctx, "c", "lapsed", false)
	if err != nil || was.Status != idempotency.StatusStarted || was.OperationID != dead.OperationID {
		t.Fatalf("ForceRelease of a lapsed key: %+v, %v; want it as it was, started", was, err)
	}
	if k := lookup(t, in, "c", "lapsed", false); k.Status != idempotency.StatusReleased || k.ReleaseKind != idempotency.ReleaseFailed {
		t.Errorf("after ForceRelease: %+v, want released as failed", k)
	}
	if again := claim(t, b.Store, req, idempotency.Claimed).Claim; again.OperationID != dead.OperationID {
		t.Errorf("the retry claimed operation %s, want %s (resumed)", again.OperationID, dead.OperationID)
	}

	done := claim(t, b.Store, request("c", "done", "a"), idempotency.Claimed).Claim
	if err := complete(t, b, done, created("p")); err != nil {
		t.Fatal(err)
	}
	_, err = in.ForceRelease(ctx, "c", "done", true)
	mustFail(t, "ForceRelease of a completed key", err, idempotency.ErrKeyCompleted)
	if st := status(t, b.Store, request("c", "done", "a")); st != idempotency.StatusCompleted {
		t.Errorf("completed key is %s after a refused release", st)
	}
	_, err = in.ForceRelease(ctx, "c", "absent", true)
	mustFail(t, "ForceRelease of an absent key", err, idempotency.ErrKeyNotFound)

	released(t, b.Store, request("c", "rejected", "a"), idempotency.ReleaseRejected)
	if was, err := in.ForceRelease(ctx, "c", "rejected", false); err != nil || was.Status != idempotency.StatusReleased {
		t.Errorf("ForceRelease of a released key: %+v, %v; want it, unchanged, and no error", was, err)
	}
	if k := lookup(t, in, "c", "rejected", false); k.ReleaseKind != idempotency.ReleaseRejected {
		t.Errorf("a released key was changed: %+v", k)
	}
}

// testForceReleaseRunning: a running key is released only when asked to
// be, and then its owner is fenced: it can neither renew nor complete,
// and its writes are rolled back.
func testForceReleaseRunning(t *testing.T, b Backend, in idempotency.Inspector) {
	ctx := context.Background()
	req := with(request("c", "k", "a"), long, long)
	owner := claim(t, b.Store, req, idempotency.Claimed).Claim
	_, err := in.ForceRelease(ctx, "c", "k", false)
	mustFail(t, "ForceRelease of a running key", err, idempotency.ErrKeyRunning)
	if err := b.Store.Renew(ctx, owner); err != nil {
		t.Fatalf("the owner's renewal after a refused release: %v", err)
	}
	tx, wctx := begin(t, b, owner)
	if err := b.Write(wctx, "owner"); err != nil {
		t.Fatal(err)
	}
	if was, err := in.ForceRelease(ctx, "c", "k", true); err != nil || !was.Running() {
		t.Fatalf("ForceRelease of a running key, asked to: %+v, %v", was, err)
	}
	mustFence(t, "the owner's renewal", b.Store.Renew(ctx, owner))
	mustFence(t, "the owner's completion", tx.Complete(ctx, created("owner")))
	mustBeWritten(t, b, "owner", false)
	mustFence(t, "the owner's release", b.Store.Release(ctx, owner, idempotency.ReleaseFailed))
	if again := claim(t, b.Store, req, idempotency.Claimed).Claim; again.OperationID != owner.OperationID {
		t.Errorf("the retry claimed operation %s, want %s (resumed)", again.OperationID, owner.OperationID)
	}
}

// testExpire: an expired key counts as absent at once, also one kept
// forever: its next request is a new operation. The purge deletes at once
// a key kept forever, and keeps one with a retention (see
// testExpiredKeyKept).
func testExpire(t *testing.T, b Backend, in idempotency.Inspector) {
	ctx := context.Background()
	for _, keep := range []time.Duration{long, 0} {
		key := "kept-" + keep.String()
		req := with(request("c", key, "a"), long, keep)
		done := claim(t, b.Store, req, idempotency.Claimed).Claim
		if err := complete(t, b, done, created("p")); err != nil {
			t.Fatal(err)
		}
		if was, err := in.Expire(ctx, "c", key, false); err != nil || was.Status != idempotency.StatusCompleted {
			t.Fatalf("Expire of a completed key: %+v, %v", was, err)
		}
		if k := lookup(t, in, "c", key, false); !k.Expired {
			t.Errorf("key %s after Expire: %+v, want expired", key, k)
		}
		_, err := in.Expire(ctx, "c", key, false)
		mustFail(t, "Expire of an expired key", err, idempotency.ErrKeyNotFound)
		_, err = in.ForceRelease(ctx, "c", key, false)
		mustFail(t, "ForceRelease of an expired key", err, idempotency.ErrKeyNotFound)
		if keep == 0 {
			purge(t, b.Store, 10, 1)
		} else {
			purge(t, b.Store, 10, 0)
		}
		// A new operation, under the ID the same request derives again:
		// a downstream keyed by it finds the work of the expired one.
		if again := claim(t, b.Store, req, idempotency.Claimed).Claim; again.OperationID != done.OperationID {
			t.Errorf("the same request after Expire began operation %s, want %s again", again.OperationID, done.OperationID)
		}
	}
	_, err := in.Expire(ctx, "c", "absent", true)
	mustFail(t, "Expire of an absent key", err, idempotency.ErrKeyNotFound)
}

// testExpiredKeyKept: a key an operator expired, completed or running,
// is kept by the purge until its retention has passed since its operation
// began, so that a retry of the operation, first sent before it began, is
// refused after a purge too, running nothing and changing nothing (past
// that, the retry is older than the retention, and refused without the
// key); a new request, first sent after, claims the key at once, as a new
// operation.
func testExpiredKeyKept(t *testing.T, b Backend, in idempotency.Inspector) {
	ctx := context.Background()
	for _, running := range []bool{false, true} {
		key := fmt.Sprintf("running-%v", running)
		req := with(request("c", key, "a"), long, long)
		sent := time.Now() // the client's first send, before its operation began
		first := claim(t, b.Store, req, idempotency.Claimed).Claim
		if !running {
			if err := complete(t, b, first, created("o1"), key+"-1"); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := in.Expire(ctx, "c", key, running); err != nil {
			t.Fatalf("Expire: %v", err)
		}
		purge(t, b.Store, 10, 0)
		was := lookup(t, in, "c", key, false)
		if !was.Expired || was.OperationID != first.OperationID {
			t.Fatalf("key %s after Expire and a purge: %+v, want it kept, expired, with operation %s", key, was, first.OperationID)
		}

		// The retry of the operation: first sent before it began, the
		// allowance taken off (a minute, generous, keeps the machine's
		// pace out of it); and any request first sent longer ago than the
		// retention.
		retry := idempotency.FirstSentCheck{EarliestBegin: sent.Add(-time.Minute), Sent: sent.Truncate(time.Second)}
		claim(t, b.Store, withCheck(req, retry), idempotency.Refused)
		claim(t, b.Store, withCheck(req, staleCheck), idempotency.Refused)
		purge(t, b.Store, 10, 0)
		if k := lookup(t, in, "c", key, false); !k.Expired || k.Token != was.Token || k.Status != was.Status || !k.CreatedAt.Equal(was.CreatedAt) {
			t.Errorf("key %s after the refused retries: %+v, want it as it was: %+v", key, k, was)
		}
		mustBeWritten(t, b, key+"-1", !running)
		mustBeWritten(t, b, key+"-2", false)

		// A new request, first sent after the expired operation began:
		// a new operation, at once.
		later := time.Now().Add(time.Minute)
		next := claim(t, b.Store, withCheck(req, idempotency.FirstSentCheck{EarliestBegin: later, Sent: later}), idempotency.Claimed).Claim
		if next.OperationID == first.OperationID {
			t.Errorf("the new request resumed the expired operation %s", first.OperationID)
		}
		if err := complete(t, b, next, created("o2"), key+"-2"); err != nil {
			t.Fatal(err)
		}
		mustBeWritten(t, b, key+"-2", true)
		if k := lookup(t, in, "c", key, false); k.Expired || k.OperationID != next.OperationID {
			t.Errorf("key %s after the new request: %+v, want it live, operation %s", key, k, next.OperationID)
		}
	}
}

// testExpireRunning: a running key (also one whose lease never runs out)
// is expired only when asked to be, and then its owner is fenced.
func testExpireRunning(t *testing.T, b Backend, in idempotency.Inspector) {
	ctx := context.Background()
	for _, lease := range []time.Duration{long, 0} {
		key := "lease-" + lease.String()
		req := with(request("c", key, "a"), lease, long)
		owner := claim(t, b.Store, req, idempotency.Claimed).Claim
		_, err := in.Expire(ctx, "c", key, false)
		mustFail(t, "Expire of a running key", err, idempotency.ErrKeyRunning)
		if st := status(t, b.Store, req); st != idempotency.StatusStarted {
			t.Errorf("running key is %s after a refused expiry", st)
		}
		tx, wctx := begin(t, b, owner)
		if err := b.Write(wctx, key); err != nil {
			t.Fatal(err)
		}
		if _, err := in.Expire(ctx, "c", key, true); err != nil {
			t.Fatalf("Expire of a running key, asked to: %v", err)
		}
		mustFence(t, "the owner's renewal", b.Store.Renew(ctx, owner))
		mustFence(t, "the owner's completion", tx.Complete(ctx, created("owner")))
		mustBeWritten(t, b, key, false)
		if again := claim(t, b.Store, req, idempotency.Claimed).Claim; again.OperationID != owner.OperationID {
			t.Errorf("the same request after Expire began operation %s, want %s again", again.OperationID, owner.OperationID)
		}
	}
}

// testStats: running, lapsed and failed keys are counted; completed,
// rejected and expired ones are not.
func testStats(t *testing.T, b Backend, in idempotency.Inspector) {
	ctx := context.Background()
	start := time.Now()
	claim(t, b.Store, with(request("c", "running", "a"), long, long), idempotency.Claimed)
	lapsed(t, b, with(request("c", "lapsed", "a"), 0, long))
	for _, kind := range []idempotency.ReleaseKind{idempotency.ReleaseFailed, idempotency.ReleaseRejected} {
		released(t, b.Store, request("c", kind.String(), "a"), kind)
	}
	done := claim(t, b.Store, request("c", "done", "a"), idempotency.Claimed).Claim
	if err := complete(t, b, done, created("p")); err != nil {
		t.Fatal(err)
	}
	released(t, b.Store, with(request("c", "gone", "a"), 0, retention), idempotency.ReleaseFailed)
	elapse(t, b, pause)
	st, err := in.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The running key aged 2*pause: lapsed's pause, then this one.
	if st.Running != 1 || st.Lapsed != 1 || st.ReleasedFailed != 1 || st.OldestRunning < 2*pause ||
		st.OldestRunning > time.Since(start)+2*pause {
		t.Errorf("Stats = %+v, want 1 running (for at least %v), 1 lapsed, 1 released as failed", st, 2*pause)
	}
}
