//go:build unix

package pgcluster

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// available skips a test that needs the PostgreSQL binaries where they are
// missing, except under CI, where they must be there.
func available(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts PostgreSQL clusters")
	}
	if err := Available(); err != nil {
		if ci, _ := strconv.ParseBool(os.Getenv("CI")); ci {
			t.Fatal(err)
		}
		t.Skip(err)
	}
}

func TestStartStop(t *testing.T) {
	available(t)
	c, err := Start(Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := ping(ctx, c.URL()); err != nil {
		t.Errorf("ping %s: %v", c.URL(), err)
	}
	if c.Host() != c.Dir() {
		t.Errorf("host %q without TCP, want the socket's directory %q", c.Host(), c.Dir())
	}
	if err := c.Stop(); err != nil {
		t.Errorf("stop: %v", err)
	}
	if _, err := os.Stat(c.Dir()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("cluster directory %s after stop: %v; want it deleted", c.Dir(), err)
	}
	if err := ping(ctx, c.URL()); err == nil {
		t.Error("cluster still answers after stop")
	}
}

// TestStartFails starts a postgres that exits at once (an unknown
// setting): Start says so without waiting out its timeout, with TCP after
// its tries, and leaves no directory behind.
func TestStartFails(t *testing.T) {
	available(t)
	for _, tcp := range []bool{false, true} {
		begin := time.Now()
		c, err := Start(Config{TCP: tcp, Settings: []string{"no_such_setting=1"}})
		if err == nil {
			c.Stop()
			t.Fatalf("TCP %v: Start with an unknown setting succeeded", tcp)
		}
		if !errors.Is(err, errExited) || time.Since(begin) > readyTimeout/2 {
			t.Errorf("TCP %v: Start: %v after %s; want errExited at once", tcp, err, time.Since(begin))
		}
	}
	left, _ := filepath.Glob(filepath.Join(os.TempDir(), "pgcluster-*"))
	for _, dir := range left {
		if b, err := os.ReadFile(filepath.Join(dir, "postgres.log")); err == nil && strings.Contains(string(b), "no_such_setting") {
			t.Errorf("directory %s left behind", dir)
		}
	}
}

// TestStandbyKillPromote starts a primary and a standby on loopback,
// writes on the primary, kills it, promotes the standby, and finds there
// what the standby had received, writable. The standby is synchronous,
// through the primary's synchronous_standby_names, which it does not
// inherit: once promoted, its commits do not wait for a standby of its own.
func TestStandbyKillPromote(t *testing.T) {
	available(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	primary, err := Start(Config{TCP: true, Settings: []string{"synchronous_standby_names=*"}})
	if err != nil {
		t.Fatal(err)
	}
	defer primary.Stop()
	standby, err := primary.StartStandby(Config{TCP: true})
	if err != nil {
		t.Fatal(err)
	}
	defer standby.Stop()
	if primary.Host() != "127.0.0.1" || standby.Host() != "127.0.0.1" || primary.Port() == standby.Port() {
		t.Fatalf("primary %s:%d, standby %s:%d: want two ports of 127.0.0.1", primary.Host(), primary.Port(), standby.Host(), standby.Port())
	}
	exec := func(c *Cluster, sql string) {
		t.Helper()
		conn, err := pgx.Connect(ctx, c.URL())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	query := func(c *Cluster, sql string, dst ...any) error {
		conn, err := pgx.Connect(ctx, c.URL())
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		return conn.QueryRow(ctx, sql).Scan(dst...)
	}
	exec(primary, "CREATE TABLE t (v int); INSERT INTO t VALUES (1)")
	var lsn string
	if err := query(primary, "SELECT pg_current_wal_lsn()::text", &lsn); err != nil {
		t.Fatal(err)
	}
	for {
		var caughtUp bool
		if err := query(standby, "SELECT pg_last_wal_replay_lsn() >= '"+lsn+"'::pg_lsn", &caughtUp); err != nil {
			t.Fatal(err)
		}
		if caughtUp {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	var names, state string
	if err := query(standby, "SHOW synchronous_standby_names", &names); err != nil || names != "" {
		t.Errorf("the standby's synchronous_standby_names %q (%v): want the primary's command-line setting not copied", names, err)
	}
	if err := query(primary, "SELECT sync_state FROM pg_stat_replication", &state); err != nil || state != "sync" {
		t.Errorf("the standby's sync_state %q (%v), want sync", state, err)
	}

	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := ping(ctx, primary.URL()); err == nil {
		t.Fatal("the primary answers after Kill")
	}
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	exec(standby, "INSERT INTO t VALUES (2)")
	var n int
	if err := query(standby, "SELECT count(*) FROM t", &n); err != nil || n != 2 {
		t.Errorf("promoted standby holds %d rows (%v), want 2", n, err)
	}
	if err := primary.Stop(); err != nil {
		t.Errorf("stopping the killed primary: %v", err)
	}
	if _, err := os.Stat(primary.Dir()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("killed primary's directory %s after stop: %v; want it deleted", primary.Dir(), err)
	}
}
