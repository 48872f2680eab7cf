package pgstore_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// relations lists the relations of the pool's schema (tables, sequences,
// indexes, views...), each as "name (kind)", sorted.
func relations(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	rows, _ := pool.Query(context.Background(), `
		SELECT relname || ' (' || relkind::text || ')' FROM pg_class
		WHERE relnamespace = current_schema()::regnamespace ORDER BY relname`)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(names, ", ")
}

// ownRelations are the relations Migrate creates, and the only ones: not
// the open keys' index, which is CreateOpenKeysIndex's.
const ownRelations = "idempotency_keys (r), idempotency_keys_expires_idx (i), idempotency_keys_pkey (i), " +
	"idempotency_lock_tokens (S), idempotency_migrations (r), idempotency_migrations_pkey (i)"

// TestMigrateCreatesOnlyItsOwn: Migrate creates the key table, its
// sequence, its index and its migration record, nothing else; again, it
// changes nothing; run by many goroutines at once, every one succeeds and
// one version is recorded.
func TestMigrateCreatesOnlyItsOwn(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { errs[i] = pgstore.Migrate(ctx, pool) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("concurrent Migrate: %v", err)
		}
	}
	if got := relations(t, pool); got != ownRelations {
		t.Errorf("relations after Migrate:\n%s\nwant\n%s", got, ownRelations)
	}
	var versions int
	var applied time.Time
	if err := pool.QueryRow(ctx, `SELECT count(*), max(applied_at) FROM idempotency_migrations`).Scan(&versions, &applied); err != nil {
		t.Fatal(err)
	}
	if versions != 1 {
		t.Errorf("%d versions recorded, want 1", versions)
	}

	s := pgstore.New(pool)
	c := mustClaim(t, s, req("key-1", "a"), idempotency.Claimed).Claim
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	var again time.Time
	if err := pool.QueryRow(ctx, `SELECT count(*), max(applied_at) FROM idempotency_migrations`).Scan(&versions, &again); err != nil {
		t.Fatal(err)
	}
	if versions != 1 || !again.Equal(applied) {
		t.Errorf("after Migrate again: %d versions, applied %v; want 1, %v", versions, again, applied)
	}
	if got := relations(t, pool); got != ownRelations {
		t.Errorf("relations after Migrate again:\n%s\nwant\n%s", got, ownRelations)
	}
	if err := s.Release(context.Background(), c, idempotency.ReleaseRejected); err != nil {
		t.Errorf("a key claimed before Migrate again: %v", err)
	}
}

// TestMigrateLeavesOtherTablesAlone: the service's own tables, one of them
// named payments as the reference server's was, are neither created,
// changed nor emptied.
func TestMigrateLeavesOtherTablesAlone(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `CREATE TABLE payments (id int PRIMARY KEY, note text);
		INSERT INTO payments VALUES (1, 'mine')`); err != nil {
		t.Fatal(err)
	}
	payments := snapshot(t, pool, "payments")
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	want := ownRelations + ", payments (r), payments_pkey (i)"
	if got := relations(t, pool); got != want {
		t.Errorf("relations:\n%s\nwant\n%s", got, want)
	}
	if got := snapshot(t, pool, "payments"); got != payments || got != "id integer, note text: (1,mine)" {
		t.Errorf("payments after Migrate: %s, want as before: %s", got, payments)
	}
}

// TestMigrateCreatesNoCheckConstraints: the key table has no CHECK
// constraints (see schema/keys.sql): the stores check their rules
// themselves.
func TestMigrateCreatesNoCheckConstraints(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_constraint
		WHERE conrelid = 'idempotency_keys'::regclass AND contype = 'c'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("the key table has %d CHECK constraints, want none", n)
	}
}

// snapshot returns the columns and the rows of table, as text.
func snapshot(t *testing.T, pool *pgxpool.Pool, table string) string {
	t.Helper()
	ctx := context.Background()
	rows, _ := pool.Query(ctx, `SELECT column_name || ' ' || data_type FROM information_schema.columns
		WHERE table_schema = current_schema() AND table_name = $1 ORDER BY ordinal_position`, table)
	cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	rows, _ = pool.Query(ctx, `SELECT t::text FROM `+pgx.Identifier{table}.Sanitize()+` t ORDER BY 1`)
	vals, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(cols, ", ") + ": " + strings.Join(vals, "; ")
}

// TestMigrateRefusesForeignKeyTable: an idempotency_keys table that
// pgstore did not create (a service's own, or one of another shape) is an
// error naming the differences, and Migrate changes nothing: no relation
// created, the table and its rows as they were.
func TestMigrateRefusesForeignKeyTable(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name, create string
		wantErr      []string
	}{
		{"user table", `CREATE TABLE idempotency_keys (id int); INSERT INTO idempotency_keys VALUES (7)`,
			[]string{"idempotency_keys", "missing columns: client_id", "unknown columns: id"}},
		{"other types", `CREATE TABLE idempotency_keys (` + strings.ReplaceAll(keysColumns, "lock_token bigint", "lock_token text") + `)`,
			[]string{"lock_token is text, not bigint"}},
		// The right columns without the primary key that claims rely on
		// (ON CONFLICT (client_id, idempotency_key)), nor the sequence:
		// every claim would fail.
		{"no primary key", `CREATE TABLE idempotency_keys (` + keysColumns + `)`,
			[]string{"idempotency_keys"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			pool := pgtest.Pool(t)
			if _, err := pool.Exec(ctx, tt.create); err != nil {
				t.Fatal(err)
			}
			before := relations(t, pool)
			err := pgstore.Migrate(ctx, pool)
			if err == nil {
				t.Fatal("Migrate over a foreign idempotency_keys: nil, want an error")
			}
			for _, w := range tt.wantErr {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Migrate: %v; want it to say %q", err, w)
				}
			}
			if after := relations(t, pool); after != before {
				t.Errorf("relations after the refused Migrate:\n%s\nwant as before:\n%s", after, before)
			}
			if tt.name == "user table" {
				var id int
				if err := pool.QueryRow(ctx, `SELECT id FROM idempotency_keys`).Scan(&id); err != nil || id != 7 {
					t.Errorf("the user's row: %d, %v; want 7", id, err)
				}
			}
		})
	}
}

// keysColumns are the columns of pgstore's key table, as a CREATE TABLE
// lists them.
const keysColumns = `client_id text, idempotency_key text, request_method text, request_path text,
	request_hash bytea, status text, operation_id uuid, lock_token bigint,
	release_rejected boolean, response_status integer, response_content_type text, response_headers jsonb,
	response_body bytea, created_at timestamptz, locked_at timestamptz, lease_us bigint, retention_us bigint,
	expires_at timestamptz`
