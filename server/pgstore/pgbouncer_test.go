package pgstore_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgbouncer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/pgstore"
)

// bouncerPool returns a pool of conns connections, all open, through a
// PgBouncer of its own in transaction mode, in pgx's query mode mode, on
// a fresh schema holding the key table and the writes table; with index,
// the open keys' index too. The bouncer hands out its server connections
// in turn (round robin), so that consecutive statements of one client
// run on different sessions more often than not.
func bouncerPool(t *testing.T, conns int32, mode pgx.QueryExecMode, index bool) *pgxpool.Pool {
	t.Helper()
	return bouncerPoolWith(t, pgbouncer.Config{}, conns, mode, index)
}

// bouncerPoolWith is bouncerPool with PgBouncer's max_prepared_statements
// as bcfg says.
func bouncerPoolWith(t *testing.T, bcfg pgbouncer.Config, conns int32, mode pgx.QueryExecMode, index bool) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	bcfg.PoolMode, bcfg.RoundRobin = pgbouncer.Transaction, true
	cfg, err := pgxpool.ParseConfig(pgtest.Bouncer(t, bcfg))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = conns
	cfg.ConnConfig.DefaultQueryExecMode = mode
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	migrate(t, pool)
	if index {
		if err := pgstore.CreateOpenKeysIndex(ctx, pool); err != nil {
			t.Fatal(err)
		}
	}
	held := make([]*pgxpool.Conn, conns)
	for i := range held {
		if held[i], err = pool.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range held {
		c.Release()
	}
	return pool
}

// spread opens n server connections behind the bouncer of pool, n of its
// clients each in a statement at once, so that the bouncer's round robin
// has n sessions to hand out in turn.
func spread(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { _, errs[i] = pool.Exec(context.Background(), `SELECT pg_sleep(0.1)`) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// advisoryLocks returns the advisory locks that the test's sessions hold
// or wait for (their application_name is the test's schema).
func advisoryLocks(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	err := pool.QueryRow(context.Background(), `
		SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'advisory' AND a.application_name = current_setting('application_name')`).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestOpenKeysIndexThroughPgBouncer: behind a pooler in transaction mode,
// where each statement outside a transaction may run on another session,
// CreateOpenKeysIndex builds the index, again and again, and from many
// callers at once, and leaves no lock held on any session: a lock taken
// on one session and released on another would stay held on an idle
// server connection of the pooler, where the next build waits for it
// forever.
func TestOpenKeysIndexThroughPgBouncer(t *testing.T) {
	ctx := context.Background()
	pool := bouncerPool(t, 8, pgx.QueryExecModeExec, false)
	if _, err := pool.Exec(ctx, `
		INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
			status, operation_id, lock_token, lease_us, retention_us)
		SELECT 'cli_a', 'key-' || g, 'POST', '/v1/orders', '\x00', 'started', gen_random_uuid(),
			nextval('idempotency_lock_tokens'), 1000000, 3600000000
		FROM generate_series(1, 20000) g`); err != nil {
		t.Fatal(err)
	}
	spread(t, pool, 8)
	for round := range 3 {
		if _, err := pool.Exec(ctx, `DROP INDEX IF EXISTS idempotency_keys_open_idx`); err != nil {
			t.Fatal(err)
		}
		callers := 1 + 2*round // one, then three and five at once
		errs := make([]error, callers)
		var wg sync.WaitGroup
		for i := range errs {
			wg.Go(func() {
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				defer cancel()
				errs[i] = pgstore.CreateOpenKeysIndex(cctx, pool)
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("round %d, %d callers: %v", round, callers, err)
		}
		if _, err := pgstore.New(pool).Stats(ctx); err != nil {
			t.Errorf("round %d: Stats after CreateOpenKeysIndex: %v", round, err)
		}
		if n := advisoryLocks(t, pool); n != 0 {
			t.Fatalf("round %d: %d advisory locks held by the test's sessions after CreateOpenKeysIndex returned; want none", round, n)
		}
	}
}

// TestCheckQueryMode: the query modes that need a session of their own
// per connection are refused, by CheckQueryMode and by Migrate, with a
// QueryModeError that names the setting to change, when the pool's
// connections reach PostgreSQL through PgBouncer in transaction mode,
// whether it hands out the session it used last or its sessions in turn;
// every mode passes directly and through PgBouncer in session mode; and
// cache_statement passes behind a PgBouncer that keeps prepared
// statements for its clients (1.21 and later, max_prepared_statements;
// skipped with an older one: Debian 12 has 1.18, and IDEM_PGBOUNCER may
// name a newer build).
func TestCheckQueryMode(t *testing.T) {
	ctx := context.Background()
	modes := []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol}
	bouncer := func(cfg pgbouncer.Config) func(t *testing.T) string {
		return func(t *testing.T) string { return pgtest.Bouncer(t, cfg) }
	}
	transaction := pgbouncer.Config{PoolMode: pgbouncer.Transaction, MaxPreparedStatements: pgbouncer.NoPreparedStatements()}
	roundRobin := transaction
	roundRobin.RoundRobin = true
	for _, tt := range []struct {
		name    string
		url     func(t *testing.T) string
		refused []pgx.QueryExecMode
		kept    bool // needs a PgBouncer that keeps prepared statements
	}{
		{"direct", func(t *testing.T) string { return pgtest.SchemaURL(t) }, nil, false},
		{"session", bouncer(pgbouncer.Config{PoolMode: pgbouncer.Session}), nil, false},
		{"transaction", bouncer(transaction), []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeDescribeExec}, false},
		{"transaction_round_robin", bouncer(roundRobin), []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeDescribeExec}, false},
		{"transaction_prepared_statements", bouncer(pgbouncer.Config{PoolMode: pgbouncer.Transaction, MaxPreparedStatements: "200"}),
			[]pgx.QueryExecMode{pgx.QueryExecModeDescribeExec}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.kept {
				skipUnlessKept(t)
			}
			url := tt.url(t)
			for _, mode := range modes {
				cfg, err := pgxpool.ParseConfig(url)
				if err != nil {
					t.Fatal(err)
				}
				cfg.ConnConfig.DefaultQueryExecMode = mode
				pool, err := pgxpool.NewWithConfig(ctx, cfg)
				if err != nil {
					t.Fatal(err)
				}
				defer pool.Close()
				if tt.name == "transaction_round_robin" {
					spread(t, pool, 4) // sessions to hand out in turn
				}
				want := slices.Contains(tt.refused, mode)
				err = pgstore.CheckQueryMode(ctx, pool)
				var qm *pgstore.QueryModeError
				if got := errors.As(err, &qm); got != want || (err != nil && !got) {
					t.Errorf("%v: CheckQueryMode = %v; want a QueryModeError: %v", mode, err, want)
					continue
				}
				if want && (qm.Mode != mode || !strings.Contains(err.Error(), "default_query_exec_mode=exec") ||
					!strings.Contains(err.Error(), "query mode "+modeName(mode)+" ")) {
					t.Errorf("%v: %v; want the mode named, and default_query_exec_mode=exec", mode, err)
				}
				if err := pgstore.Migrate(ctx, pool); !errors.As(err, &qm) && want || err != nil && !want {
					t.Errorf("%v: Migrate = %v; want a QueryModeError: %v", mode, err, want)
				}
			}
		})
	}
}

// skipUnlessKept skips a test that needs a PgBouncer that keeps prepared
// statements for its clients (1.21 and later), naming the one at hand.
func skipUnlessKept(t *testing.T) {
	t.Helper()
	pgtest.NeedBouncer(t)
	if !pgbouncer.CanKeepPreparedStatements() {
		major, minor, _ := pgbouncer.Version()
		t.Skipf("needs PgBouncer 1.21 or later (max_prepared_statements), this is %d.%d; set %s to a newer build",
			major, minor, pgbouncer.EnvBinary)
	}
}

// modeName is the name of mode in a connection string.
func modeName(mode pgx.QueryExecMode) string { return strings.ReplaceAll(mode.String(), " ", "_") }
