package storetest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// ExerciseSweeper runs the conformance suite of [idempotency.Sweepable]
// through an [idempotency.Sweeper], for a store that implements it (the
// suite fails at once on one that does not). newBackend is as for
// [Exercise], its store ready to be swept (pgstore's and sqlstore's after
// their CreateOpenKeysIndex). The subtests run in parallel.
func ExerciseSweeper(t *testing.T, newBackend func(t *testing.T) Backend) {
	tests := []struct {
		name string
		run  func(t *testing.T, b Backend)
	}{
		{"CompletesLapsedKey", testSweepCompletes},
		{"ReleasesReleasedAfterFailure", testSweepReleases},
		{"LeavesKeyForNextPass", testSweepLeaves},
		{"GraceCountsFromLapse", testSweepGrace},
		{"LateRetryRace", testSweepRetryRace},
		{"FencedByRetry", testSweepFenced},
		{"TwoSweepersRace", testSweepersRace},
		{"AdoptChecksAgain", testAdoptChecksAgain},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := backendOf(t, newBackend)
			if _, ok := b.Store.(idempotency.Sweepable); !ok {
				t.Fatalf("%T does not implement idempotency.Sweepable", b.Store)
			}
			tt.run(t, b)
		})
	}
}

// graceNow is a grace any key abandoned before the sweep has served.
const graceNow = time.Nanosecond

// sweeper returns a sweeper of b's store with settle, graceNow and a lease
// no test outlives.
func sweeper(b Backend, settle idempotency.SweepFunc) *idempotency.Sweeper {
	return &idempotency.Sweeper{Store: b.Store, Settle: settle, Grace: graceNow, LockTimeout: long,
		Logger: slog.New(slog.DiscardHandler)}
}

// sweep runs one pass and checks what it did.
func sweep(t *testing.T, s *idempotency.Sweeper, want idempotency.SweepResult) {
	t.Helper()
	got, err := s.Sweep(context.Background())
	if err != nil {
		t.Fatalf("Sweep: %v", err)
	}
	if got != want {
		t.Fatalf("Sweep = %+v, want %+v", got, want)
	}
}

// settleWith returns a hook that writes name in the key's unit of work and
// completes the key with resp; it records the keys it was handed.
func settleWith(b Backend, name string, resp idempotency.StoredResponse, seen *[]idempotency.KeyInfo) idempotency.SweepFunc {
	var mu sync.Mutex
	return func(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
		mu.Lock()
		*seen = append(*seen, k)
		mu.Unlock()
		if err := b.Write(ctx, name); err != nil {
			return idempotency.Settlement{}, err
		}
		return idempotency.Settlement{Response: &resp}, nil
	}
}

// released claims req, which must be new or free, and releases it as kind,
// as a request that failed (ReleaseFailed) or was rejected does.
func released(t *testing.T, s idempotency.Store, req idempotency.ClaimRequest, kind idempotency.ReleaseKind) idempotency.Claim {
	t.Helper()
	c := claim(t, s, req, idempotency.Claimed).Claim
	if err := s.Release(context.Background(), c, kind); err != nil {
		t.Fatalf("Release(%s, %s): %v", req.ClientID, req.Key, err)
	}
	return c
}

// lapsed claims req, with the suite's lock timeout, and ages it until its
// lease ran out, as after a crash of its owner.
func lapsed(t *testing.T, b Backend, req idempotency.ClaimRequest) idempotency.Claim {
	t.Helper()
	c := claim(t, b.Store, withLockTimeout(req), idempotency.Claimed).Claim
	elapse(t, b, pause)
	return c
}

// testSweepCompletes: a key whose owner died is handed to the hook with
// what the application needs, under a new claim of the same operation;
// the hook's writes commit with its response, the retry gets the replay,
// and the dead owner is fenced. Live, completed and rejected keys are not
// swept.
func testSweepCompletes(t *testing.T, b Backend) {
	req := with(request("c", "k", "a"), 0, long)
	dead := lapsed(t, b, req)
	claim(t, b.Store, with(request("c", "live", "a"), long, long), idempotency.Claimed)
	done := claim(t, b.Store, request("c", "done", "a"), idempotency.Claimed).Claim
	if err := complete(t, b, done, created("done")); err != nil {
		t.Fatal(err)
	}
	released(t, b.Store, request("c", "rejected", "a"), idempotency.ReleaseRejected)

	var inHook idempotency.Claim
	var client string
	s := sweeper(b, func(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
		inHook, _ = idempotency.ClaimFromContext(ctx)
		client, _ = idempotency.ClientIDFromContext(ctx)
		if k.ClientID != "c" || k.Key != "k" || k.Method != "POST" || k.Path != "/v1/orders" ||
			k.OperationID != dead.OperationID || k.Status != idempotency.StatusStarted || !k.Lapsed ||
			k.CreatedAt.IsZero() || k.LockedAt.IsZero() {
			return idempotency.Settlement{}, fmt.Errorf("hook handed %+v, want the lapsed key c/k of operation %s", k, dead.OperationID)
		}
		if err := b.Write(ctx, "swept"); err != nil {
			return idempotency.Settlement{}, err
		}
		resp := created("swept")
		return idempotency.Settlement{Response: &resp}, nil
	})
	sweep(t, s, idempotency.SweepResult{Found: 1, Completed: 1})
	if inHook.OperationID != dead.OperationID || inHook.Token == dead.Token || client != "c" {
		t.Errorf("the hook's context holds claim %+v and client %q; want operation %s under a new token (not %d), client c",
			inHook, client, dead.OperationID, dead.Token)
	}
	mustBeWritten(t, b, "swept", true)
	rec := claim(t, b.Store, req, idempotency.Exists).Record
	if rec.Status != idempotency.StatusCompleted || rec.Response == nil || string(rec.Response.Body) != `{"id":"swept"}` {
		t.Errorf("the retry after the sweep found %+v, want the hook's response", rec)
	}
	mustFence(t, "the dead owner's completion", complete(t, b, dead, created("late"), "late"))
	mustBeWritten(t, b, "late", false)
	sweep(t, s, idempotency.SweepResult{})
}

// testSweepReleases: a key released after a failure is swept; one released
// as rejected is not. The hook's release frees the key as rejected: no
// later sweep takes it, and the retry of its request resumes its
// operation.
func testSweepReleases(t *testing.T, b Backend) {
	req := with(request("c", "failed", "a"), long, long)
	c := released(t, b.Store, req, idempotency.ReleaseFailed)
	released(t, b.Store, request("c", "rejected", "a"), idempotency.ReleaseRejected)
	elapse(t, b, time.Second) // past graceNow

	var seen []idempotency.KeyInfo
	s := sweeper(b, func(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
		seen = append(seen, k)
		if err := b.Write(ctx, "dropped"); err != nil {
			return idempotency.Settlement{}, err
		}
		return idempotency.Settlement{Release: true}, nil
	})
	sweep(t, s, idempotency.SweepResult{Found: 1, Released: 1})
	if len(seen) != 1 || seen[0].Key != "failed" || seen[0].Status != idempotency.StatusReleased ||
		seen[0].ReleaseKind != idempotency.ReleaseFailed || seen[0].OperationID != c.OperationID {
		t.Errorf("hook handed %+v, want only the key released as failed", seen)
	}
	mustBeWritten(t, b, "dropped", false)
	sweep(t, s, idempotency.SweepResult{})
	if again := claim(t, b.Store, req, idempotency.Claimed).Claim; again.OperationID != c.OperationID {
		t.Errorf("the retry after the sweep's release claimed operation %s, want %s (resumed)", again.OperationID, c.OperationID)
	}
}

// testSweepLeaves: a hook that leaves the key (the zero Settlement, an
// error, a panic) writes nothing; the key stays the operation's, found
// again by the next pass after the grace, and claimed by the retry of its
// request under the same operation.
func testSweepLeaves(t *testing.T, b Backend) {
	req := with(request("c", "k", "a"), 0, long)
	dead := lapsed(t, b, req)
	leave := []func() (idempotency.Settlement, error){
		func() (idempotency.Settlement, error) { return idempotency.Settlement{}, nil },
		func() (idempotency.Settlement, error) {
			return idempotency.Settlement{}, errors.New("processor unreachable")
		},
		func() (idempotency.Settlement, error) { panic("a bug in the hook") },
		func() (idempotency.Settlement, error) {
			resp := created("both")
			return idempotency.Settlement{Response: &resp, Release: true}, nil
		},
	}
	for i, how := range leave {
		name := fmt.Sprintf("left-%d", i)
		var ops []string
		s := sweeper(b, func(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
			ops = append(ops, k.OperationID)
			if err := b.Write(ctx, name); err != nil {
				return idempotency.Settlement{}, err
			}
			return how()
		})
		elapse(t, b, time.Second) // past graceNow since the last release
		sweep(t, s, idempotency.SweepResult{Found: 1, Left: 1})
		if len(ops) != 1 || ops[0] != dead.OperationID {
			t.Errorf("pass %d handed operations %v, want [%s]", i, ops, dead.OperationID)
		}
		mustBeWritten(t, b, name, false)
		s.Grace = long
		sweep(t, s, idempotency.SweepResult{}) // just released: within any real grace
	}
	if st := peek(t, b.Store, req).Status; st != idempotency.StatusReleased {
		t.Errorf("a key left by the sweeper is %s, want released", st)
	}
	if again := claim(t, b.Store, req, idempotency.Claimed).Claim; again.OperationID != dead.OperationID {
		t.Errorf("the retry claimed operation %s, want %s (resumed)", again.OperationID, dead.OperationID)
	}
}

// testSweepGrace: a lapsed key is swept only once the grace has passed
// since its lease ran out, not since it was claimed; a key whose lease is
// live, or never runs out, is never swept.
func testSweepGrace(t *testing.T, b Backend) {
	var seen []idempotency.KeyInfo
	s := sweeper(b, settleWith(b, "never", created("x"), &seen))
	claim(t, b.Store, with(request("c", "live", "a"), long, long), idempotency.Claimed)
	claim(t, b.Store, with(request("c", "forever", "a"), 0, long), idempotency.Claimed)
	lapsed(t, b, with(request("c", "lapsed", "a"), 0, long))
	// Lapsed pause - lockTimeout ago, claimed pause ago: a grace between.
	s.Grace = pause - lockTimeout/2
	sweep(t, s, idempotency.SweepResult{})
	s.Grace = long
	sweep(t, s, idempotency.SweepResult{})
	if len(seen) != 0 {
		t.Errorf("hook handed %+v, want nothing", seen)
	}
}

// testSweepRetryRace: late retries race a sweeper for lapsed keys; for
// each key exactly one of them settles it, and the retry that loses sees
// the key started (its 409) or its outcome.
func testSweepRetryRace(t *testing.T, b Backend) {
	ctx := context.Background()
	const n = 16
	reqs := make([]idempotency.ClaimRequest, n)
	for i := range reqs {
		reqs[i] = withLockTimeout(with(request("c", fmt.Sprintf("k%d", i), "a"), 0, long))
		claim(t, b.Store, reqs[i], idempotency.Claimed)
	}
	elapse(t, b, pause)
	s := sweeper(b, func(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
		if err := b.Write(ctx, k.Key+"-sweep"); err != nil {
			return idempotency.Settlement{}, err
		}
		resp := created(k.Key + "-sweep")
		return idempotency.Settlement{Response: &resp}, nil
	})
	var wg sync.WaitGroup
	errs := make(chan error, n+1)
	wg.Go(func() {
		if _, err := s.Sweep(ctx); err != nil {
			errs <- err
		}
	})
	for i := range reqs {
		wg.Go(func() {
			res, err := b.Store.Claim(ctx, reqs[i])
			switch {
			case err != nil:
				errs <- err
			case res.Outcome == idempotency.TookOver:
				tx, err := b.Store.Begin(ctx, res.Claim)
				if err == nil {
					wctx := idempotency.NewContext(ctx, res.Claim, tx)
					if err = b.Write(wctx, reqs[i].Key+"-retry"); err == nil {
						err = tx.Complete(ctx, created(reqs[i].Key+"-retry"))
					}
				}
				if err != nil {
					errs <- fmt.Errorf("the retry of %s: %w", reqs[i].Key, err)
				}
			case res.Outcome != idempotency.Exists:
				errs <- fmt.Errorf("the retry of %s: %s, want took over or exists", reqs[i].Key, res.Outcome)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for _, req := range reqs {
		bySweep := written(t, b, req.Key+"-sweep")
		byRetry := written(t, b, req.Key+"-retry")
		if bySweep == byRetry {
			t.Errorf("key %s: written by the sweeper %v, by the retry %v; want exactly one", req.Key, bySweep, byRetry)
			continue
		}
		want := req.Key + "-retry"
		if bySweep {
			want = req.Key + "-sweep"
		}
		rec := claim(t, b.Store, req, idempotency.Exists).Record
		if rec.Status != idempotency.StatusCompleted || string(rec.Response.Body) != `{"id":"`+want+`"}` {
			t.Errorf("key %s: %s %+v, want completed by the one that wrote (%s)", req.Key, rec.Status, rec.Response, want)
		}
	}
}

// unrenewed is a store whose renewals do nothing, as when they stop
// reaching the store: a claim's lease runs out while its owner works.
type unrenewed struct {
	idempotency.Store
	idempotency.Sweepable
}

func (unrenewed) Renew(context.Context, idempotency.Claim) error { return nil }

// testSweepFenced: a retry that takes the key over from a sweeper whose
// lease ran out fences it: the hook's writes are rolled back, and the
// retry's outcome stands.
func testSweepFenced(t *testing.T, b Backend) {
	req := withLockTimeout(with(request("c", "k", "a"), 0, long))
	claim(t, b.Store, req, idempotency.Claimed)
	elapse(t, b, pause)
	s := sweeper(b, func(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
		elapse(t, b, pause) // the sweeper's lease runs out, unrenewed
		res := claim(t, b.Store, req, idempotency.TookOver)
		if err := complete(t, b, res.Claim, created("retry"), "retry"); err != nil {
			return idempotency.Settlement{}, err
		}
		if err := b.Write(ctx, "sweep"); err != nil {
			return idempotency.Settlement{}, err
		}
		resp := created("sweep")
		return idempotency.Settlement{Response: &resp}, nil
	})
	s.Store = unrenewed{b.Store, b.Store.(idempotency.Sweepable)}
	s.LockTimeout = lockTimeout
	sweep(t, s, idempotency.SweepResult{Found: 1, Lost: 1})
	mustBeWritten(t, b, "sweep", false)
	mustBeWritten(t, b, "retry", true)
	if rec := claim(t, b.Store, req, idempotency.Exists).Record; string(rec.Response.Body) != `{"id":"retry"}` {
		t.Errorf("the key holds %+v, want the retry's outcome", rec.Response)
	}
}

// testSweepersRace: two sweepers on one store take each abandoned key
// once between them: each key is handed to one hook, once.
func testSweepersRace(t *testing.T, b Backend) {
	const n = 16
	for i := range n {
		claim(t, b.Store, withLockTimeout(with(request("c", fmt.Sprintf("k%d", i), "a"), 0, long)), idempotency.Claimed)
	}
	elapse(t, b, pause)
	var mu sync.Mutex
	handed := make(map[string]int)
	settle := func(who string) idempotency.SweepFunc {
		return func(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
			mu.Lock()
			handed[k.Key]++
			mu.Unlock()
			if err := b.Write(ctx, k.Key+"-"+who); err != nil {
				return idempotency.Settlement{}, err
			}
			resp := created(k.Key)
			return idempotency.Settlement{Response: &resp}, nil
		}
	}
	var wg sync.WaitGroup
	var results [2]idempotency.SweepResult
	var errs [2]error
	for i, who := range []string{"one", "two"} {
		wg.Go(func() { results[i], errs[i] = sweeper(b, settle(who)).Sweep(context.Background()) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if done := results[0].Completed + results[1].Completed; done != n {
		t.Errorf("the sweepers completed %d keys (%+v, %+v), want %d", done, results[0], results[1], n)
	}
	for i := range n {
		key := fmt.Sprintf("k%d", i)
		if handed[key] != 1 {
			t.Errorf("key %s handed to a hook %d times, want once", key, handed[key])
		}
		if one, two := written(t, b, key+"-one"), written(t, b, key+"-two"); one == two {
			t.Errorf("key %s: written by one %v, by two %v; want exactly one", key, one, two)
		}
	}
}

// testAdoptChecksAgain: Adopt takes a key only if it is still as it was
// found and still abandoned: not after its owner renewed its lease, nor
// after a retry claimed it, nor within a longer grace; and then it keeps
// the key's operation under a new token.
func testAdoptChecksAgain(t *testing.T, b Backend) {
	ctx := context.Background()
	sw := b.Store.(idempotency.Sweepable)
	find := func(key string) idempotency.KeyInfo {
		t.Helper()
		ks, err := sw.Abandoned(ctx, graceNow, 100)
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range ks {
			if k.Key == key {
				return k
			}
		}
		t.Fatalf("Abandoned(%v) = %+v, without key %s", graceNow, ks, key)
		return idempotency.KeyInfo{}
	}
	owner := lapsed(t, b, request("c", "renewed", "a"))
	k := find("renewed")
	if err := b.Store.Renew(ctx, owner); err != nil {
		t.Fatalf("the lapsed owner's renewal: %v", err)
	}
	_, err := sw.Adopt(ctx, k, graceNow, long)
	mustFence(t, "Adopt of a key renewed since it was found", err)

	req := with(request("c", "retried", "a"), long, long)
	c := released(t, b.Store, req, idempotency.ReleaseFailed)
	elapse(t, b, time.Second)
	k = find("retried")
	_, err = sw.Adopt(ctx, k, long, long)
	mustFence(t, "Adopt within a longer grace", err)
	retry := released(t, b.Store, req, idempotency.ReleaseFailed)
	elapse(t, b, time.Second)
	_, err = sw.Adopt(ctx, k, graceNow, long)
	mustFence(t, "Adopt of a key claimed and released again since it was found", err)

	k = find("retried")
	adopted, err := sw.Adopt(ctx, k, graceNow, long)
	if err != nil || adopted.OperationID != c.OperationID || adopted.Token == k.Token {
		t.Fatalf("Adopt = %+v, %v; want operation %s under a new token", adopted, err, c.OperationID)
	}
	if st := status(t, b.Store, req); st != idempotency.StatusStarted {
		t.Errorf("an adopted key is %s, want started", st)
	}
	mustFence(t, "the retry's release after the adoption", b.Store.Release(ctx, retry, idempotency.ReleaseFailed))
	_, err = sw.Adopt(ctx, k, graceNow, long)
	mustFence(t, "a second Adopt", err)
}

// written reports whether the write named name is committed.
func written(t *testing.T, b Backend, name string) bool {
	t.Helper()
	ok, err := b.Written(context.Background(), name)
	if err != nil {
		t.Fatalf("Written(%s): %v", name, err)
	}
	return ok
}
