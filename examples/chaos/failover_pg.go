package main

// The failover test's PostgreSQL: the primary and its standby, and the
// statements the test runs on them.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgcluster"
)

// startPair starts the run's primary and its standby, both on loopback:
// with -failover sync, the primary names every standby synchronous
// (synchronous_standby_names=*, on its command line, so that the standby
// does not inherit it).
func startPair(ctx context.Context, cfg config) (primary, standby *pgcluster.Cluster, err error) {
	if err := pgcluster.Available(); err != nil {
		return nil, nil, fmt.Errorf("the failover test starts its own PostgreSQL primary and standby: %w", err)
	}
	var settings []string
	if cfg.failover == failoverSync {
		settings = append(settings, "synchronous_standby_names=*")
	}
	if primary, err = pgcluster.Start(pgcluster.Config{TCP: true, Settings: settings}); err != nil {
		return nil, nil, fmt.Errorf("primary: %w", err)
	}
	if standby, err = primary.StartStandby(pgcluster.Config{TCP: true}); err != nil {
		primary.Stop()
		return nil, nil, fmt.Errorf("standby: %w", err)
	}
	return primary, standby, nil
}

// awaitStandby waits until the standby streams from the primary with
// sync_state want there (sync or async; a synchronous standby is reported
// async for a moment after it starts streaming). A standby that inherited
// synchronous_standby_names is an error: once promoted, it would wait at
// every commit for a standby it does not have.
func awaitStandby(ctx context.Context, primary, standby *pgcluster.Cluster, want string) error {
	var names string
	if err := queryRow(ctx, standby, "SHOW synchronous_standby_names", &names); err != nil {
		return fmt.Errorf("standby: %w", err)
	}
	if names != "" {
		return fmt.Errorf("the standby has synchronous_standby_names %q: once promoted, its commits would wait for a standby of its own", names)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var state string
		err := queryRow(ctx, primary, "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'", &state)
		switch {
		case err == nil && state == want:
			return nil
		case err != nil && !errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("primary: %w", err)
		case time.Now().After(deadline):
			return fmt.Errorf("the standby is not streaming with sync_state %s 30s after it started (%q, %v); see %s",
				want, state, err, standby.LogPath())
		}
		if !sleep(ctx, 50*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// lsnDiff returns the bytes of WAL from LSN b to LSN a ("16/B374D848"),
// or 0 when either cannot be read.
func lsnDiff(a, b string) int64 {
	parse := func(lsn string) (uint64, bool) {
		hi, lo, ok := strings.Cut(lsn, "/")
		h, err1 := strconv.ParseUint(hi, 16, 32)
		l, err2 := strconv.ParseUint(lo, 16, 32)
		return h<<32 | l, ok && err1 == nil && err2 == nil
	}
	x, ok1 := parse(a)
	y, ok2 := parse(b)
	if !ok1 || !ok2 {
		return 0
	}
	return int64(x - y)
}

// holdBack makes the standby stop receiving WAL, as a lagging or
// partitioned asynchronous standby does, and waits until the primary sees
// no standby streaming. Pausing the standby's replay would not do: a
// promotion replays all the WAL the standby received first.
func holdBack(ctx context.Context, primary, standby *pgcluster.Cluster) error {
	for _, sql := range []string{"ALTER SYSTEM SET primary_conninfo = ''", "SELECT pg_reload_conf()"} {
		if err := execSQL(ctx, standby, sql); err != nil {
			return fmt.Errorf("standby: %s: %w", sql, err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		if err := queryRow(ctx, primary, "SELECT count(*) FROM pg_stat_replication", &n); err != nil {
			return fmt.Errorf("primary: %w", err)
		}
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("the standby still streams 10s after its primary_conninfo was emptied")
		}
		if !sleep(ctx, 20*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// queryRow runs sql on a connection of its own to cluster c and scans its
// one row into dst.
func queryRow(ctx context.Context, c *pgcluster.Cluster, sql string, dst ...any) error {
	return withConn(ctx, c, func(conn *pgx.Conn) error { return conn.QueryRow(ctx, sql).Scan(dst...) })
}

// execSQL runs sql on a connection of its own to cluster c.
func execSQL(ctx context.Context, c *pgcluster.Cluster, sql string) error {
	return withConn(ctx, c, func(conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, sql)
		return err
	})
}

// withConn calls f with a connection of its own to cluster c.
func withConn(ctx context.Context, c *pgcluster.Cluster, f func(*pgx.Conn) error) error {
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(cctx, c.URL())
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return f(conn)
}
