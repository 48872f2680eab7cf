package storetest

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/idemkit/idem/server"
)

func testFencedCompletion(t *testing.T, b Backend) {
	req := withLockTimeout(request("cli_a", "key-1", "a"))
	slow := stale(t, b, req)
	taker := claim(t, b.Store, req, server.TookOver).Claim

	// The slow original finishes first, after the takeover: fenced, and
	// nothing of its unit of work is visible.
	if err := complete(t, b, slow, created("pay_slow"), payment(slow, "pay_slow")); !errors.Is(err, server.ErrFenced) {
		t.Fatalf("Complete of the taken-over claim: %v, want ErrFenced", err)
	}
	mustNotFindPayment(t, b, "cli_a", "pay_slow")
	if rec := claim(t, b.Store, req, server.Exists).Record; rec.Status != server.StatusStarted {
		t.Errorf("after the fenced completion: status %q, want started", rec.Status)
	}

	if err := complete(t, b, taker, created("pay_taker"), payment(taker, "pay_taker")); err != nil {
		t.Fatalf("Complete of the taker: %v", err)
	}
	mustGetPayment(t, b, "cli_a", payment(taker, "pay_taker"))
	rec := claim(t, b.Store, req, server.Exists).Record
	if rec.Status != server.StatusCompleted || rec.Response == nil || string(rec.Response.Body) != `{"id":"pay_taker"}` {
		t.Errorf("record %+v, want the taker's response", rec)
	}
}

func testFencedAfterTakerCompleted(t *testing.T, b Backend) {
	req := withLockTimeout(request("cli_a", "key-1", "a"))
	slow := stale(t, b, req)
	taker := claim(t, b.Store, req, server.TookOver).Claim
	if err := complete(t, b, taker, created("pay_taker"), payment(taker, "pay_taker")); err != nil {
		t.Fatalf("Complete of the taker: %v", err)
	}
	// The slow original's payment has the same operation as the taker's:
	// the fence answers first.
	if err := complete(t, b, slow, created("pay_slow"), payment(slow, "pay_slow")); !errors.Is(err, server.ErrFenced) {
		t.Fatalf("Complete of the taken-over claim: %v, want ErrFenced", err)
	}
	mustNotFindPayment(t, b, "cli_a", "pay_slow")
	mustGetPayment(t, b, "cli_a", payment(taker, "pay_taker"))
	if rec := claim(t, b.Store, req, server.Exists).Record; string(rec.Response.Body) != `{"id":"pay_taker"}` {
		t.Errorf("stored response %q, want the taker's", rec.Response.Body)
	}
}

func testPaymentVisibility(t *testing.T, b Backend) {
	ctx := context.Background()
	c := claim(t, b.Store, request("cli_a", "key-1", "a"), server.Claimed).Claim
	tx, err := b.Store.Begin(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	p := payment(c, "pay_1")
	if err := b.Payments.CreatePayment(ctx, tx, p); err != nil {
		t.Fatal(err)
	}
	mustNotFindPayment(t, b, "cli_a", "pay_1") // not before Complete
	if err := tx.Complete(ctx, created("pay_1")); err != nil {
		t.Fatal(err)
	}
	mustGetPayment(t, b, "cli_a", p)
	mustNotFindPayment(t, b, "cli_b", "pay_1") // never to another client
	mustNotFindPayment(t, b, "cli_a", "pay_unknown")
}

func testRollbackDropsPayment(t *testing.T, b Backend) {
	ctx := context.Background()
	req := request("cli_a", "key-1", "a")
	c := claim(t, b.Store, req, server.Claimed).Claim
	tx, err := b.Store.Begin(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Payments.CreatePayment(ctx, tx, payment(c, "pay_1")); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("second Rollback: %v, want nil", err)
	}
	if err := tx.Complete(ctx, created("pay_1")); err == nil {
		t.Errorf("Complete after Rollback succeeded, want an error")
	}
	mustNotFindPayment(t, b, "cli_a", "pay_1")
	// The key stays started, still owned by c.
	if rec := claim(t, b.Store, req, server.Exists).Record; rec.Status != server.StatusStarted {
		t.Errorf("after Rollback: status %q, want started", rec.Status)
	}
	if err := complete(t, b, c, created("pay_2"), payment(c, "pay_2")); err != nil {
		t.Errorf("a new unit of work of the same claim: %v", err)
	}
	mustGetPayment(t, b, "cli_a", payment(c, "pay_2"))
}

func testDuplicatePayment(t *testing.T, b Backend) {
	req1 := request("cli_a", "key-1", "a")
	c1 := claim(t, b.Store, req1, server.Claimed).Claim
	if err := complete(t, b, c1, created("pay_1"), payment(c1, "pay_1")); err != nil {
		t.Fatal(err)
	}
	// Another operation reusing the payment ID: nothing of it is applied.
	req2 := request("cli_a", "key-2", "a")
	c2 := claim(t, b.Store, req2, server.Claimed).Claim
	if err := complete(t, b, c2, created("pay_1"), payment(c2, "pay_1")); !errors.Is(err, server.ErrDuplicatePayment) {
		t.Errorf("Complete with a duplicate payment ID: %v, want ErrDuplicatePayment", err)
	}
	if rec := claim(t, b.Store, req2, server.Exists).Record; rec.Status != server.StatusStarted {
		t.Errorf("key of the failed completion: status %q, want started", rec.Status)
	}
	mustGetPayment(t, b, "cli_a", payment(c1, "pay_1"))
	// Two payments of one operation in one unit of work.
	if err := complete(t, b, c2, created("pay_2"), payment(c2, "pay_2"), payment(c2, "pay_3")); !errors.Is(err, server.ErrDuplicatePayment) {
		t.Errorf("Complete with two payments of one operation: %v, want ErrDuplicatePayment", err)
	}
	mustNotFindPayment(t, b, "cli_a", "pay_2")
}

// testInsertPayment checks a payment stored outside any key's unit of work
// ([server.PaymentInserter]): it is visible at once, needs no key, and
// keeps the same uniqueness as a staged one. A store that is no
// PaymentInserter skips it.
func testInsertPayment(t *testing.T, b Backend) {
	ins, ok := b.Payments.(server.PaymentInserter)
	if !ok {
		t.Skipf("%T is not a server.PaymentInserter", b.Payments)
	}
	ctx := context.Background()
	op := server.Claim{ClientID: "cli_a", OperationID: "0b9f4a3e-7c11-4b8e-9d52-1f0e6a2c3b44"}
	p := payment(op, "pay_unkeyed")
	if p.IdempotencyKey != "" {
		t.Fatalf("test payment has key %q", p.IdempotencyKey)
	}
	if err := ins.InsertPayment(ctx, p); err != nil {
		t.Fatalf("InsertPayment: %v", err)
	}
	mustGetPayment(t, b, "cli_a", p)
	mustNotFindPayment(t, b, "cli_b", p.ID)

	// The same ID, or the same (client, operation): refused, nothing stored.
	sameID := p
	sameID.OperationID = "5d2c8e61-3a9f-4f0b-8c7d-2e4b6a1f9c03"
	if err := ins.InsertPayment(ctx, sameID); !errors.Is(err, server.ErrDuplicatePayment) {
		t.Errorf("InsertPayment with a stored ID: %v, want ErrDuplicatePayment", err)
	}
	sameOp := payment(op, "pay_unkeyed_2")
	if err := ins.InsertPayment(ctx, sameOp); !errors.Is(err, server.ErrDuplicatePayment) {
		t.Errorf("InsertPayment with a stored operation: %v, want ErrDuplicatePayment", err)
	}
	mustNotFindPayment(t, b, "cli_a", sameOp.ID)
	mustGetPayment(t, b, "cli_a", p)

	// A staged payment of a claimed key cannot reuse the operation either.
	c := claim(t, b.Store, request("cli_a", "key-1", "a"), server.Claimed).Claim
	if err := complete(t, b, c, created("pay_unkeyed"), payment(c, "pay_unkeyed")); !errors.Is(err, server.ErrDuplicatePayment) {
		t.Errorf("Complete reusing the inserted payment's ID: %v, want ErrDuplicatePayment", err)
	}
}

// foreignTx is a Tx of no store.
type foreignTx struct{}

func (foreignTx) Complete(context.Context, server.StoredResponse) error { return nil }
func (foreignTx) Rollback(context.Context) error                        { return nil }

func testForeignTx(t *testing.T, b Backend) {
	c := claim(t, b.Store, request("cli_a", "key-1", "a"), server.Claimed).Claim
	if err := b.Payments.CreatePayment(context.Background(), foreignTx{}, payment(c, "pay_1")); err == nil {
		t.Errorf("CreatePayment with another store's Tx succeeded, want an error")
	}
}

func testCreateChargeOnce(t *testing.T, b Backend) {
	ctx := context.Background()
	first := server.Charge{ID: "ch_1", IdempotencyKey: "cli_a/op_1", Amount: 4200, Currency: "usd"}
	got, created, err := b.Charges.CreateCharge(ctx, first)
	if err != nil || !created {
		t.Fatalf("first CreateCharge = %v, %v; want created", created, err)
	}
	if got.ID != "ch_1" || got.IdempotencyKey != first.IdempotencyKey || got.Amount != 4200 || got.Currency != "usd" || got.CreatedAt.IsZero() {
		t.Errorf("first CreateCharge stored %+v, want %+v with a creation time", got, first)
	}
	again := first
	again.ID = "ch_2"
	dup, created, err := b.Charges.CreateCharge(ctx, again)
	if err != nil || created {
		t.Fatalf("second CreateCharge = %v, %v; want not created", created, err)
	}
	if dup.ID != "ch_1" || !dup.CreatedAt.Equal(got.CreatedAt) {
		t.Errorf("second CreateCharge returned %+v, want the stored %+v", dup, got)
	}
	other, created, err := b.Charges.CreateCharge(ctx, server.Charge{ID: "ch_3", IdempotencyKey: "cli_a/op_2", Amount: 1, Currency: "eur"})
	if err != nil || !created || other.ID != "ch_3" {
		t.Errorf("CreateCharge with another key = %+v, %v, %v; want a new charge ch_3", other, created, err)
	}
}

func testCreateChargeConcurrent(t *testing.T, b Backend) {
	const n = 20
	charges := make([]server.Charge, n)
	created := make([]bool, n)
	errs := make([]error, n)
	race(n, func(i int) {
		c := server.Charge{ID: fmt.Sprintf("ch_%d", i), IdempotencyKey: "cli_a/op_1", Amount: 4200, Currency: "usd"}
		charges[i], created[i], errs[i] = b.Charges.CreateCharge(context.Background(), c)
	})
	winners := 0
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("concurrent CreateCharge: %v", errs[i])
		}
		if created[i] {
			winners++
		}
		if charges[i].ID != charges[0].ID {
			t.Errorf("concurrent CreateCharge returned charges %s and %s, want one", charges[0].ID, charges[i].ID)
		}
	}
	if winners != 1 {
		t.Errorf("%d concurrent CreateCharge calls with one key created %d charges, want 1", n, winners)
	}
}
