package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server"
	"github.com/idemkit/idem/server/storetest"
)

// migratedPool returns a pool on a fresh schema holding the embedded schema.
func migratedPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t)
	if err := server.Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

// widePool is migratedPool with conns connections, all open: concurrent
// claims then reach PostgreSQL at the same time and take the retry paths
// of the claim and charge statements.
func widePool(t testing.TB, conns int32) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) { cfg.MaxConns = conns })
	held := make([]*pgxpool.Conn, conns)
	var err error
	for i := range held {
		if held[i], err = pool.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range held {
		c.Release()
	}
	if err := server.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

func TestPostgresStoreConformance(t *testing.T) {
	storetest.Exercise(t, func(t *testing.T) storetest.Backend {
		s := server.NewPostgresStore(widePool(t, 16))
		return storetest.Backend{Store: s, Payments: s, Charges: s}
	})
}

func TestPostgresStoreAsyncClaimsConformance(t *testing.T) {
	storetest.Exercise(t, func(t *testing.T) storetest.Backend {
		s := server.NewPostgresStore(migratedPool(t))
		s.AsyncClaims = true
		return storetest.Backend{Store: s, Payments: s, Charges: s}
	})
}

func TestPostgresStoreBatchConformance(t *testing.T) {
	for _, async := range []bool{false, true} {
		t.Run(fmt.Sprintf("async=%v", async), func(t *testing.T) {
			storetest.Exercise(t, func(t *testing.T) storetest.Backend {
				s := server.NewPostgresStore(widePool(t, 16))
				s.BatchClaims, s.BatchCompletions, s.AsyncClaims = true, true, async
				return storetest.Backend{Store: s, Payments: s, Charges: s}
			})
		})
	}
}

func TestMigrateTwiceAndConcurrently(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { errs[i] = server.Migrate(ctx, pool) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("concurrent Migrate: %v", err)
		}
	}
	if err := server.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	var versions int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_schema_migrations`).Scan(&versions); err != nil {
		t.Fatal(err)
	}
	var tables []string
	rows, err := pool.Query(ctx, `SELECT table_name FROM information_schema.tables
		WHERE table_schema = current_schema() ORDER BY table_name`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			t.Fatal(err)
		}
		tables = append(tables, name)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(tables, " "), "charges idem_schema_migrations idempotency_keys payments"; got != want {
		t.Errorf("tables %q, want %q", got, want)
	}
	if versions < 1 {
		t.Errorf("%d versions recorded, want at least 1", versions)
	}
}

// TestMigrateFromVersion1 upgrades a database made by the first schema,
// with keys in it, as a server of that version left them: the keys
// survive, a key started before the upgrade can be released and resumed,
// and the status check still refuses unknown states. Then a database of
// version 2 with a released key in it (its kind unknown): after the
// upgrade it takes its own request back, and refuses another (see
// 003_release_kind.sql).
func TestMigrateFromVersion1(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	schema := func(name string) string {
		sql, err := os.ReadFile("schema/" + name)
		if err != nil {
			t.Fatal(err)
		}
		return string(sql)
	}
	if _, err := pool.Exec(ctx, schema("001_init.sql")); err != nil {
		t.Fatal(err)
	}
	// As Migrate records a version (see migrate.go), and as a server of
	// version 1 claims and completes keys.
	migrations := `
		CREATE TABLE idem_schema_migrations (
			version    integer     PRIMARY KEY,
			name       text        NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now()
		);
		INSERT INTO idem_schema_migrations (version, name) VALUES (1, '001_init.sql')`
	if _, err := pool.Exec(ctx, migrations+`;
		INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
			fingerprint_version, status, operation_id, lock_token, response_status, created_at, locked_at)
		VALUES ('cli_a', 'done', 'POST', '/v1/payments', '\x01', 1, 'completed', gen_random_uuid(),
			nextval('idempotency_lock_tokens'), 201, now(), now())`); err != nil {
		t.Fatal(err)
	}
	var running server.Claim
	err := pool.QueryRow(ctx, `
		INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
			fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
		VALUES ('cli_a', 'running', 'POST', '/v1/payments', '\x02', 1, 'started', gen_random_uuid(),
			nextval('idempotency_lock_tokens'), now(), now())
		RETURNING client_id, idempotency_key, lock_token, operation_id::text`).Scan(
		&running.ClientID, &running.Key, &running.Token, &running.OperationID)
	if err != nil {
		t.Fatal(err)
	}

	for range 2 { // and again: nothing to do
		if err := server.Migrate(ctx, pool); err != nil {
			t.Fatalf("Migrate from version 1: %v", err)
		}
	}
	rows, _ := pool.Query(ctx, `SELECT version FROM idem_schema_migrations ORDER BY version`)
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil || fmt.Sprint(versions) != "[1 2 3]" {
		t.Errorf("versions %v, %v; want [1 2 3]", versions, err)
	}
	s := server.NewPostgresStore(pool)
	req := server.ClaimRequest{ClientID: "cli_a", Key: "running", Method: "POST", Path: "/v1/payments",
		Fingerprint: []byte{2}, FingerprintVersion: 1}
	done := req
	done.Key, done.Fingerprint = "done", []byte{1}
	if res, err := s.Claim(ctx, done); err != nil || res.Outcome != server.Exists || res.Record.Status != server.StatusCompleted {
		t.Errorf("completed key after the upgrade: %+v, %v", res, err)
	}
	if err := s.Release(ctx, running, server.ReleaseFailed); err != nil {
		t.Fatalf("Release of a key claimed before the upgrade: %v", err)
	}
	if res, err := s.Claim(ctx, req); err != nil || res.Outcome != server.Claimed || res.Claim.OperationID != running.OperationID {
		t.Errorf("claim of the released key: %+v, %v; want Claimed with operation %s", res, err, running.OperationID)
	}
	_, err = pool.Exec(ctx, `UPDATE idempotency_keys SET status = 'gone' WHERE idempotency_key = 'running'`)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.ConstraintName != "idempotency_keys_status_check" {
		t.Errorf("unknown status: %v, want a violation of idempotency_keys_status_check", err)
	}

	// Version 2, with a key a server of that version released.
	if _, err := pool.Exec(ctx, `DROP TABLE idem_schema_migrations, idempotency_keys, payments, charges;
		DROP SEQUENCE idempotency_lock_tokens`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, schema("001_init.sql")+";"+schema("002_released.sql")); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, migrations+`, (2, '002_released.sql')`); err != nil {
		t.Fatal(err)
	}
	var released server.Claim
	err = pool.QueryRow(ctx, `
		INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
			fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
		VALUES ('cli_a', 'released', 'POST', '/v1/payments', '\x03', 1, 'released', gen_random_uuid(),
			nextval('idempotency_lock_tokens'), now(), now())
		RETURNING operation_id::text`).Scan(&released.OperationID)
	if err != nil {
		t.Fatal(err)
	}
	if err := server.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate from version 2: %v", err)
	}
	other := req
	other.Key, other.Fingerprint = "released", []byte{4}
	if res, err := s.Claim(ctx, other); err != nil || res.Outcome != server.Exists || res.Record.Status != server.StatusReleased {
		t.Errorf("another request on a key released before the upgrade: %+v, %v; want Exists, released", res, err)
	}
	same := other
	same.Fingerprint = []byte{3}
	if res, err := s.Claim(ctx, same); err != nil || res.Outcome != server.Claimed || res.Claim.OperationID != released.OperationID {
		t.Errorf("its own request on a key released before the upgrade: %+v, %v; want Claimed with operation %s", res, err, released.OperationID)
	}
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

// TestPostgresPurgeIsBounded fills the key table, then checks that one
// Purge deletes exactly its limit of the oldest expired keys, and that its
// statement is planned as an index walk and a TID scan: no step of it scans
// the whole table.
func TestPostgresPurgeIsBounded(t *testing.T) {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.SchemaURL(t))
	if err != nil {
		t.Fatal(err)
	}
	rec := &sqlRecorder{}
	cfg.ConnConfig.Tracer = rec
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := server.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	// Key g was created g minutes ago: 20000 keys, 19940 older than an hour.
	const keys, limit = 20000, 100
	if _, err := pool.Exec(ctx, `
		INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
			fingerprint_version, status, operation_id, lock_token, response_status, created_at, locked_at)
		SELECT 'cli_a', 'key-' || g, 'POST', '/v1/payments', '\x00', 1, 'completed', gen_random_uuid(),
			nextval('idempotency_lock_tokens'), 201, now() - g * interval '1 minute', now() - g * interval '1 minute'
		FROM generate_series(1, $1::int) g`, keys); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE idempotency_keys`); err != nil {
		t.Fatal(err)
	}

	s := server.NewPostgresStore(pool)
	n, err := s.Purge(ctx, time.Hour, limit)
	if err != nil || n != limit {
		t.Fatalf("Purge(1h, %d) = %d, %v; want %d", limit, n, err, limit)
	}
	var left int
	var oldest time.Duration
	if err := pool.QueryRow(ctx, `SELECT count(*), (extract(epoch FROM now() - min(created_at)) * 1e6)::bigint
		FROM idempotency_keys`).Scan(&left, &oldest); err != nil {
		t.Fatal(err)
	}
	oldest *= time.Microsecond
	if left != keys-limit || oldest.Round(time.Minute) != (keys-limit)*time.Minute {
		t.Errorf("after Purge: %d keys, the oldest %v old; want %d, %v (the oldest went first)",
			left, oldest.Round(time.Minute), keys-limit, (keys-limit)*time.Minute)
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
		!strings.Contains(text, "idempotency_keys_created_idx") {
		t.Errorf("Purge's plan scans the table or skips the created_at index:\n%s", text)
	}
}

// TestPostgresAsyncClaimIsLocal checks that AsyncClaims turns off
// synchronous commit for the claim's transaction only: the connection goes
// back to the pool with durable commits, for the completions that need them.
func TestPostgresAsyncClaimIsLocal(t *testing.T) {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pgtest.SchemaURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1 // every statement below runs on the claim's connection
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := server.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	s := server.NewPostgresStore(pool)
	s.AsyncClaims = true
	req := server.ClaimRequest{ClientID: "cli_a", Key: "key-1", Method: "POST", Path: "/v1/payments",
		Fingerprint: []byte("fp"), FingerprintVersion: 1}
	if _, err := s.Claim(ctx, req); err != nil {
		t.Fatal(err)
	}
	var setting string
	if err := pool.QueryRow(ctx, `SELECT current_setting('synchronous_commit')`).Scan(&setting); err != nil {
		t.Fatal(err)
	}
	if setting != "on" {
		t.Errorf("synchronous_commit after an async claim = %q, want on", setting)
	}
}

// benchClaims runs op once per iteration on a fresh store, durable and
// with AsyncClaims, each time with a claim request for a new key.
func benchClaims(b *testing.B, op func(b *testing.B, s *server.PostgresStore, req server.ClaimRequest, i int)) {
	for _, async := range []bool{false, true} {
		name := map[bool]string{false: "sync", true: "async"}[async]
		b.Run(name, func(b *testing.B) {
			s := server.NewPostgresStore(migratedPool(b))
			s.AsyncClaims = async
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				i++
				op(b, s, server.ClaimRequest{ClientID: "cli_bench", Key: fmt.Sprint("key-", i), Method: "POST",
					Path: "/v1/payments", Fingerprint: []byte("fp"), FingerprintVersion: 1}, i)
			}
		})
	}
}

// BenchmarkPostgresClaim measures the claim of a new key, which commits one
// row: durably (one WAL flush) or with AsyncClaims.
func BenchmarkPostgresClaim(b *testing.B) {
	benchClaims(b, func(b *testing.B, s *server.PostgresStore, req server.ClaimRequest, _ int) {
		if _, err := s.Claim(context.Background(), req); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchmarkPostgresRequest measures a whole first request as the store sees
// it: claim, then one payment and the completion; then a replayed duplicate.
func BenchmarkPostgresRequest(b *testing.B) {
	ctx := context.Background()
	benchClaims(b, func(b *testing.B, s *server.PostgresStore, req server.ClaimRequest, i int) {
		res, err := s.Claim(ctx, req)
		if err != nil {
			b.Fatal(err)
		}
		tx, _ := s.Begin(ctx, res.Claim)
		c := res.Claim
		p := server.Payment{ID: fmt.Sprint("pay_", i), ClientID: c.ClientID, Customer: "cus_1", Amount: 4200,
			Currency: "usd", IdempotencyKey: c.Key, OperationID: c.OperationID, ChargeID: "ch_1"}
		if err := s.CreatePayment(ctx, tx, p); err != nil {
			b.Fatal(err)
		}
		if err := tx.Complete(ctx, server.StoredResponse{Status: 201, ContentType: "application/json",
			Body: []byte(`{"id":"` + p.ID + `"}`)}); err != nil {
			b.Fatal(err)
		}
		if res, err := s.Claim(ctx, req); err != nil || res.Outcome != server.Exists {
			b.Fatal(res.Outcome, err)
		}
	})
}
