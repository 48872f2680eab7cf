package sqlstore_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/stdlib" // the "pgx" driver

	"github.com/idemkit/idem/server/internal/sqlpipe"
	"github.com/idemkit/idem/server/sqlstore/internal/sqlstoretest"
	_ "github.com/idemkit/idem/server/sqlstore/pgxpipeline"
)

// TestPgxStdlib runs the tests of sqlstore on pgx's database/sql driver,
// its transactions as database/sql's *sql.Tx (without
// server/sqlstore/pgxpipeline); internal/pqtest runs them on lib/pq's.
func TestPgxStdlib(t *testing.T) {
	unpiped(t)
	sqlstoretest.Run(t, "pgx")
}

// TestPgxQueryModes runs the conformance suite on pgx's database/sql
// driver in each of pgx's other query modes (its default,
// cache_statement, runs in TestPgxStdlib): exec and simple_protocol are
// the ones a pooler in transaction mode needs.
func TestPgxQueryModes(t *testing.T) {
	unpiped(t)
	for _, mode := range []string{"cache_describe", "describe_exec", "exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			sqlstoretest.Conformance(t, "pgx", "default_query_exec_mode="+mode)
		})
	}
}

// TestPgxPiped runs them on pgx's database/sql driver with
// server/sqlstore/pgxpipeline, which this test binary imports: the
// request's transaction piped (BEGIN with the claim in one transaction,
// the completion with the COMMIT). Top-level tests run one after another,
// so the two runs never share the database's connections.
func TestPgxPiped(t *testing.T) {
	sqlstoretest.Run(t, "pgx")
}

// unpiped makes the stores on pgx's driver that the test makes, until it
// ends, run their transactions as *sql.Tx: the Runner of
// server/sqlstore/pgxpipeline is suspended. The test and its caller's
// must not run in parallel with others.
func unpiped(t *testing.T) {
	t.Cleanup(sqlpipe.Suspend(stdlib.GetDefaultDriver()))
}

// forBoth runs f as two subtests, on stores without the pipeline (as
// *sql.Tx) and with it.
func forBoth(t *testing.T, f func(t *testing.T)) {
	for _, piped := range []bool{false, true} {
		name := "tx"
		if piped {
			name = "piped"
		}
		t.Run(name, func(t *testing.T) {
			if !piped {
				unpiped(t)
			}
			f(t)
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
