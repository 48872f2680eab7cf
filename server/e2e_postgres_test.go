package server

import "testing"

// TestEndToEndPostgres runs the end-to-end tests on PostgreSQL, each test on
// a schema of its own. Without a database it is skipped, except under
// CI=true, where pgtest fails it.
func TestEndToEndPostgres(t *testing.T) {
	testEndToEnd(t, postgresStorage)
}
