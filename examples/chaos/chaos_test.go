package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/pgtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// progress logs the run's output line by line as it comes, so that
// go test -v (make test runs this package so) shows the chaos test's
// timeline while it runs, and keeps it whole for the checks.
type progress struct {
	t *testing.T
	bytes.Buffer
	partial []byte
}

func (p *progress) Write(b []byte) (int, error) {
	p.Buffer.Write(b)
	p.partial = append(p.partial, b...)
	for {
		i := bytes.IndexByte(p.partial, '\n')
		if i < 0 {
			return len(b), nil
		}
		p.t.Log(string(p.partial[:i]))
		p.partial = p.partial[i+1:]
	}
}

// TestChaos runs a short chaos test: two replicas, one SIGKILL, three
// rounds of backend terminations and the proxy's faults, with a fixed seed.
// It asserts outcomes only, never timings: the grace period is generous so
// that a loaded machine merely makes it slower.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("the chaos test runs for about 30s; skipped with -short")
	}
	t.Run("default", func(t *testing.T) { testChaos(t, "") })
}

func testChaos(t *testing.T, serverArgs string, more ...string) {
	dbURL := pgtest.URL(t) // fails under CI=true when there is no database
	args := append([]string{
		"-duration", "8s", "-grace", "3m", "-seed", "1",
		"-replicas", "2", "-clients", "6", "-kills", "1", "-restarts", "1", "-pg-terminations", "3",
		"-invalid-text", "0.1", "-hold", "0.1", "-cancel", "0.2", "-late", "0.2", "-vanish", "0.2",
		"-database-url", dbURL, "-server-args", serverArgs,
	}, more...)
	cfg, err := parseFlags(args, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	out := &progress{t: t}
	rep, err := runChaos(ctx, cfg, out)
	if err != nil {
		t.Fatalf("runChaos: %v", err)
	}
	v := rep.verdict
	if v.duplicates() != 0 || v.lost() != 0 {
		t.Errorf("duplicates %d, lost %d; want 0 and 0", v.duplicates(), v.lost())
	}
	if err := v.err(); err != nil {
		t.Error(err)
	}
	if v.operations == 0 || v.succeeded+v.vanished != v.operations {
		t.Errorf("%d of %d operations succeeded, %d vanished; want all of at least one to succeed but those that vanished",
			v.succeeded, v.operations, v.vanished)
	}
	// Clients vanished after unknown outcomes; every charge still has its
	// payment (checked above), thanks to the sweepers.
	if v.vanished == 0 {
		t.Errorf("no client vanished")
	}
	// The faults were injected.
	if rep.kills != 1 || rep.restarts != 1 || rep.termRounds != 3 {
		t.Errorf("%d kills, %d graceful restarts and %d termination rounds, want 1, 1 and 3", rep.kills, rep.restarts, rep.termRounds)
	}
	if v.invalid == 0 || v.acceptedInvalid != 0 || v.orphanCharges != 0 {
		t.Errorf("%d operations sent invalid text first, %d accepted; %d charges without a payment; want some, 0 and 0",
			v.invalid, v.acceptedInvalid, v.orphanCharges)
	}
	// Transactions were held past the retention, and calls cancelled
	// mid-flight; their operations still succeeded once.
	if held := rep.serverLogs["payments: holding the transaction after the payment's insert (Faults.HoldAfterWrite)"]; held == 0 {
		t.Errorf("no transaction held past the retention")
	}
	if cancelled := rep.stats.unknown["cancelled by the caller"]; cancelled == 0 {
		t.Errorf("no call cancelled by its caller")
	}
	// Operations sent again after their key's retention, their key and
	// first-sent time pinned, were refused, never paid again.
	if l := rep.late; l.refused == 0 || l.paid != 0 || l.other != 0 {
		t.Errorf("late retries %+v: want some refused (410), none paid again, none other", l)
	}
	if rep.proxy.Connections == 0 || rep.proxy.Connections == rep.proxy.Faults[faultproxy.Pass] {
		t.Errorf("proxy stats %+v: want connections, some of them faulted", rep.proxy)
	}

	// The output ends with the three lines docs/chaos.md promises.
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) < 3 {
		t.Fatalf("output too short")
	}
	last := lines[len(lines)-3:]
	if !strings.HasPrefix(last[0], "operations: ") || last[1] != "duplicates: 0" || last[2] != "lost: 0" {
		t.Errorf("last lines %q, want operations: N, duplicates: 0, lost: 0", last)
	}

	// The run's schema is gone.
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_namespace WHERE nspname = $1", rep.schema).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("schema %s still exists after the run", rep.schema)
	}
}

// TestChaosCatchesKeyPerAttempt is the negative control: with the classic
// client bug, a new key on every attempt, answers dropped after the server
// sent them become second payments, and the check must say so.
func TestChaosCatchesKeyPerAttempt(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for about 5s; skipped with -short")
	}
	args := []string{
		"-duration", "3s", "-grace", "3m", "-seed", "1",
		"-replicas", "1", "-clients", "4", "-kills", "0", "-pg-terminations", "0",
		"-drop", "0.3", "-reset", "0", "-stall", "0", "-latency", "0",
		// One replica, not slow (replica 0 is the slow one by default: with
		// it alone nothing would succeed within an attempt, and the run would
		// wait out its grace), and none of the other faults.
		"-slow-processor-delay", "0", "-hold", "0", "-cancel", "0", "-vanish", "0",
		"-bug-key-per-attempt", "-database-url", pgtest.URL(t), "-logs", t.TempDir(),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err := run(ctx, args, &out)
	t.Logf("output:\n%s", out.String())
	if err == nil || !strings.Contains(err.Error(), "duplicate") {
		t.Fatalf("run with a new key per attempt: %v; want an invariant violation naming duplicates", err)
	}
	if strings.Contains(out.String(), "\nduplicates: 0\n") {
		t.Error("the output reports no duplicates")
	}
}

func TestParseFlags(t *testing.T) {
	cfg, err := parseFlags([]string{"-duration", "30s"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.kills != 6 || cfg.terminations != 10 || cfg.replicas < 2 || cfg.databaseURL != defaultDatabaseURL {
		t.Errorf("defaults for 30s: %d kills, %d terminations, %d replicas, %q; want 6, 10, at least 2, the local server",
			cfg.kills, cfg.terminations, cfg.replicas, cfg.databaseURL)
	}
	for _, args := range [][]string{
		{"-duration", "0s"},
		{"-replicas", "0"},
		{"-clients", "2", "-accounts", "3"},
		{"-reset", "0.6", "-drop", "0.6"},
		{"-processor-failure-rate", "2"},
		{"-pgbouncer", "statement"},
		{"-query-exec-mode", "cache"},
		{"extra"},
	} {
		if _, err := parseFlags(args, &bytes.Buffer{}); err == nil {
			t.Errorf("parseFlags(%q) succeeded, want an error", args)
		}
	}
}
