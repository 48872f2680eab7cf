package idempotency

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// fakeClock is a settable clock for the MemoryStore's test seam.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func newClockedMemoryStore() (*MemoryStore, *fakeClock) {
	s, c := NewMemoryStore(), newFakeClock()
	s.now = c.Now
	return s, c
}

func claimReq(client, key, fp string) ClaimRequest {
	return ClaimRequest{
		ClientID: client, Key: key, Method: "POST", Path: "/v1/payments",
		Fingerprint: []byte(fp), FingerprintVersion: FingerprintVersion,
		LockTimeout: 30 * time.Second, Retention: 24 * time.Hour,
	}
}

func mustClaim(t *testing.T, s Store, req ClaimRequest, want Outcome) ClaimResult {
	t.Helper()
	res, err := s.Claim(context.Background(), req)
	if err != nil {
		t.Fatalf("Claim(%s/%s): %v", req.ClientID, req.Key, err)
	}
	if res.Outcome != want {
		t.Fatalf("Claim(%s/%s) outcome = %v, want %v", req.ClientID, req.Key, res.Outcome, want)
	}
	return res
}

func TestMemoryStoreClaim(t *testing.T) {
	ctx := context.Background()
	s, clock := newClockedMemoryStore()

	first := mustClaim(t, s, claimReq("a", "k", "fp1"), Claimed)
	// Same key, other client: another operation.
	other := mustClaim(t, s, claimReq("b", "k", "fp1"), Claimed)
	if other.Claim.OperationID == first.Claim.OperationID {
		t.Error("two clients share an operation ID")
	}
	// Duplicate while started: the row as it is.
	dup := mustClaim(t, s, claimReq("a", "k", "fp1"), Exists)
	if dup.Record.Status != StatusStarted || string(dup.Record.Fingerprint) != "fp1" {
		t.Errorf("duplicate sees %+v", dup.Record)
	}
	// Stale but another fingerprint: no takeover.
	clock.Advance(31 * time.Second)
	mustClaim(t, s, claimReq("a", "k", "fp2"), Exists)
	// Stale and the same fingerprint: takeover, same operation, new token.
	took := mustClaim(t, s, claimReq("a", "k", "fp1"), TookOver)
	if took.Claim.OperationID != first.Claim.OperationID || took.Claim.Token == first.Claim.Token {
		t.Errorf("takeover claim %+v, first %+v", took.Claim, first.Claim)
	}
	// The first owner is fenced: its completion applies nothing.
	tx, _ := s.Begin(ctx, first.Claim)
	if err := s.CreatePayment(ctx, tx, Payment{ID: "pay_old", ClientID: "a", OperationID: first.Claim.OperationID}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, StoredResponse{Status: 201}); !errors.Is(err, ErrFenced) {
		t.Fatalf("fenced Complete = %v, want ErrFenced", err)
	}
	if _, err := s.GetPayment(ctx, "a", "pay_old"); !errors.Is(err, ErrNotFound) {
		t.Errorf("fenced payment visible: %v", err)
	}
	if err := s.Release(ctx, first.Claim, ReleaseFailed); !errors.Is(err, ErrFenced) {
		t.Errorf("fenced Release = %v, want ErrFenced", err)
	}
	// The new owner completes.
	tx, _ = s.Begin(ctx, took.Claim)
	s.CreatePayment(ctx, tx, Payment{ID: "pay_new", ClientID: "a", OperationID: took.Claim.OperationID})
	if err := tx.Complete(ctx, StoredResponse{Status: 201, ContentType: "application/json", Body: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("Rollback after Complete = %v", err)
	}
	if p, err := s.GetPayment(ctx, "a", "pay_new"); err != nil || p.ID != "pay_new" {
		t.Errorf("GetPayment = %+v, %v", p, err)
	}
	if _, err := s.GetPayment(ctx, "b", "pay_new"); !errors.Is(err, ErrNotFound) {
		t.Errorf("other client's payment: %v, want ErrNotFound", err)
	}
	done := mustClaim(t, s, claimReq("a", "k", "fp1"), Exists)
	if done.Record.Status != StatusCompleted || string(done.Record.Response.Body) != "{}" {
		t.Errorf("completed record %+v", done.Record)
	}
	// A completed key is never taken over, however old.
	clock.Advance(time.Hour)
	mustClaim(t, s, claimReq("a", "k", "fp1"), Exists)
	// Retention is exact: one tick past it, the key is absent and a new
	// operation starts, even before any purge.
	clock.Advance(23*time.Hour - 31*time.Second) // exactly 24h after the first claim
	mustClaim(t, s, claimReq("a", "k", "fp1"), Exists)
	clock.Advance(time.Nanosecond)
	fresh := mustClaim(t, s, claimReq("a", "k", "fp2"), Claimed)
	if fresh.Claim.OperationID == first.Claim.OperationID {
		t.Error("a key used again after expiry kept its operation ID")
	}
}

func TestMemoryStoreRelease(t *testing.T) {
	ctx := context.Background()
	s, _ := newClockedMemoryStore()
	c := mustClaim(t, s, claimReq("a", "k", "fp"), Claimed).Claim
	tx, _ := s.Begin(ctx, c)
	s.CreatePayment(ctx, tx, Payment{ID: "p", ClientID: "a"})
	tx.Rollback(ctx)
	if err := tx.Complete(ctx, StoredResponse{Status: 201}); err == nil {
		t.Error("Complete after Rollback succeeded")
	}
	if err := s.Release(ctx, c, ReleaseFailed); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, c, ReleaseFailed); !errors.Is(err, ErrFenced) {
		t.Errorf("second Release = %v, want ErrFenced", err)
	}
	if again := mustClaim(t, s, claimReq("a", "k", "fp"), Claimed).Claim; again.OperationID != c.OperationID {
		t.Errorf("claim after release: operation %s, want the released %s", again.OperationID, c.OperationID)
	} else if err := s.Release(ctx, again, ReleaseFailed); err != nil {
		t.Fatal(err)
	}
	// Released as failed, the key refuses another request...
	if rec := mustClaim(t, s, claimReq("a", "k", "another body"), Exists).Record; rec.Status != StatusReleased {
		t.Errorf("another request after a failed release: status %q, want released", rec.Status)
	}
	// ...and released as rejected, it takes it as a new operation.
	again := mustClaim(t, s, claimReq("a", "k", "fp"), Claimed).Claim
	if err := s.Release(ctx, again, ReleaseRejected); err != nil {
		t.Fatal(err)
	}
	if other := mustClaim(t, s, claimReq("a", "k", "another body"), Claimed).Claim; other.OperationID == c.OperationID {
		t.Error("another request after a rejected release kept the released operation")
	}
	if _, err := s.GetPayment(ctx, "a", "p"); !errors.Is(err, ErrNotFound) {
		t.Errorf("rolled back payment visible: %v", err)
	}
}

func TestMemoryStoreDuplicatePayment(t *testing.T) {
	ctx := context.Background()
	s := NewMemoryStore()
	for i, key := range []string{"k1", "k2"} {
		c := mustClaim(t, s, claimReq("a", key, "fp"), Claimed).Claim
		tx, _ := s.Begin(ctx, c)
		s.CreatePayment(ctx, tx, Payment{ID: "pay_1", ClientID: "a", OperationID: c.OperationID})
		err := tx.Complete(ctx, StoredResponse{Status: 201})
		if i == 1 && !errors.Is(err, ErrDuplicatePayment) {
			t.Errorf("second payment with the same ID: %v, want ErrDuplicatePayment", err)
		}
	}
	// The failed completion left its key started.
	res := mustClaim(t, s, ClaimRequest{ClientID: "a", Key: "k2", Fingerprint: []byte("fp"), FingerprintVersion: 1}, Exists)
	if res.Record.Status != StatusStarted {
		t.Errorf("key of a failed completion is %s", res.Record.Status)
	}
}

func TestMemoryStorePurge(t *testing.T) {
	ctx := context.Background()
	s, clock := newClockedMemoryStore()
	for _, key := range []string{"a", "b", "c", "d", "e"} {
		mustClaim(t, s, claimReq("x", key, "fp"), Claimed)
		clock.Advance(time.Minute)
	}
	// Now a is 5m old, e 1m old.
	for _, tt := range []struct {
		retention time.Duration
		limit     int
		want      int64
	}{
		{time.Hour, 10, 0},
		{150 * time.Second, 2, 2}, // a, b
		{150 * time.Second, 2, 1}, // c
		{150 * time.Second, 2, 0},
		{0, 10, 0},
		{time.Second, 0, 0},
		{time.Second, 10, 2}, // d, e
	} {
		n, err := s.Purge(ctx, tt.retention, tt.limit)
		if err != nil || n != tt.want {
			t.Errorf("Purge(%v, %d) = %d, %v; want %d", tt.retention, tt.limit, n, err, tt.want)
		}
	}
}

func TestMemoryStoreConcurrentClaims(t *testing.T) {
	s, clock := newClockedMemoryStore()
	mustClaim(t, s, claimReq("a", "stale", "fp"), Claimed)
	clock.Advance(time.Minute)
	for _, key := range []string{"new", "stale"} {
		var wg sync.WaitGroup
		var mu sync.Mutex
		winners := 0
		for range 50 {
			wg.Go(func() {
				res, err := s.Claim(context.Background(), claimReq("a", key, "fp"))
				if err != nil {
					t.Error(err)
					return
				}
				if res.Outcome != Exists {
					mu.Lock()
					winners++
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		if winners != 1 {
			t.Errorf("key %s: %d winners, want 1", key, winners)
		}
	}
}

func TestMemoryStoreCharges(t *testing.T) {
	ctx := context.Background()
	s := NewMemoryStore()
	var wg sync.WaitGroup
	var mu sync.Mutex
	created := 0
	for i := range 20 {
		wg.Go(func() {
			c, ok, err := s.CreateCharge(ctx, Charge{ID: "ch_" + string(rune('a'+i)), IdempotencyKey: "op", Amount: 100, Currency: "usd"})
			if err != nil || c.IdempotencyKey != "op" {
				t.Errorf("CreateCharge = %+v, %v", c, err)
			}
			if ok {
				mu.Lock()
				created++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if created != 1 || len(s.Charges()) != 1 {
		t.Errorf("created %d, stored %d charges; want 1", created, len(s.Charges()))
	}
}

// TestMemoryStorePayments lists only committed payments: a staged one
// appears when its unit of work completes, never after a rollback, and the
// list is in creation order.
func TestMemoryStorePayments(t *testing.T) {
	ctx := context.Background()
	s, clock := newClockedMemoryStore()
	pay := func(key, id string, commit bool) {
		t.Helper()
		c := mustClaim(t, s, claimReq("A", key, "fp"), Claimed).Claim
		before := len(s.Payments())
		tx, err := s.Begin(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		p := Payment{ID: id, ClientID: "A", Customer: "cus_1", Amount: 100, Currency: "usd",
			IdempotencyKey: key, OperationID: c.OperationID, CreatedAt: clock.Now()}
		if err := s.CreatePayment(ctx, tx, p); err != nil {
			t.Fatal(err)
		}
		if n := len(s.Payments()); n != before {
			t.Errorf("a staged payment is listed before its completion")
		}
		if commit {
			err = tx.Complete(ctx, StoredResponse{Status: 201})
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Second)
	}
	pay("k1", "pay_b", true)
	pay("k2", "pay_x", false)
	pay("k3", "pay_a", true)
	got := s.Payments()
	if len(got) != 2 || got[0].ID != "pay_b" || got[1].ID != "pay_a" {
		t.Errorf("Payments() = %+v, want pay_b then pay_a", got)
	}
}
