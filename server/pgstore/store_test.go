package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// writesSQL creates the business table of the tests: one row per write,
// named, a second write of a name is a unique violation.
const writesSQL = `CREATE TABLE writes (name text PRIMARY KEY)`

// write inserts the row name through the request's transaction, as a
// handler behind the middleware does.
func write(ctx context.Context, name string) error {
	tx, err := pgstore.Tx(ctx)
	if err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `INSERT INTO writes (name) VALUES ($1)`, name)
	return err
}

// written reports whether the row name is committed.
func written(ctx context.Context, pool *pgxpool.Pool, name string) (bool, error) {
	var ok bool
	err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM writes WHERE name = $1)`, name).Scan(&ok)
	return ok, err
}

// mustBeWritten checks whether the row name is committed.
func mustBeWritten(t *testing.T, pool *pgxpool.Pool, name string, want bool) {
	t.Helper()
	got, err := written(context.Background(), pool, name)
	if err != nil {
		t.Fatalf("written(%s): %v", name, err)
	}
	if got != want {
		t.Errorf("row %s committed: %v, want %v", name, got, want)
	}
}

// migrate migrates pool's schema and creates the writes table in it.
func migrate(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, writesSQL); err != nil {
		t.Fatal(err)
	}
}

// migratedPool returns a pool on a fresh schema holding the key table and
// the writes table, configured by configure if not nil.
func migratedPool(t testing.TB, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.PoolWith(t, configure)
	migrate(t, pool)
	return pool
}

// newStore returns a store on migratedPool(t, configure).
func newStore(t testing.TB, configure func(*pgxpool.Config)) (*pgstore.Store, *pgxpool.Pool) {
	t.Helper()
	pool := migratedPool(t, configure)
	return pgstore.New(pool), pool
}

// widePool is migratedPool with conns connections, all open, configured
// by configure if not nil: concurrent claims then reach PostgreSQL at the
// same time and take the retry paths of the claim statement.
func widePool(t testing.TB, conns int32, configure ...func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	pool := migratedPool(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = conns
		for _, f := range configure {
			f(cfg)
		}
	})
	openAll(t, pool, conns)
	return pool
}

// openAll opens conns connections of pool, all at once, and gives them
// back: claims then reach PostgreSQL together. A connection it cannot
// open (too many clients) fails the test, after the others are given
// back, which the pool's Close at the cleanup would wait for for good.
func openAll(t testing.TB, pool *pgxpool.Pool, conns int32) {
	t.Helper()
	held := make([]*pgxpool.Conn, 0, conns)
	defer func() {
		for _, c := range held {
			c.Release()
		}
	}()
	for range conns {
		c, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
}

// withIsolation configures a pool whose transactions run under isolation
// by default (default_transaction_isolation); "" leaves the server's.
func withIsolation(isolation string) func(*pgxpool.Config) {
	return func(cfg *pgxpool.Config) {
		if isolation != "" {
			cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = isolation
		}
	}
}

// req returns a claim request of cli_a for key with the fingerprint body,
// no lease and no retention.
func req(key, body string) idempotency.ClaimRequest {
	return idempotency.ClaimRequest{ClientID: "cli_a", Key: key, Method: "POST", Path: "/v1/orders",
		Fingerprint: []byte(body)}
}

// leased returns r with the given lease and retention.
func leased(r idempotency.ClaimRequest, lease, keep time.Duration) idempotency.ClaimRequest {
	r.LockTimeout, r.Retention = lease, keep
	return r
}

// mustClaim claims r and checks the outcome.
func mustClaim(t *testing.T, s idempotency.Store, r idempotency.ClaimRequest, want idempotency.Outcome) idempotency.ClaimResult {
	t.Helper()
	res, err := s.Claim(context.Background(), r)
	if err != nil {
		t.Fatalf("Claim(%s): %v", r.Key, err)
	}
	if res.Outcome != want {
		t.Fatalf("Claim(%s) = %v (record %+v), want %v", r.Key, res.Outcome, res.Record, want)
	}
	return res
}

// unitOf begins the unit of work of c and returns it with the context a
// handler behind the middleware gets.
func unitOf(t *testing.T, s idempotency.Store, c idempotency.Claim) (idempotency.Tx, context.Context) {
	t.Helper()
	tx, err := s.Begin(context.Background(), c)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	// A test that fails half-way gives back the connection, which the
	// pool's Close waits for; after Complete, Rollback does nothing.
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx, idempotency.NewContext(context.Background(), c, tx)
}

// created is a response worth storing.
func created(id string) idempotency.StoredResponse {
	return idempotency.StoredResponse{Status: 201, ContentType: "application/json",
		Header: map[string]string{"Location": "/v1/orders/" + id}, Body: []byte(`{"id":"` + id + `"}`)}
}

// keyRow is the stored state of a key, read from the table.
type keyRow struct {
	status    string
	token     int64
	lockedAt  time.Time
	expiresAt *time.Time
	leaseUS   int64
	keepUS    int64
}

// readKey reads the row of cli_a's key; ok is false when there is none.
func readKey(t *testing.T, pool *pgxpool.Pool, key string) (row keyRow, ok bool) {
	t.Helper()
	err := pool.QueryRow(context.Background(), `
		SELECT status, lock_token, locked_at, expires_at, lease_us, retention_us
		FROM idempotency_keys WHERE client_id = 'cli_a' AND idempotency_key = $1`, key).
		Scan(&row.status, &row.token, &row.lockedAt, &row.expiresAt, &row.leaseUS, &row.keepUS)
	if errors.Is(err, pgx.ErrNoRows) {
		return row, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return row, true
}

// keyStatus returns the status of cli_a's key, "" when it has no row.
func keyStatus(t *testing.T, pool *pgxpool.Pool, key string) string {
	t.Helper()
	row, _ := readKey(t, pool, key)
	return row.status
}

// sqlRecorder is a pgx tracer that keeps the statements a pool runs.
type sqlRecorder struct {
	mu      sync.Mutex
	queries []pgx.TraceQueryStartData
}

func (r *sqlRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.queries = append(r.queries, data)
	return ctx
}

func (r *sqlRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// last returns the last statement that starts with prefix.
func (r *sqlRecorder) last(prefix string) (pgx.TraceQueryStartData, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := len(r.queries) - 1; i >= 0; i-- {
		if strings.HasPrefix(strings.TrimSpace(r.queries[i].SQL), prefix) {
			return r.queries[i], true
		}
	}
	return pgx.TraceQueryStartData{}, false
}

// roundTrips counts the round trips of a pool as server.DBRoundTrips does:
// a statement is one, a batch (a pipeline) is one.
type roundTrips struct {
	n atomic.Int64
}

func (c *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// since returns the round trips counted since the last call.
func (c *roundTrips) since(last *int64) int64 {
	n := c.n.Load()
	d := n - *last
	*last = n
	return d
}

// TestRoundTrips counts the round trips of a first execution whose handler
// writes one row, and of its replay, in two commits and in one
// transaction. The handler's transaction without the middleware (BEGIN,
// INSERT, COMMIT, on the same pool) is the baseline: in two commits the
// layer adds one round trip to it, the claim, since the key's completion
// travels with the COMMIT; in one transaction none, since the claim
// travels with the BEGIN. A replay in two commits is one round trip for a
// retry (a first-sent time a minute old): the read of the key's row, sent
// with the insert that finds it there; two without (the insert, then the
// read). In one transaction it is two: the claim, sent with the BEGIN, and
// the ROLLBACK of that transaction. Each mode runs a first request beforehand, so that
// the statements are prepared on the pool's one connection.
func TestRoundTrips(t *testing.T) {
	ctx := context.Background()
	rt := &roundTrips{}
	s, pool := newStore(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 1
		cfg.ConnConfig.Tracer = rt
	})
	for _, mode := range []struct {
		name                                         string
		claim                                        func(idempotency.ClaimRequest) (idempotency.ClaimResult, error)
		wantClaim, wantFirst, wantReplay, wantUnsent int64
	}{
		{"two commits", func(r idempotency.ClaimRequest) (idempotency.ClaimResult, error) { return s.Claim(ctx, r) }, 1, 4, 1, 2},
		{"one transaction", func(r idempotency.ClaimRequest) (idempotency.ClaimResult, error) { return s.ClaimInTx(ctx, r) }, 1, 3, 1, 2},
	} {
		var last int64
		for i := range 2 {
			rt.since(&last)
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO writes (name) VALUES ($1)`, fmt.Sprint(mode.name, "-plain", i))
				return err
			}); err != nil {
				t.Fatal(err)
			}
			baseline := rt.since(&last)

			r := req(fmt.Sprint(mode.name, "-key-", i), "a")
			res, err := mode.claim(r)
			if err != nil || res.Outcome != idempotency.Claimed {
				t.Fatalf("%s: claim: %v, %v; want Claimed", mode.name, res.Outcome, err)
			}
			claim := rt.since(&last)
			tx, hctx := unitOf(t, s, res.Claim)
			if err := write(hctx, fmt.Sprint(mode.name, "-w", i)); err != nil {
				t.Fatal(err)
			}
			handler := rt.since(&last)
			if err := tx.Complete(ctx, created(fmt.Sprint("ord_", i))); err != nil {
				t.Fatal(err)
			}
			complete := rt.since(&last)
			resent := r
			resent.FirstSent.Sent = time.Now().Add(-time.Minute).Truncate(time.Second)
			if res, err := mode.claim(resent); err != nil || res.Outcome != idempotency.Exists {
				t.Fatalf("%s: replay: %v, %v; want Exists", mode.name, res.Outcome, err)
			}
			replay := rt.since(&last)
			if res, err := mode.claim(r); err != nil || res.Outcome != idempotency.Exists {
				t.Fatalf("%s: replay without a first-sent time: %v, %v; want Exists", mode.name, res.Outcome, err)
			}
			unsent := rt.since(&last)
			if i == 0 {
				continue // statements prepared meanwhile
			}
			first := claim + handler + complete
			t.Logf("%s: round trips: %d for the handler's transaction alone; %d for a first execution "+
				"(claim %d, handler %d, completion and COMMIT %d); %d for a replay",
				mode.name, baseline, first, claim, handler, complete, replay)
			if baseline != 3 {
				t.Errorf("the handler's transaction alone took %d round trips, want 3 (BEGIN, INSERT, COMMIT)", baseline)
			}
			if claim != mode.wantClaim || complete != 1 || first != mode.wantFirst {
				t.Errorf("%s: a first execution took %d round trips (claim %d, handler %d, completion and COMMIT %d); want %d (claim %d, completion 1)",
					mode.name, first, claim, handler, complete, mode.wantFirst, mode.wantClaim)
			}
			if replay != mode.wantReplay || unsent != mode.wantUnsent {
				t.Errorf("%s: a replay took %d round trips, %d without a first-sent time; want %d, %d",
					mode.name, replay, unsent, mode.wantReplay, mode.wantUnsent)
			}
		}
	}
}

// TestClaimRefusesInvalidText claims keys whose client, key, method or
// path holds a NUL byte or invalid UTF-8, which PostgreSQL's text columns
// refuse: Claim returns an error wrapping idempotency.ErrInvalidText, and
// nothing is stored.
func TestClaimRefusesInvalidText(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	for _, bad := range []string{"a\x00b", "caf\xe9", "\xff"} {
		for field, set := range map[string]func(*idempotency.ClaimRequest){
			"client": func(r *idempotency.ClaimRequest) { r.ClientID = bad },
			"key":    func(r *idempotency.ClaimRequest) { r.Key = bad },
			"method": func(r *idempotency.ClaimRequest) { r.Method = bad },
			"path":   func(r *idempotency.ClaimRequest) { r.Path = "/v1/orders/" + bad },
		} {
			r := req("key-1", "a")
			set(&r)
			res, err := s.Claim(ctx, r)
			if !errors.Is(err, idempotency.ErrInvalidText) {
				t.Errorf("Claim with %q in the %s = %+v, %v; want ErrInvalidText", bad, field, res, err)
			}
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("%d keys stored, want none", n)
	}
	// Valid text that is not ASCII is kept as it is.
	r := req("clé-ü-日本", "a")
	r.Path = "/v1/orders/ü"
	mustClaim(t, s, r, idempotency.Claimed)
	if rec := mustClaim(t, s, r, idempotency.Exists).Record; rec.Key != r.Key || rec.Path != r.Path {
		t.Errorf("record %+v, want key %q and path %q", rec, r.Key, r.Path)
	}
}

// TestPurgeIsBounded fills the key table, then checks that one Purge
// deletes exactly its limit of the keys that expired first, and that its
// statement is planned as a walk of the expires_at index and a TID scan: no
// step of it scans the whole table.
func TestPurgeIsBounded(t *testing.T) {
	ctx := context.Background()
	rec := &sqlRecorder{}
	s, pool := newStore(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = rec })
	// Key g expires 60-g minutes from now, plus 20 seconds: 20000 keys,
	// the first 60 live, the others expired.
	const keys, limit, live = 20000, 100, 60
	if _, err := pool.Exec(ctx, `
		INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
			status, operation_id, lock_token, response_status, created_at, locked_at,
			lease_us, retention_us, expires_at)
		SELECT 'cli_a', 'key-' || g, 'POST', '/v1/orders', '\x00', 'completed', gen_random_uuid(),
			nextval('idempotency_lock_tokens'), 201, now() - interval '2 days', now() - interval '2 days',
			1000000, 60000000, now() + ($2 - g) * interval '1 minute' + interval '20 seconds'
		FROM generate_series(1, $1::int) g`, keys, live); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE idempotency_keys`); err != nil {
		t.Fatal(err)
	}

	n, err := s.Purge(ctx, limit)
	if err != nil || n != limit {
		t.Fatalf("Purge(%d) = %d, %v; want %d", limit, n, err, limit)
	}
	var left int
	var oldest time.Duration
	if err := pool.QueryRow(ctx, `SELECT count(*), (extract(epoch FROM now() - min(expires_at)) * 1e6)::bigint
		FROM idempotency_keys`).Scan(&left, &oldest); err != nil {
		t.Fatal(err)
	}
	oldest *= time.Microsecond
	want := (keys - live - limit) * time.Minute
	if left != keys-limit || oldest.Round(time.Minute) != want {
		t.Errorf("after Purge: %d keys, the first expired %v ago; want %d, %v (those that expired first went first)",
			left, oldest.Round(time.Minute), keys-limit, want)
	}

	purge, ok := rec.last("DELETE")
	if !ok {
		t.Fatal("Purge ran no DELETE")
	}
	rows, err := pool.Query(ctx, "EXPLAIN "+purge.SQL, purge.Args...)
	if err != nil {
		t.Fatal(err)
	}
	plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(plan, "\n")
	if strings.Contains(text, "Seq Scan") || !strings.Contains(text, "Tid Scan") ||
		!strings.Contains(text, "idempotency_keys_expires_idx") {
		t.Errorf("Purge's plan scans the table or skips the expires_at index:\n%s", text)
	}

	// Everything expired goes, batch by batch; the live keys stay.
	for {
		n, err := s.Purge(ctx, 5000)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != live {
		t.Errorf("after purging everything expired: %d keys left, want %d", left, live)
	}
	if n, err := s.Purge(ctx, 0); n != 0 || err != nil {
		t.Errorf("Purge(0) = %d, %v; want 0, nil", n, err)
	}
}

// benchClaims runs op once per iteration on a fresh store, each time with
// a claim request for a new key.
func benchClaims(b *testing.B, op func(b *testing.B, s *pgstore.Store, r idempotency.ClaimRequest, i int)) {
	s, _ := newStore(b, nil)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		op(b, s, req(fmt.Sprint("key-", i), "a"), i)
	}
}

// BenchmarkClaim measures the claim of a new key, which commits one row
// durably (one WAL flush).
func BenchmarkClaim(b *testing.B) {
	benchClaims(b, func(b *testing.B, s *pgstore.Store, r idempotency.ClaimRequest, _ int) {
		if _, err := s.Claim(context.Background(), r); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchmarkRequest measures a whole first request as the store sees it:
// claim, then one row written by the handler and the completion; then a
// replayed duplicate.
func BenchmarkRequest(b *testing.B) {
	ctx := context.Background()
	benchClaims(b, func(b *testing.B, s *pgstore.Store, r idempotency.ClaimRequest, i int) {
		res, err := s.Claim(ctx, r)
		if err != nil {
			b.Fatal(err)
		}
		tx, err := s.Begin(ctx, res.Claim)
		if err != nil {
			b.Fatal(err)
		}
		if err := write(idempotency.NewContext(ctx, res.Claim, tx), fmt.Sprint("ord_", i)); err != nil {
			b.Fatal(err)
		}
		if err := tx.Complete(ctx, created(fmt.Sprint("ord_", i))); err != nil {
			b.Fatal(err)
		}
		if res, err := s.Claim(ctx, r); err != nil || res.Outcome != idempotency.Exists {
			b.Fatal(res.Outcome, err)
		}
	})
}

// BenchmarkReplay measures a retry's claim of a completed key: one read of
// its row (keysql.ClaimPeekSQL), the whole of a replay's database work.
func BenchmarkReplay(b *testing.B) {
	ctx := context.Background()
	s, _ := newStore(b, nil)
	r := req("replayed", "a")
	res, err := s.Claim(ctx, r)
	if err != nil {
		b.Fatal(err)
	}
	tx, err := s.Begin(ctx, res.Claim)
	if err != nil {
		b.Fatal(err)
	}
	if err := tx.Complete(ctx, created("ord_1")); err != nil {
		b.Fatal(err)
	}
	r.FirstSent.Sent = time.Now().Add(-time.Minute) // a retry
	b.ReportAllocs()
	for b.Loop() {
		if res, err := s.Claim(ctx, r); err != nil || res.Outcome != idempotency.Exists {
			b.Fatal(res.Outcome, err)
		}
	}
}
