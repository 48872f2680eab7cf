//go:build poolers

package pgstore_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgbouncer"
	"github.com/idemkit/idem/server/pgstore"
	"github.com/idemkit/idem/server/storetest"
)

// TestPgBouncerConformance runs the conformance suites of the store, the
// sweeper and the inspector through PgBouncer in transaction mode, in
// each of pgx's query modes that work there: those that send each
// statement whole in one round trip and leave nothing on the session for
// a later one, and pgx's default, cache_statement, behind a PgBouncer that
// keeps prepared statements for its clients (1.21 and later; skipped with
// an older one, as Debian 12's 1.18: set IDEM_PGBOUNCER to a newer build).
// See docs/operations.md, "Poolers". make poolers runs it.
func TestPgBouncerConformance(t *testing.T) {
	for _, tt := range []struct {
		mode pgx.QueryExecMode
		keep bool // PgBouncer keeps prepared statements (max_prepared_statements)
	}{
		{pgx.QueryExecModeExec, false},
		{pgx.QueryExecModeSimpleProtocol, false},
		{pgx.QueryExecModeCacheDescribe, false},
		{pgx.QueryExecModeCacheStatement, true},
	} {
		t.Run(modeName(tt.mode), func(t *testing.T) {
			bcfg := pgbouncer.Config{MaxPreparedStatements: pgbouncer.NoPreparedStatements()}
			if tt.keep {
				skipUnlessKept(t)
				bcfg.MaxPreparedStatements = "200"
			}
			backend := func(index bool) func(t *testing.T) storetest.Backend {
				return func(t *testing.T) storetest.Backend {
					pool := bouncerPoolWith(t, bcfg, 8, tt.mode, index)
					return storetest.Backend{
						Store: pgstore.New(pool),
						Write: write,
						Written: func(ctx context.Context, name string) (bool, error) {
							return written(ctx, pool, name)
						},
						Elapse: elapseAll(pool),
					}
				}
			}
			t.Run("Store", func(t *testing.T) { storetest.Exercise(t, backend(false)) })
			t.Run("Sweeper", func(t *testing.T) { storetest.ExerciseSweeper(t, backend(true)) })
			t.Run("Inspector", func(t *testing.T) { storetest.ExerciseInspector(t, backend(true)) })
		})
	}
}
