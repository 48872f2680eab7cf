package pgstore_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// TestDeferredTriggerUniqueViolationIsNotFenced: a deferred constraint
// trigger of the handler's own table that raises unique_violation without
// naming a constraint (RAISE ... USING ERRCODE, the usual way to enforce a
// rule no index can) fails the COMMIT with the SQLSTATE of a fenced
// completion. It is the COMMIT's error, not the completion's: the request
// fails as its commit failed (500), not as a claim a retry took over
// (409), and nothing of it commits.
func TestDeferredTriggerUniqueViolationIsNotFenced(t *testing.T) {
	var s *service
	s = newService(t, idempotency.Options{OneTransaction: true}, nil,
		func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
			if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if _, err := tx.Exec(r.Context(), `INSERT INTO deferred_rule VALUES (1)`); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
	_, err := s.pool.Exec(context.Background(), `
CREATE TABLE deferred_rule (v int);
CREATE FUNCTION deferred_rule_check() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'duplicate order' USING ERRCODE = 'unique_violation';
END $$;
CREATE CONSTRAINT TRIGGER deferred_rule_check AFTER INSERT ON deferred_rule
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION deferred_rule_check();`)
	require.NoError(t, err)
	status, _ := s.send("k1")
	assert.Equal(t, http.StatusInternalServerError, status, s.logs.String())
	assert.NotContains(t, s.logs.String(), "fenced", "a failed COMMIT reported as a fenced claim")
	assert.Empty(t, s.keyRows(t, "k1"), "key rows")
	s.mustMatch(t, "k1", status)
}

// TestCreateOpenKeysIndexBesidePreviousRelease: during a rolling
// upgrade, a replica of the previous release runs its Migrate (one
// transaction: its check that the open keys' index is missing, then a
// plain CREATE INDEX IF NOT EXISTS of it) while a replica of this release
// runs CreateOpenKeysIndex. When the concurrent build commits the index's
// catalog entry between the old check and the old CREATE INDEX, the old
// statement waits for the build's table lock while holding a snapshot,
// and the build's last phase waits for that snapshot: a deadlock, which
// PostgreSQL breaks by failing one of them (the new replica's start, via
// server.Migrate, or the old replica's): CreateOpenKeysIndex tries again
// and succeeds; the old replica's Migrate may fail, once.
func TestCreateOpenKeysIndexBesidePreviousRelease(t *testing.T) {
	ctx := context.Background()
	// Five connections: the writer's, the old Migrate's, the build's, its
	// lock's and the test's own.
	pool := widePool(t, 5)
	// A writer keeps the build waiting after its first phase, so that the
	// old Migrate's CREATE INDEX lands inside the build.
	writer, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer writer.Rollback(ctx)
	_, err = writer.Exec(ctx, `LOCK TABLE idempotency_keys IN ROW EXCLUSIVE MODE`)
	require.NoError(t, err)

	old, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer old.Rollback(ctx)
	var missing bool
	require.NoError(t, old.QueryRow(ctx,
		`SELECT to_regclass(quote_ident(current_schema()) || '.idempotency_keys_open_idx') IS NULL`).Scan(&missing))
	require.True(t, missing)

	built := make(chan error, 1)
	go func() { built <- pgstore.CreateOpenKeysIndex(ctx, pool) }()
	for {
		if oid, _ := openIndex(t, pool); oid != 0 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	oldDone := make(chan error, 1)
	go func() {
		_, err := old.Exec(ctx, `CREATE INDEX IF NOT EXISTS idempotency_keys_open_idx ON idempotency_keys (locked_at) WHERE status <> 'completed'`)
		if err == nil {
			err = old.Commit(ctx)
		}
		oldDone <- err
	}()
	// Let the old CREATE INDEX queue behind the build's lock.
	count := func(q string, n *int) error { return pool.QueryRow(ctx, q).Scan(n) }
	queued, stop := pgtest.WatchLockWait(count, 1, `query LIKE 'CREATE INDEX IF NOT EXISTS%'`)
	<-queued
	require.NoError(t, stop())
	require.NoError(t, writer.Rollback(ctx))
	buildErr, oldErr := <-built, <-oldDone
	assert.NoError(t, buildErr, "CreateOpenKeysIndex beside the previous release's Migrate")
	// PostgreSQL may end either side as the deadlock's victim: ours tries
	// again; the previous release's Migrate fails, and its replica's next
	// start finds the index (docs/operations.md says so).
	if oldErr != nil {
		assert.Contains(t, oldErr.Error(), "40P01", "the previous release's Migrate beside CreateOpenKeysIndex")
	}
	oid, valid := openIndex(t, pool)
	assert.True(t, oid != 0 && valid, "index %d valid %v", oid, valid)
}

// TestCreateOpenKeysIndexCancelledBuildEnds (passes: checked sound): a
// CreateOpenKeysIndex whose context ends while the build waits (here for a
// writer's transaction) returns, and the build's backend ends with it
// (pgconn's close sends a CancelRequest), so no session is left holding
// the build's advisory lock.
func TestCreateOpenKeysIndexCancelledBuildEnds(t *testing.T) {
	ctx := context.Background()
	// The build's sessions are told from those of other tests (other
	// packages build the index too, at the same time) by their name.
	const app = "pgstore-cancelled-build-test"
	pool := widePool(t, 4, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["application_name"] = app })
	writer, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer writer.Rollback(ctx)
	_, err = writer.Exec(ctx, `LOCK TABLE idempotency_keys IN ROW EXCLUSIVE MODE`)
	require.NoError(t, err)

	bctx, cancel := context.WithCancel(ctx)
	built := make(chan error, 1)
	go func() { built <- pgstore.CreateOpenKeysIndex(bctx, pool) }()
	for {
		if oid, _ := openIndex(t, pool); oid != 0 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	var before int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE query LIKE 'CREATE INDEX CONCURRENTLY%' AND pid <> pg_backend_pid() AND application_name = $1`, app).Scan(&before))
	require.Equal(t, 1, before, "the build, waiting for the writer")
	cancel()
	t.Log(<-built)

	// The build's session should be gone (or going) now; wait a little
	// for it, bounded: a cancelled statement ends within milliseconds.
	var left int
	for range 50 {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE query LIKE 'CREATE INDEX CONCURRENTLY%' AND pid <> pg_backend_pid() AND application_name = $1`, app).Scan(&left))
		if left == 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	assert.Zero(t, left, "backends still building the index after CreateOpenKeysIndex returned")
	var locks int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE l.locktype = 'advisory' AND l.classid = $1 AND l.granted AND a.application_name = $2`, 0x1de5, app).Scan(&locks))
	assert.Zero(t, locks, "sessions holding the build's advisory lock after CreateOpenKeysIndex returned")
}
