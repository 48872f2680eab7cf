package server

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
)

// tracedPool returns a migrated pool of one connection on a schema of its
// own, whose round trips trips counts. One connection makes the counts
// exact: every statement is prepared once, on it.
func tracedPool(t *testing.T, trips *DBRoundTrips) *pgxpool.Pool {
	t.Helper()
	return migratedTracedPool(t, trips, 1)
}

// migratedTracedPool returns a migrated pool of at most conns connections
// on a schema of its own, traced by tracer.
func migratedTracedPool(t *testing.T, tracer pgx.QueryTracer, conns int32) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = conns
		cfg.ConnConfig.Tracer = tracer
	})
	if err := Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

// TestDBRoundTripsPerRequest pins the database round trips of each kind of
// request on PostgreSQL, as counted by DBRoundTrips and served on /metrics.
// A change that adds a round trip to the hot path fails here.
//
//   - A first execution makes five: the claim (its own committed
//     statement); the fake processor's charge (it shares the pool); the
//     BEGIN of pgstore.Tx, which reads the transaction's ID in the same
//     round trip; the payment's INSERT; and the key's completion,
//     pipelined with the COMMIT.
//   - A replay makes one: the read of the key's row, which returns the
//     stored outcome, pipelined with the claim's insert, which finds the
//     key there (see pgstore's insertClaim), for a retry as the SDK sends
//     it, with the first attempt's Repeatability-First-Sent; a replay
//     without the header makes two, the insert and then the read.
//   - A malformed payment makes none: it is refused before its key is
//     claimed (idempotency.Options.Validate).
//   - The corrected request with the key of such a 400 makes five, as a
//     first execution: the key was never used.
//   - An unkeyed payment (Config.NoIdempotency) makes four: the charge,
//     and BEGIN, INSERT and COMMIT of pgx.BeginFunc, one round trip each.
//     The idempotency layer adds no round trip to it: the claim it adds is
//     paid back by the BEGIN that pgstore pipelines with the INSERT, and
//     the completion travels with the COMMIT.
func TestDBRoundTripsPerRequest(t *testing.T) {
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_1"}`
	bad := `{"amount": -1, "currency": "usd", "customer": "cus_1"}` // 400 before the claim
	t.Run("keyed", func(t *testing.T) {
		trips := new(DBRoundTrips)
		storage := NewPostgresStorage(tracedPool(t, trips))
		ts := newTestServer(t, storage.Storage(), Config{DBRoundTrips: trips})
		cases := []struct {
			name       string
			key        func(i int) string
			body       string
			wantStatus int
			want       int64
		}{
			{"first execution", func(i int) string { return fmt.Sprint("first-", i) }, body, http.StatusCreated, 5},
			{"replay", func(int) string { return "first-0" }, body, http.StatusCreated, 1},
			{"replay without first-sent time", func(int) string { return "first-0" }, body, http.StatusCreated, 2},
			{"refused", func(i int) string { return fmt.Sprint("bad-", i) }, bad, http.StatusBadRequest, 0},
			{"corrected", func(i int) string { return fmt.Sprint("bad-", i) }, body, http.StatusCreated, 5},
		}
		for _, c := range cases {
			// The first send prepares the statements on the connection.
			for i := range 2 {
				before := trips.Total()
				call := keyed(c.key(i), c.body)
				if c.name == "replay" {
					sent := time.Now().Add(-time.Minute).UTC().Format(http.TimeFormat)
					call.header = http.Header{"Repeatability-First-Sent": {sent}}
				}
				r := ts.mustSend(t, call)
				if r.status != c.wantStatus {
					t.Fatalf("%s: status %d, want %d", c.name, r.status, c.wantStatus)
				}
				if got := trips.Total() - before; i == 1 && got != c.want {
					t.Errorf("%s: %d round trips, want %d", c.name, got, c.want)
				}
			}
		}
		if n := ts.counter(t, "idem_db_round_trips_total"); n != float64(trips.Total()) {
			t.Errorf("idem_db_round_trips_total = %v, want %d", n, trips.Total())
		}
		resp, err := http.Get(ts.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		text, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, kind := range []string{"query", "batch", "prepare", "connect"} {
			if !strings.Contains(string(text), `idem_db_round_trips_total{kind="`+kind+`"}`) {
				t.Errorf("/metrics lacks idem_db_round_trips_total{kind=%q}", kind)
			}
		}
	})

	t.Run("unkeyed", func(t *testing.T) {
		trips := new(DBRoundTrips)
		ts := newTestServer(t, NewPostgresStorage(tracedPool(t, trips)).Storage(), Config{DBRoundTrips: trips, NoIdempotency: true})
		ts.mustSend(t, call{body: body})
		before := trips.Total()
		if r := ts.mustSend(t, call{body: body}); r.status != http.StatusCreated {
			t.Fatalf("unkeyed payment: %d", r.status)
		}
		if got := trips.Total() - before; got != 4 {
			t.Errorf("unkeyed payment: %d round trips, want 4 (charge, BEGIN, INSERT, COMMIT)", got)
		}
	})
}

// TestDBRoundTripsKinds checks the kinds apart on a plain connection: a
// statement new to the connection costs a prepare and a query, the same
// statement again a query only, a batch one round trip whatever it holds,
// and a new connection one connect.
func TestDBRoundTripsKinds(t *testing.T) {
	trips := new(DBRoundTrips)
	pool := tracedPool(t, trips)
	ctx := context.Background()
	start := [4]int64{trips.query.Load(), trips.batch.Load(), trips.prepare.Load(), trips.connect.Load()}
	// Migrate's: the pool's one connection, the two of pgstore's check of
	// the query mode (pgx's default needs a session of its own), and the
	// one the open keys' index build holds its lock on (the pool has one).
	if start[3] != 4 {
		t.Errorf("connects after Migrate: %d, want 4", start[3])
	}
	const q = "SELECT $1::int + 1 AS dbtrace_kinds"
	for range 2 {
		var n int
		if err := pool.QueryRow(ctx, q, 1).Scan(&n); err != nil || n != 2 {
			t.Fatalf("query: %d, %v", n, err)
		}
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	b := &pgx.Batch{}
	for _, q := range []string{"SELECT 1", "SELECT 2", "SELECT 3"} {
		b.Queue(q)
	}
	br := conn.SendBatch(ctx, b)
	if err := br.Close(); err != nil {
		t.Fatal(err)
	}
	conn.Release()
	got := [4]int64{trips.query.Load() - start[0], trips.batch.Load() - start[1], trips.prepare.Load() - start[2], trips.connect.Load() - start[3]}
	if want := [4]int64{2, 1, 1, 0}; got != want {
		t.Errorf("query, batch, prepare, connect = %v, want %v", got, want)
	}
}
