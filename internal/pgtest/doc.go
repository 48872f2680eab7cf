// Package pgtest gives each test its own schema on a real PostgreSQL and
// drops it when the test ends:
//
//	pool := pgtest.Pool(t) // search_path is a fresh schema, dropped on cleanup
//	err := server.Migrate(ctx, pool)
//
// # How the database is found
//
// The first test that asks for a database decides, once per test binary:
//
//  1. the connection string in IDEM_TEST_DATABASE_URL, if set (a URL or
//     keyword/value string as accepted by pgx; the role needs CREATE on the
//     database);
//  2. else the local server at postgres://postgres@127.0.0.1:5432/postgres,
//     if it answers;
//  3. else a throwaway cluster made with initdb and started from the
//     PostgreSQL binaries on the machine (PATH, then
//     /usr/lib/postgresql/*/bin) by package pgcluster. It listens on a Unix socket in a temporary
//     directory only, runs as the postgres OS user when the tests run as root
//     (initdb refuses root), and is stopped and deleted when the test binary
//     exits, however it exits. go test runs each package as its own binary,
//     so each package that falls back to it gets its own cluster.
//
// When none of these works the test is skipped with a message naming
// IDEM_TEST_DATABASE_URL, except under CI=true, where it fails: CI must never
// pass by skipping the database tests.
//
// # Through PgBouncer
//
// [Bouncer] starts a throwaway PgBouncer (internal/pgbouncer) in front of
// that database, on a fresh schema, for the tests of the stores behind a
// pooler:
//
//	url := pgtest.Bouncer(t, pgbouncer.Config{PoolMode: pgbouncer.Transaction})
//	pool, err := pgxpool.New(ctx, url+" default_query_exec_mode=exec")
//
// Without pgbouncer on the machine such a test is skipped, naming the
// command that installs it, and fails under CI=true.
package pgtest
