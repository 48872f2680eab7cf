//go:build poolers

package main

import (
	"testing"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestChaosThroughPgBouncer runs the short chaos test of TestChaos with
// the replicas behind PgBouncer in transaction mode, in pgx's exec mode:
// their backends terminated under them are PgBouncer's server connections,
// and consecutive statements of one replica's connection run on different
// sessions. make poolers runs it.
func TestChaosThroughPgBouncer(t *testing.T) {
	if testing.Short() {
		t.Skip("the chaos test runs for about 30s; skipped with -short")
	}
	pgtest.NeedBouncer(t)
	testChaos(t, "", "-pgbouncer", "transaction", "-query-exec-mode", "exec")
}
