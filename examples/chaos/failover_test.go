package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestFailover runs the failover test in both modes, 20s of load each:
// make failover runs it (and CI); make test skips it. It needs the
// PostgreSQL binaries, not a running server: without them it is skipped,
// except under CI=true, where it fails.
func TestFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("the failover test runs for about a minute; skipped with -short")
	}
	if err := pgcluster.Available(); err != nil {
		if pgtest.CI() {
			t.Fatalf("the failover test needs the PostgreSQL binaries: %v (CI=true: it must run, not skip)", err)
		}
		t.Skip(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	bin, err := buildServer(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []string{failoverSync, failoverAsync} {
		t.Run(mode, func(t *testing.T) {
			cfg, err := parseFlags([]string{"-failover", mode, "-seed", "1", "-server-bin", bin}, &bytes.Buffer{})
			if err != nil {
				t.Fatal(err)
			}
			out := &progress{t: t}
			rep, err := runFailover(ctx, cfg, out)
			if err != nil {
				t.Fatalf("runFailover: %v", err)
			}
			if err := rep.err(); err != nil {
				t.Error(err)
			}
			v := rep.after
			if v.operations == 0 || v.succeeded != v.operations {
				t.Errorf("%d of %d operations succeeded; want all of at least one", v.succeeded, v.operations)
			}
			if rep.recovery <= 0 || rep.promotedAt <= rep.killAt {
				t.Errorf("killed at %s, promoted at %s, recovery %s: want a promotion after the kill, and a success after it",
					rep.killAt, rep.promotedAt, rep.recovery)
			}
			switch mode {
			case failoverSync:
				if rep.before.missing != 0 || rep.recon != (reconcileStats{}) {
					t.Errorf("synchronous: %d payments lost, reconciliation %+v; want none", rep.before.missing, rep.recon)
				}
			case failoverAsync:
				// The loss window was exercised, and everything it lost came back.
				if rep.before.missing == 0 || rep.walBehind <= 0 {
					t.Errorf("asynchronous: %d payments lost, the standby %d bytes behind at the kill; want some of both", rep.before.missing, rep.walBehind)
				}
				if r := rep.recon; r.gone != rep.before.missing || r.restored != r.gone || r.other != 0 {
					t.Errorf("reconciliation %+v of %d lost: want every one gone and restored as told", r, rep.before.missing)
				}
				if rep.deduped < int64(rep.recon.restored) {
					t.Errorf("the processor answered %d charge requests with a charge it held, fewer than the %d payments restored", rep.deduped, rep.recon.restored)
				}
			}

			// The output ends with the figures docs/chaos.md shows.
			lines := strings.Split(strings.TrimSpace(out.String()), "\n")
			if len(lines) < 5 {
				t.Fatalf("output too short")
			}
			last := lines[len(lines)-5:]
			if !strings.HasPrefix(last[0], "operations: ") || last[1] != "duplicates: 0" || last[2] != "double-charged keys: 0" ||
				!strings.HasPrefix(last[3], "lost: ") || !strings.HasPrefix(last[4], "recovery: ") {
				t.Errorf("last lines %q, want operations, duplicates: 0, double-charged keys: 0, lost, recovery", last)
			}
		})
	}
}

func TestLSNDiff(t *testing.T) {
	tests := []struct {
		a, b string
		want int64
	}{
		{"0/3000000", "0/2FFFF00", 0x100},
		{"1/0", "0/FFFFFFFF", 1},
		{"16/B374D848", "16/B374D848", 0},
		{"0/10", "0/20", -0x10},
		{"x", "0/0", 0},
	}
	for _, tt := range tests {
		if got := lsnDiff(tt.a, tt.b); got != tt.want {
			t.Errorf("lsnDiff(%q, %q) = %d, want %d", tt.a, tt.b, got, tt.want)
		}
	}
}

func TestParseFlagsFailover(t *testing.T) {
	cfg, err := parseFlags([]string{"-failover", "async"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.kills != 0 || cfg.restarts != 0 || cfg.terminations != 0 || cfg.mix.Reset+cfg.mix.Drop+cfg.mix.Stall+cfg.mix.Latency != 0 ||
		cfg.invalidRate+cfg.holdRate+cfg.cancelRate+cfg.lateRate+cfg.vanishRate+cfg.processorFails != 0 || cfg.slowDelay != 0 {
		t.Errorf("-failover: %+v; want none of the chaos faults", cfg)
	}
	if cfg.duration != 20*time.Second || cfg.replicas != 2 || cfg.retention != 10*time.Minute || cfg.databaseURL != "" {
		t.Errorf("-failover defaults: %s, %d replicas, retention %s, database %q; want 20s, 2, 10m, none",
			cfg.duration, cfg.replicas, cfg.retention, cfg.databaseURL)
	}
	for _, args := range [][]string{
		{"-failover", "maybe"},
		{"-failover", "sync", "-kills", "1"},
		{"-failover", "sync", "-database-url", "postgres://x"},
		{"-failover", "sync", "-replication-lag", "1s"},
		{"-failover", "async", "-duration", "5s", "-replication-lag", "2s"},
	} {
		if _, err := parseFlags(args, &bytes.Buffer{}); err == nil {
			t.Errorf("parseFlags(%q) succeeded, want an error", args)
		}
	}
}
