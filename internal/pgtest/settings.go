package pgtest

import (
	"fmt"
	"testing"

	"github.com/idemkit/idem/internal/pgcluster"
)

// ClusterURL starts a throwaway cluster of the test's own with settings
// ("name=value", such as max_prepared_transactions=2, which the shared
// server may not have and cannot change without a restart) and returns
// the connection string of its postgres database. The cluster is stopped
// when the test ends. Without PostgreSQL's binaries the test is skipped,
// or fails under CI=true.
func ClusterURL(t testing.TB, settings ...string) string {
	t.Helper()
	if err := pgcluster.Available(); err != nil {
		msg := fmt.Sprintf("pgtest: no cluster with %v for this test: %v", settings, err)
		if CI() {
			t.Fatal(msg + " (CI=true: database tests must run, not skip)")
		}
		t.Skip(msg)
	}
	c, err := pgcluster.Start(pgcluster.Config{Settings: settings})
	if err != nil {
		t.Fatalf("pgtest: start a cluster with %v: %v", settings, err)
	}
	t.Cleanup(func() { _ = c.Stop() })
	return c.URL()
}
