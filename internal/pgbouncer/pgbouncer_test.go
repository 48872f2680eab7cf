package pgbouncer_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/pgbouncer"
	"github.com/idemkit/idem/internal/pgtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// backends returns the backend of each of two connections to url, held
// open at once, as each sees it in a statement of its own, one after the
// other, sent in the simple protocol (pgx's default mode would prepare it
// twice on one backend, an error in transaction mode).
func backends(t *testing.T, url string) (a, b int32) {
	t.Helper()
	ctx := context.Background()
	c1, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close(ctx)
	c2, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close(ctx)
	if err := c1.QueryRow(ctx, "SELECT pg_backend_pid()", pgx.QueryExecModeSimpleProtocol).Scan(&a); err != nil {
		t.Fatal(err)
	}
	if err := c2.QueryRow(ctx, "SELECT pg_backend_pid()", pgx.QueryExecModeSimpleProtocol).Scan(&b); err != nil {
		t.Fatal(err)
	}
	return a, b
}

// TestPoolModes: in transaction mode two connections open at once take
// turns on one backend (the bouncer hands out the one it used last); in
// session mode each has its own. Either way the server connections'
// search_path is the test's schema.
func TestPoolModes(t *testing.T) {
	for _, tt := range []struct {
		mode   string
		shared bool
	}{{pgbouncer.Transaction, true}, {pgbouncer.Session, false}} {
		t.Run(tt.mode, func(t *testing.T) {
			url := pgtest.Bouncer(t, pgbouncer.Config{PoolMode: tt.mode})
			a, b := backends(t, url)
			if (a == b) != tt.shared {
				t.Errorf("two connections at once ran on backends %d and %d; want shared: %v", a, b, tt.shared)
			}
			ctx := context.Background()
			conn, err := pgx.Connect(ctx, url+" default_query_exec_mode=exec")
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			var schema, app string
			if err := conn.QueryRow(ctx, "SELECT current_schema(), current_setting('application_name')").Scan(&schema, &app); err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(schema, "pgtest_testpoolmodes_") || app != schema {
				t.Errorf("through the bouncer: schema %q, application_name %q; want the test's schema for both", schema, app)
			}
		})
	}
}

// TestStartRefusesBadConfig: a pool mode PgBouncer would not serve, or a
// server setting it cannot quote, is an error before anything starts.
func TestStartRefusesBadConfig(t *testing.T) {
	ctx := context.Background()
	for _, cfg := range []pgbouncer.Config{
		{Server: "host=127.0.0.1 user=postgres", PoolMode: "statement"},
		{Server: "host=127.0.0.1 user=postgres", SearchPath: "a b"},
		{Server: "host=127.0.0.1 user=postgres password='x''y'"},
	} {
		if b, err := pgbouncer.Start(ctx, cfg); err == nil {
			b.Close()
			t.Errorf("Start(%+v) succeeded, want an error", cfg)
		}
	}
}

// TestCloseRemovesDirectory: Close stops PgBouncer and deletes its
// directory; its socket answers no more.
func TestCloseRemovesDirectory(t *testing.T) {
	if _, err := pgbouncer.Find(); err != nil && !pgtest.CI() {
		t.Skip(err)
	}
	ctx := context.Background()
	b, err := pgbouncer.Start(ctx, pgbouncer.Config{Server: pgtest.URL(t)})
	if err != nil {
		t.Fatal(err)
	}
	url := b.URL()
	dir := strings.TrimPrefix(strings.Fields(url)[0], "host=")
	if err := b.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("directory %s after Close: %v; want it deleted", dir, err)
	}
	if c, err := pgx.Connect(ctx, url); err == nil {
		c.Close(ctx)
		t.Error("the bouncer still answers after Close")
	}
}

// TestTransactionModeSharesStatements shows why pgx's describe_exec and
// cache_statement modes cannot work behind a pooler in transaction mode:
// what one client prepares outside a transaction is on a session that the
// next client gets. Here the first client describes a statement (the
// first round trip of describe_exec), a second client describes another
// on the same session, and the first client's Bind, in its second round
// trip, runs the second client's statement with its own arguments.
func TestTransactionModeSharesStatements(t *testing.T) {
	ctx := context.Background()
	url := pgtest.Bouncer(t, pgbouncer.Config{PoolMode: pgbouncer.Transaction})
	c1, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close(ctx)
	c2, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close(ctx)
	mine, err := c1.PgConn().Prepare(ctx, "", "SELECT $1::int + 1", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c2.PgConn().Prepare(ctx, "", "SELECT $1::int * 100", nil); err != nil {
		t.Fatal(err)
	}
	res := c1.PgConn().ExecStatement(ctx, mine, [][]byte{[]byte("1")}, nil, nil).Read()
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	if got := string(res.Rows[0][0]); got != "100" {
		t.Errorf("SELECT 1 + 1, bound in a second round trip, = %s; want the other client's statement's 100", got)
	}
}
