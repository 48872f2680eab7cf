package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

func testClaimNewKey(t *testing.T, b Backend) {
	res := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Claimed)
	if res.Claim.Token == 0 {
		t.Errorf("claim token is 0, want a fencing token")
	}
	if res.Record != nil {
		t.Errorf("Claimed with a record %+v, want none", res.Record)
	}
	if res.Claim.Resumed {
		t.Errorf("claim of a new key reads as resumed, want a new operation")
	}
}

func testClaimStartedKey(t *testing.T, b Backend) {
	req := request("cli_a", "key-1", "a")
	claim(t, b.Store, req, idempotency.Claimed)
	rec := claim(t, b.Store, req, idempotency.Exists).Record
	if rec.Status != idempotency.StatusStarted || rec.Response != nil {
		t.Errorf("record status %q, response %+v; want started without a response", rec.Status, rec.Response)
	}
	if rec.ClientID != "cli_a" || rec.Key != "key-1" || rec.Method != "POST" || rec.Path != "/v1/orders" {
		t.Errorf("record names %s %s %s %s, want cli_a key-1 POST /v1/orders", rec.ClientID, rec.Key, rec.Method, rec.Path)
	}
	if !bytes.Equal(rec.Fingerprint, req.Fingerprint) {
		t.Errorf("record fingerprint %x, want %x", rec.Fingerprint, req.Fingerprint)
	}
	if rec.CreatedAt.IsZero() || rec.LockedAt.IsZero() {
		t.Errorf("record created at %v, locked at %v; want both set", rec.CreatedAt, rec.LockedAt)
	}
}

func testCompleteStoresResponse(t *testing.T, b Backend) {
	req := request("cli_a", "key-1", "a")
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	// Odd whitespace, key order and bytes that are not UTF-8: the replay
	// must give back exactly these bytes.
	want := idempotency.StoredResponse{
		Status:      201,
		ContentType: "application/json; charset=utf-8",
		Header:      map[string]string{"Location": "/v1/orders/ord_1", "X-Request-Id": "req_1"},
		Body:        []byte("{\"z\": 1,\n  \"a\":[ 2 ,1], \"bin\": \"\xff\x00\"}\n"),
	}
	if err := complete(t, b, c, want); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	rec := claim(t, b.Store, req, idempotency.Exists).Record
	if rec.Status != idempotency.StatusCompleted || rec.Response == nil {
		t.Fatalf("record status %q, response %+v; want completed with the response", rec.Status, rec.Response)
	}
	got := rec.Response
	if got.Status != want.Status || got.ContentType != want.ContentType || !maps.Equal(got.Header, want.Header) {
		t.Errorf("stored response %d %q %v, want %d %q %v", got.Status, got.ContentType, got.Header, want.Status, want.ContentType, want.Header)
	}
	if !bytes.Equal(got.Body, want.Body) {
		t.Errorf("stored body %q, want %q byte for byte", got.Body, want.Body)
	}

	// Completing the claim again, from a new unit of work, is fenced.
	tx, err := b.Store.Begin(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(context.Background(), want); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Complete of an already completed key: %v, want ErrFenced", err)
	}

	// A response without headers or body replays as such.
	c2 := claim(t, b.Store, request("cli_a", "key-2", "a"), idempotency.Claimed).Claim
	if err := complete(t, b, c2, idempotency.StoredResponse{Status: 204}); err != nil {
		t.Fatal(err)
	}
	got = claim(t, b.Store, request("cli_a", "key-2", "a"), idempotency.Exists).Record.Response
	if got == nil || got.Status != 204 || got.ContentType != "" || len(got.Header) != 0 || len(got.Body) != 0 {
		t.Errorf("stored empty response %+v, want 204 with nothing else", got)
	}
}

func testFingerprintMismatch(t *testing.T, b Backend) {
	claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Claimed)
	other := request("cli_a", "key-1", "b")
	rec := claim(t, b.Store, other, idempotency.Exists).Record
	if bytes.Equal(rec.Fingerprint, other.Fingerprint) || !bytes.Equal(rec.Fingerprint, fingerprint("a")) {
		t.Errorf("record fingerprint %x, want the first request's %x", rec.Fingerprint, fingerprint("a"))
	}
}

// race runs n calls of f at once and waits for them.
func race(n int, f func(i int)) {
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			f(i)
		})
	}
	close(start)
	wg.Wait()
}

// raceClaims runs n claims of req at once and counts their outcomes.
func raceClaims(t *testing.T, s idempotency.Store, n int, req idempotency.ClaimRequest) (map[idempotency.Outcome]int, []idempotency.ClaimResult) {
	t.Helper()
	results := make([]idempotency.ClaimResult, n)
	errs := make([]error, n)
	race(n, func(i int) { results[i], errs[i] = s.Claim(context.Background(), req) })
	counts := map[idempotency.Outcome]int{}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("concurrent Claim: %v", err)
		}
		counts[results[i].Outcome]++
	}
	return counts, results
}

func testConcurrentClaims(t *testing.T, b Backend) {
	const n = 50
	counts, results := raceClaims(t, b.Store, n, request("cli_a", "key-1", "a"))
	if counts[idempotency.Claimed] != 1 || counts[idempotency.Exists] != n-1 {
		t.Fatalf("%d concurrent claims of one key: %d Claimed, %d Exists, %d TookOver; want 1, %d, 0",
			n, counts[idempotency.Claimed], counts[idempotency.Exists], counts[idempotency.TookOver], n-1)
	}
	for _, r := range results {
		if r.Outcome == idempotency.Exists && r.Record.Status != idempotency.StatusStarted {
			t.Errorf("a losing claim saw status %q, want started", r.Record.Status)
		}
	}
}

func testKeysScopedByClient(t *testing.T, b Backend) {
	a := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Claimed).Claim
	bc := claim(t, b.Store, request("cli_b", "key-1", "b"), idempotency.Claimed).Claim
	if a.Token == bc.Token || a.OperationID == bc.OperationID {
		t.Errorf("two clients' claims share token or operation: %+v and %+v", a, bc)
	}
	if err := complete(t, b, a, created("ord_a")); err != nil {
		t.Fatal(err)
	}
	rec := claim(t, b.Store, request("cli_b", "key-1", "b"), idempotency.Exists).Record
	if rec.ClientID != "cli_b" || rec.Status != idempotency.StatusStarted || rec.Response != nil {
		t.Errorf("client b sees %+v, want its own started key", rec)
	}
	rec = claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Exists).Record
	if rec.ClientID != "cli_a" || rec.Status != idempotency.StatusCompleted {
		t.Errorf("client a sees %+v, want its own completed key", rec)
	}
}

// stale claims req and ages its key past the suite's lock timeout.
func stale(t *testing.T, b Backend, req idempotency.ClaimRequest) idempotency.Claim {
	t.Helper()
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	elapse(t, b, pause)
	return c
}

func testTakeover(t *testing.T, b Backend) {
	req := withLockTimeout(request("cli_a", "key-1", "a"))
	first := stale(t, b, req)
	second := claim(t, b.Store, req, idempotency.TookOver).Claim
	if second.Token == first.Token {
		t.Errorf("takeover kept token %d, want a new one", first.Token)
	}
	if second.OperationID != first.OperationID {
		t.Errorf("takeover changed the operation %q to %q, want it kept", first.OperationID, second.OperationID)
	}
	if !second.Resumed {
		t.Errorf("takeover does not read as resumed, want it: the first owner may have done work")
	}
	// The lock is fresh again: the next request waits.
	if rec := claim(t, b.Store, req, idempotency.Exists).Record; rec.Status != idempotency.StatusStarted {
		t.Errorf("after takeover: status %q, want started", rec.Status)
	}
}

// testTakeoverRace: one stale key, n takers at once: one takes it over,
// the others find it started.
func testTakeoverRace(t *testing.T, b Backend) {
	const n = 10
	req := withLockTimeout(request("cli_a", "key-1", "a"))
	first := stale(t, b, req)
	counts, results := raceClaims(t, b.Store, n, req)
	if counts[idempotency.TookOver] != 1 || counts[idempotency.Exists] != n-1 {
		t.Fatalf("%d racing takers: %d TookOver, %d Exists, %d Claimed; want 1, %d, 0",
			n, counts[idempotency.TookOver], counts[idempotency.Exists], counts[idempotency.Claimed], n-1)
	}
	for _, r := range results {
		if r.Outcome == idempotency.TookOver && r.Claim.OperationID != first.OperationID {
			t.Errorf("winner's operation %q, want the first claim's %q", r.Claim.OperationID, first.OperationID)
		}
	}
}

func testTakeoverRefusedForOtherFingerprint(t *testing.T, b Backend) {
	first := stale(t, b, withLockTimeout(request("cli_a", "key-1", "a")))
	rec := claim(t, b.Store, withLockTimeout(request("cli_a", "key-1", "b")), idempotency.Exists).Record
	if rec.Status != idempotency.StatusStarted || !bytes.Equal(rec.Fingerprint, fingerprint("a")) {
		t.Errorf("record %+v, want the first request's started key", rec)
	}
	// The original still owns the key.
	if err := complete(t, b, first, created("ord_1")); err != nil {
		t.Errorf("original's Complete after refused takeovers: %v", err)
	}
}

func testNoTakeoverWithoutLockTimeout(t *testing.T, b Backend) {
	req := request("cli_a", "key-1", "a") // LockTimeout 0: never
	stale(t, b, req)
	claim(t, b.Store, req, idempotency.Exists)
}

// testReleaseThenClaim releases a key, as failed and as rejected, and
// claims it again with the same request: the same operation (and creation
// time) under a new token, at once, although the request sets a lock
// timeout.
func testReleaseThenClaim(t *testing.T, b Backend) {
	for _, kind := range []idempotency.ReleaseKind{idempotency.ReleaseFailed, idempotency.ReleaseRejected} {
		t.Run(kind.String(), func(t *testing.T) { releaseThenClaim(t, b, kind) })
	}
}

func releaseThenClaim(t *testing.T, b Backend, kind idempotency.ReleaseKind) {
	ctx := context.Background()
	req := withLockTimeout(request("cli_a", "key-"+kind.String(), "a"))
	first := claim(t, b.Store, req, idempotency.Claimed).Claim
	createdAt := peek(t, b.Store, req).CreatedAt
	if err := b.Store.Release(ctx, first, kind); err != nil {
		t.Fatalf("Release: %v", err)
	}
	second := claim(t, b.Store, req, idempotency.Claimed).Claim
	if second.Token == first.Token {
		t.Errorf("claim after release reused token %d", first.Token)
	}
	if second.OperationID != first.OperationID {
		t.Errorf("claim after release: operation %q, want the released %q", second.OperationID, first.OperationID)
	}
	if want := kind == idempotency.ReleaseFailed; second.Resumed != want {
		t.Errorf("claim after a release as %s: resumed %v, want %v (only a failure may have left work done)", kind, second.Resumed, want)
	}
	rec := peek(t, b.Store, req) // the new owner holds it
	if rec.Status != idempotency.StatusStarted || !rec.CreatedAt.Equal(createdAt) || !bytes.Equal(rec.Fingerprint, fingerprint("a")) {
		t.Errorf("resumed key: status %q, created %v, fingerprint %x; want started, created %v, the request's",
			rec.Status, rec.CreatedAt, rec.Fingerprint, createdAt)
	}
	// The released claim owns nothing any more.
	if err := b.Store.Release(ctx, first, kind); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("second Release of the first claim: %v, want ErrFenced", err)
	}
	if err := b.Store.Renew(ctx, first); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Renew of the released claim: %v, want ErrFenced", err)
	}
	if err := complete(t, b, first, created("ord_1"), "w_released_"+kind.String()); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Complete of the released claim: %v, want ErrFenced", err)
	}
	mustBeWritten(t, b, "w_released_"+kind.String(), false)
	if err := complete(t, b, second, created("ord_2"), "w_resumed_"+kind.String()); err != nil {
		t.Fatalf("Complete of the resumed claim: %v", err)
	}
	mustBeWritten(t, b, "w_resumed_"+kind.String(), true)
}

// testReleaseThenClaimOther releases a key as rejected and claims it with
// another request: a new operation replaces the released one.
func testReleaseThenClaimOther(t *testing.T, b Backend) {
	ctx := context.Background()
	first := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Claimed).Claim
	before := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Exists).Record
	if err := b.Store.Release(ctx, first, idempotency.ReleaseRejected); err != nil {
		t.Fatalf("Release: %v", err)
	}
	other := request("cli_a", "key-1", "b")
	second := claim(t, b.Store, other, idempotency.Claimed).Claim
	if second.OperationID == first.OperationID || second.Token == first.Token || second.Resumed {
		t.Errorf("another request after release: claim %+v, want a new operation and token than %+v, not resumed", second, first)
	}
	rec := claim(t, b.Store, other, idempotency.Exists).Record
	if rec.Status != idempotency.StatusStarted || !bytes.Equal(rec.Fingerprint, fingerprint("b")) || rec.CreatedAt.Before(before.CreatedAt) {
		t.Errorf("replaced key: status %q, fingerprint %x, created %v; want started, the new request's, not before %v",
			rec.Status, rec.Fingerprint, rec.CreatedAt, before.CreatedAt)
	}
	// The first request is now the mismatch.
	if rec := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Exists).Record; !bytes.Equal(rec.Fingerprint, fingerprint("b")) {
		t.Errorf("the first request sees fingerprint %x, want the new request's", rec.Fingerprint)
	}
	if err := b.Store.Release(ctx, first, idempotency.ReleaseRejected); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Release of the replaced claim: %v, want ErrFenced", err)
	}
	if err := complete(t, b, second, created("ord_2"), "w_new"); err != nil {
		t.Fatalf("Complete of the new operation: %v", err)
	}
	mustBeWritten(t, b, "w_new", true)
}

// testFailedReleaseRefusesOther releases a key as failed and claims it with
// another request: Exists, the released record as it was, since the failed
// request may have done work keyed by its operation that a new operation
// would leave behind or do again. The released request itself still
// resumes the operation afterwards, and the other request is then a
// mismatch of a started key.
func testFailedReleaseRefusesOther(t *testing.T, b Backend) {
	ctx := context.Background()
	first := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Claimed).Claim
	before := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Exists).Record
	if err := b.Store.Release(ctx, first, idempotency.ReleaseFailed); err != nil {
		t.Fatalf("Release: %v", err)
	}
	other := request("cli_a", "key-1", "b")
	for range 2 { // refusing changes nothing: the second answer is the same
		rec := claim(t, b.Store, other, idempotency.Exists).Record
		if rec.Status != idempotency.StatusReleased || !bytes.Equal(rec.Fingerprint, fingerprint("a")) ||
			!rec.CreatedAt.Equal(before.CreatedAt) || rec.Response != nil {
			t.Fatalf("another request on a key released as failed: record %+v, want the released key of request a, created %v", rec, before.CreatedAt)
		}
	}
	second := claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Claimed).Claim
	if second.OperationID != first.OperationID {
		t.Errorf("the released request after a refused other: operation %q, want the released %q", second.OperationID, first.OperationID)
	}
	if rec := claim(t, b.Store, other, idempotency.Exists).Record; rec.Status != idempotency.StatusStarted || !bytes.Equal(rec.Fingerprint, fingerprint("a")) {
		t.Errorf("the other request after the resume: status %q, fingerprint %x; want started, request a's", rec.Status, rec.Fingerprint)
	}
	if err := complete(t, b, second, created("ord_1"), "w_resumed"); err != nil {
		t.Fatalf("Complete of the resumed operation: %v", err)
	}
	mustBeWritten(t, b, "w_resumed", true)
}

// testReleasedClaimRace lets many claimers race for a released key, first
// all with the released request, then half of them with another. Released
// as rejected, exactly one wins, with the released operation if and only
// if its request is the released one. Released as failed, exactly one of
// the released request's claimers wins, with the released operation, and
// the other request never does. The losers see the key started, or, for
// the other request of a failed release, still released.
func testReleasedClaimRace(t *testing.T, b Backend) {
	for _, kind := range []idempotency.ReleaseKind{idempotency.ReleaseRejected, idempotency.ReleaseFailed} {
		for _, mixed := range []bool{false, true} {
			key := fmt.Sprintf("key-%s-mixed-%v", kind, mixed)
			first := claim(t, b.Store, request("cli_a", key, "a"), idempotency.Claimed).Claim
			if err := b.Store.Release(context.Background(), first, kind); err != nil {
				t.Fatalf("Release: %v", err)
			}
			const n = 20
			body := func(i int) string {
				if mixed && i%2 == 1 {
					return "b"
				}
				return "a"
			}
			results := make([]idempotency.ClaimResult, n)
			errs := make([]error, n)
			race(n, func(i int) { results[i], errs[i] = b.Store.Claim(context.Background(), request("cli_a", key, body(i))) })
			winners := 0
			for i, r := range results {
				if errs[i] != nil {
					t.Fatalf("concurrent Claim: %v", errs[i])
				}
				switch r.Outcome {
				case idempotency.Claimed:
					winners++
					if kind == idempotency.ReleaseFailed && body(i) != "a" {
						t.Errorf("%s: another request claimed a key released as failed", key)
					}
					if same := r.Claim.OperationID == first.OperationID; same != (body(i) == "a") {
						t.Errorf("%s: winner with request %q got operation %q (released: %q)", key, body(i), r.Claim.OperationID, first.OperationID)
					}
				case idempotency.Exists:
					ok := r.Record.Status == idempotency.StatusStarted ||
						kind == idempotency.ReleaseFailed && body(i) != "a" && r.Record.Status == idempotency.StatusReleased
					if !ok {
						t.Errorf("%s: a losing claim with request %q saw status %q", key, body(i), r.Record.Status)
					}
				default:
					t.Errorf("%s: a claim of a released key returned %s", key, r.Outcome)
				}
			}
			if winners != 1 {
				t.Errorf("%d claimers of a released key (%s): %d won, want 1", n, key, winners)
			}
		}
	}
}

func testReleaseFenced(t *testing.T, b Backend) {
	ctx := context.Background()
	req := withLockTimeout(request("cli_a", "key-1", "a"))
	first := stale(t, b, req)
	second := claim(t, b.Store, req, idempotency.TookOver).Claim
	if err := b.Store.Release(ctx, first, idempotency.ReleaseFailed); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Release by the taken-over claim: %v, want ErrFenced", err)
	}
	if rec := peek(t, b.Store, req); rec.Status != idempotency.StatusStarted {
		t.Errorf("after a fenced release: status %q, want started", rec.Status)
	}
	if err := complete(t, b, second, created("ord_1")); err != nil {
		t.Fatal(err)
	}
	if err := b.Store.Release(ctx, second, idempotency.ReleaseFailed); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Release of a completed key: %v, want ErrFenced", err)
	}
	if rec := claim(t, b.Store, req, idempotency.Exists).Record; rec.Status != idempotency.StatusCompleted {
		t.Errorf("after Release of a completed key: status %q, want completed", rec.Status)
	}
}

// testReleaseTwice releases a key twice under one claim: the second
// release succeeds and changes nothing (the middleware releases a key that
// Complete released already after a lost commit). The key stays released
// as failed (the second release, as rejected, would let another request
// claim it), and once the same request claimed it again, the first claim
// owns nothing.
func testReleaseTwice(t *testing.T, b Backend) {
	ctx := context.Background()
	req := request("cli_a", "key-1", "a")
	first := claim(t, b.Store, req, idempotency.Claimed).Claim
	if err := b.Store.Release(ctx, first, idempotency.ReleaseFailed); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if err := b.Store.Release(ctx, first, idempotency.ReleaseRejected); err != nil {
		t.Errorf("second Release under the same claim: %v, want nil", err)
	}
	if rec := peek(t, b.Store, req); rec.Status != idempotency.StatusReleased {
		t.Errorf("after the second release: status %q, want released", rec.Status)
	}
	second := claim(t, b.Store, req, idempotency.Claimed).Claim
	if second.OperationID != first.OperationID {
		t.Errorf("claim after two releases: operation %q, want the released %q", second.OperationID, first.OperationID)
	}
	if err := b.Store.Release(ctx, first, idempotency.ReleaseFailed); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("Release of the first claim after the key was claimed again: %v, want ErrFenced", err)
	}
	if rec := peek(t, b.Store, req); rec.Status != idempotency.StatusStarted {
		t.Errorf("after a fenced release: status %q, want started", rec.Status)
	}
}

// testOperationIDDerived: a claim that begins an operation begins the
// request's own (idempotency.ClaimRequest.OperationID), never one drawn
// at random: claimed again after its row is gone (here: purged once
// expired), the same request gets the same operation ID, so a downstream
// keyed by it dedupes; the same request first sent at another time gets
// another.
func testOperationIDDerived(t *testing.T, b Backend) {
	sent := time.Now().Add(-time.Minute).Truncate(time.Second)
	req := with(withCheck(request("cli_a", "key", "a"), idempotency.FirstSentCheck{Sent: sent}), 0, time.Millisecond)
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	if c.OperationID != req.OperationID() {
		t.Fatalf("claim of a new key began operation %q, want the request's %q", c.OperationID, req.OperationID())
	}
	if err := complete(t, b, c, created("o1"), "w1"); err != nil {
		t.Fatal(err)
	}
	elapse(t, b, pause)
	if n, err := b.Store.Purge(context.Background(), 10); n != 1 || err != nil {
		t.Fatalf("Purge of the expired key: %d, %v; want 1", n, err)
	}
	again := claim(t, b.Store, req, idempotency.Claimed).Claim
	if again.OperationID != c.OperationID {
		t.Errorf("the same request, claimed after its key was purged, began operation %q; want %q again",
			again.OperationID, c.OperationID)
	}
	other := withCheck(request("cli_a", "key-2", "a"), idempotency.FirstSentCheck{Sent: sent.Add(time.Second)})
	if claim(t, b.Store, other, idempotency.Claimed).Claim.OperationID == withCheck(other, idempotency.FirstSentCheck{Sent: sent}).OperationID() {
		t.Error("two first-sent times derived one operation ID")
	}
}

// testRecordOfKey: the record a duplicate gets carries the key's
// operation ID and the retention stored with it (whatever the duplicate
// asked for), so that a replay or a 409 can say how long the key is kept.
func testRecordOfKey(t *testing.T, b Backend) {
	req := with(request("cli_a", "key-1", "a"), long, 90*time.Minute)
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	rec := claim(t, b.Store, with(request("cli_a", "key-1", "a"), long, time.Hour), idempotency.Exists).Record
	if rec.OperationID != c.OperationID || rec.Retention != 90*time.Minute {
		t.Errorf("record of a started key: operation %q, retention %v; want %q, 1h30m0s", rec.OperationID, rec.Retention, c.OperationID)
	}
	if err := complete(t, b, c, created("o1"), "w1"); err != nil {
		t.Fatal(err)
	}
	rec = claim(t, b.Store, request("cli_a", "key-1", "a"), idempotency.Exists).Record
	if rec.OperationID != c.OperationID || rec.Retention != 90*time.Minute {
		t.Errorf("record of a completed key: operation %q, retention %v; want %q, 1h30m0s", rec.OperationID, rec.Retention, c.OperationID)
	}
}
