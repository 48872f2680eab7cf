//go:build poolers

package sqlstore_test

import (
	"testing"

	"github.com/idemkit/idem/internal/pgbouncer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/sqlstore/internal/sqlstoretest"
)

// TestPgBouncerConformance runs the conformance suites of the store, the
// sweeper and the inspector through PgBouncer in transaction mode, on
// pgx's database/sql driver in each of its query modes that work there,
// and in pgx's default, cache_statement, behind a PgBouncer that keeps
// prepared statements for its clients (1.21 and later; skipped with an
// older one, as Debian 12's 1.18: set IDEM_PGBOUNCER to a newer build).
// See docs/operations.md, "Poolers". make poolers runs it.
func TestPgBouncerConformance(t *testing.T) {
	for _, mode := range []string{"exec", "simple_protocol", "cache_describe"} {
		t.Run(mode, func(t *testing.T) {
			sqlstoretest.ConformanceThroughPgBouncer(t, "pgx", "default_query_exec_mode="+mode, pgbouncer.NoPreparedStatements())
		})
	}
	t.Run("cache_statement", func(t *testing.T) {
		pgtest.NeedBouncer(t)
		if !pgbouncer.CanKeepPreparedStatements() {
			major, minor, _ := pgbouncer.Version()
			t.Skipf("needs PgBouncer 1.21 or later (max_prepared_statements), this is %d.%d; set %s to a newer build",
				major, minor, pgbouncer.EnvBinary)
		}
		sqlstoretest.ConformanceThroughPgBouncer(t, "pgx", "", "200")
	})
}
