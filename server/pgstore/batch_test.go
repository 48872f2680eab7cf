package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// batchHook is a pgx tracer that calls onBatch when a batch starts and
// onReleased when a release statement has ended, and counts the batches.
type batchHook struct {
	mu         sync.Mutex
	onBatch    func()
	onReleased func()
	batches    int
}

type releaseMark struct{}

func (h *batchHook) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.Contains(data.SQL, "SET status = 'released'") {
		return context.WithValue(ctx, releaseMark{}, true)
	}
	return ctx
}

func (h *batchHook) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	h.mu.Lock()
	f := h.onReleased
	h.mu.Unlock()
	if ctx.Value(releaseMark{}) != nil && f != nil {
		f()
	}
}

func (h *batchHook) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	h.mu.Lock()
	f := h.onBatch
	h.batches++
	h.mu.Unlock()
	if f != nil {
		f()
	}
	return ctx
}
func (h *batchHook) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (h *batchHook) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// batchStore returns a migrated Store with BatchClaims on a pool of
// conns connections traced by hook.
func batchStore(t *testing.T, hook *batchHook, conns int32) (*pgstore.Store, *pgxpool.Pool) {
	t.Helper()
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = conns
		cfg.ConnConfig.Tracer = hook
	})
	migrate(t, pool)
	s := pgstore.New(pool)
	s.BatchClaims = true
	return s, pool
}

func batchReq(key, body string) idempotency.ClaimRequest {
	return idempotency.ClaimRequest{ClientID: "cli_a", Key: key, Method: "POST", Path: "/v1/payments",
		Fingerprint: []byte(body), FingerprintVersion: 1}
}

// TestBatchClaimCallerGone cancels a caller's context while its
// claim is in a running batch: Claim returns the context's error at once,
// before the batch has ended, and the batch then releases the key it
// claimed for the caller as rejected, free for the next request, its own or
// another, instead of leaving it started (409) until the lock timeout.
func TestBatchClaimCallerGone(t *testing.T) {
	hook := &batchHook{}
	s, _ := batchStore(t, hook, 4)
	ctx, cancel := context.WithCancel(context.Background())
	returned, released := make(chan struct{}), make(chan struct{})
	hook.mu.Lock()
	hook.onBatch = func() {
		cancel()
		<-returned // the batch runs only once the caller has left
	}
	hook.onReleased = func() { close(released) }
	hook.mu.Unlock()
	_, err := s.Claim(ctx, batchReq("gone", "a"))
	close(returned)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Claim whose caller left during the batch: %v, want context.Canceled", err)
	}
	select {
	case <-released:
	case <-time.After(10 * time.Second):
		t.Fatal("the key claimed for the caller that left was not released")
	}
	hook.mu.Lock()
	hook.onBatch, hook.onReleased = nil, nil
	batches := hook.batches
	hook.mu.Unlock()
	if batches != 1 {
		t.Fatalf("%d batches, want 1", batches)
	}
	res, err := s.Claim(context.Background(), batchReq("gone", "b"))
	if err != nil || res.Outcome != idempotency.Claimed {
		t.Fatalf("another request after the caller left: %+v, %v; want Claimed", res, err)
	}
	// A context that has ended before Claim claims nothing.
	if _, err := s.Claim(ctx, batchReq("never", "a")); !errors.Is(err, context.Canceled) {
		t.Fatalf("Claim with an ended context: %v", err)
	}
	if res, err := s.Claim(context.Background(), batchReq("never", "b")); err != nil || res.Outcome != idempotency.Claimed {
		t.Fatalf("the key of an ended context: %+v, %v; want Claimed (it was never claimed)", res, err)
	}
}

// TestBatchClaimsMixed claims 8 new keys, each by 4 concurrent
// callers: exactly one caller of each key gets Claimed, whether its batch
// held the key once or several times, and the tokens differ.
func TestBatchClaimsMixed(t *testing.T) {
	hook := &batchHook{}
	s, _ := batchStore(t, hook, 8)
	const keys, callers = 8, 4
	results := make([]idempotency.ClaimResult, keys*callers)
	errs := make([]error, keys*callers)
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() {
			results[i], errs[i] = s.Claim(context.Background(), batchReq(fmt.Sprintf("k%d", i%keys), "a"))
		})
	}
	wg.Wait()
	won := make(map[string]int)
	tokens := make(map[int64]bool)
	for i, r := range results {
		if errs[i] != nil {
			t.Fatalf("Claim: %v", errs[i])
		}
		switch r.Outcome {
		case idempotency.Claimed:
			won[r.Claim.Key]++
			if tokens[r.Claim.Token] {
				t.Errorf("token %d handed out twice", r.Claim.Token)
			}
			tokens[r.Claim.Token] = true
		case idempotency.Exists:
			if r.Record.Status != idempotency.StatusStarted {
				t.Errorf("a losing claim saw %q, want started", r.Record.Status)
			}
		default:
			t.Errorf("outcome %v", r.Outcome)
		}
	}
	for k := range keys {
		if n := won[fmt.Sprintf("k%d", k)]; n != 1 {
			t.Errorf("key k%d claimed %d times, want once", k, n)
		}
	}
	t.Logf("%d claims in %d batches", keys*callers, hook.batches)
}

// TestBatchClaimError makes the batch statement fail (a
// fingerprint version out of PostgreSQL's integer range): the caller gets
// the error of its own claim, the one claimSQL reports, and nothing hangs.
func TestBatchClaimError(t *testing.T) {
	s, _ := batchStore(t, &batchHook{}, 2)
	req := batchReq("big", "a")
	req.FingerprintVersion = 1 << 40
	if _, err := s.Claim(context.Background(), req); err == nil {
		t.Fatal("Claim with a fingerprint version out of range: no error")
	}
	if res, err := s.Claim(context.Background(), batchReq("big", "a")); err != nil || res.Outcome != idempotency.Claimed {
		t.Fatalf("the key after the failed batch: %+v, %v; want Claimed", res, err)
	}
}

// TestBatchClaimCommitFails makes the batch's commit fail after
// its rows came back (a deferred constraint trigger that refuses the key
// at commit, as a connection ended during the commit's WAL flush would
// fail it): the rows are not claims. Claim must not return Claimed for a
// key that has no row, or the caller would charge under an operation that
// the next claim of the key replaces, and charge twice.
func TestBatchClaimCommitFails(t *testing.T) {
	ctx := context.Background()
	for _, async := range []bool{false, true} {
		t.Run(fmt.Sprintf("async=%v", async), func(t *testing.T) {
			s, pool := batchStore(t, &batchHook{}, 2)
			s.AsyncClaims = async
			refuseAtCommit(t, pool, "idempotency_keys", "idempotency_key", "boom")
			res, err := s.Claim(ctx, batchReq("boom", "a"))
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE idempotency_key = 'boom'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if err == nil || n != 0 {
				t.Fatalf("Claim whose commit failed: %+v, %v, with %d rows; want an error and no row", res, err, n)
			}
			if res, err := s.Claim(ctx, batchReq("fine", "a")); err != nil || res.Outcome != idempotency.Claimed {
				t.Fatalf("the next claim: %+v, %v", res, err)
			}
		})
	}
}

// refuseAtCommit makes every transaction that inserts a row into table
// whose column is value fail at its commit, after the statement has
// returned its rows: a deferred constraint trigger.
func refuseAtCommit(t *testing.T, pool *pgxpool.Pool, table, column, value string) {
	t.Helper()
	_, err := pool.Exec(context.Background(), fmt.Sprintf(`
		CREATE FUNCTION refuse_%[1]s() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.%[2]s = %[3]s THEN
				RAISE EXCEPTION 'refused at commit';
			END IF;
			RETURN NULL;
		END $$;
		CREATE CONSTRAINT TRIGGER refuse_%[1]s AFTER INSERT ON %[1]s
			DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_%[1]s()`,
		table, column, "'"+strings.ReplaceAll(value, "'", "''")+"'"))
	if err != nil {
		t.Fatal(err)
	}
}
