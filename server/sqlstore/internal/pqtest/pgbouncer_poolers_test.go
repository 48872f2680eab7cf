//go:build poolers

package pqtest

import (
	"testing"

	"github.com/idemkit/idem/internal/pgbouncer"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/sqlstore/internal/sqlstoretest"
)

// TestPgBouncerConformance runs the conformance suites of the store, the
// sweeper and the inspector on lib/pq through PgBouncer in transaction
// mode, where lib/pq works only with binary_parameters=yes (each statement
// in one round trip: without it, lib/pq binds in a second round trip the
// unnamed statement it prepared in the first) and a PgBouncer that keeps
// prepared statements for its clients (1.21 and later: sqlstore prepares
// its statements of a first execution on lib/pq). Skipped with an older
// PgBouncer, as Debian 12's 1.18: set IDEM_PGBOUNCER to a newer build.
// See docs/operations.md, "Poolers". make poolers runs it.
func TestPgBouncerConformance(t *testing.T) {
	pgtest.NeedBouncer(t)
	if !pgbouncer.CanKeepPreparedStatements() {
		major, minor, _ := pgbouncer.Version()
		t.Skipf("needs PgBouncer 1.21 or later (max_prepared_statements), this is %d.%d; set %s to a newer build",
			major, minor, pgbouncer.EnvBinary)
	}
	sqlstoretest.ConformanceThroughPgBouncer(t, "postgres", "binary_parameters=yes", "200")
}
