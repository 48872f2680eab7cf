// Package storetest is the conformance suite of the stores of package
// server: every implementation of [server.Store], [server.PaymentStore] and
// [server.ChargeStore] runs it from its own tests, so the in-memory store
// and the PostgreSQL store keep one behaviour:
//
//	func TestConformance(t *testing.T) {
//		storetest.Exercise(t, func(t *testing.T) storetest.Backend {
//			s := server.NewMemoryStore()
//			return storetest.Backend{Store: s, Payments: s, Charges: s}
//		})
//	}
//
// The suite waits past short lock timeouts and retention periods with
// time.Sleep, asserting only the order of events, never how long anything
// took. Run it with -race.
package storetest

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/server"
)

// Backend is one store under test, seen through the three interfaces it
// implements. The fields usually hold the same value. When Payments is
// also a [server.PaymentInserter], the suite checks InsertPayment too.
type Backend struct {
	Store    server.Store
	Payments server.PaymentStore
	Charges  server.ChargeStore
}

// Exercise runs the conformance suite. newStore is called once per subtest
// and must return an empty store of its own (a fresh schema, say), cleaned
// up by t.Cleanup. The subtests run in parallel.
func Exercise(t *testing.T, newStore func(t *testing.T) Backend) {
	tests := []struct {
		name string
		run  func(t *testing.T, b Backend)
	}{
		{"ClaimNewKey", testClaimNewKey},
		{"ClaimStartedKey", testClaimStartedKey},
		{"CompleteStoresResponse", testCompleteStoresResponse},
		{"FingerprintMismatch", testFingerprintMismatch},
		{"ConcurrentClaims", testConcurrentClaims},
		{"KeysScopedByClient", testKeysScopedByClient},
		{"TakeoverAfterLockTimeout", testTakeover},
		{"TakeoverRace", testTakeoverRace},
		{"TakeoverRefusedForOtherFingerprint", testTakeoverRefusedForOtherFingerprint},
		{"NoTakeoverWithoutLockTimeout", testNoTakeoverWithoutLockTimeout},
		{"FencedCompletionRollsBack", testFencedCompletion},
		{"FencedAfterTakerCompleted", testFencedAfterTakerCompleted},
		{"ReleaseThenClaimKeepsOperation", testReleaseThenClaim},
		{"ReleaseThenClaimOtherRequest", testReleaseThenClaimOther},
		{"FailedReleaseRefusesOtherRequest", testFailedReleaseRefusesOther},
		{"ReleasedKeyOtherFingerprintVersion", testReleasedOtherVersion},
		{"ReleasedKeyClaimRace", testReleasedClaimRace},
		{"ReleaseFenced", testReleaseFenced},
		{"RetentionExpiresCompletedKey", testRetentionCompleted},
		{"RetentionExpiresStartedKey", testRetentionStarted},
		{"RetentionExpiresReleasedKey", testRetentionReleased},
		{"Purge", testPurge},
		{"PurgeReleased", testPurgeReleased},
		{"PurgeNothing", testPurgeNothing},
		{"PaymentVisibleAfterComplete", testPaymentVisibility},
		{"RollbackDropsPayment", testRollbackDropsPayment},
		{"DuplicatePayment", testDuplicatePayment},
		{"CreatePaymentRejectsForeignTx", testForeignTx},
		{"InsertPayment", testInsertPayment},
		{"CreateChargeOnce", testCreateChargeOnce},
		{"CreateChargeConcurrent", testCreateChargeConcurrent},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.run(t, newStore(t))
		})
	}
}

// Timing of the suite: lockTimeout and retention are short, and the tests
// sleep for pause, comfortably longer, to make a key stale or expired. Keys
// claimed after the pause must be used well within lockTimeout.
const (
	lockTimeout = 200 * time.Millisecond
	retention   = 200 * time.Millisecond
	pause       = 300 * time.Millisecond
)

// fingerprint returns a distinct fingerprint for each body.
func fingerprint(body string) []byte {
	sum := sha256.Sum256([]byte("POST /v1/payments " + body))
	return sum[:]
}

// request returns a claim request of client for key with the fingerprint of
// body, no lock timeout and no retention.
func request(client, key, body string) server.ClaimRequest {
	return server.ClaimRequest{
		ClientID:           client,
		Key:                key,
		Method:             "POST",
		Path:               "/v1/payments",
		Fingerprint:        fingerprint(body),
		FingerprintVersion: 1,
	}
}

// withLockTimeout returns req with the suite's lock timeout.
func withLockTimeout(req server.ClaimRequest) server.ClaimRequest {
	req.LockTimeout = lockTimeout
	return req
}

// withRetention returns req with the suite's retention.
func withRetention(req server.ClaimRequest) server.ClaimRequest {
	req.Retention = retention
	return req
}

// claim calls Claim and checks its outcome.
func claim(t *testing.T, s server.Store, req server.ClaimRequest, want server.Outcome) server.ClaimResult {
	t.Helper()
	res, err := s.Claim(context.Background(), req)
	if err != nil {
		t.Fatalf("Claim(%s, %s): %v", req.ClientID, req.Key, err)
	}
	if res.Outcome != want {
		t.Fatalf("Claim(%s, %s) = %s (record %+v), want %s", req.ClientID, req.Key, outcome(res.Outcome), res.Record, outcome(want))
	}
	switch want {
	case server.Claimed, server.TookOver:
		c := res.Claim
		if c.ClientID != req.ClientID || c.Key != req.Key || c.OperationID == "" {
			t.Fatalf("Claim(%s, %s) returned claim %+v: want the client, the key and an operation ID", req.ClientID, req.Key, c)
		}
	case server.Exists:
		if res.Record == nil {
			t.Fatalf("Claim(%s, %s) = Exists with a nil record", req.ClientID, req.Key)
		}
	}
	return res
}

// outcome names an outcome for messages.
func outcome(o server.Outcome) string {
	switch o {
	case server.Claimed:
		return "Claimed"
	case server.TookOver:
		return "TookOver"
	case server.Exists:
		return "Exists"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// complete runs one unit of work of c: it creates payments, then completes
// with resp, and returns Complete's error.
func complete(t *testing.T, b Backend, c server.Claim, resp server.StoredResponse, payments ...server.Payment) error {
	t.Helper()
	ctx := context.Background()
	tx, err := b.Store.Begin(ctx, c)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	for _, p := range payments {
		if err := b.Payments.CreatePayment(ctx, tx, p); err != nil {
			t.Fatalf("CreatePayment(%s): %v", p.ID, err)
		}
	}
	err = tx.Complete(ctx, resp)
	if rerr := tx.Rollback(ctx); rerr != nil {
		t.Errorf("Rollback after Complete: %v, want nil (a no-op)", rerr)
	}
	return err
}

// created is a response worth storing.
func created(id string) server.StoredResponse {
	return server.StoredResponse{
		Status:      201,
		ContentType: "application/json",
		Header:      map[string]string{"Location": "/v1/payments/" + id},
		Body:        []byte(`{"id":"` + id + `"}`),
	}
}

// payment returns a payment of claim c.
func payment(c server.Claim, id string) server.Payment {
	return server.Payment{
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

// mustGetPayment checks that client sees want.
func mustGetPayment(t *testing.T, b Backend, client string, want server.Payment) {
	t.Helper()
	got, err := b.Payments.GetPayment(context.Background(), client, want.ID)
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
func mustNotFindPayment(t *testing.T, b Backend, client, id string) {
	t.Helper()
	got, err := b.Payments.GetPayment(context.Background(), client, id)
	if !errors.Is(err, server.ErrNotFound) {
		t.Errorf("GetPayment(%s, %s) = %+v, %v; want ErrNotFound", client, id, got, err)
	}
}
