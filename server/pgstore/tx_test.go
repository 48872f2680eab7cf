package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// TestTxElsewhere: Tx finds nothing outside a request that owns its key on
// a pgstore store: a plain context, a unit of work of the memory store.
func TestTxElsewhere(t *testing.T) {
	ctx := context.Background()
	if tx, err := pgstore.Tx(ctx); !errors.Is(err, pgstore.ErrNoTx) || tx != nil {
		t.Errorf("Tx(Background) = %v, %v; want nil, ErrNoTx", tx, err)
	}
	mem := idempotency.NewMemoryStore()
	res, err := mem.Claim(ctx, req("key-1", "a"))
	if err != nil {
		t.Fatal(err)
	}
	memTx, err := mem.Begin(ctx, res.Claim)
	if err != nil {
		t.Fatal(err)
	}
	defer memTx.Rollback(ctx)
	if tx, err := pgstore.Tx(idempotency.NewContext(ctx, res.Claim, memTx)); !errors.Is(err, pgstore.ErrNoTx) || tx != nil {
		t.Errorf("Tx of a memory store's unit of work = %v, %v; want nil, ErrNoTx", tx, err)
	}
}

// TestTxBeginsLazily: the unit of work holds no connection until the
// handler asks for its transaction, holds one from then on, and gives it
// back when it completes; a handler that never asks takes none.
func TestTxBeginsLazily(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	acquired := func() int32 { return pool.Stat().AcquiredConns() }

	c := mustClaim(t, s, req("key-1", "a"), idempotency.Claimed).Claim
	tx, hctx := unitOf(t, s, c)
	if n := acquired(); n != 0 {
		t.Errorf("%d connections acquired before the handler asked for its transaction, want 0", n)
	}
	htx, err := pgstore.Tx(hctx)
	if err != nil {
		t.Fatalf("Tx in a request that owns its key: %v", err)
	}
	if again, err := pgstore.Tx(hctx); again != htx || err != nil {
		t.Errorf("Tx asked again = %v, %v; want the same transaction", again, err)
	}
	if _, err := htx.Exec(hctx, `INSERT INTO writes (name) VALUES ('w1')`); err != nil {
		t.Fatal(err)
	}
	if n := acquired(); n != 1 {
		t.Errorf("%d connections acquired once the handler wrote, want 1", n)
	}
	var n int
	if err := htx.QueryRow(hctx, `SELECT count(*) FROM writes`).Scan(&n); err != nil || n != 1 {
		t.Errorf("the handler reads %d rows of its own, %v; want 1", n, err)
	}
	mustBeWritten(t, pool, "w1", false) // not before the completion
	if err := tx.Complete(ctx, created("ord_1")); err != nil {
		t.Fatal(err)
	}
	if n := acquired(); n != 0 {
		t.Errorf("%d connections acquired after the completion, want 0", n)
	}
	mustBeWritten(t, pool, "w1", true)

	// A handler that never writes: no connection, the key completes alone.
	c = mustClaim(t, s, req("key-2", "a"), idempotency.Claimed).Claim
	tx, _ = unitOf(t, s, c)
	if n := acquired(); n != 0 {
		t.Errorf("%d connections acquired by a handler that did not write, want 0", n)
	}
	if err := tx.Complete(ctx, created("ord_2")); err != nil {
		t.Fatal(err)
	}
	if st := keyStatus(t, pool, "key-2"); st != "completed" {
		t.Errorf("key-2 %q, want completed", st)
	}
}

// TestTxRollback: a unit of work rolled back (as the middleware does for a
// released 4xx, a 5xx or a panic) commits none of the handler's writes,
// gives back its connection, and leaves the key started, free to release.
func TestTxRollback(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	c := mustClaim(t, s, req("key-1", "a"), idempotency.Claimed).Claim
	tx, hctx := unitOf(t, s, c)
	for _, name := range []string{"w1", "w2"} {
		if err := write(hctx, name); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections acquired after Rollback, want 0", n)
	}
	if err := write(hctx, "w3"); err == nil {
		t.Errorf("a write after Rollback succeeded, want an error")
	}
	mustBeWritten(t, pool, "w1", false)
	mustBeWritten(t, pool, "w2", false)
	mustBeWritten(t, pool, "w3", false)
	if st := keyStatus(t, pool, "key-1"); st != "started" {
		t.Errorf("key %q after Rollback, want started", st)
	}
	if err := s.Release(ctx, c, idempotency.ReleaseRejected); err != nil {
		t.Errorf("Release after Rollback: %v", err)
	}
}

// TestTxFencedCompletion: a handler whose key was taken over while it ran
// (its lease ran out) writes, then completes: Complete returns ErrFenced,
// and none of its writes is committed, though the statement that fences it
// travels with the COMMIT. The new owner completes with its own writes.
func TestTxFencedCompletion(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	r := leased(req("key-1", "a"), time.Minute, time.Hour)
	first := mustClaim(t, s, r, idempotency.Claimed).Claim
	tx, hctx := unitOf(t, s, first)
	if err := write(hctx, "w_first"); err != nil {
		t.Fatal(err)
	}
	elapse(t, pool, "key-1", 2*time.Minute) // the lease runs out
	taker := mustClaim(t, s, r, idempotency.TookOver).Claim
	if taker.OperationID != first.OperationID {
		t.Errorf("takeover under operation %s, want the first's %s", taker.OperationID, first.OperationID)
	}
	if err := write(hctx, "w_first_late"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, created("ord_first")); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Complete of the fenced owner: %v, want ErrFenced", err)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections acquired after the fenced completion, want 0", n)
	}
	mustBeWritten(t, pool, "w_first", false)
	mustBeWritten(t, pool, "w_first_late", false)
	if row, _ := readKey(t, pool, "key-1"); row.status != "started" || row.token != taker.Token {
		t.Errorf("key %+v after the fenced completion, want started under the taker's token %d", row, taker.Token)
	}

	tx, hctx = unitOf(t, s, taker)
	if err := write(hctx, "w_taker"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, created("ord_taker")); err != nil {
		t.Fatalf("Complete of the taker: %v", err)
	}
	mustBeWritten(t, pool, "w_taker", true)
	rec := mustClaim(t, s, r, idempotency.Exists).Record
	if rec.Response == nil || string(rec.Response.Body) != `{"id":"ord_taker"}` {
		t.Errorf("replay %+v, want the taker's response", rec.Response)
	}
}

// TestTxSavepoint: the handler's Begin opens a savepoint that it commits or
// rolls back itself, as with any pgx.Tx: a failed write inside a savepoint
// rolled back leaves the transaction usable, and what the handler kept
// commits with the key.
func TestTxSavepoint(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	mustComplete(t, s, mustClaim(t, s, req("key-0", "a"), idempotency.Claimed).Claim, "w_taken")

	c := mustClaim(t, s, req("key-1", "a"), idempotency.Claimed).Claim
	tx, hctx := unitOf(t, s, c)
	htx, err := pgstore.Tx(hctx)
	if err != nil {
		t.Fatal(err)
	}
	sp, err := htx.Begin(hctx)
	if err != nil {
		t.Fatalf("Begin of a savepoint: %v", err)
	}
	if _, err := sp.Exec(hctx, `INSERT INTO writes (name) VALUES ('w_dropped')`); err != nil {
		t.Fatal(err)
	}
	if _, err := sp.Exec(hctx, `INSERT INTO writes (name) VALUES ('w_taken')`); !isUniqueViolation(err) {
		t.Fatalf("insert of a taken name: %v, want a unique violation", err)
	}
	if err := sp.Rollback(hctx); err != nil {
		t.Fatalf("Rollback of the savepoint: %v", err)
	}
	if err := pgx.BeginFunc(hctx, htx, func(sp pgx.Tx) error {
		_, err := sp.Exec(hctx, `INSERT INTO writes (name) VALUES ('w_kept')`)
		return err
	}); err != nil {
		t.Fatalf("a savepoint committed: %v", err)
	}
	if err := write(hctx, "w_after"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, created("ord_1")); err != nil {
		t.Fatal(err)
	}
	mustBeWritten(t, pool, "w_dropped", false)
	mustBeWritten(t, pool, "w_kept", true)
	mustBeWritten(t, pool, "w_after", true)
	if st := keyStatus(t, pool, "key-1"); st != "completed" {
		t.Errorf("key %q, want completed", st)
	}
}

// TestTxFailedWrite: a handler's write fails (a unique violation), which
// aborts its transaction, as any failed statement does in PostgreSQL. If
// it answers a 4xx that is stored (a 422, say), the key completes alone,
// with none of the handler's rows; if it answers a 2xx anyway, Complete
// fails, nothing is committed and the key stays started under its claim,
// which the middleware then releases. Either as the transaction's first
// statement (sent with its BEGIN) or after another.
func TestTxFailedWrite(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name   string
		before []string // writes before the failing one
	}{
		{"first statement", nil},
		{"after a write", []string{"w_before"}},
	} {
		for _, status := range []int{422, 409, 201, 200} {
			t.Run(fmt.Sprintf("%s/%d", tt.name, status), func(t *testing.T) {
				s, pool := newStore(t, nil)
				mustComplete(t, s, mustClaim(t, s, req("key-0", "a"), idempotency.Claimed).Claim, "w_taken")
				r := req("key-1", "a")
				c := mustClaim(t, s, r, idempotency.Claimed).Claim
				tx, hctx := unitOf(t, s, c)
				for _, name := range tt.before {
					if err := write(hctx, name); err != nil {
						t.Fatal(err)
					}
				}
				if err := write(hctx, "w_taken"); !isUniqueViolation(err) {
					t.Fatalf("write of a taken name: %v, want a unique violation", err)
				}
				if err := write(hctx, "w_after"); err == nil {
					t.Errorf("a write in the aborted transaction succeeded")
				}
				resp := idempotency.StoredResponse{Status: status, ContentType: "application/problem+json",
					Body: []byte(`{"status":` + fmt.Sprint(status) + `}`)}
				err := tx.Complete(ctx, resp)
				if n := pool.Stat().AcquiredConns(); n != 0 {
					t.Errorf("%d connections acquired after Complete, want 0", n)
				}
				for _, name := range append(tt.before, "w_after") {
					mustBeWritten(t, pool, name, false)
				}
				if status >= 400 {
					if err != nil {
						t.Fatalf("Complete with a stored %d after a failed write: %v, want nil", status, err)
					}
					rec := mustClaim(t, s, r, idempotency.Exists).Record
					if rec.Status != idempotency.StatusCompleted || rec.Response == nil || rec.Response.Status != status {
						t.Errorf("record %+v, want completed with %d", rec, status)
					}
					return
				}
				if err == nil || errors.Is(err, idempotency.ErrFenced) {
					t.Errorf("Complete with %d after a failed write: %v, want an error other than ErrFenced", status, err)
				}
				if row, _ := readKey(t, pool, "key-1"); row.status != "started" || row.token != c.Token {
					t.Errorf("key %+v, want started under the claim's token %d", row, c.Token)
				}
				if err := s.Release(ctx, c, idempotency.ReleaseFailed); err != nil {
					t.Errorf("Release after the failed completion: %v", err)
				}
				again := mustClaim(t, s, r, idempotency.Claimed).Claim
				if again.OperationID != c.OperationID {
					t.Errorf("retry under operation %s, want %s", again.OperationID, c.OperationID)
				}
			})
		}
	}
}

// TestTxNeverBegan: the handler's first statement fails before its
// transaction began (here its context is cancelled, as when the pool has
// no connection to give or the connection breaks under the BEGIN). As
// after a failed write in a begun transaction (TestTxFailedWrite), a
// stored 4xx completes the key alone, and a 2xx fails Complete: storing a
// success whose writes never happened would replay it forever.
func TestTxNeverBegan(t *testing.T) {
	ctx := context.Background()
	for _, status := range []int{422, 201} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			s, pool := newStore(t, nil)
			c := mustClaim(t, s, req("key-1", "a"), idempotency.Claimed).Claim
			tx, hctx := unitOf(t, s, c)
			gone, cancel := context.WithCancel(hctx)
			cancel()
			if err := write(gone, "w1"); err == nil {
				t.Fatal("a write with a cancelled context succeeded")
			}
			err := tx.Complete(ctx, idempotency.StoredResponse{Status: status, Body: []byte(`{}`)})
			mustBeWritten(t, pool, "w1", false)
			st := keyStatus(t, pool, "key-1")
			if status >= 400 {
				if err != nil || st != "completed" {
					t.Errorf("Complete with a stored %d: %v, key %s; want nil, completed", status, err, st)
				}
				return
			}
			if err == nil || errors.Is(err, idempotency.ErrFenced) || st != "started" {
				t.Errorf("Complete with %d after the transaction failed to begin: %v, key %s; want an error other than ErrFenced, started",
					status, err, st)
			}
		})
	}
}

// TestTxCommitRefused: the COMMIT pipelined behind the key's completion
// fails (a deferred constraint of the handler's table refuses its row at
// commit): Complete returns an error, and neither the row nor the key's

// mustComplete completes c with the named writes made through
// pgstore.Tx, and checks they were committed.
func mustComplete(t *testing.T, s idempotency.Store, c idempotency.Claim, writes ...string) {
	t.Helper()
	ctx := context.Background()
	tx, hctx := unitOf(t, s, c)
	for _, name := range writes {
		if err := write(hctx, name); err != nil {
			t.Fatalf("write(%s): %v", name, err)
		}
	}
	if err := tx.Complete(ctx, created("ord_"+c.Key)); err != nil {
		t.Fatalf("Complete: %v", err)
	}
}

// isUniqueViolation reports whether err is PostgreSQL's unique_violation.
func isUniqueViolation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505"
}
