package sqlstore_test

import (
	"os/exec"
	"strings"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" driver

	"github.com/idemkit/idem/server/sqlstore/internal/sqlstoretest"
)

// TestPgxStdlib runs the tests of sqlstore on pgx's database/sql driver;
// internal/pqtest runs them on lib/pq's.
func TestPgxStdlib(t *testing.T) {
	sqlstoretest.Run(t, "pgx")
}

// TestPgxQueryModes runs the conformance suite on pgx's database/sql
// driver in each of pgx's other query modes (its default,
// cache_statement, runs in TestPgxStdlib): exec and simple_protocol are
// the ones a pooler in transaction mode needs.
func TestPgxQueryModes(t *testing.T) {
	for _, mode := range []string{"cache_describe", "describe_exec", "exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			sqlstoretest.Conformance(t, "pgx", "default_query_exec_mode="+mode)
		})
	}
}

// TestImportsNoPgx: a service that imports sqlstore pulls in no pgx
// unless it chose the pgx driver itself.
func TestImportsNoPgx(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for dep := range strings.FieldsSeq(string(out)) {
		if strings.HasPrefix(dep, "github.com/jackc/") {
			t.Errorf("sqlstore depends on %s", dep)
		}
	}
}

// TestOpenKeysIndexThroughPgBouncer builds the open keys' index through
// PgBouncer in transaction mode, on pgx's driver in exec mode, and checks
// that no lock is left on a session (see
// sqlstoretest.OpenKeysIndexThroughPgBouncer).
func TestOpenKeysIndexThroughPgBouncer(t *testing.T) {
	sqlstoretest.OpenKeysIndexThroughPgBouncer(t, "pgx", "default_query_exec_mode=exec")
}
