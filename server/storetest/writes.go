package storetest

import (
	"context"
	"errors"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
)

// testWritesVisibleAfterComplete makes writes in a unit of work: invisible
// until Complete, visible after it, and the key completed with them.
func testWritesVisibleAfterComplete(t *testing.T, b Backend) {
	ctx := context.Background()
	req := request("cli_a", "key-1", "a")
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	tx, wctx := begin(t, b, c)
	for _, name := range []string{"w1", "w2"} {
		if err := b.Write(wctx, name); err != nil {
			t.Fatalf("Write(%s): %v", name, err)
		}
	}
	mustBeWritten(t, b, "w1", false) // not before Complete
	mustBeWritten(t, b, "w2", false)
	if st := status(t, b.Store, req); st != idempotency.StatusStarted {
		t.Errorf("before Complete: status %q, want started", st)
	}
	if err := tx.Complete(ctx, created("ord_1")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	mustBeWritten(t, b, "w1", true)
	mustBeWritten(t, b, "w2", true)
	mustBeWritten(t, b, "w_unknown", false)
	if st := status(t, b.Store, req); st != idempotency.StatusCompleted {
		t.Errorf("after Complete: status %q, want completed", st)
	}
	if err := tx.Complete(ctx, created("ord_1")); err == nil {
		t.Errorf("second Complete of one unit of work succeeded, want an error")
	}
}

// testRollbackDropsWrites rolls back a unit of work: its writes are never
// visible, the key stays started and owned by its claim, and a new unit of
// work of the same claim completes; a released key's writes are dropped too.
func testRollbackDropsWrites(t *testing.T, b Backend) {
	ctx := context.Background()
	req := request("cli_a", "key-1", "a")
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	tx, wctx := begin(t, b, c)
	if err := b.Write(wctx, "w_rolled_back"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("second Rollback: %v, want nil", err)
	}
	if err := tx.Complete(ctx, created("ord_1")); err == nil {
		t.Errorf("Complete after Rollback succeeded, want an error")
	}
	mustBeWritten(t, b, "w_rolled_back", false)
	if st := status(t, b.Store, req); st != idempotency.StatusStarted {
		t.Errorf("after Rollback: status %q, want started", st)
	}
	if err := complete(t, b, c, created("ord_2"), "w_second_unit"); err != nil {
		t.Errorf("a new unit of work of the same claim: %v", err)
	}
	mustBeWritten(t, b, "w_second_unit", true)
	mustBeWritten(t, b, "w_rolled_back", false)

	// Rolled back and released, as the middleware abandons a request.
	rel := claim(t, b.Store, request("cli_a", "key-2", "a"), idempotency.Claimed).Claim
	tx, wctx = begin(t, b, rel)
	if err := b.Write(wctx, "w_released"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	release(t, b.Store, rel, idempotency.ReleaseFailed)
	mustBeWritten(t, b, "w_released", false)
	resumed := claim(t, b.Store, request("cli_a", "key-2", "a"), idempotency.Claimed).Claim
	if err := complete(t, b, resumed, created("ord_3"), "w_resumed"); err != nil {
		t.Fatal(err)
	}
	mustBeWritten(t, b, "w_resumed", true)
	mustBeWritten(t, b, "w_released", false)
}

// testFailedWrite makes a unit of work one of whose writes fails (its name
// is taken): the unit of work does not complete with a success. Complete
// fails, with an error other than ErrFenced; none of its writes is
// visible; the key stays started, and its owner completes it with a new
// unit of work.
func testFailedWrite(t *testing.T, b Backend) {
	ctx := context.Background()
	first := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Claimed).Claim
	if err := complete(t, b, first, created("ord_1"), "w_taken"); err != nil {
		t.Fatal(err)
	}
	req := request("cli_a", "key-2", "a")
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	tx, wctx := begin(t, b, c)
	if err := b.Write(wctx, "w_before"); err != nil {
		t.Fatalf("Write(w_before): %v", err)
	}
	dupErr := b.Write(wctx, "w_taken") // fails now, or at Complete
	t.Logf("Write of a taken name: %v", dupErr)
	err := tx.Complete(ctx, created("ord_2"))
	if err == nil || errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Complete of a unit of work with a failed write: %v, want an error other than ErrFenced", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("Rollback after a failed Complete: %v", err)
	}
	mustBeWritten(t, b, "w_before", false)
	if st := status(t, b.Store, req); st != idempotency.StatusStarted {
		t.Errorf("key of the failed completion: status %q, want started", st)
	}
	if err := complete(t, b, c, created("ord_2"), "w_after"); err != nil {
		t.Fatalf("a new unit of work after the failed one: %v", err)
	}
	mustBeWritten(t, b, "w_after", true)
	mustBeWritten(t, b, "w_before", false)
}

// foreignTx is a Tx of no store.
type foreignTx struct{}

func (foreignTx) Complete(context.Context, idempotency.StoredResponse) error { return nil }
func (foreignTx) Rollback(context.Context) error                             { return nil }

// testWriteOutsideUnitOfWork writes where no unit of work of the store is:
// a plain context, a unit of work of another store, a finished one. Each
// write fails and nothing is written.
func testWriteOutsideUnitOfWork(t *testing.T, b Backend) {
	ctx := context.Background()
	c := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Claimed).Claim
	if err := b.Write(ctx, "w_plain"); err == nil {
		t.Errorf("Write without a unit of work succeeded, want an error")
	}
	if err := b.Write(idempotency.NewContext(ctx, c, foreignTx{}), "w_foreign"); err == nil {
		t.Errorf("Write in another store's unit of work succeeded, want an error")
	}
	tx, wctx := begin(t, b, c)
	if err := tx.Complete(ctx, created("ord_1")); err != nil {
		t.Fatal(err)
	}
	if err := b.Write(wctx, "w_late"); err == nil {
		t.Errorf("Write in a completed unit of work succeeded, want an error")
	}
	for _, name := range []string{"w_plain", "w_foreign", "w_late"} {
		mustBeWritten(t, b, name, false)
	}
}
