package pgstore_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgbouncer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/internal/drivertest"
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
	openAll(t, pool, conns)
	return pool
}

// TestOpenKeysIndexThroughPgBouncer is drivertest's, which sqlstore runs
// too, on pgx.
func TestOpenKeysIndexThroughPgBouncer(t *testing.T) {
	drivertest.OpenKeysIndexThroughPgBouncer(t, driverPool{bouncerPool(t, 8, pgx.QueryExecModeExec, false)})
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
					drivertest.Spread(t, driverPool{pool}, 4) // sessions to hand out in turn
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
