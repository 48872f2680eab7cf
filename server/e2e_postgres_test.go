package server

import (
	"context"
	"errors"
	"maps"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
)

// TestEndToEndPostgres runs the end-to-end tests on PostgreSQL, each test on
// a schema of its own. Without a database it is skipped, except under
// CI=true, where pgtest fails it.
func TestEndToEndPostgres(t *testing.T) {
	testEndToEnd(t, postgresStorage)
}

// TestKeyRowLostChargesOnce deletes a key's row, as a failover to a
// standby that had not received it or a restore from an older backup
// loses it, under a running operation and under a finished one; the
// client's retry of the same request then claims the key anew, under the
// same derived operation ID, so the processor finds the charge it made
// and the payment is stored once: one charge, one payment, and the retry
// answered with it.
func TestKeyRowLostChargesOnce(t *testing.T) {
	ctx := context.Background()
	pool := migratedPool(t)
	block := newBlocker(1)
	ts := newTestServer(t, NewPostgresStorage(pool).Storage(), Config{AfterCharge: block.afterCharge})
	lose := func(key string) {
		t.Helper()
		tag, err := pool.Exec(ctx, `DELETE FROM idempotency_keys WHERE idempotency_key = $1`, key)
		if err != nil || tag.RowsAffected() != 1 {
			t.Fatalf("deleting the row of %s: %v, %d rows", key, err, tag.RowsAffected())
		}
	}

	t.Run("running", func(t *testing.T) {
		first := make(chan reply)
		go func() { first <- ts.send(t, keyed("k-lost-running", payment)) }()
		<-block.reached // charged, the payment not yet written
		lose("k-lost-running")
		retry := ts.mustSend(t, keyed("k-lost-running", payment))
		block.open()
		orig := <-first
		if retry.status != http.StatusCreated {
			t.Fatalf("retry after the row was lost: %d %s", retry.status, retry.body)
		}
		if orig.err == nil && orig.status == http.StatusCreated && orig.payment(t) != retry.payment(t) {
			t.Errorf("the original answered payment %+v, the retry %+v", orig.payment(t), retry.payment(t))
		}
	})
	t.Run("finished", func(t *testing.T) {
		first := ts.mustSend(t, keyed("k-lost-done", payment))
		if first.status != http.StatusCreated {
			t.Fatalf("first: %d %s", first.status, first.body)
		}
		lose("k-lost-done")
		retry := ts.mustSend(t, keyed("k-lost-done", payment))
		if retry.status != http.StatusCreated || retry.payment(t) != first.payment(t) {
			t.Errorf("retry after the row was lost: %d %s; want 201 with the payment %s", retry.status, retry.body, first.body)
		}
		// The retry's answer is stored with the key again: a replay now.
		if again := ts.mustSend(t, keyed("k-lost-done", payment)); !again.replayed() || again.payment(t) != first.payment(t) {
			t.Errorf("third ask: %d replayed=%v %s", again.status, again.replayed(), again.body)
		}
	})
	if n := ts.charges.created.Load(); n != 2 {
		t.Errorf("%d charges for two operations, want 2", n)
	}
	if n := ts.payments(t); n != 2 {
		t.Errorf("%d payments for two operations, want 2", n)
	}
}

// TestReadOnlyDatabaseAnswers503 serves payments on a database that
// refuses writes (default_transaction_read_only, as a standby does): the
// claim fails with idempotency.ErrReadOnly, and the client gets 503 with
// Retry-After, a problem that says so, and no charge; nothing is written
// anywhere else.
func TestReadOnlyDatabaseAnswers503(t *testing.T) {
	ctx := context.Background()
	url := pgtest.SchemaURL(t)
	open := func(params map[string]string) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		maps.Copy(cfg.ConnConfig.RuntimeParams, params)
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return pool
	}
	if err := Migrate(ctx, open(nil)); err != nil {
		t.Fatal(err)
	}
	readOnly := NewPostgresStorage(open(map[string]string{"default_transaction_read_only": "on"}))
	if _, err := readOnly.Keys().Claim(ctx, idempotency.ClaimRequest{ClientID: "c", Key: "k", Method: "POST",
		Path: "/v1/payments", Fingerprint: []byte("fp")}); !errors.Is(err, idempotency.ErrReadOnly) {
		t.Errorf("Claim on a read-only database: %v, want ErrReadOnly", err)
	}
	ts := newTestServer(t, readOnly.Storage(), Config{})
	r := ts.mustSend(t, keyed("k-read-only", payment))
	if r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" ||
		r.problem(t).Type != idempotency.ProblemUnavailable || !strings.Contains(r.problem(t).Detail, "read-only") {
		t.Errorf("payment on a read-only database: %d Retry-After %q %s; want 503 with Retry-After, unavailable, read-only",
			r.status, r.header.Get("Retry-After"), r.body)
	}
	if n := ts.charges.created.Load(); n != 0 {
		t.Errorf("%d charges on a read-only database, want none", n)
	}
}
