package storetest

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// staleCheck is the first-sent check of a request first sent longer ago than
// its key is kept.
var staleCheck = idempotency.FirstSentCheck{Stale: true}

// withCheck returns req with the first-sent check c.
func withCheck(req idempotency.ClaimRequest, c idempotency.FirstSentCheck) idempotency.ClaimRequest {
	req.FirstSent = c
	return req
}

// testFirstSentAbsent: a claim whose first-sent check is stale finds no
// key and is refused, creating nothing; one that is not stale begins a new
// operation, whatever its earliest begin.
func testFirstSentAbsent(t *testing.T, b Backend) {
	req := request("cli_a", "key", "a")
	claim(t, b.Store, withCheck(req, staleCheck), idempotency.Refused)
	claim(t, b.Store, withCheck(req, staleCheck), idempotency.Refused)
	// Nothing was created: another request claims the key as new.
	other := request("cli_a", "key", "b")
	c := claim(t, b.Store, withCheck(other, idempotency.FirstSentCheck{EarliestBegin: time.Now().Add(time.Hour)}), idempotency.Claimed).Claim
	if err := complete(t, b, c, created("o1"), "w"); err != nil {
		t.Fatal(err)
	}
}

// testFirstSentLive: a key that is there and not expired is served as
// without the check, however stale: started (Exists), completed (Exists,
// its response), released (resumed by the same request).
func testFirstSentLive(t *testing.T, b Backend) {
	req := withCheck(withLockTimeout(request("cli_a", "running", "a")), staleCheck)
	claim(t, b.Store, with(request("cli_a", "running", "a"), long, 0), idempotency.Claimed) // live however slow the next claim
	if st := claim(t, b.Store, req, idempotency.Exists).Record.Status; st != idempotency.StatusStarted {
		t.Errorf("started key: %q", st)
	}

	c := claim(t, b.Store, request("cli_a", "done", "a"), idempotency.Claimed).Claim
	if err := complete(t, b, c, created("o1")); err != nil {
		t.Fatal(err)
	}
	if rec := claim(t, b.Store, withCheck(request("cli_a", "done", "a"), staleCheck), idempotency.Exists).Record; rec.Response == nil {
		t.Errorf("completed key: %+v, want its response", rec)
	}

	c = claim(t, b.Store, request("cli_a", "released", "a"), idempotency.Claimed).Claim
	release(t, b.Store, c, idempotency.ReleaseFailed)
	resumed := claim(t, b.Store, withCheck(request("cli_a", "released", "a"), staleCheck), idempotency.Claimed).Claim
	if resumed.OperationID != c.OperationID {
		t.Errorf("released key resumed under %s, want %s", resumed.OperationID, c.OperationID)
	}
}

// testFirstSentExpired: an expired key is refused, changing nothing, to a
// stale request and to one first sent before its operation began (plus
// the allowance), and claimed as a new operation by one first sent after.
func testFirstSentExpired(t *testing.T, b Backend) {
	ctx := context.Background()
	req := withRetention(request("cli_a", "key", "a"))
	began := time.Now()
	first := claim(t, b.Store, req, idempotency.Claimed).Claim
	if err := complete(t, b, first, created("o1"), "w1"); err != nil {
		t.Fatal(err)
	}
	elapse(t, b, pause)
	began = began.Add(-pause) // as the store now sees it
	claim(t, b.Store, withCheck(req, staleCheck), idempotency.Refused)
	// The retry of the expired operation: first sent before it began,
	// the allowance taken off. A generous allowance keeps the machine's
	// pace out of it.
	retry := idempotency.FirstSentCheck{EarliestBegin: began.Add(-time.Minute)}
	claim(t, b.Store, withCheck(req, retry), idempotency.Refused)
	n, err := b.Store.Purge(ctx, 10)
	if err != nil || n != 1 {
		t.Fatalf("Purge after the refusals: %d, %v; want the expired key, untouched, deleted", n, err)
	}

	// Expired again, and reused by a request first sent after its
	// operation began: a new operation.
	second := claim(t, b.Store, req, idempotency.Claimed).Claim
	if err := complete(t, b, second, created("o2"), "w2"); err != nil {
		t.Fatal(err)
	}
	elapse(t, b, pause)
	sent := time.Now().Add(time.Minute)
	later := idempotency.FirstSentCheck{EarliestBegin: sent, Sent: sent}
	third := claim(t, b.Store, withCheck(req, later), idempotency.Claimed).Claim
	if third.OperationID == second.OperationID {
		t.Errorf("a request first sent after the expired operation resumed it (%s)", third.OperationID)
	}
}
