package drivertest

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// Pool is a pool of a store's driver, with the store package's calls that
// the open keys' index tests make on it.
type Pool interface {
	// Exec runs sql, a statement of no result, outside any transaction.
	Exec(ctx context.Context, sql string) error
	// Count runs sql, a query of one integer, and returns it.
	Count(ctx context.Context, sql string) (int, error)
	// CreateOpenKeysIndex is the store package's CreateOpenKeysIndex.
	CreateOpenKeysIndex(ctx context.Context) error
	// Stats is the Stats of the store package's New on the pool, which
	// needs the open keys' index.
	Stats(ctx context.Context) error
}

// StartedKeysSQL inserts 20,000 started keys of client cli_a, so that
// building the open keys' index takes a while.
const StartedKeysSQL = `
	INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
		status, operation_id, lock_token, lease_us, retention_us)
	SELECT 'cli_a', 'key-' || g, 'POST', '/v1/orders', '\x00', 'started', gen_random_uuid(),
		nextval('idempotency_lock_tokens'), 1000000, 3600000000
	FROM generate_series(1, 20000) g`

// OpenKeysIndexThroughPgBouncer: behind a pooler in transaction mode,
// where each statement outside a transaction may run on another session,
// CreateOpenKeysIndex builds the index, again and again, and from many
// callers at once, and leaves no lock held on any session: a lock taken
// on one session and released on another would stay held on an idle
// server connection of the pooler, where the next build waits for it
// forever. pool has 8 connections, all open, through a PgBouncer of its
// own in transaction mode that hands out its server connections in turn
// (round robin), on a fresh schema with the key table and without the
// index.
func OpenKeysIndexThroughPgBouncer(t *testing.T, pool Pool) {
	ctx := context.Background()
	if err := pool.Exec(ctx, StartedKeysSQL); err != nil {
		t.Fatal(err)
	}
	Spread(t, pool, 8)
	for round := range 3 {
		if err := pool.Exec(ctx, `DROP INDEX IF EXISTS idempotency_keys_open_idx`); err != nil {
			t.Fatal(err)
		}
		callers := 1 + 2*round // one, then three and five at once
		errs := make([]error, callers)
		var wg sync.WaitGroup
		for i := range errs {
			wg.Go(func() {
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				defer cancel()
				errs[i] = pool.CreateOpenKeysIndex(cctx)
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("round %d, %d callers: %v", round, callers, err)
		}
		if err := pool.Stats(ctx); err != nil {
			t.Errorf("round %d: Stats after CreateOpenKeysIndex: %v", round, err)
		}
		locks, err := pool.Count(ctx, `
			SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND a.application_name = current_setting('application_name')`)
		if err != nil {
			t.Fatal(err)
		}
		if locks != 0 {
			t.Fatalf("round %d: %d advisory locks held by the test's sessions after CreateOpenKeysIndex returned; want none", round, locks)
		}
	}
}

// Spread opens n server connections behind the pooler of pool, n of its
// connections each in a statement at once, so that the pooler's round
// robin has n sessions to hand out in turn.
func Spread(t *testing.T, pool Pool, n int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { errs[i] = pool.Exec(context.Background(), `SELECT pg_sleep(0.1)`) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}
