package pgstore_test

import (
	"context"
	"testing"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// previousChecksSQL are the CHECK constraints of the key table as the
// previous release created it.
const previousChecksSQL = `ALTER TABLE idempotency_keys
	ADD CONSTRAINT idempotency_keys_key_check CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255),
	ADD CONSTRAINT idempotency_keys_status_check CHECK (status IN ('started', 'completed', 'released')),
	ADD CONSTRAINT idempotency_keys_response_check CHECK ((status = 'completed') = (response_status IS NOT NULL)),
	ADD CONSTRAINT idempotency_keys_response_status_check CHECK (response_status BETWEEN 100 AND 599),
	ADD CONSTRAINT idempotency_keys_lease_check CHECK (lease_us >= 0 AND retention_us >= 0)`

// TestMigrateDropsCheckConstraints: a key table of the previous release,
// with its five CHECK constraints and a completed key, loses them to
// Migrate (a compatible step: the version recorded stays 1) and keeps its
// key, which replays; a key table that Migrate creates has none.
func TestMigrateDropsCheckConstraints(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	count := func() (n int) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_constraint
			WHERE conrelid = 'idempotency_keys'::regclass AND contype = 'c'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(); n != 0 {
		t.Fatalf("a new key table has %d CHECK constraints, want none", n)
	}
	if _, err := pool.Exec(ctx, previousChecksSQL); err != nil {
		t.Fatal(err)
	}
	s := pgstore.New(pool)
	r := req("key-1", "a")
	c := mustClaim(t, s, r, idempotency.Claimed).Claim
	tx, _ := unitOf(t, s, c)
	if err := tx.Complete(ctx, idempotency.StoredResponse{Status: 201, Body: []byte("done")}); err != nil {
		t.Fatal(err)
	}
	for range 2 { // and again: nothing to do
		if err := pgstore.Migrate(ctx, pool); err != nil {
			t.Fatalf("Migrate of a table with the previous release's CHECK constraints: %v", err)
		}
	}
	if n := count(); n != 0 {
		t.Errorf("after Migrate: %d CHECK constraints, want none", n)
	}
	var versions int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_migrations`).Scan(&versions); err != nil {
		t.Fatal(err)
	}
	if versions != 1 {
		t.Errorf("%d versions recorded, want 1", versions)
	}
	if rec := mustClaim(t, s, r, idempotency.Exists).Record; rec.Response == nil || string(rec.Response.Body) != "done" {
		t.Errorf("the key completed before Migrate: %+v", rec)
	}
}
