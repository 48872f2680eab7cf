package pgbouncer_test

import (
	"testing"

	"github.com/idemkit/idem/internal/pgbouncer"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestVersion reads the version of the pgbouncer binary.
func TestVersion(t *testing.T) {
	pgtest.NeedBouncer(t)
	major, minor, err := pgbouncer.Version()
	if err != nil || major < 1 || minor < 0 {
		t.Fatalf("Version() = %d, %d, %v; want PgBouncer's major and minor version", major, minor, err)
	}
	t.Logf("PgBouncer %d.%d", major, minor)
}
