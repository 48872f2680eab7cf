package pgstore_test

import (
	"context"
	"testing"
	"time"

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

// TestMigrateDropChecksDoesNotStallClaims: the first replica of this
// release starts (Migrate) during a rolling upgrade, while a request of a
// replica already serving holds its claim's transaction open (a claim in
// one transaction, its handler calling a slow processor). Dropping the
// CHECK constraints needs the table's ACCESS EXCLUSIVE lock, which waits
// for that transaction; every claim of every replica queues behind the
// waiting ALTER TABLE, for as long as the slowest handler runs. Migrate
// must give the lock up soon and leave the step for a later start, and
// claims must go on meanwhile.
func TestMigrateDropChecksDoesNotStallClaims(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, previousChecksSQL); err != nil {
		t.Fatal(err)
	}
	s := pgstore.New(pool)
	res, err := s.ClaimInTx(ctx, req("held", "a"))
	if err != nil || res.Outcome != idempotency.Claimed {
		t.Fatalf("ClaimInTx = %+v, %v; want Claimed", res, err)
	}
	c := res.Claim
	tx, _ := unitOf(t, s, c) // its transaction stays open: the handler runs

	migrated := make(chan error, 1)
	mctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	go func() { migrated <- pgstore.Migrate(mctx, pool) }()
	time.Sleep(300 * time.Millisecond) // the ALTER TABLE waits for the lock

	cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
	defer ccancel()
	began := time.Now()
	_, err = s.Claim(cctx, leased(req("other", "b"), time.Minute, time.Hour))
	if err != nil {
		t.Errorf("a claim while Migrate drops the CHECK constraints: %v after %v (stalled behind the ALTER TABLE)",
			err, time.Since(began).Round(time.Millisecond))
	}
	select {
	case err := <-migrated:
		if err != nil {
			t.Errorf("Migrate while a claim's transaction is open: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Error("Migrate still waits for the table's lock after 10s")
		cancel()
		<-migrated
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// A later start drops them.
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_constraint
		WHERE conrelid = 'idempotency_keys'::regclass AND contype = 'c'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("%d CHECK constraints after a Migrate with the table free, want none", n)
	}
}
