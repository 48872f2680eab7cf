package sqlstoretest

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/pgbouncer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/sqlstore"
	"github.com/idemkit/idem/server/storetest"
)

// bouncerDB returns a pool of driver through a PgBouncer of its own in
// transaction mode, which hands out its server connections in turn
// (round robin) and keeps as many prepared statements for each client as
// maxPrepared says (pgbouncer.Config.MaxPreparedStatements), with the
// connection parameters params (key=value, space-separated), on a fresh
// schema holding the key table and the writes table; with index, the open
// keys' index too.
func bouncerDB(t *testing.T, driver, params, maxPrepared string, index bool) *sql.DB {
	t.Helper()
	url := pgtest.Bouncer(t, pgbouncer.Config{PoolMode: pgbouncer.Transaction, RoundRobin: true, MaxPreparedStatements: maxPrepared})
	db := open(t, driver, strings.TrimSpace(url+" "+params))
	ctx := context.Background()
	if err := sqlstore.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, writesSQL); err != nil {
		t.Fatal(err)
	}
	if index {
		if err := sqlstore.CreateOpenKeysIndex(ctx, db); err != nil {
			t.Fatal(err)
		}
	}
	warm(t, db, 8)
	return db
}

// ConformanceThroughPgBouncer runs the conformance suites of the store,
// the sweeper and the inspector on driver through PgBouncer in
// transaction mode, with the connection parameters params (key=value,
// space-separated; pgx's query modes that work there, say), PgBouncer
// keeping as many prepared statements for each client as maxPrepared
// says (pgbouncer.Config.MaxPreparedStatements).
func ConformanceThroughPgBouncer(t *testing.T, driver, params, maxPrepared string) {
	backend := func(index bool) func(t *testing.T) storetest.Backend {
		return func(t *testing.T) storetest.Backend {
			return backendOn(bouncerDB(t, driver, params, maxPrepared, index))
		}
	}
	t.Run("Store", func(t *testing.T) { storetest.Exercise(t, backend(false)) })
	t.Run("Sweeper", func(t *testing.T) { storetest.ExerciseSweeper(t, backend(true)) })
	t.Run("Inspector", func(t *testing.T) { storetest.ExerciseInspector(t, backend(true)) })
}

// OpenKeysIndexThroughPgBouncer: behind a pooler in transaction mode,
// where each statement outside a transaction may run on another session,
// CreateOpenKeysIndex builds the index, again and again, and from many
// callers at once, and leaves no lock held on any session (a lock taken
// on one session and released on another would stay held on an idle
// server connection of the pooler, where the next build waits for it
// forever). params are driver's connection parameters for the pooler
// (see ConformanceThroughPgBouncer).
func OpenKeysIndexThroughPgBouncer(t *testing.T, driver, params string) {
	ctx := context.Background()
	db := bouncerDB(t, driver, params, "", false)
	if _, err := db.ExecContext(ctx, `
		INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
			status, operation_id, lock_token, lease_us, retention_us)
		SELECT 'cli_a', 'key-' || g, 'POST', '/v1/orders', '\x00', 'started', gen_random_uuid(),
			nextval('idempotency_lock_tokens'), 1000000, 3600000000
		FROM generate_series(1, 20000) g`); err != nil {
		t.Fatal(err)
	}
	spread(t, db, 8)
	for round := range 3 {
		if _, err := db.ExecContext(ctx, `DROP INDEX IF EXISTS idempotency_keys_open_idx`); err != nil {
			t.Fatal(err)
		}
		callers := 1 + 2*round // one, then three and five at once
		errs := make([]error, callers)
		var wg sync.WaitGroup
		for i := range errs {
			wg.Go(func() {
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				defer cancel()
				errs[i] = sqlstore.CreateOpenKeysIndex(cctx, db)
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("round %d, %d callers: %v", round, callers, err)
		}
		if _, err := sqlstore.New(db).Stats(ctx); err != nil {
			t.Errorf("round %d: Stats after CreateOpenKeysIndex: %v", round, err)
		}
		var locks int
		if err := db.QueryRowContext(ctx, `
			SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE l.locktype = 'advisory' AND a.application_name = current_setting('application_name')`).Scan(&locks); err != nil {
			t.Fatal(err)
		}
		if locks != 0 {
			t.Fatalf("round %d: %d advisory locks held by the test's sessions after CreateOpenKeysIndex returned; want none", round, locks)
		}
	}
}

// spread opens n server connections behind the bouncer of db, n of its
// connections each in a statement at once, so that the bouncer's round
// robin has n sessions to hand out in turn.
func spread(t *testing.T, db *sql.DB, n int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { _, errs[i] = db.ExecContext(context.Background(), `SELECT pg_sleep(0.1)`) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}
