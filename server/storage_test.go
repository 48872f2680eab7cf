package server

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// The key stores pass the conformance suite of package storetest in their
// own packages. These tests check what the reference server adds on top:
// its payments, written through the key's unit of work as any service's
// rows are, and its processor's charges, on both storages.

func TestStorageMemory(t *testing.T) { testStorage(t, memoryStorage) }

func TestStoragePostgres(t *testing.T) { testStorage(t, postgresStorage) }

func testStorage(t *testing.T, newStorage newStorageFunc) {
	for _, tt := range []struct {
		name string
		fn   func(t *testing.T, s Storage)
	}{
		{"PaymentVisibleOnCompletion", testPaymentVisibleOnCompletion},
		{"RollbackDropsPayment", testRollbackDropsPayment},
		{"FencedCompletionDropsPayment", testFencedCompletionDropsPayment},
		{"PaymentOutsideRequest", testPaymentOutsideRequest},
		{"DuplicatePaymentInRequest", testDuplicatePaymentInRequest},
		{"InvalidPaymentText", testInvalidPaymentText},
		{"CreateChargeOnce", testCreateChargeOnce},
		{"CreateChargeConcurrent", testCreateChargeConcurrent},
	} {
		t.Run(tt.name, func(t *testing.T) { tt.fn(t, newStorage(t)) })
	}
}

// claimKey claims a new key of client on s's key store.
func claimKey(t *testing.T, s Storage, client, key string) idempotency.Claim {
	t.Helper()
	res, err := s.Keys.Claim(context.Background(), idempotency.ClaimRequest{
		ClientID: client, Key: key, Method: "POST", Path: "/v1/payments",
		Fingerprint: []byte("fp-" + key),
		LockTimeout: time.Minute, Retention: time.Hour,
	})
	if err != nil || res.Outcome != idempotency.Claimed {
		t.Fatalf("Claim(%s, %s) = %v, %v; want Claimed", client, key, res.Outcome, err)
	}
	return res.Claim
}

// begin opens the unit of work of c and returns the context a handler
// behind the middleware gets, carrying it.
func begin(t *testing.T, s Storage, c idempotency.Claim) (context.Context, idempotency.Tx) {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Keys.Begin(ctx, c)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	return idempotency.NewContext(ctx, c, tx), tx
}

// testPayment returns a payment of operation c.
func testPayment(c idempotency.Claim, id string) Payment {
	return Payment{
		ID:             id,
		ClientID:       c.ClientID,
		Customer:       "cus_123",
		Amount:         4200,
		Currency:       "usd",
		IdempotencyKey: c.Key,
		OperationID:    c.OperationID,
		ChargeID:       "ch_" + id,
		CreatedAt:      time.Date(2026, 3, 4, 5, 6, 7, 891011000, time.UTC),
	}
}

var stored = idempotency.StoredResponse{Status: 201, ContentType: "application/json", Body: []byte(`{}`)}

// mustGetPayment checks that client sees want.
func mustGetPayment(t *testing.T, s Storage, client string, want Payment) {
	t.Helper()
	got, err := s.Payments.GetPayment(context.Background(), client, want.ID)
	if err != nil {
		t.Fatalf("GetPayment(%s, %s): %v", client, want.ID, err)
	}
	if !got.CreatedAt.Equal(want.CreatedAt) {
		t.Errorf("GetPayment(%s, %s).CreatedAt = %v, want %v", client, want.ID, got.CreatedAt, want.CreatedAt)
	}
	got.CreatedAt = want.CreatedAt
	if got != want {
		t.Errorf("GetPayment(%s, %s) = %+v, want %+v", client, want.ID, got, want)
	}
}

// mustNotFindPayment checks that client does not see payment id.
func mustNotFindPayment(t *testing.T, s Storage, client, id string) {
	t.Helper()
	got, err := s.Payments.GetPayment(context.Background(), client, id)
	if !errors.Is(err, ErrNotFound) {
		t.Errorf("GetPayment(%s, %q) = %+v, %v; want ErrNotFound", client, id, got, err)
	}
}

// testPaymentVisibleOnCompletion writes a payment inside a keyed request:
// it is visible only once the key completes, and only to its client.
func testPaymentVisibleOnCompletion(t *testing.T, s Storage) {
	c := claimKey(t, s, "cli_a", "key-1")
	ctx, tx := begin(t, s, c)
	p := testPayment(c, "pay_1")
	if err := s.Payments.CreatePayment(ctx, p); err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	mustNotFindPayment(t, s, "cli_a", "pay_1") // not before Complete
	if err := tx.Complete(context.Background(), stored); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	mustGetPayment(t, s, "cli_a", p)
	mustNotFindPayment(t, s, "cli_b", "pay_1") // never to another client
	mustNotFindPayment(t, s, "cli_a", "pay_unknown")
}

// testRollbackDropsPayment rolls back a unit of work: its payment is gone,
// and the key stays started, owned by the claim.
func testRollbackDropsPayment(t *testing.T, s Storage) {
	c := claimKey(t, s, "cli_a", "key-1")
	ctx, tx := begin(t, s, c)
	if err := s.Payments.CreatePayment(ctx, testPayment(c, "pay_1")); err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	if err := tx.Rollback(context.Background()); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	mustNotFindPayment(t, s, "cli_a", "pay_1")
	// A new unit of work of the same claim stores its own payment.
	ctx, tx = begin(t, s, c)
	p := testPayment(c, "pay_2")
	if err := s.Payments.CreatePayment(ctx, p); err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	if err := tx.Complete(context.Background(), stored); err != nil {
		t.Fatalf("Complete of a new unit of work: %v", err)
	}
	mustGetPayment(t, s, "cli_a", p)
	mustNotFindPayment(t, s, "cli_a", "pay_1")
}

// testFencedCompletionDropsPayment completes a unit of work whose claim no
// longer owns its key: ErrFenced, and its payment is not stored.
func testFencedCompletionDropsPayment(t *testing.T, s Storage) {
	c := claimKey(t, s, "cli_a", "key-1")
	ctx, tx := begin(t, s, c)
	if err := s.Payments.CreatePayment(ctx, testPayment(c, "pay_1")); err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	if err := s.Keys.Release(context.Background(), c, idempotency.ReleaseFailed); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if err := tx.Complete(context.Background(), stored); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Complete of a released claim: %v, want ErrFenced", err)
	}
	mustNotFindPayment(t, s, "cli_a", "pay_1")
}

// testPaymentOutsideRequest writes payments outside any keyed request (the
// unkeyed route): visible at once, and unique by ID and by (client,
// operation) as inside one.
func testPaymentOutsideRequest(t *testing.T, s Storage) {
	ctx := context.Background()
	op := idempotency.Claim{ClientID: "cli_a", OperationID: "0b9f4a3e-7c11-4b8e-9d52-1f0e6a2c3b44"}
	p := testPayment(op, "pay_unkeyed")
	if err := s.Payments.CreatePayment(ctx, p); err != nil {
		t.Fatalf("CreatePayment: %v", err)
	}
	mustGetPayment(t, s, "cli_a", p)
	mustNotFindPayment(t, s, "cli_b", p.ID)

	sameID := p
	sameID.OperationID = "5d2c8e61-3a9f-4f0b-8c7d-2e4b6a1f9c03"
	if err := s.Payments.CreatePayment(ctx, sameID); !errors.Is(err, ErrDuplicatePayment) {
		t.Errorf("CreatePayment with a stored ID: %v, want ErrDuplicatePayment", err)
	}
	sameOp := testPayment(op, "pay_unkeyed_2")
	if err := s.Payments.CreatePayment(ctx, sameOp); !errors.Is(err, ErrDuplicatePayment) {
		t.Errorf("CreatePayment with a stored operation: %v, want ErrDuplicatePayment", err)
	}
	mustNotFindPayment(t, s, "cli_a", sameOp.ID)
	mustGetPayment(t, s, "cli_a", p)
}

// testDuplicatePaymentInRequest writes, inside a keyed request, a payment
// that repeats a stored one: ErrDuplicatePayment from the write, nothing
// stored, and the unit of work goes on (the handler answers with the
// stored payment, and that completes the key).
func testDuplicatePaymentInRequest(t *testing.T, s Storage) {
	c1 := claimKey(t, s, "cli_a", "key-1")
	ctx, tx := begin(t, s, c1)
	first := testPayment(c1, "pay_1")
	if err := s.Payments.CreatePayment(ctx, first); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(context.Background(), stored); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name string
		p    func(c idempotency.Claim) Payment
	}{
		{"same ID", func(c idempotency.Claim) Payment { return testPayment(c, "pay_1") }},
		{"same operation", func(idempotency.Claim) Payment { return testPayment(c1, "pay_other") }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := claimKey(t, s, "cli_a", "key-"+tt.name)
			ctx, tx := begin(t, s, c)
			p := tt.p(c)
			if err := s.Payments.CreatePayment(ctx, p); !errors.Is(err, ErrDuplicatePayment) {
				t.Errorf("CreatePayment = %v, want ErrDuplicatePayment", err)
			}
			if err := tx.Complete(context.Background(), stored); err != nil {
				t.Errorf("Complete after a duplicate payment: %v, want nil (nothing failed the unit of work)", err)
			}
			if p.ID != first.ID {
				mustNotFindPayment(t, s, "cli_a", p.ID)
			}
			mustGetPayment(t, s, "cli_a", first)
		})
	}
}

// testInvalidPaymentText checks that both storages refuse the text
// PostgreSQL's text columns refuse, inside a request and outside, and that
// a lookup by such an id finds nothing.
func testInvalidPaymentText(t *testing.T, s Storage) {
	c := claimKey(t, s, "cli_a", "key-1")
	for _, bad := range []string{"a\x00b", "caf\xe9"} {
		p := testPayment(c, "pay_1")
		p.Customer = bad
		ctx, tx := begin(t, s, c)
		if err := s.Payments.CreatePayment(ctx, p); !errors.Is(err, idempotency.ErrInvalidText) {
			t.Errorf("CreatePayment in a request with customer %q: %v, want ErrInvalidText", bad, err)
		}
		tx.Rollback(context.Background())
		if err := s.Payments.CreatePayment(context.Background(), p); !errors.Is(err, idempotency.ErrInvalidText) {
			t.Errorf("CreatePayment with customer %q: %v, want ErrInvalidText", bad, err)
		}
		mustNotFindPayment(t, s, "cli_a", "pay_1")
		mustNotFindPayment(t, s, "cli_a", "pay_"+bad)
	}
}

func testCreateChargeOnce(t *testing.T, s Storage) {
	ctx := context.Background()
	first := Charge{ID: "ch_1", IdempotencyKey: "cli_a/op_1", Amount: 4200, Currency: "usd"}
	got, created, err := s.Charges.CreateCharge(ctx, first)
	if err != nil || !created {
		t.Fatalf("first CreateCharge = %v, %v; want created", created, err)
	}
	if got.ID != "ch_1" || got.IdempotencyKey != first.IdempotencyKey || got.Amount != 4200 || got.Currency != "usd" || got.CreatedAt.IsZero() {
		t.Errorf("first CreateCharge stored %+v, want %+v with a creation time", got, first)
	}
	again := first
	again.ID = "ch_2"
	again.Amount = 1 // the stored charge is returned as it is
	dup, created, err := s.Charges.CreateCharge(ctx, again)
	if err != nil || created {
		t.Fatalf("second CreateCharge = %v, %v; want not created", created, err)
	}
	if dup.ID != "ch_1" || dup.Amount != 4200 || !dup.CreatedAt.Equal(got.CreatedAt) {
		t.Errorf("second CreateCharge returned %+v, want the stored %+v", dup, got)
	}
	other, created, err := s.Charges.CreateCharge(ctx, Charge{ID: "ch_3", IdempotencyKey: "cli_a/op_2", Amount: 1, Currency: "eur", Customer: "cus_1"})
	if err != nil || !created || other.ID != "ch_3" || other.Customer != "cus_1" {
		t.Errorf("CreateCharge with another key = %+v, %v, %v; want a new charge ch_3 of cus_1", other, created, err)
	}
	for key, want := range map[string]Charge{"cli_a/op_1": got, "cli_a/op_2": other} {
		if found, err := s.Charges.ChargeByKey(ctx, key); err != nil || found != want {
			t.Errorf("ChargeByKey(%s) = %+v, %v; want %+v", key, found, err, want)
		}
	}
	for _, key := range []string{"cli_a/op_3", "bad\x00key"} {
		if _, err := s.Charges.ChargeByKey(ctx, key); !errors.Is(err, ErrNotFound) {
			t.Errorf("ChargeByKey(%q): %v, want ErrNotFound", key, err)
		}
	}
}

func testCreateChargeConcurrent(t *testing.T, s Storage) {
	const n = 20
	charges := make([]Charge, n)
	created := make([]bool, n)
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			c := Charge{ID: fmt.Sprintf("ch_%d", i), IdempotencyKey: "cli_a/op_1", Amount: 4200, Currency: "usd"}
			charges[i], created[i], errs[i] = s.Charges.CreateCharge(context.Background(), c)
		})
	}
	close(start)
	wg.Wait()
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
