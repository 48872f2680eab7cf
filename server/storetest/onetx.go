package storetest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// Claims in one transaction (idempotency.TxClaimer). For a store that
// offers them, Exercise runs the subtests below, and the subtests of
// bothModes again with every claim made in one transaction, under
// "OneTransaction/".

// oneTransactionTests are the subtests of claims in one transaction.
var oneTransactionTests = []struct {
	name string
	run  func(t *testing.T, b Backend)
}{
	{"ClaimHidesKeyUntilComplete", testOneTxClaim},
	{"ConcurrentClaimsBusyAtOnce", testOneTxConcurrent},
	{"RollbackLeavesNoKey", testOneTxRollback},
	{"ReleaseWithoutBegin", testOneTxRelease},
	{"FailedCompletionLeavesNoKey", testOneTxFailedCompletion},
	{"OwnCommitClaimRespectsHold", testOneTxFencedByOwnCommit},
	{"KeyWithRowClaimedInOwnCommit", testOneTxKeyWithRow},
	{"DoneContext", testOneTxDoneContext},
}

// bothModes names the subtests of Exercise that hold as they are when
// every claim asks for one transaction: those that complete or expire
// each key before they look at it again, and never release one.
var bothModes = []string{
	"CompleteStoresResponse",
	"WriteOutsideUnitOfWork",
	"FirstSentAbsent",
	"FirstSentExpired",
	"RetentionExpiresCompletedKey",
	"RetentionOfHeldUnitCountsFromCompletion",
	"PurgeNothing",
}

// oneTxStore claims every key with ClaimInTx.
type oneTxStore struct{ idempotency.TxClaimer }

func (s oneTxStore) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	return s.ClaimInTx(ctx, req)
}

// inTx returns s, a TxClaimer, with every claim made in one transaction.
func inTx(s idempotency.Store) idempotency.Store {
	return oneTxStore{s.(idempotency.TxClaimer)}
}

// exerciseOneTransaction runs the subtests of claims in one transaction,
// and those of tests named in bothModes with every claim in one
// transaction, when the store offers them (an idempotency.TxClaimer).
func exerciseOneTransaction(t *testing.T, newBackend func(t *testing.T) Backend, tests []struct {
	name string
	run  func(t *testing.T, b Backend)
}) {
	t.Run("OneTransaction", func(t *testing.T) {
		t.Parallel()
		if _, ok := newBackend(t).Store.(idempotency.TxClaimer); !ok {
			return
		}
		for _, tt := range oneTransactionTests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				tt.run(t, backendOf(t, newBackend))
			})
		}
		for _, tt := range tests {
			for _, name := range bothModes {
				if tt.name != name {
					continue
				}
				t.Run(tt.name, func(t *testing.T) {
					t.Parallel()
					b := backendOf(t, newBackend)
					b.Store = inTx(b.Store)
					tt.run(t, b)
				})
			}
		}
	})
}

// claimInTx claims req in one transaction, which the store must do.
func claimInTx(t *testing.T, b Backend, req idempotency.ClaimRequest) idempotency.Claim {
	t.Helper()
	c := claim(t, inTx(b.Store), req, idempotency.Claimed).Claim
	letGoAtEnd(t, b.Store, c)
	if !c.OneTransaction {
		t.Fatalf("ClaimInTx(%s, %s): the store claimed in a commit of its own", req.ClientID, req.Key)
	}
	return c
}

// answers is how long a claim that must not wait for another request may
// take before the suite calls it blocked: far above any claim's time, far
// below the length of a test.
const answers = 30 * time.Second

// claimAtOnce claims req and checks its outcome, failing (and not hanging)
// when the claim waits, as it would behind another transaction's row.
func claimAtOnce(t *testing.T, s idempotency.Store, req idempotency.ClaimRequest, want idempotency.Outcome) idempotency.ClaimResult {
	t.Helper()
	type result struct {
		res idempotency.ClaimResult
		err error
	}
	ch := make(chan result, 1)
	go func() {
		res, err := s.Claim(context.Background(), req)
		ch <- result{res, err}
	}()
	var r result
	select {
	case r = <-ch:
	case <-time.After(answers):
		t.Fatalf("Claim(%s, %s) still waits after %v: it must not wait for the transaction that holds the key", req.ClientID, req.Key, answers)
	}
	if r.err != nil {
		t.Fatalf("Claim(%s, %s): %v", req.ClientID, req.Key, r.err)
	}
	if r.res.Outcome != want {
		letGo(s, r.res)
		t.Fatalf("Claim(%s, %s) = %s (record %+v), want %s", req.ClientID, req.Key, r.res.Outcome, r.res.Record, want)
	}
	if want == idempotency.Claimed {
		letGoAtEnd(t, s, r.res.Claim)
	}
	return r.res
}

// letGoAtEnd releases c when the test ends, before its store's cleanup (a
// pool's Close waits for the connections of open units of work), in case
// the test failed before it completed or released c; it does nothing to a
// claim that is over.
func letGoAtEnd(t *testing.T, s idempotency.Store, c idempotency.Claim) {
	t.Cleanup(func() { _ = s.Release(context.Background(), c, idempotency.ReleaseRejected) })
}

// letGo releases the claim of a result that a failing test will not
// complete: one made in one transaction holds its unit of work (a
// connection of a store's pool, say) until it is released.
func letGo(s idempotency.Store, res idempotency.ClaimResult) {
	if res.Outcome == idempotency.Claimed || res.Outcome == idempotency.TookOver {
		_ = s.Release(context.Background(), res.Claim, idempotency.ReleaseRejected)
	}
}

// testOneTxClaim claims a key in one transaction and writes in its unit of
// work: while the unit is open, every other claim of the key in one
// transaction is Busy, at once, whatever its request; another client's
// key of the same name is its own. Complete commits the key, completed,
// with the writes: the retry replays it, another request finds it.
func testOneTxClaim(t *testing.T, b Backend) {
	ctx := context.Background()
	req := request("cli_a", "key-1", "a")
	c := claimInTx(t, b, req)
	if c.Token == 0 || c.OperationID == "" {
		t.Errorf("claim %+v: want a token and an operation", c)
	}
	tx, wctx := begin(t, b, c)
	if err := b.Write(wctx, "w1"); err != nil {
		t.Fatal(err)
	}
	claimAtOnce(t, inTx(b.Store), req, idempotency.Busy)
	claimAtOnce(t, inTx(b.Store), request("cli_a", "key-1", "b"), idempotency.Busy)
	// Another client's key of the same name is its own. It is released,
	// not completed, while the first is open: under SERIALIZABLE, two
	// transactions that each read the key table and then insert into it
	// may fail one another's commit (see pgstore), which a rollback
	// cannot.
	other := claimAtOnce(t, inTx(b.Store), request("cli_b", "key-1", "a"), idempotency.Claimed).Claim
	if other.OperationID == c.OperationID || other.Token == c.Token {
		t.Errorf("two clients' claims share an operation or a token: %+v and %+v", c, other)
	}
	release(t, b.Store, other, idempotency.ReleaseRejected)
	if err := b.Store.Renew(ctx, c); err != nil {
		t.Errorf("Renew of an open claim in one transaction: %v, want nil (no lease)", err)
	}
	mustBeWritten(t, b, "w1", false)

	if err := tx.Complete(ctx, created("ord_1")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	mustBeWritten(t, b, "w1", true)
	rec := claimAtOnce(t, inTx(b.Store), req, idempotency.Exists).Record
	if rec.Status != idempotency.StatusCompleted || rec.Response == nil || rec.Response.Status != 201 ||
		string(rec.Response.Body) != `{"id":"ord_1"}` || rec.CreatedAt.IsZero() {
		t.Errorf("replay of a key completed in one transaction: %+v", rec)
	}
	rec = claimAtOnce(t, inTx(b.Store), request("cli_a", "key-1", "b"), idempotency.Exists).Record
	if string(rec.Fingerprint) != string(fingerprint("a")) || rec.Method != "POST" || rec.Path != "/v1/orders" {
		t.Errorf("another request finds %+v, want the first request's fingerprint, method and path", rec)
	}
	claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Exists) // in a commit of its own too
	if err := b.Store.Release(ctx, c, idempotency.ReleaseFailed); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Release after Complete: %v, want ErrFenced", err)
	}
	if err := b.Store.Renew(ctx, c); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Renew after Complete: %v, want ErrFenced", err)
	}
}

// testOneTxConcurrent claims one absent key in one transaction from many
// goroutines at once: exactly one gets it, every other gets Busy; once it
// completes, every claim finds it.
func testOneTxConcurrent(t *testing.T, b Backend) {
	// Few enough that a store which let each claim hold its unit of work
	// (a connection of a pool of 8, say) fails here rather than waits.
	const n = 6
	req := request("cli_a", "key-1", "a")
	counts, results := raceClaims(t, inTx(b.Store), n, req)
	if counts[idempotency.Claimed] != 1 || counts[idempotency.Busy] != n-1 {
		for _, r := range results {
			letGo(b.Store, r)
		}
		t.Fatalf("%d concurrent claims in one transaction: %v; want 1 Claimed, %d Busy", n, counts, n-1)
	}
	for _, r := range results {
		if r.Outcome == idempotency.Claimed {
			if err := complete(t, b, r.Claim, created("ord_1"), "w"); err != nil {
				t.Fatal(err)
			}
		}
	}
	counts, _ = raceClaims(t, inTx(b.Store), n, req)
	if counts[idempotency.Exists] != n {
		t.Errorf("%d claims of the completed key: %v, want %d Exists", n, counts, n)
	}
	mustBeWritten(t, b, "w", true)
}

// testOneTxRollback rolls back the unit of work of a claim in one
// transaction: its writes and its key are gone. Another request claims the
// key as a new operation, and the rolled-back claim owns nothing: its
// release, renewal and completion are fenced.
func testOneTxRollback(t *testing.T, b Backend) {
	ctx := context.Background()
	c := claimInTx(t, b, request("cli_a", "key-1", "a"))
	tx, wctx := begin(t, b, c)
	if err := b.Write(wctx, "w_rolled_back"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("second Rollback: %v, want nil", err)
	}
	mustBeWritten(t, b, "w_rolled_back", false)
	if err := b.Store.Release(ctx, c, idempotency.ReleaseFailed); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Release after the rollback: %v, want ErrFenced", err)
	}
	if err := b.Store.Renew(ctx, c); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Renew after the rollback: %v, want ErrFenced", err)
	}
	if err := complete(t, b, c, created("ord_1")); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Complete of a new unit of work after the rollback: %v, want ErrFenced", err)
	}

	// Another request: nothing of the first is left, not even a failed
	// release that would refuse it.
	next := claimInTx(t, b, request("cli_a", "key-1", "b"))
	if next.OperationID == c.OperationID {
		t.Errorf("claim after the rollback resumed operation %s, want a new one", c.OperationID)
	}
	if err := complete(t, b, next, created("ord_2"), "w_next"); err != nil {
		t.Fatal(err)
	}
	mustBeWritten(t, b, "w_next", true)
}

// testOneTxRelease releases claims in one transaction, one before its unit
// of work began and one after writes in it: each key is gone at once, and
// its writes with it.
func testOneTxRelease(t *testing.T, b Backend) {
	ctx := context.Background()
	c := claimInTx(t, b, request("cli_a", "key-1", "a"))
	if err := b.Store.Release(ctx, c, idempotency.ReleaseFailed); err != nil {
		t.Fatalf("Release of an open claim in one transaction: %v", err)
	}
	if err := b.Store.Release(ctx, c, idempotency.ReleaseFailed); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("second Release: %v, want ErrFenced", err)
	}
	again := claimAtOnce(t, inTx(b.Store), request("cli_a", "key-1", "b"), idempotency.Claimed).Claim
	if again.OperationID == c.OperationID {
		t.Errorf("claim after the release resumed operation %s, want a new one", c.OperationID)
	}
	_, wctx := begin(t, b, again)
	if err := b.Write(wctx, "w_released"); err != nil {
		t.Fatal(err)
	}
	if err := b.Store.Release(ctx, again, idempotency.ReleaseRejected); err != nil {
		t.Fatalf("Release of a claim in one transaction whose unit of work began: %v", err)
	}
	mustBeWritten(t, b, "w_released", false)
	last := claimInTx(t, b, request("cli_a", "key-1", "a"))
	if err := complete(t, b, last, created("ord_1"), "w_last"); err != nil {
		t.Fatal(err)
	}
	mustBeWritten(t, b, "w_last", true)
	mustBeWritten(t, b, "w_released", false)
}

// testOneTxFailedCompletion fails completions of claims in one transaction:
// a write that failed (its name is taken), a status outside 100 to 599, a
// header that is not text. Each leaves no key and none of its writes, and
// the retry claims the key at once and completes it.
func testOneTxFailedCompletion(t *testing.T, b Backend) {
	ctx := context.Background()
	taken := claimInTx(t, b, request("cli_a", "taken", "a"))
	if err := complete(t, b, taken, created("ord_0"), "w_taken"); err != nil {
		t.Fatal(err)
	}
	for i, fail := range []struct {
		resp  idempotency.StoredResponse
		write string
		is    error
	}{
		{created("ord_1"), "w_taken", nil},
		{idempotency.StoredResponse{Status: 600}, "", idempotency.ErrInvalidStatus},
		{idempotency.StoredResponse{Status: 201, Header: map[string]string{"Location": "/\x00"}}, "", idempotency.ErrInvalidText},
	} {
		key := fmt.Sprintf("key-%d", i)
		req := request("cli_a", key, "a")
		c := claimInTx(t, b, req)
		tx, wctx := begin(t, b, c)
		if err := b.Write(wctx, key+"-w"); err != nil {
			t.Fatal(err)
		}
		if fail.write != "" {
			t.Logf("Write of a taken name: %v", b.Write(wctx, fail.write))
		}
		err := tx.Complete(ctx, fail.resp)
		switch {
		case err == nil, errors.Is(err, idempotency.ErrFenced):
			t.Errorf("%s: Complete of a failing unit of work: %v, want an error other than ErrFenced", key, err)
		case fail.is != nil && !errors.Is(err, fail.is):
			t.Errorf("%s: Complete: %v, want an error wrapping %v", key, err, fail.is)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Errorf("Rollback after a failed Complete: %v", err)
		}
		mustBeWritten(t, b, key+"-w", false)
		retry := claimAtOnce(t, inTx(b.Store), req, idempotency.Claimed).Claim
		// Nothing of the failed one is left, but the same request
		// derives the same operation ID: a downstream keyed by it
		// finds whatever the failed one did there.
		if retry.OperationID != c.OperationID {
			t.Errorf("%s: the retry began operation %s, want the failed one's %s again", key, retry.OperationID, c.OperationID)
		}
		if err := complete(t, b, retry, created(key), key+"-w2"); err != nil {
			t.Fatalf("%s: Complete of the retry: %v", key, err)
		}
		mustBeWritten(t, b, key+"-w2", true)
	}
}

// testOneTxFencedByOwnCommit claims a key in a commit of its own (a route
// without the mode, a replica of a rolling deploy that turns it on) while
// a claim of it in one transaction is open: the claim in its own commit
// respects the hold and gets Busy at once, whatever its request, so two
// handlers never run one key at once; once the claim in one transaction
// completed, it finds the key (a replay). (A claim that raced the hold,
// committing its key between the one-transaction claim's snapshot and its
// lock, fences that claim's completion: see pgstore's fence tests.)
func testOneTxFencedByOwnCommit(t *testing.T, b Backend) {
	ctx := context.Background()
	req := request("cli_a", "key-1", "a")
	inTx := claimInTx(t, b, req)
	tx, wctx := begin(t, b, inTx)
	if err := b.Write(wctx, "w_in_tx"); err != nil {
		t.Fatal(err)
	}
	claimAtOnce(t, b.Store, req, idempotency.Busy)
	claimAtOnce(t, b.Store, request("cli_a", "key-1", "b"), idempotency.Busy)
	claimAtOnce(t, b.Store, withLockTimeout(req), idempotency.Busy)
	if err := tx.Complete(ctx, created("ord_1")); err != nil {
		t.Fatalf("Complete in one transaction, its hold respected: %v", err)
	}
	mustBeWritten(t, b, "w_in_tx", true)
	if rec := claim(t, b.Store, req, idempotency.Exists).Record; rec.Status != idempotency.StatusCompleted {
		t.Errorf("key after the completion in one transaction: %+v, want completed", rec)
	}
}

// testOneTxKeyWithRow claims in one transaction keys that have a row:
// started in a commit of its own (Exists), completed (Exists, replayed or
// mismatched), released (resumed in a commit of its own, same operation),
// expired (a new operation in a commit of its own). None is Busy, and none
// waits.
func testOneTxKeyWithRow(t *testing.T, b Backend) {
	running := request("cli_a", "running", "a")
	claim(t, b.Store, withLockTimeout(running), idempotency.Claimed)
	if rec := claimAtOnce(t, inTx(b.Store), running, idempotency.Exists).Record; rec.Status != idempotency.StatusStarted {
		t.Errorf("started key: %+v", rec)
	}

	done := request("cli_a", "done", "a")
	c := claim(t, b.Store, done, idempotency.Claimed).Claim
	if err := complete(t, b, c, created("o1")); err != nil {
		t.Fatal(err)
	}
	if rec := claimAtOnce(t, inTx(b.Store), done, idempotency.Exists).Record; rec.Response == nil {
		t.Errorf("completed key: %+v, want its response", rec)
	}
	if rec := claimAtOnce(t, inTx(b.Store), request("cli_a", "done", "b"), idempotency.Exists).Record; string(rec.Fingerprint) != string(fingerprint("a")) {
		t.Errorf("completed key, another request: %+v", rec)
	}

	released := request("cli_a", "released", "a")
	c = claim(t, b.Store, released, idempotency.Claimed).Claim
	release(t, b.Store, c, idempotency.ReleaseFailed)
	resumed := claimAtOnce(t, inTx(b.Store), released, idempotency.Claimed).Claim
	if resumed.OperationID != c.OperationID || resumed.OneTransaction {
		t.Errorf("released key claimed in one transaction: %+v, want operation %s resumed in a commit of its own", resumed, c.OperationID)
	}
	if err := complete(t, b, resumed, created("o2"), "w_resumed"); err != nil {
		t.Fatal(err)
	}
	mustBeWritten(t, b, "w_resumed", true)

	expiring := withRetention(request("cli_a", "expired", "a"))
	c = claimInTx(t, b, expiring)
	if err := complete(t, b, c, created("o3")); err != nil {
		t.Fatal(err)
	}
	elapse(t, b, pause)
	again := claimAtOnce(t, inTx(b.Store), expiring, idempotency.Claimed).Claim
	if again.OneTransaction {
		t.Errorf("expired key claimed in one transaction: %+v, want a new operation in a commit of its own", again)
	}
	release(t, b.Store, again, idempotency.ReleaseRejected)
}

// testOneTxDoneContext claims and completes in one transaction with a
// context that is already done: each returns the context's error; the
// completion ends the unit of work with nothing committed, key included.
func testOneTxDoneContext(t *testing.T, b Backend) {
	ctx := context.Background()
	done, cancel := context.WithCancel(ctx)
	cancel()
	req := request("cli_a", "key", "a")
	if _, err := inTx(b.Store).Claim(done, req); !errors.Is(err, context.Canceled) {
		t.Errorf("Claim with a done context: %v, want context.Canceled", err)
	}
	c := claimInTx(t, b, req)
	tx, wctx := begin(t, b, c)
	if err := b.Write(wctx, "w"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(done, created("o1")); !errors.Is(err, context.Canceled) {
		t.Errorf("Complete with a done context: %v, want context.Canceled", err)
	}
	mustBeWritten(t, b, "w", false)
	retry := claimAtOnce(t, inTx(b.Store), req, idempotency.Claimed).Claim
	if err := complete(t, b, retry, created("o1"), "w2"); err != nil {
		t.Fatal(err)
	}
	mustBeWritten(t, b, "w2", true)
}
