// Package storetest is the conformance suite of [idempotency.Store]: every
// implementation runs it from its own tests, so the in-memory store, the
// PostgreSQL store and any store of one's own keep one behaviour. A store
// passes it with the business writes of its units of work, which a
// [Backend] makes and reads back:
//
//	func TestConformance(t *testing.T) {
//		storetest.Exercise(t, func(t *testing.T) storetest.Backend {
//			s := mystore.New(...)
//			return storetest.Backend{
//				Store:   s,
//				Write:   func(ctx context.Context, name string) error { ... },
//				Written: func(ctx context.Context, name string) (bool, error) { ... },
//				Elapse:  func(ctx context.Context, d time.Duration) error { ... },
//			}
//		})
//	}
//
// [ExerciseSealed], given the same function, runs the suite again with the
// store sealed ([idempotency.Sealed]), and the tests of sealing at rest: a
// store passes both.
//
// The suite never waits for a lease or a retention to run out: it asks the
// backend to age the store's keys ([Backend.Elapse]), so its leases and
// retentions are minutes long and no stall of a busy machine decides a
// check. Run it with -race.
package storetest

import (
	"context"
	"crypto/sha256"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// Backend is one store under test, with the business writes of its units
// of work.
type Backend struct {
	// Store is the store under test.
	Store idempotency.Store
	// Write makes a business write named name inside the unit of work
	// found in ctx, which the suite builds with [idempotency.NewContext]
	// from a claim and the [idempotency.Tx] that Store.Begin returned for
	// it, as [idempotency.Middleware] does for a handler. The write must
	// become visible (see Written) when the unit of work completes, and
	// never otherwise. It fails, writing nothing, when ctx holds no unit of
	// work of Store, or one already completed or rolled back; a write whose name is already committed fails (a
	// unique violation), now or at the latest when the unit of work
	// completes. Names are short ASCII strings.
	Write func(ctx context.Context, name string) error
	// Written reports whether the write named name is committed, as seen
	// from outside any unit of work.
	Written func(ctx context.Context, name string) (bool, error)
	// Elapse makes every time the store has stamped on its keys (when
	// each operation began, its last lock or finish, its expiry) d
	// earlier, as if d had passed; the suite calls it with no unit of
	// work open on a key. Required.
	Elapse func(ctx context.Context, d time.Duration) error
}

// Exercise runs the conformance suite. newBackend is called once per
// subtest and must return an empty store of its own (a fresh schema, say),
// cleaned up by t.Cleanup. The subtests run in parallel. Those under
// "OneTransaction/" claim in one transaction, for a store that is an
// [idempotency.TxClaimer].
func Exercise(t *testing.T, newBackend func(t *testing.T) Backend) {
	tests := []struct {
		name string
		run  func(t *testing.T, b Backend)
	}{
		// Claims.
		{"ClaimNewKey", testClaimNewKey},
		{"ClaimStartedKey", testClaimStartedKey},
		{"CompleteStoresResponse", testCompleteStoresResponse},
		{"FingerprintMismatch", testFingerprintMismatch},
		{"ConcurrentClaims", testConcurrentClaims},
		{"KeysScopedByClient", testKeysScopedByClient},
		{"OperationIDDerived", testOperationIDDerived},
		{"RecordOfKey", testRecordOfKey},
		// Leases, takeovers and fencing.
		{"TakeoverAfterLockTimeout", testTakeover},
		{"TakeoverRace", testTakeoverRace},
		{"TakeoverRefusedForOtherFingerprint", testTakeoverRefusedForOtherFingerprint},
		{"NoTakeoverWithoutLockTimeout", testNoTakeoverWithoutLockTimeout},
		{"LeaseStoredWithKey", testLeaseStoredWithKey},
		{"RenewExtendsLease", testRenewExtendsLease},
		{"RenewFenced", testRenewFenced},
		{"FencedCompletionRollsBack", testFencedCompletion},
		{"FencedAfterTakerCompleted", testFencedAfterTakerCompleted},
		// Releases.
		{"ReleaseThenClaimKeepsOperation", testReleaseThenClaim},
		{"ReleaseThenClaimOtherRequest", testReleaseThenClaimOther},
		{"FailedReleaseRefusesOtherRequest", testFailedReleaseRefusesOther},
		{"ReleasedKeyClaimRace", testReleasedClaimRace},
		{"ReleaseFenced", testReleaseFenced},
		{"ReleaseTwice", testReleaseTwice},
		// Retention and purge.
		{"RetentionExpiresCompletedKey", testRetentionCompleted},
		{"RetentionCountsFromCompletion", testRetentionFromCompletion},
		{"RetentionExpiresAbandonedStartedKey", testRetentionStarted},
		{"RetentionExpiresReleasedKey", testRetentionReleased},
		{"RetentionSparesResumedKey", testRetentionResumed},
		{"RetentionSparesRenewedKey", testRetentionRenewed},
		{"RetentionStoredWithKey", testRetentionStoredWithKey},
		{"RetentionOfHeldUnitCountsFromCompletion", testHeldUnitRetention},
		{"RetentionOfHeldUnitCountsFromRelease", testHeldUnitRelease},
		{"Purge", testPurge},
		{"PurgeReleased", testPurgeReleased},
		{"PurgeSparesRunningKeys", testPurgeSparesRunning},
		{"PurgeNothing", testPurgeNothing},
		// Units of work.
		{"WritesVisibleAfterComplete", testWritesVisibleAfterComplete},
		{"RollbackDropsWrites", testRollbackDropsWrites},
		{"FailedWriteFailsCompletion", testFailedWrite},
		{"WriteOutsideUnitOfWork", testWriteOutsideUnitOfWork},
		// Text a store cannot keep.
		{"ClaimRefusesInvalidText", testClaimInvalidText},
		{"ClaimKeepsUnicodeText", testClaimUnicodeText},
		{"ClaimRefusesKeyLength", testClaimKeyLength},
		{"CompleteRefusesInvalidText", testCompleteInvalidText},
		// The edges every store agrees on.
		{"CompleteStatusRange", testCompleteStatusRange},
		{"DoneContextChangesNothing", testDoneContext},
		// The first-sent check of a claim.
		{"FirstSentAbsentKey", testFirstSentAbsent},
		{"FirstSentLiveKey", testFirstSentLive},
		{"FirstSentExpiredKey", testFirstSentExpired},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.run(t, backendOf(t, newBackend))
		})
	}
	exerciseOneTransaction(t, newBackend, tests)
}

// backendOf returns a new backend, checked complete.
func backendOf(t *testing.T, newBackend func(t *testing.T) Backend) Backend {
	t.Helper()
	b := newBackend(t)
	if b.Store == nil || b.Write == nil || b.Written == nil || b.Elapse == nil {
		t.Fatal("storetest.Backend needs its Store, Write, Written and Elapse")
	}
	return b
}

// Timing of the suite: the tests elapse pause (see [Backend.Elapse]) to
// make a key claimed with lockTimeout stale, or one finished with
// retention expired; lockTimeout and retention are far longer than any
// stall of the machine, so a key is live until the suite ages it. long is
// a lease or retention no test outlives, whatever it elapses.
const (
	lockTimeout = time.Minute
	retention   = time.Minute
	pause       = 90 * time.Second
	long        = time.Hour
)

// elapse ages b's keys by d (see [Backend.Elapse]).
func elapse(t *testing.T, b Backend, d time.Duration) {
	t.Helper()
	if err := b.Elapse(context.Background(), d); err != nil {
		t.Fatalf("Elapse(%v): %v", d, err)
	}
}

// fingerprint returns a distinct fingerprint for each body.
func fingerprint(body string) []byte {
	sum := sha256.Sum256([]byte("POST /v1/orders " + body))
	return sum[:]
}

// request returns a claim request of client for key with the fingerprint of
// body, no lock timeout and no retention.
func request(client, key, body string) idempotency.ClaimRequest {
	return idempotency.ClaimRequest{
		ClientID:    client,
		Key:         key,
		Method:      "POST",
		Path:        "/v1/orders",
		Fingerprint: fingerprint(body),
	}
}

// withLockTimeout returns req with the suite's lock timeout.
func withLockTimeout(req idempotency.ClaimRequest) idempotency.ClaimRequest {
	req.LockTimeout = lockTimeout
	return req
}

// withRetention returns req with the suite's retention.
func withRetention(req idempotency.ClaimRequest) idempotency.ClaimRequest {
	req.Retention = retention
	return req
}

// with returns req with the given lease and retention.
func with(req idempotency.ClaimRequest, lease, keep time.Duration) idempotency.ClaimRequest {
	req.LockTimeout, req.Retention = lease, keep
	return req
}

// claim calls Claim and checks its outcome.
func claim(t *testing.T, s idempotency.Store, req idempotency.ClaimRequest, want idempotency.Outcome) idempotency.ClaimResult {
	t.Helper()
	res, err := s.Claim(context.Background(), req)
	if err != nil {
		t.Fatalf("Claim(%s, %s): %v", req.ClientID, req.Key, err)
	}
	if res.Outcome != want {
		t.Fatalf("Claim(%s, %s) = %s (record %+v), want %s", req.ClientID, req.Key, res.Outcome, res.Record, want)
	}
	switch want {
	case idempotency.Claimed, idempotency.TookOver:
		c := res.Claim
		if c.ClientID != req.ClientID || c.Key != req.Key || c.OperationID == "" {
			t.Fatalf("Claim(%s, %s) returned claim %+v: want the client, the key and an operation ID", req.ClientID, req.Key, c)
		}
	case idempotency.Exists:
		if res.Record == nil {
			t.Fatalf("Claim(%s, %s) = Exists with a nil record", req.ClientID, req.Key)
		}
	}
	return res
}

// status claims req, which must find its key, and returns the key's status.
func status(t *testing.T, s idempotency.Store, req idempotency.ClaimRequest) idempotency.Status {
	t.Helper()
	return claim(t, s, req, idempotency.Exists).Record.Status
}

// peek returns the record of req's key, started (whether or not its lease
// ran out), completed, or released as failed, as another request sees it:
// unlike a claim of req itself, it never takes the key over.
func peek(t *testing.T, s idempotency.Store, req idempotency.ClaimRequest) *idempotency.Record {
	t.Helper()
	req.Fingerprint = fingerprint("a request of its own, to peek")
	return claim(t, s, req, idempotency.Exists).Record
}

// complete runs one unit of work of c: it makes the named writes, then
// completes with resp, and returns Complete's error.
func complete(t *testing.T, b Backend, c idempotency.Claim, resp idempotency.StoredResponse, writes ...string) error {
	t.Helper()
	ctx := context.Background()
	tx, err := b.Store.Begin(ctx, c)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	wctx := idempotency.NewContext(ctx, c, tx)
	for _, name := range writes {
		if err := b.Write(wctx, name); err != nil {
			t.Fatalf("Write(%s): %v", name, err)
		}
	}
	err = tx.Complete(ctx, resp)
	if rerr := tx.Rollback(ctx); rerr != nil {
		t.Errorf("Rollback after Complete: %v, want nil (a no-op)", rerr)
	}
	return err
}

// begin opens a unit of work of c and returns it with its context.
func begin(t *testing.T, b Backend, c idempotency.Claim) (idempotency.Tx, context.Context) {
	t.Helper()
	tx, err := b.Store.Begin(context.Background(), c)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	return tx, idempotency.NewContext(context.Background(), c, tx)
}

// created is a response worth storing.
func created(id string) idempotency.StoredResponse {
	return idempotency.StoredResponse{
		Status:      201,
		ContentType: "application/json",
		Header:      map[string]string{"Location": "/v1/orders/" + id},
		Body:        []byte(`{"id":"` + id + `"}`),
	}
}

// mustBeWritten checks whether the write named name is committed.
func mustBeWritten(t *testing.T, b Backend, name string, want bool) {
	t.Helper()
	got, err := b.Written(context.Background(), name)
	if err != nil {
		t.Fatalf("Written(%s): %v", name, err)
	}
	if got != want {
		t.Errorf("Written(%s) = %v, want %v", name, got, want)
	}
}

// purge calls Purge and checks how many keys it deleted.
func purge(t *testing.T, s idempotency.Store, limit int, want int64) {
	t.Helper()
	n, err := s.Purge(context.Background(), limit)
	if err != nil || n != want {
		t.Fatalf("Purge(%d) = %d, %v; want %d", limit, n, err, want)
	}
}

// mustFence checks that err is ErrFenced.
func mustFence(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("%s: %v, want ErrFenced", what, err)
	}
}

// begun returns when the operation on client's key began, as a request
// with another body sees it: Exists, a mismatch, which changes nothing
// (the key must be live: started with a live lease, completed, or
// released as failed). Operation IDs are derived from the request
// (idempotency.ClaimRequest.OperationID), so a new operation of the same
// request is told from a resumed one by this time.
func begun(t *testing.T, s idempotency.Store, client, key string) time.Time {
	t.Helper()
	return claim(t, s, request(client, key, "another body, to read the key"), idempotency.Exists).Record.CreatedAt
}

// begunAt is begun for req's client and key.
func begunAt(t *testing.T, b Backend, req idempotency.ClaimRequest) time.Time {
	t.Helper()
	return begun(t, b.Store, req.ClientID, req.Key)
}
