package pgtest

import (
	"context"
	"fmt"
	"testing"

	"github.com/idemkit/idem/internal/pgbouncer"
)

// Bouncer starts a PgBouncer configured as cfg says (its pool mode, size,
// round robin) in front of the test database, whose server connections
// use a fresh schema of their own as search_path (set by the bouncer as
// it connects them, since a pooler in transaction mode keeps no setting
// a client sends), and returns a connection string through it, whose
// application_name is the schema's name (see SchemaURL). The bouncer is
// stopped and the schema dropped when the test ends; cfg.Server and
// cfg.SearchPath are Bouncer's to set.
//
// Without pgbouncer on the machine the test is skipped with a message
// naming the command that installs it, except under CI=true, where it
// fails: the tests through a pooler must run there, not skip.
func Bouncer(t testing.TB, cfg pgbouncer.Config) string {
	t.Helper()
	NeedBouncer(t)
	base, schema := newSchema(t) // registered first, so its cleanup runs after the bouncer stops
	cfg.Server, cfg.SearchPath = base, schema
	b, err := pgbouncer.Start(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("pgtest: stopping pgbouncer: %v", err)
		}
	})
	return fmt.Sprintf("%s application_name=%s", b.URL(), schema)
}

// NeedBouncer skips the test when pgbouncer is not on the machine, with a
// message naming the command that installs it, or fails it under CI=true,
// for a test that starts PgBouncer itself (through internal/pgbouncer).
func NeedBouncer(t testing.TB) {
	t.Helper()
	if _, err := pgbouncer.Find(); err != nil {
		msg := "pgtest: no PgBouncer for this test: " + err.Error()
		if CI() {
			t.Fatal(msg + " (CI=true: the tests through a pooler must run, not skip)")
		}
		t.Skip(msg)
	}
}
