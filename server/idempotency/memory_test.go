package idempotency

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"
)

// fakeClock is a settable clock for the MemoryStore's and Purger's test
// seams.
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

// claimReq is a request with a 30s lease and a 24h retention.
func claimReq(client, key, fp string) ClaimRequest {
	return ClaimRequest{
		ClientID: client, Key: key, Method: "POST", Path: "/v1/payments",
		Fingerprint: []byte(fp),
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
		t.Fatalf("Claim(%s/%s) outcome = %v (record %+v), want %v", req.ClientID, req.Key, res.Outcome, res.Record, want)
	}
	return res
}

// journal records staged writes as a handler's table would.
type journal struct {
	mu      sync.Mutex
	entries []string
}

func (j *journal) add(e string) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.entries = append(j.entries, e)
}

func (j *journal) list() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.entries)
}

// unit begins a unit of work of c and returns the context a handler sees.
func unit(t *testing.T, s *MemoryStore, c Claim) (Tx, context.Context) {
	t.Helper()
	tx, err := s.Begin(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	return tx, NewContext(context.Background(), c, tx)
}

// stage stages the write of e to j in the unit of work of ctx.
func stage(t *testing.T, s *MemoryStore, ctx context.Context, j *journal, e string) {
	t.Helper()
	if !s.Stage(ctx, func() error { j.add(e); return nil }) {
		t.Fatalf("Stage(%s) = false inside a unit of work", e)
	}
}

func TestMemoryStoreClaim(t *testing.T) {
	ctx := context.Background()
	s, clock := newClockedMemoryStore()
	var rows journal

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
	// At the lease's end exactly, the key is still its owner's.
	clock.Advance(30 * time.Second)
	mustClaim(t, s, claimReq("a", "k", "fp1"), Exists)
	clock.Advance(time.Nanosecond)
	// Stale but another fingerprint: no takeover.
	mustClaim(t, s, claimReq("a", "k", "fp2"), Exists)
	// Stale and the same fingerprint: takeover, same operation, new token.
	took := mustClaim(t, s, claimReq("a", "k", "fp1"), TookOver)
	if took.Claim.OperationID != first.Claim.OperationID || took.Claim.Token == first.Claim.Token {
		t.Errorf("takeover claim %+v, first %+v", took.Claim, first.Claim)
	}
	// The first owner is fenced: its completion applies nothing.
	tx, wctx := unit(t, s, first.Claim)
	stage(t, s, wctx, &rows, "old")
	if err := tx.Complete(ctx, StoredResponse{Status: 201}); !errors.Is(err, ErrFenced) {
		t.Fatalf("fenced Complete = %v, want ErrFenced", err)
	}
	if err := s.Renew(ctx, first.Claim); !errors.Is(err, ErrFenced) {
		t.Errorf("fenced Renew = %v, want ErrFenced", err)
	}
	if err := s.Release(ctx, first.Claim, ReleaseFailed); !errors.Is(err, ErrFenced) {
		t.Errorf("fenced Release = %v, want ErrFenced", err)
	}
	// The new owner completes.
	tx, wctx = unit(t, s, took.Claim)
	stage(t, s, wctx, &rows, "new")
	if err := tx.Complete(ctx, StoredResponse{Status: 201, ContentType: "application/json", Body: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("Rollback after Complete = %v", err)
	}
	if got := rows.list(); !slices.Equal(got, []string{"new"}) {
		t.Errorf("rows %q, want only the new owner's", got)
	}
	done := mustClaim(t, s, claimReq("a", "k", "fp1"), Exists)
	if done.Record.Status != StatusCompleted || string(done.Record.Response.Body) != "{}" {
		t.Errorf("completed record %+v", done.Record)
	}
	// A completed key is never taken over, however old.
	clock.Advance(time.Hour)
	mustClaim(t, s, claimReq("a", "k", "fp1"), Exists)
	// Retention is exact and counts from the completion: at 24h after it
	// the key is live; one tick past it, absent, and a new operation
	// starts, even before any purge.
	clock.Advance(23 * time.Hour)
	mustClaim(t, s, claimReq("a", "k", "fp1"), Exists)
	clock.Advance(time.Nanosecond)
	fresh := mustClaim(t, s, claimReq("a", "k", "fp2"), Claimed)
	if fresh.Claim.OperationID == first.Claim.OperationID {
		t.Error("a key used again after expiry kept its operation ID")
	}
}

// TestMemoryStoreLease checks the stored lease: renewals keep a started key
// its owner's however long it runs, a key is taken over one lease after its
// last renewal, and a claimer's own lock timeout does not matter.
func TestMemoryStoreLease(t *testing.T) {
	ctx := context.Background()
	s, clock := newClockedMemoryStore()
	req := claimReq("a", "k", "fp")
	c := mustClaim(t, s, req, Claimed).Claim
	for range 100 { // 50 minutes, past the lease and far past the retention
		clock.Advance(30 * time.Second)
		if err := s.Renew(ctx, c); err != nil {
			t.Fatalf("Renew: %v", err)
		}
	}
	short := req
	short.LockTimeout = time.Second
	short.Retention = time.Second
	mustClaim(t, s, short, Exists)
	if n, err := s.Purge(ctx, 100); n != 0 || err != nil {
		t.Errorf("Purge of a renewed key = %d, %v; want 0", n, err)
	}
	rec := mustClaim(t, s, req, Exists).Record
	if want := rec.CreatedAt.Add(50 * time.Minute); !rec.LockedAt.Equal(want) {
		t.Errorf("LockedAt = %v, want the last renewal %v", rec.LockedAt, want)
	}
	clock.Advance(30 * time.Second)
	mustClaim(t, s, short, Exists) // the stored lease, not the claimer's
	clock.Advance(time.Nanosecond)
	if took := mustClaim(t, s, short, TookOver).Claim; took.OperationID != c.OperationID {
		t.Errorf("takeover: operation %s, want %s", took.OperationID, c.OperationID)
	}
	if err := s.Renew(ctx, c); !errors.Is(err, ErrFenced) {
		t.Errorf("Renew after the takeover = %v, want ErrFenced", err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := s.Renew(cancelled, c); !errors.Is(err, context.Canceled) {
		t.Errorf("Renew with a cancelled context = %v, want context.Canceled", err)
	}
}

// TestMemoryStoreExpiry checks each kind of key's expiry to the
// nanosecond: a finished key its retention after it finished, an abandoned
// started key its retention after its lease ran out, a started key with no
// lease or no retention never.
func TestMemoryStoreExpiry(t *testing.T) {
	ctx := context.Background()
	const lease, keep = 30 * time.Second, time.Hour
	req := func(key string, lease, keep time.Duration) ClaimRequest {
		r := claimReq("a", key, "fp")
		r.LockTimeout, r.Retention = lease, keep
		return r
	}
	s, clock := newClockedMemoryStore()
	completed := mustClaim(t, s, req("completed", lease, keep), Claimed).Claim
	released := mustClaim(t, s, req("released", lease, keep), Claimed).Claim
	mustClaim(t, s, req("abandoned", lease, keep), Claimed)
	mustClaim(t, s, req("no-lease", 0, keep), Claimed)
	mustClaim(t, s, req("no-retention", lease, 0), Claimed)

	clock.Advance(10 * time.Minute) // each renewed meanwhile, but for the abandoned ones
	for _, c := range []Claim{completed, released} {
		for range 20 {
			if err := s.Renew(ctx, c); err != nil {
				t.Fatal(err)
			}
		}
	}
	tx, _ := unit(t, s, completed)
	if err := tx.Complete(ctx, StoredResponse{Status: 201}); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, released, ReleaseFailed); err != nil {
		t.Fatal(err)
	}
	// Now: completed and released expire at +1h; abandoned expired at
	// 30s+1h after its claim, 10m ago: +50m30s.
	check := func(key string, want Outcome) {
		t.Helper()
		r := req(key, lease, keep)
		r.Fingerprint = []byte("another request")
		res, err := s.Claim(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		if res.Outcome != want {
			t.Errorf("%s: %s, want %s", key, res.Outcome, want)
		}
	}
	clock.Advance(50*time.Minute + 30*time.Second)
	check("abandoned", Exists)
	clock.Advance(time.Nanosecond)
	check("abandoned", Claimed)

	clock.Advance(9*time.Minute + 30*time.Second - time.Nanosecond) // +1h after the finish
	check("completed", Exists)
	if n, err := s.Purge(ctx, 100); n != 0 || err != nil {
		t.Errorf("Purge at the retention's end = %d, %v; want 0", n, err)
	}
	clock.Advance(time.Nanosecond)
	check("completed", Claimed)
	if n, err := s.Purge(ctx, 100); n != 1 || err != nil { // the released key
		t.Errorf("Purge one tick past the retention = %d, %v; want 1", n, err)
	}
	clock.Advance(1000 * time.Hour)
	check("no-lease", Exists)
	check("no-retention", Exists)
}

func TestMemoryStoreRelease(t *testing.T) {
	ctx := context.Background()
	s, _ := newClockedMemoryStore()
	var rows journal
	c := mustClaim(t, s, claimReq("a", "k", "fp"), Claimed).Claim
	tx, wctx := unit(t, s, c)
	stage(t, s, wctx, &rows, "p")
	tx.Rollback(ctx)
	if err := tx.Complete(ctx, StoredResponse{Status: 201}); err == nil {
		t.Error("Complete after Rollback succeeded")
	}
	if err := s.Release(ctx, c, ReleaseFailed); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, c, ReleaseFailed); err != nil {
		t.Errorf("second Release = %v, want nil (released by this claim already)", err)
	}
	if again := mustClaim(t, s, claimReq("a", "k", "fp"), Claimed).Claim; again.OperationID != c.OperationID {
		t.Errorf("claim after release: operation %s, want the released %s", again.OperationID, c.OperationID)
	} else if err := s.Release(ctx, c, ReleaseFailed); !errors.Is(err, ErrFenced) {
		t.Errorf("Release of the first claim after the key was claimed again = %v, want ErrFenced", err)
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
	if got := rows.list(); len(got) != 0 {
		t.Errorf("rolled back rows applied: %q", got)
	}
}

// TestMemoryStoreStage checks what Stage does: nothing outside a unit of
// work of the store; inside one, functions applied at the completion in
// order, under the ownership check, never on a rollback or a fenced
// completion; and a failing function fails the completion.
func TestMemoryStoreStage(t *testing.T) {
	ctx := context.Background()
	s, clock := newClockedMemoryStore()
	var rows journal
	nop := func() error { return nil }

	if s.Stage(ctx, nop) {
		t.Error("Stage outside a unit of work = true")
	}
	c := mustClaim(t, s, claimReq("a", "k1", "fp"), Claimed).Claim
	otherStore := NewMemoryStore()
	otherTx, _ := otherStore.Begin(ctx, c)
	if s.Stage(NewContext(ctx, c, otherTx), nop) {
		t.Error("Stage in another store's unit of work = true")
	}

	tx, wctx := unit(t, s, c)
	for _, e := range []string{"first", "second", "third"} {
		stage(t, s, wctx, &rows, e)
	}
	if got := rows.list(); len(got) != 0 {
		t.Errorf("staged rows applied before the completion: %q", got)
	}
	if err := tx.Complete(ctx, StoredResponse{Status: 201}); err != nil {
		t.Fatal(err)
	}
	if got := rows.list(); !slices.Equal(got, []string{"first", "second", "third"}) {
		t.Errorf("rows %q, want the staged ones in order", got)
	}
	if s.Stage(wctx, nop) {
		t.Error("Stage in a completed unit of work = true")
	}

	// A failing function fails the completion: the key stays started,
	// the functions after it do not run.
	errRow := errors.New("row refused")
	c2 := mustClaim(t, s, claimReq("a", "k2", "fp"), Claimed).Claim
	tx, wctx = unit(t, s, c2)
	s.Stage(wctx, func() error { return errRow })
	stage(t, s, wctx, &rows, "after the failure")
	if err := tx.Complete(ctx, StoredResponse{Status: 201}); !errors.Is(err, errRow) {
		t.Errorf("Complete with a failing staged write = %v, want %v", err, errRow)
	}
	if rec := mustClaim(t, s, claimReq("a", "k2", "fp"), Exists).Record; rec.Status != StatusStarted {
		t.Errorf("key of the failed completion: status %q, want started", rec.Status)
	}

	// Rolled back, and fenced: nothing applied.
	tx, wctx = unit(t, s, c2)
	stage(t, s, wctx, &rows, "rolled back")
	tx.Rollback(ctx)
	if s.Stage(wctx, nop) {
		t.Error("Stage in a rolled back unit of work = true")
	}
	tx, wctx = unit(t, s, c2)
	stage(t, s, wctx, &rows, "fenced")
	clock.Advance(time.Minute)
	mustClaim(t, s, claimReq("a", "k2", "fp"), TookOver)
	if err := tx.Complete(ctx, StoredResponse{Status: 201}); !errors.Is(err, ErrFenced) {
		t.Errorf("Complete of the taken-over claim = %v, want ErrFenced", err)
	}
	if got := rows.list(); !slices.Equal(got, []string{"first", "second", "third"}) {
		t.Errorf("rows %q, want only the completed unit's", got)
	}
}

// TestMemoryStoreInvalidText checks that the memory store refuses what
// PostgreSQL refuses, before it changes anything.
func TestMemoryStoreInvalidText(t *testing.T) {
	ctx := context.Background()
	s := NewMemoryStore()
	for _, bad := range []string{"a\x00b", "caf\xe9", "\xed\xa0\x80"} {
		for _, field := range []string{"client", "key", "method", "path"} {
			req := claimReq("a", "k", "fp")
			switch field {
			case "client":
				req.ClientID = bad
			case "key":
				req.Key = bad
			case "method":
				req.Method = bad
			case "path":
				req.Path = bad
			}
			if _, err := s.Claim(ctx, req); !errors.Is(err, ErrInvalidText) {
				t.Errorf("Claim with %s %q: %v, want ErrInvalidText", field, bad, err)
			}
		}
	}
	if len(s.keys) != 0 {
		t.Errorf("refused claims stored %d keys", len(s.keys))
	}
	for _, tt := range []struct {
		s    string
		want bool
	}{{"", true}, {"café ✓", true}, {"a\x00", false}, {"\xff", false}, {"\xed\xa0\x80", false}} {
		if got := ValidText(tt.s); got != tt.want {
			t.Errorf("ValidText(%q) = %v, want %v", tt.s, got, tt.want)
		}
	}
}

func TestMemoryStorePurge(t *testing.T) {
	ctx := context.Background()
	s, clock := newClockedMemoryStore()
	// Five keys finished a minute apart with a 150s retention: a expires
	// first, e last.
	for _, key := range []string{"a", "b", "c", "d", "e"} {
		req := claimReq("x", key, "fp")
		req.Retention = 150 * time.Second
		c := mustClaim(t, s, req, Claimed).Claim
		tx, _ := unit(t, s, c)
		if err := tx.Complete(ctx, StoredResponse{Status: 201}); err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Minute)
	}
	// Now a finished 5m ago, e 1m ago: a, b and c expired.
	for _, tt := range []struct {
		limit int
		want  int64
	}{{0, 0}, {-1, 0}, {2, 2}, {2, 1}, {2, 0}} {
		n, err := s.Purge(ctx, tt.limit)
		if err != nil || n != tt.want {
			t.Errorf("Purge(%d) = %d, %v; want %d", tt.limit, n, err, tt.want)
		}
	}
	for key, want := range map[string]Outcome{"a": Claimed, "c": Claimed, "d": Exists, "e": Exists} {
		mustClaim(t, s, claimReq("x", key, "fp"), want)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.Purge(cancelled, 10); !errors.Is(err, context.Canceled) {
		t.Errorf("Purge with a cancelled context: %v, want context.Canceled", err)
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
