package sqlstoretest

import (
	"context"
	"database/sql"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/pgbouncer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/internal/drivertest"
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

// OpenKeysIndexThroughPgBouncer is drivertest's, which pgstore runs too,
// on driver with the connection parameters params for the pooler (see
// ConformanceThroughPgBouncer).
func OpenKeysIndexThroughPgBouncer(t *testing.T, driver, params string) {
	drivertest.OpenKeysIndexThroughPgBouncer(t, driverPool{bouncerDB(t, driver, params, "", false)})
}

// driverPool is db as a drivertest.Pool.
type driverPool struct{ *sql.DB }

func (p driverPool) Exec(ctx context.Context, sql string) error {
	_, err := p.ExecContext(ctx, sql)
	return err
}

func (p driverPool) Count(ctx context.Context, sql string) (n int, err error) {
	err = p.QueryRowContext(ctx, sql).Scan(&n)
	return n, err
}

func (p driverPool) CreateOpenKeysIndex(ctx context.Context) error {
	return sqlstore.CreateOpenKeysIndex(ctx, p.DB)
}

func (p driverPool) Stats(ctx context.Context) error {
	_, err := sqlstore.New(p.DB).Stats(ctx)
	return err
}
