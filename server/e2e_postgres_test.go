package server

import (
	"context"
	"testing"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestEndToEndPostgres runs the end-to-end tests on PostgreSQL, each test on
// a schema of its own. Without a database it is skipped, except under
// CI=true, where pgtest fails it.
func TestEndToEndPostgres(t *testing.T) {
	testEndToEnd(t, func(t *testing.T) Store {
		pool := pgtest.Pool(t)
		if err := Migrate(context.Background(), pool); err != nil {
			t.Fatal(err)
		}
		return NewPostgresStore(pool)
	})
}
