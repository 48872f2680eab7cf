package pqtest

import (
	"testing"

	_ "github.com/lib/pq" // the "postgres" driver

	"github.com/idemkit/idem/server/sqlstore/internal/sqlstoretest"
)

// TestLibPQ runs the tests of sqlstore on lib/pq.
func TestLibPQ(t *testing.T) {
	sqlstoretest.Run(t, "postgres")
}
