package pgtest

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/pgbouncer"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestPoolIsolatesTests(t *testing.T) {
	ctx := context.Background()
	a, b := Pool(t), Pool(t)
	// The same table name in two pools: two schemas, no collision.
	for i, p := range []*struct{ name string }{{"a"}, {"b"}} {
		pool := a
		if i == 1 {
			pool = b
		}
		if _, err := pool.Exec(ctx, "CREATE TABLE t (v text); INSERT INTO t VALUES ('"+p.name+"')"); err != nil {
			t.Fatalf("pool %s: %v", p.name, err)
		}
	}
	var got string
	if err := b.QueryRow(ctx, "SELECT v FROM t").Scan(&got); err != nil || got != "b" {
		t.Fatalf("pool b reads %q, %v; want its own row b", got, err)
	}
	var schemaA, schemaB string
	_ = a.QueryRow(ctx, "SELECT current_schema()").Scan(&schemaA)
	_ = b.QueryRow(ctx, "SELECT current_schema()").Scan(&schemaB)
	if schemaA == schemaB || !strings.HasPrefix(schemaA, "pgtest_testpoolisolatestests_") {
		t.Errorf("schemas %q and %q: want two distinct pgtest_testpoolisolatestests_* schemas", schemaA, schemaB)
	}
}

func TestSchemaDroppedOnCleanup(t *testing.T) {
	ctx := context.Background()
	var schema string
	t.Run("user", func(t *testing.T) {
		pool := Pool(t)
		if _, err := pool.Exec(ctx, "CREATE TABLE t (v int)"); err != nil {
			t.Fatal(err)
		}
		if err := pool.QueryRow(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
			t.Fatal(err)
		}
	})
	conn, err := pgx.Connect(ctx, URL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_namespace WHERE nspname = $1", schema).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if schema == "" || n != 0 {
		t.Errorf("schema %q still exists after the test ended (count %d)", schema, n)
	}
}

func TestSchemaURLSetsSearchPath(t *testing.T) {
	ctx := context.Background()
	u := SchemaURL(t)
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var schema string
	if err := conn.QueryRow(ctx, "SELECT current_schema()").Scan(&schema); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(schema, "pgtest_testschemaurlsetssearchpath_") {
		t.Errorf("current_schema() = %q, want the test's own schema", schema)
	}
	var app string
	if err := conn.QueryRow(ctx, "SELECT current_setting('application_name')").Scan(&app); err != nil {
		t.Fatal(err)
	}
	if app != schema {
		t.Errorf("application_name = %q, want the schema's name %q", app, schema)
	}
}

func TestWithSession(t *testing.T) {
	tests := []struct{ in, want string }{
		{"postgres://u@h:1/db?sslmode=disable", "postgres://u@h:1/db?application_name=s&search_path=s&sslmode=disable"},
		{"postgresql://u@h/db", "postgresql://u@h/db?application_name=s&search_path=s"},
		{"host=/tmp/x port=5 user=u", "host=/tmp/x port=5 user=u search_path=s application_name=s"},
	}
	for _, tt := range tests {
		if got := withSession(tt.in, "s"); got != tt.want {
			t.Errorf("withSession(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestSchemaName(t *testing.T) {
	long := strings.Repeat("Sub/Test-", 20)
	for _, name := range []string{"TestX", "TestX/sub_test#01", long} {
		got := schemaName(name)
		if len(got) > 63 || strings.Trim(got, "abcdefghijklmnopqrstuvwxyz0123456789_") != "" {
			t.Errorf("schemaName(%q) = %q: want at most 63 characters of [a-z0-9_]", name, got)
		}
		if schemaName(name) == got {
			t.Errorf("schemaName(%q) returned %q twice", name, got)
		}
	}
}

// recorder is a testing.TB that records Skip and Fatal instead of ending the
// goroutine.
type recorder struct {
	testing.TB
	skipped, failed string
}

func (r *recorder) Helper()           {}
func (r *recorder) Skip(args ...any)  { r.skipped = fmt.Sprint(args...) }
func (r *recorder) Fatal(args ...any) { r.failed = fmt.Sprint(args...) }

func TestUnavailable(t *testing.T) {
	err := errors.New("nothing answers")
	for _, tt := range []struct {
		ci       string
		wantFail bool
	}{{"", false}, {"false", false}, {"true", true}, {"1", true}} {
		t.Setenv("CI", tt.ci)
		r := &recorder{TB: t}
		unavailable(r, err)
		msg := r.skipped
		if tt.wantFail {
			msg = r.failed
		}
		if (r.failed != "") != tt.wantFail || !strings.Contains(msg, EnvURL) || !strings.Contains(msg, "nothing answers") {
			t.Errorf("CI=%q: skipped %q, failed %q; want a %s naming %s and the cause",
				tt.ci, r.skipped, r.failed, map[bool]string{false: "skip", true: "failure"}[tt.wantFail], EnvURL)
		}
	}
}

// TestNeedBouncer: without pgbouncer (here IDEM_PGBOUNCER names a file
// that does not exist), a test that needs it is skipped, naming the
// command that installs it, and fails under CI=true.
func TestNeedBouncer(t *testing.T) {
	t.Setenv(pgbouncer.EnvBinary, filepath.Join(t.TempDir(), "no-pgbouncer"))
	for _, tt := range []struct {
		ci       string
		wantFail bool
	}{{"", false}, {"true", true}} {
		t.Setenv("CI", tt.ci)
		r := &recorder{TB: t}
		NeedBouncer(r)
		msg := r.skipped
		if tt.wantFail {
			msg = r.failed
		}
		if (r.failed != "") != tt.wantFail || !strings.Contains(msg, pgbouncer.Install) || !strings.Contains(msg, pgbouncer.EnvBinary) {
			t.Errorf("CI=%q: skipped %q, failed %q; want a %s naming %s and %q",
				tt.ci, r.skipped, r.failed, map[bool]string{false: "skip", true: "failure"}[tt.wantFail], pgbouncer.EnvBinary, pgbouncer.Install)
		}
	}
}
