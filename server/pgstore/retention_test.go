package pgstore_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
	"github.com/idemkit/idem/server/pgstore"
)

// The tests below move time in SQL (see elapse) rather than sleep past
// leases and retentions. A handler's transaction held open past the
// retention, which only real time can age, is the conformance suite's
// (storetest's RetentionOfHeldUnitCountsFromCompletion).

// makeOld moves the creation and the last lock of cli_a's key two days
// back, as for a key whose operation began long ago.
func makeOld(t *testing.T, pool *pgxpool.Pool, key string) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `UPDATE idempotency_keys SET created_at = now() - interval '2 days'
		WHERE client_id = 'cli_a' AND idempotency_key = $1`, key); err != nil {
		t.Fatal(err)
	}
}

// elapseAll is the storetest.Backend.Elapse of a store on pool: it moves
// every time of every key d back, as if d had passed for them all.
func elapseAll(pool *pgxpool.Pool) func(context.Context, time.Duration) error {
	return func(ctx context.Context, d time.Duration) error {
		_, err := pool.Exec(ctx, keysql.ElapseSQL, d.Microseconds())
		return err
	}
}

// elapse moves every time of cli_a's key d back, as if d had passed for
// it: its creation, its last lock or finish, and its expiry bound.
func elapse(t *testing.T, pool *pgxpool.Pool, key string, d time.Duration) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), keysql.ElapseSQL+` WHERE client_id = 'cli_a' AND idempotency_key = $2`,
		d.Microseconds(), key); err != nil {
		t.Fatal(err)
	}
}

// TestRetentionOfTheKeyNotTheReplica: a key completed with a 24h retention
// is kept by a replica running with a short one: past that short
// retention, the replica's claim of the key (same request, or another)
// finds it completed, and its purge deletes nothing.
func TestRetentionOfTheKeyNotTheReplica(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	const short = time.Minute
	r := leased(req("key-1", "a"), time.Minute, 24*time.Hour)
	c := mustClaim(t, s, r, idempotency.Claimed).Claim
	mustComplete(t, s, c, "w1")
	makeOld(t, pool, "key-1")
	elapse(t, pool, "key-1", 2*short)

	replica := pgstore.New(pool) // another process, with other settings
	for _, body := range []string{"a", "b"} {
		rec := mustClaim(t, replica, leased(req("key-1", body), short, short), idempotency.Exists).Record
		if rec.Status != idempotency.StatusCompleted {
			t.Errorf("key seen by the short replica with body %s: %q, want completed", body, rec.Status)
		}
	}
	if n, err := replica.Purge(ctx, 100); n != 0 || err != nil {
		t.Errorf("Purge of the short replica = %d, %v; want 0", n, err)
	}
	if row, _ := readKey(t, pool, "key-1"); row.status != "completed" || row.keepUS != (24*time.Hour).Microseconds() {
		t.Errorf("key %+v, want completed with its 24h retention", row)
	}
}

// TestRetentionCountsFromCompletion: a key completed with a short
// retention counts as absent that long after its completion, however long
// ago its operation began: kept right after the completion, then claimed
// as a new operation, and purged.
func TestRetentionCountsFromCompletion(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	const keep = time.Hour
	r := leased(req("key", "a"), time.Hour, keep)
	purged := leased(req("key-purged", "a"), time.Hour, keep)
	c := mustClaim(t, s, r, idempotency.Claimed).Claim
	cp := mustClaim(t, s, purged, idempotency.Claimed).Claim
	makeOld(t, pool, "key")
	makeOld(t, pool, "key-purged")
	mustComplete(t, s, c)
	mustComplete(t, s, cp)
	rec := mustClaim(t, s, r, idempotency.Exists).Record
	if n, err := s.Purge(ctx, 100); rec.Status != idempotency.StatusCompleted || n != 0 || err != nil {
		t.Fatalf("right after the completion: key %q, Purge = %d, %v; want completed, 0", rec.Status, n, err)
	}
	elapse(t, pool, "key", keep+time.Minute)
	elapse(t, pool, "key-purged", keep+time.Minute)
	again := mustClaim(t, s, r, idempotency.Claimed).Claim
	if again.OperationID != r.OperationID() {
		t.Errorf("expired key claimed under operation %s, want the request's %s", again.OperationID, r.OperationID())
	}
	if n, err := s.Purge(ctx, 100); n != 1 || err != nil {
		t.Errorf("Purge past the retention = %d, %v; want 1 (the expired key, not the one claimed anew)", n, err)
	}
	if _, ok := readKey(t, pool, "key-purged"); ok {
		t.Errorf("expired key not purged")
	}
}

// TestPurgeSparesLiveLease: a started key whose owner renews its lease is
// never expired nor purged, however old it is and however long it runs
// past its lease and retention; one with no lease never is either.
func TestPurgeSparesLiveLease(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	const lease, keep = time.Minute, 10 * time.Second
	c := mustClaim(t, s, leased(req("key-1", "a"), lease, keep), idempotency.Claimed).Claim
	forever := mustClaim(t, s, leased(req("key-2", "a"), 0, keep), idempotency.Claimed).Claim
	makeOld(t, pool, "key-1")
	makeOld(t, pool, "key-2")
	// Renewed every lease/2, for twice the lease and retention.
	for passed := time.Duration(0); passed <= 2*(lease+keep); passed += lease / 2 {
		elapse(t, pool, "key-1", lease/2)
		elapse(t, pool, "key-2", lease/2)
		if err := s.Renew(ctx, c); err != nil {
			t.Fatalf("Renew: %v", err)
		}
		if n, err := s.Purge(ctx, 100); n != 0 || err != nil {
			t.Fatalf("Purge while the lease is renewed = %d, %v; want 0", n, err)
		}
	}
	rec := mustClaim(t, s, leased(req("key-1", "a"), lease, keep), idempotency.Exists).Record
	if rec.Status != idempotency.StatusStarted {
		t.Errorf("renewed key %q, want started", rec.Status)
	}
	mustClaim(t, s, leased(req("key-2", "a"), lease, keep), idempotency.Exists)
	mustComplete(t, s, c, "w1")
	mustComplete(t, s, forever, "w2")
	mustBeWritten(t, pool, "w1", true)
	mustBeWritten(t, pool, "w2", true)
}

// TestResumedKeyOutlivesItsRetention: a released key, old, is resumed by
// its own request near the end of its retention; while that request runs,
// past the moment the released key would have expired, a concurrent
// duplicate finds it started (409), not absent (a new operation, a second
// charge). The resumed request then completes.
func TestResumedKeyOutlivesItsRetention(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	const lease, keep = time.Hour, time.Minute
	r := leased(req("key", "a"), lease, keep)
	first := mustClaim(t, s, r, idempotency.Claimed).Claim
	makeOld(t, pool, "key")
	if err := s.Release(ctx, first, idempotency.ReleaseFailed); err != nil {
		t.Fatal(err)
	}
	elapse(t, pool, "key", keep*2/3) // near the end of its retention
	res, err := s.Claim(ctx, r)
	if err != nil {
		t.Fatal(err)
	}
	if res.Outcome != idempotency.Claimed || res.Claim.OperationID != first.OperationID {
		t.Fatalf("retry of the released key: %+v, want Claimed under operation %s", res, first.OperationID)
	}
	resumed := res.Claim
	elapse(t, pool, "key", keep/2) // the released key would have expired; the lease has not run out
	dup, err := s.Claim(ctx, r)
	if err != nil {
		t.Fatal(err)
	}
	if dup.Outcome == idempotency.Claimed {
		t.Fatalf("a duplicate of the running resumed request claimed it as absent (operation %s): a second charge", dup.Claim.OperationID)
	}
	n, err := s.Purge(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	if dup.Outcome != idempotency.Exists || dup.Record.Status != idempotency.StatusStarted || n != 0 {
		t.Fatalf("duplicate of the running resumed request: %+v, purged %d; want Exists, started, none purged", dup, n)
	}
	mustComplete(t, s, resumed, "w_key")
	mustBeWritten(t, pool, "w_key", true)
}

// TestExpiredKeyPurgedAfterItsRetention: a key an operator expired is
// kept by the purge until its retention has passed since its operation
// began, and deleted after; time is moved in SQL (every time of the key
// moved back, as if it had passed). One key is a minute short of its
// retention, the other a minute past it.
func TestExpiredKeyPurgedAfterItsRetention(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	const keep = time.Hour
	for _, key := range []string{"short", "past"} {
		c := mustClaim(t, s, leased(req(key, "a"), time.Minute, keep), idempotency.Claimed).Claim
		mustComplete(t, s, c)
		if _, err := s.Expire(ctx, "cli_a", key, false); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := s.Purge(ctx, 100); n != 0 || err != nil {
		t.Fatalf("Purge right after the expiries = %d, %v; want 0", n, err)
	}
	for key, passed := range map[string]time.Duration{"short": keep - time.Minute, "past": keep + time.Minute} {
		elapse(t, pool, key, passed)
	}
	if n, err := s.Purge(ctx, 100); n != 1 || err != nil {
		t.Fatalf("Purge = %d, %v; want 1, the key past its retention", n, err)
	}
	if _, ok := readKey(t, pool, "past"); ok {
		t.Error("the key past its retention was not purged")
	}
	if row, ok := readKey(t, pool, "short"); !ok || row.status != "completed" {
		t.Errorf("the key a minute short of its retention: %+v, %v; want it kept, completed", row, ok)
	}
}

// TestLongestDurationsDoNotOverflow serves a request with the largest durations an
// Options can hold: no overflow in the lease, expiry or Retry-After.
func TestLongestDurationsDoNotOverflow(t *testing.T) {
	s, pool := newStore(t, nil)
	const huge = time.Duration(1<<63 - 1)
	opts := idempotency.Options{LockTimeout: huge, Retention: huge, RetryAfter: huge, WaitForCompletion: 0, Logger: slog.New(slog.DiscardHandler)}
	h := idempotency.Middleware(s, opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	for i := range 2 {
		r := httptest.NewRequestWithContext(idempotency.WithClientID(context.Background(), "cli_a"), "POST", "/v1/orders", strings.NewReader("{}"))
		r.Header.Set("Idempotency-Key", "k")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		if rec.Code != http.StatusCreated || (i == 1) != (rec.Header().Get("Idempotent-Replayed") == "true") {
			t.Fatalf("request %d: %d %s", i, rec.Code, rec.Body)
		}
	}
	var expires time.Time
	if err := pool.QueryRow(context.Background(), `SELECT expires_at FROM idempotency_keys`).Scan(&expires); err != nil {
		t.Fatal(err)
	}
	if expires.Before(time.Now().AddDate(200, 0, 0)) {
		t.Errorf("expires_at %v, want about 292 years from now", expires)
	}
}
