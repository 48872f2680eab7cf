package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// EnvURL names the environment variable that points the tests at a database.
const EnvURL = "IDEM_TEST_DATABASE_URL"

// localURL is the database tried when EnvURL is not set.
const localURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// cleanupTimeout bounds the DROP SCHEMA run when a test ends.
const cleanupTimeout = 30 * time.Second

// discover finds the database once per test binary; see the package doc.
var discover = sync.OnceValues(func() (string, error) {
	if u := os.Getenv(EnvURL); u != "" {
		return u, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	localErr := ping(ctx, localURL)
	if localErr == nil {
		return localURL, nil
	}
	u, clusterErr := startCluster()
	if clusterErr != nil {
		return "", fmt.Errorf("%s is not set, %s does not answer (%v), and no throwaway cluster could be started (%v)",
			EnvURL, localURL, localErr, clusterErr)
	}
	return u, nil
})

// URL returns the connection string of the test database, shared by every
// test of the binary. Most tests want [Pool] or [SchemaURL] instead, which
// isolate them. When no database can be had, URL skips the test, or fails it
// under CI=true.
func URL(t testing.TB) string {
	t.Helper()
	u, err := discover()
	if err != nil {
		unavailable(t, err)
	}
	return u
}

// SchemaURL creates a schema with a unique name and returns a connection
// string whose search_path is that schema, for code under test that opens
// its own connections (a server started with -database-url, say), and
// whose application_name is the schema's name too (see withSession). The schema
// and everything in it are dropped when the test ends.
func SchemaURL(t testing.TB) string {
	t.Helper()
	base, schema := newSchema(t)
	return withSession(base, schema)
}

// newSchema creates a schema with a unique name, dropped when the test
// ends, and returns the test database's connection string and the
// schema's name.
func newSchema(t testing.TB) (base, schema string) {
	t.Helper()
	base = URL(t)
	schema = schemaName(t.Name())
	ctx := context.Background()
	if err := execOnce(ctx, base, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Fatalf("pgtest: create schema %s (set %s to use another database): %v", schema, EnvURL, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
		defer cancel()
		if err := dropSchema(ctx, base, schema); err != nil {
			t.Errorf("pgtest: %v", err)
		}
	})
	return base, schema
}

// Pool returns a pool whose connections use a fresh schema of their own as
// search_path, so the test can create tables without meeting any other
// test's. The pool is closed and the schema dropped when the test ends; the
// test must not close the pool itself.
func Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return PoolWith(t, nil)
}

// PoolWith is Pool with the pool's configuration adjusted by configure, if
// not nil, before the pool opens: its size, a tracer.
func PoolWith(t testing.TB, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	u := SchemaURL(t) // registered first, so its cleanup runs after Close
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		t.Fatalf("pgtest: parse connection string: %v", err)
	}
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pgtest: open pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// unavailable ends a test that cannot have a database: a failure under CI,
// a skip elsewhere.
func unavailable(t testing.TB, err error) {
	t.Helper()
	msg := fmt.Sprintf("pgtest: no PostgreSQL for this test: %v; set %s to a database URL", err, EnvURL)
	if CI() {
		t.Fatal(msg + " (CI=true: database tests must run, not skip)")
	}
	t.Skip(msg)
}

var nonIdent = regexp.MustCompile(`[^a-z0-9]+`)

// schemaName makes a unique, valid, readable schema name from a test name.
func schemaName(testName string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := strings.Trim(nonIdent.ReplaceAllString(strings.ToLower(testName), "_"), "_")
	const maxPrefix = 63 - len("pgtest__") - 2*len(b)
	if len(prefix) > maxPrefix {
		prefix = prefix[:maxPrefix]
	}
	return "pgtest_" + prefix + "_" + hex.EncodeToString(b[:])
}

// withSession adds search_path=schema and application_name=schema to a
// connection string in either of the forms pgx and lib/pq accept (pgx
// sends unknown settings as run-time parameters). The application name
// tells the test's sessions from other tests' in pg_stat_activity:
// packages run at the same time against one database, so a test that
// looks at sessions filters on application_name =
// current_setting('application_name').
func withSession(conn, schema string) string {
	if strings.HasPrefix(conn, "postgres://") || strings.HasPrefix(conn, "postgresql://") {
		u, err := url.Parse(conn)
		if err == nil {
			q := u.Query()
			q.Set("search_path", schema)
			q.Set("application_name", schema)
			u.RawQuery = q.Encode()
			return u.String()
		}
	}
	return conn + " search_path=" + schema + " application_name=" + schema // schema names are plain identifiers
}

// ping connects to conn once and runs a trivial query.
func ping(ctx context.Context, conn string) error {
	return execOnce(ctx, conn, "SELECT 1")
}

// execOnce runs sql on a connection of its own.
func execOnce(ctx context.Context, conn, sql string) error {
	c, err := pgx.Connect(ctx, conn)
	if err != nil {
		return err
	}
	defer c.Close(context.WithoutCancel(ctx))
	_, err = c.Exec(ctx, sql)
	return err
}

// dropSchema drops schema and its contents. A lock wait longer than the
// cleanup timeout means the test left a transaction open on the schema.
func dropSchema(ctx context.Context, conn, schema string) error {
	if err := execOnce(ctx, conn, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("drop schema %s: %w", schema, err)
	}
	return nil
}

// MainPool is Pool for code that has no test to hand, such as the
// runnable examples of a package, which a TestMain sets up: a pool on a
// fresh schema, and a cleanup that closes it and drops the schema. The
// error says why no database could be had; under CI=true the caller must
// fail with it, elsewhere it may skip.
func MainPool(name string) (*pgxpool.Pool, func(), error) {
	base, err := discover()
	if err != nil {
		return nil, nil, fmt.Errorf("pgtest: no PostgreSQL: %v; set %s to a database URL", err, EnvURL)
	}
	ctx := context.Background()
	schema := schemaName(name)
	if err := execOnce(ctx, base, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return nil, nil, fmt.Errorf("pgtest: create schema %s: %w", schema, err)
	}
	pool, err := pgxpool.New(ctx, withSession(base, schema))
	if err != nil {
		_ = dropSchema(ctx, base, schema)
		return nil, nil, fmt.Errorf("pgtest: open pool: %w", err)
	}
	return pool, func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(ctx, cleanupTimeout)
		defer cancel()
		_ = dropSchema(ctx, base, schema)
	}, nil
}

// CI reports whether the tests run under CI (CI=true), where a database
// test must fail, never skip, without PostgreSQL.
func CI() bool {
	ci, _ := strconv.ParseBool(os.Getenv("CI"))
	return ci
}
