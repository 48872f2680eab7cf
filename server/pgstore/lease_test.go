package pgstore_test

import (
	"cmp"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// TestRenewExtendsLease: Renew moves locked_at to now and the expiry with
// it, by the lease and retention stored with the key, and leaves expires_at
// (the purge's bound below the expiry) as the claim wrote it; a key claimed
// with no lease never expires while started. Renew of another token is
// fenced and changes nothing.
func TestRenewExtendsLease(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	const lease, keep = time.Minute, time.Hour
	c := mustClaim(t, s, leased(req("key-1", "a"), lease, keep), idempotency.Claimed).Claim
	before, _ := readKey(t, pool, "key-1")
	if before.expiresAt == nil || before.leaseUS != lease.Microseconds() || before.keepUS != keep.Microseconds() {
		t.Fatalf("claimed key %+v: want an expiry, the lease and the retention stored", before)
	}
	if got := before.expiresAt.Sub(before.lockedAt); got != keep {
		t.Errorf("expires_at - locked_at = %v, want the retention %v: the bound below the expiry", got, keep)
	}
	if got := expiry(t, pool, "key-1"); got == nil || got.Sub(before.lockedAt) != lease+keep {
		t.Errorf("expiry of the claimed key %v, want locked_at %v + lease + retention", got, before.lockedAt)
	}
	elapse(t, pool, "key-1", time.Second)
	before, _ = readKey(t, pool, "key-1")
	if err := s.Renew(ctx, c); err != nil {
		t.Fatalf("Renew: %v", err)
	}
	after, _ := readKey(t, pool, "key-1")
	if !after.lockedAt.After(before.lockedAt) || !after.expiresAt.Equal(*before.expiresAt) {
		t.Errorf("after Renew: locked_at %v, expires_at %v; want locked_at later than %v, expires_at %v as it was",
			after.lockedAt, after.expiresAt, before.lockedAt, before.expiresAt)
	}
	if got := expiry(t, pool, "key-1"); got == nil || got.Sub(after.lockedAt) != lease+keep {
		t.Errorf("after Renew: expiry %v, want locked_at %v + lease + retention", got, after.lockedAt)
	}
	if after.status != "started" || after.token != c.Token {
		t.Errorf("after Renew: %+v, want started under token %d", after, c.Token)
	}

	other := c
	other.Token++
	if err := s.Renew(ctx, other); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Renew under another token: %v, want ErrFenced", err)
	}
	if again, _ := readKey(t, pool, "key-1"); !again.lockedAt.Equal(after.lockedAt) {
		t.Errorf("a fenced Renew moved locked_at from %v to %v", after.lockedAt, again.lockedAt)
	}

	// No lease: never taken over, never expired while started.
	c = mustClaim(t, s, leased(req("key-2", "a"), 0, keep), idempotency.Claimed).Claim
	if err := s.Renew(ctx, c); err != nil {
		t.Fatalf("Renew of a key with no lease: %v", err)
	}
	if at := expiry(t, pool, "key-2"); at != nil {
		t.Errorf("started key with no lease expires at %v, want never", at)
	}
}

// TestLeaseStoredWithKey: the lease is the claimer's, stored with the key,
// not the one of whoever looks. A key claimed with a long lock timeout is
// not taken over by a replica passing a short one, however long it waits
// past that; a key claimed with a short one is, by a replica passing a long
// one.
func TestLeaseStoredWithKey(t *testing.T) {
	s, pool := newStore(t, nil)
	long := leased(req("key-long", "a"), time.Hour, time.Hour)
	short := leased(req("key-short", "a"), time.Minute, time.Hour)
	owner := mustClaim(t, s, long, idempotency.Claimed).Claim
	shortOwner := mustClaim(t, s, short, idempotency.Claimed).Claim
	elapse(t, pool, "key-long", 3*time.Minute)
	elapse(t, pool, "key-short", 3*time.Minute)

	rec := mustClaim(t, s, leased(long, time.Minute, time.Second), idempotency.Exists).Record
	if rec.Status != idempotency.StatusStarted {
		t.Errorf("long-leased key seen as %q, want started", rec.Status)
	}
	if row, _ := readKey(t, pool, "key-long"); row.token != owner.Token || row.leaseUS != time.Hour.Microseconds() {
		t.Errorf("long-leased key %+v, want still its owner's (token %d) with its lease", row, owner.Token)
	}
	taker := mustClaim(t, s, leased(short, time.Hour, time.Hour), idempotency.TookOver).Claim
	if taker.OperationID != shortOwner.OperationID {
		t.Errorf("takeover under operation %s, want %s", taker.OperationID, shortOwner.OperationID)
	}
	// The taker's lease is now the key's: a replica passing a short one
	// does not take it over either.
	elapse(t, pool, "key-short", 3*time.Minute)
	mustClaim(t, s, short, idempotency.Exists)
}

// TestFencedAfterTakeover: once a key is taken over, every operation of
// its previous owner (Renew, Release, Complete, with or without writes) is
// fenced and changes nothing, while the new owner's succeed.
func TestFencedAfterTakeover(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	r := leased(req("key-1", "a"), time.Minute, time.Hour)
	old := mustClaim(t, s, r, idempotency.Claimed).Claim
	oldTx, oldCtx := unitOf(t, s, old)
	elapse(t, pool, "key-1", 3*time.Minute)
	taker := mustClaim(t, s, r, idempotency.TookOver).Claim
	if taker.Token == old.Token {
		t.Fatalf("takeover under the same token %d", old.Token)
	}

	if err := s.Renew(ctx, old); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Renew of the old owner: %v, want ErrFenced", err)
	}
	if err := s.Release(ctx, old, idempotency.ReleaseFailed); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Release of the old owner: %v, want ErrFenced", err)
	}
	if err := oldTx.Complete(ctx, created("ord_old")); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Complete of the old owner, no writes: %v, want ErrFenced", err)
	}
	if err := write(oldCtx, "w_old"); err == nil {
		t.Errorf("write after Complete succeeded")
	}
	if row, _ := readKey(t, pool, "key-1"); row.status != "started" || row.token != taker.Token {
		t.Errorf("key %+v, want started under the taker's token %d", row, taker.Token)
	}
	if err := s.Renew(ctx, taker); err != nil {
		t.Errorf("Renew of the taker: %v", err)
	}
	mustComplete(t, s, taker, "w_taker")
	mustBeWritten(t, pool, "w_taker", true)
	mustBeWritten(t, pool, "w_old", false)
}

// TestRenewFollowsTransactionLevel: a renewal while the handler's
// transaction is open moves the lease under READ COMMITTED; under the
// session's default_transaction_isolation serializable, which the store
// reads from the transaction itself, it only checks the claim, so that
// the completion, which updates the key row, still commits.
func TestRenewFollowsTransactionLevel(t *testing.T) {
	for _, tt := range []struct {
		level string // default_transaction_isolation; "": the server's
		moved bool   // the renewal moves locked_at
	}{
		{"", true},
		{"serializable", false},
	} {
		t.Run(cmp.Or(tt.level, "default"), func(t *testing.T) {
			ctx := context.Background()
			s, pool := newStore(t, withIsolation(tt.level))
			c := mustClaim(t, s, leased(req("key-1", "a"), time.Minute, time.Hour), idempotency.Claimed).Claim
			elapse(t, pool, "key-1", time.Second) // before the snapshot: an update after it would fail the completion
			before, _ := readKey(t, pool, "key-1")
			tx, hctx := unitOf(t, s, c)
			if err := write(hctx, "key-1/1"); err != nil { // the transaction begins, its snapshot taken
				t.Fatal(err)
			}
			if err := s.Renew(ctx, c); err != nil {
				t.Fatalf("Renew with the transaction open: %v", err)
			}
			after, _ := readKey(t, pool, "key-1")
			if moved := after.lockedAt.After(before.lockedAt); moved != tt.moved {
				t.Errorf("the renewal moved locked_at: %v, want %v", moved, tt.moved)
			}
			if err := tx.Complete(ctx, created("1")); err != nil {
				t.Fatalf("Complete after the renewal: %v", err)
			}
			mustBeWritten(t, pool, "key-1/1", true)
			if row, _ := readKey(t, pool, "key-1"); row.status != "completed" {
				t.Errorf("key status %q, want completed", row.status)
			}
		})
	}
}
