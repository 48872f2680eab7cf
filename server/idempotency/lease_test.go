package idempotency

import (
	"cmp"
	"context"
	"errors"
	"io"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

// recordingStore records the claims it is asked for and the renewals, and
// may answer renewals itself (a store that cannot be reached, say).
type recordingStore struct {
	Store
	// renew, if not nil, is called with the number of each renewal (from
	// 1); a non-nil error is returned instead of the store's answer.
	renew func(n int) error

	mu      sync.Mutex
	claims  []ClaimRequest
	renewed int // renewals asked for
	kept    int // renewals the store made
}

func (s *recordingStore) Claim(ctx context.Context, req ClaimRequest) (ClaimResult, error) {
	s.mu.Lock()
	s.claims = append(s.claims, req)
	s.mu.Unlock()
	return s.Store.Claim(ctx, req)
}

// claimCount returns the number of claims asked for.
func (s *recordingStore) claimCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.claims)
}

func (s *recordingStore) Renew(ctx context.Context, c Claim) error {
	s.mu.Lock()
	s.renewed++
	n := s.renewed
	s.mu.Unlock()
	if s.renew != nil {
		if err := s.renew(n); err != nil {
			return err
		}
	}
	err := s.Store.Renew(ctx, c)
	if err == nil {
		s.mu.Lock()
		s.kept++
		s.mu.Unlock()
	}
	return err
}

func (s *recordingStore) requests() []ClaimRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.claims)
}

func (s *recordingStore) renewals() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.renewed
}

// events counts the events a middleware reports.
type events struct {
	mu sync.Mutex
	n  map[Event]int
}

func (e *events) add(ev Event) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == nil {
		e.n = make(map[Event]int)
	}
	e.n[ev]++
}

func (e *events) count(ev Event) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n[ev]
}

// The lock timeout of the lease tests, in a synctest bubble's fake time:
// renewals every second.
const testLease = 3 * time.Second

// TestMiddlewareRenewKeepsSlowHandler runs a handler for three lock
// timeouts: renewed every third of it, its key is never taken over, and
// each duplicate meanwhile gets 409, never a second execution.
func TestMiddlewareRenewKeepsSlowHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &recordingStore{Store: NewMemoryStore()}
		var ev events
		var calls atomic.Int32
		h := testHandler(t, store, Options{LockTimeout: testLease, OnEvent: ev.add}, func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			time.Sleep(3 * testLease)
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "done")
		})
		first := make(chan reply)
		go func() { first <- serve(t, h, keyed("k", "{}")) }()
		for range 4 { // at 2s, 4s, 6s and 8s: past the lock timeout, more than once
			time.Sleep(testLease * 2 / 3)
			if r := serve(t, h, keyed("k", "{}")); r.status != http.StatusConflict {
				t.Errorf("duplicate while the first runs: %d %s, want 409", r.status, r.body)
			}
		}
		if r := <-first; r.status != http.StatusCreated || r.replayed() || string(r.body) != "done" {
			t.Errorf("first: %d %q replayed=%v, want a fresh 201", r.status, r.body, r.replayed())
		}
		if r := serve(t, h, keyed("k", "{}")); r.status != http.StatusCreated || !r.replayed() {
			t.Errorf("retry after the first: %d replayed=%v, want the replay", r.status, r.replayed())
		}
		if n := calls.Load(); n != 1 {
			t.Errorf("handler ran %d times, want 1", n)
		}
		if ev.count(EventTookOver) != 0 || ev.count(EventLeaseLost) != 0 || ev.count(EventConflict) != 4 {
			t.Errorf("events: %d took over, %d lease lost, %d conflicts; want 0, 0, 4",
				ev.count(EventTookOver), ev.count(EventLeaseLost), ev.count(EventConflict))
		}
		if n := ev.count(EventRenewed); n < 8 {
			t.Errorf("%d renewals in three lock timeouts, want one every third of it (at least 8)", n)
		}
	})
}

var errUnreachable = errors.New("store unreachable")

// TestMiddlewareRenewUnreachable is the control of the test above: when no
// renewal reaches the store, a duplicate past the lock timeout takes the
// key over and runs, and the first request's completion is fenced (409),
// its staged writes dropped.
func TestMiddlewareRenewUnreachable(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := NewMemoryStore()
		store := &recordingStore{Store: mem, renew: func(int) error { return errUnreachable }}
		var ev events
		var rows journal
		var calls atomic.Int32
		h := testHandler(t, store, Options{LockTimeout: testLease, OnEvent: ev.add}, func(w http.ResponseWriter, r *http.Request) {
			n := calls.Add(1)
			mem.Stage(r.Context(), func() error { rows.add(string('0' + rune(n))); return nil })
			time.Sleep(3 * testLease)
			w.WriteHeader(http.StatusCreated)
		})
		first := make(chan reply)
		go func() { first <- serve(t, h, keyed("k", "{}")) }()
		time.Sleep(testLease + time.Second)
		second := make(chan reply)
		go func() { second <- serve(t, h, keyed("k", "{}")) }()
		if r := <-first; r.status != http.StatusConflict || r.problem(t).Type != ProblemKeyInUse {
			t.Errorf("first, taken over: %d %s, want 409", r.status, r.body)
		}
		if r := <-second; r.status != http.StatusCreated {
			t.Errorf("taker: %d %s, want 201", r.status, r.body)
		}
		if got := rows.list(); !slices.Equal(got, []string{"2"}) {
			t.Errorf("rows %q, want only the taker's", got)
		}
		if ev.count(EventTookOver) != 1 || ev.count(EventFenced) != 1 || ev.count(EventRenewed) != 0 {
			t.Errorf("events: %d took over, %d fenced, %d renewed; want 1, 1, 0",
				ev.count(EventTookOver), ev.count(EventFenced), ev.count(EventRenewed))
		}
	})
}

// TestMiddlewareRenewRetried fails the first two renewals (the store
// briefly unreachable): the middleware keeps renewing, and the third
// renewal, within the lock timeout, keeps the key, which a duplicate
// sent past the lock timeout finds still running.
func TestMiddlewareRenewRetried(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &recordingStore{Store: NewMemoryStore(), renew: func(n int) error {
			if n <= 2 {
				return errUnreachable
			}
			return nil
		}}
		var ev events
		var calls atomic.Int32
		h := testHandler(t, store, Options{LockTimeout: testLease, OnEvent: ev.add}, func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			time.Sleep(2 * testLease)
			w.WriteHeader(http.StatusCreated)
		})
		first := make(chan reply)
		go func() { first <- serve(t, h, keyed("k", "{}")) }()
		time.Sleep(testLease + testLease/6) // past the claim's lease, not the third renewal's
		if r := serve(t, h, keyed("k", "{}")); r.status != http.StatusConflict {
			t.Errorf("duplicate past the lock timeout after failed renewals: %d, want 409", r.status)
		}
		if r := <-first; r.status != http.StatusCreated {
			t.Errorf("first: %d, want 201", r.status)
		}
		if n := calls.Load(); n != 1 || ev.count(EventTookOver) != 0 {
			t.Errorf("handler ran %d times, %d takeovers; want 1, 0", n, ev.count(EventTookOver))
		}
		if n := store.renewals(); n < 5 {
			t.Errorf("%d renewals asked in two lock timeouts, want at least 5 (the failed ones retried)", n)
		}
		store.mu.Lock()
		kept := store.kept
		store.mu.Unlock()
		if got := ev.count(EventRenewed); got != kept || kept < 3 {
			t.Errorf("%d renewed events, %d renewals made by the store; want the same, at least 3", got, kept)
		}
	})
}

// TestMiddlewareLeaseLost fences the first renewal: the handler's context
// is cancelled with cause ErrLeaseLost, renewals stop, and the outcome is
// not stored.
func TestMiddlewareLeaseLost(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &recordingStore{Store: NewMemoryStore(), renew: func(int) error { return ErrFenced }}
		var ev events
		var cause, ctxErr error
		h := testHandler(t, store, Options{LockTimeout: testLease, OnEvent: ev.add}, func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
				cause, ctxErr = context.Cause(r.Context()), r.Context().Err()
				w.WriteHeader(http.StatusServiceUnavailable)
			case <-time.After(time.Hour):
				w.WriteHeader(http.StatusCreated)
			}
		})
		r := serve(t, h, keyed("k", "{}"))
		if !errors.Is(cause, ErrLeaseLost) || !errors.Is(ctxErr, context.Canceled) {
			t.Errorf("handler's context: cause %v, err %v; want ErrLeaseLost, context.Canceled", cause, ctxErr)
		}
		if r.status != http.StatusServiceUnavailable {
			t.Errorf("%d, want the handler's 503", r.status)
		}
		if ev.count(EventLeaseLost) != 1 || ev.count(EventCompleted) != 0 {
			t.Errorf("events: %d lease lost, %d completed; want 1, 0", ev.count(EventLeaseLost), ev.count(EventCompleted))
		}
		time.Sleep(10 * testLease)
		if n := store.renewals(); n != 1 {
			t.Errorf("%d renewals, want 1: renewals stop when the lease is lost", n)
		}
	})
}

// TestMiddlewareLeaseLostAfterPartition cuts the first request off from the
// store for longer than the lock timeout: a retry takes the key over and
// completes; when the store is reachable again, the first request's
// renewal is fenced, its handler learns it from its context, and what it
// still writes is dropped (409).
func TestMiddlewareLeaseLostAfterPartition(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := NewMemoryStore()
		var cut atomic.Bool
		cut.Store(true)
		store := &recordingStore{Store: mem, renew: func(int) error {
			if cut.Load() {
				return errUnreachable
			}
			return nil
		}}
		var ev events
		var rows journal
		var calls atomic.Int32
		var cause error
		h := testHandler(t, store, Options{LockTimeout: testLease, OnEvent: ev.add}, func(w http.ResponseWriter, r *http.Request) {
			if calls.Add(1) == 1 {
				mem.Stage(r.Context(), func() error { rows.add("first"); return nil })
				select {
				case <-r.Context().Done():
					cause = context.Cause(r.Context())
				case <-time.After(time.Hour):
				}
				w.WriteHeader(http.StatusCreated) // a handler that ignores it
				return
			}
			mem.Stage(r.Context(), func() error { rows.add("retry"); return nil })
			w.WriteHeader(http.StatusCreated)
		})
		first := make(chan reply)
		go func() { first <- serve(t, h, keyed("k", "{}")) }()
		time.Sleep(testLease + time.Second/2)
		if r := serve(t, h, keyed("k", "{}")); r.status != http.StatusCreated || r.replayed() {
			t.Errorf("retry past the lock timeout: %d replayed=%v, want a fresh 201", r.status, r.replayed())
		}
		cut.Store(false)
		r := <-first
		if !errors.Is(cause, ErrLeaseLost) {
			t.Errorf("first handler's context cause: %v, want ErrLeaseLost", cause)
		}
		if r.status != http.StatusConflict {
			t.Errorf("first: %d %s, want 409", r.status, r.body)
		}
		if got := rows.list(); !slices.Equal(got, []string{"retry"}) {
			t.Errorf("rows %q, want only the retry's", got)
		}
		if ev.count(EventTookOver) != 1 || ev.count(EventLeaseLost) != 1 || ev.count(EventFenced) != 1 {
			t.Errorf("events: %d took over, %d lease lost, %d fenced; want 1 each",
				ev.count(EventTookOver), ev.count(EventLeaseLost), ev.count(EventFenced))
		}
	})
}

// TestMiddlewareStopsRenewing ends requests in every way (completed,
// rejected, failed, panicked, their client gone, no lease): once
// ServeHTTP has returned, no renewal is made and no goroutine of the
// request is left.
func TestMiddlewareStopsRenewing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		leak := goleak.IgnoreCurrent()
		for _, tt := range []struct {
			name   string
			opts   Options
			handle func(w http.ResponseWriter, r *http.Request)
			cancel bool // the client goes away while the handler runs
		}{
			{"completed", Options{}, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }, false},
			{"rejected", Options{}, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusBadRequest) }, false},
			{"failed", Options{}, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusBadGateway) }, false},
			{"panicked", Options{}, func(w http.ResponseWriter, r *http.Request) { panic("boom") }, false},
			{"client gone", Options{}, func(w http.ResponseWriter, r *http.Request) {
				<-r.Context().Done()
				w.WriteHeader(http.StatusCreated)
			}, true},
			{"no lease", Options{LockTimeout: -1}, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }, false},
		} {
			store := &recordingStore{Store: NewMemoryStore()}
			tt.opts.LockTimeout = cmp.Or(tt.opts.LockTimeout, testLease)
			h := testHandler(t, store, tt.opts, func(w http.ResponseWriter, r *http.Request) {
				time.Sleep(2 * testLease) // renewed meanwhile
				tt.handle(w, r)
			})
			ctx, cancel := context.WithCancel(context.Background())
			if tt.cancel {
				time.AfterFunc(testLease, cancel)
			}
			func() {
				defer func() { recover() }()
				h.ServeHTTP(discard{}, keyed("k", "{}").request(t, "").WithContext(ctx))
			}()
			cancel()
			n := store.renewals()
			if tt.opts.LockTimeout > 0 && n == 0 {
				t.Errorf("%s: no renewal while the handler ran", tt.name)
			}
			time.Sleep(10 * testLease)
			if later := store.renewals(); later != n {
				t.Errorf("%s: %d renewals after the request ended", tt.name, later-n)
			}
			goleak.VerifyNone(t, leak)
		}
	})
}

// discard is a ResponseWriter that drops the response.
type discard struct{}

func (discard) Header() http.Header         { return http.Header{} }
func (discard) Write(b []byte) (int, error) { return len(b), nil }
func (discard) WriteHeader(int)             {}

// TestMiddlewareTinyLockTimeout gives a lock timeout too short to divide
// into renewal ticks (1ns, 2ns; time.NewTicker panics on a zero interval,
// in the renewal goroutine, which would kill the process): a request is
// still served, as any other short lease.
func TestMiddlewareTinyLockTimeout(t *testing.T) {
	for _, lt := range []time.Duration{1, 2} {
		store := NewMemoryStore()
		h := testHandler(t, store, Options{LockTimeout: lt}, func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
		})
		var r reply
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Errorf("LockTimeout %v: the middleware panicked: %v", lt, p)
				}
			}()
			r = serve(t, h, keyed("k", "{}"))
		}()
		if r.status != http.StatusCreated {
			t.Errorf("LockTimeout %v: %d, want 201", lt, r.status)
		}
	}
}

// TestTakeoverKeepsOperationWhenBeginFails: a request claims a key, charges a
// card under its operation and dies; its retry takes the key over, but
// Begin fails (the client went away, the store hiccupped). The key must
// still belong to that operation: another request with the key is a
// mismatch, not a new operation that orphans the charge.
func TestTakeoverKeepsOperationWhenBeginFails(t *testing.T) {
	mem, clock := newClockedMemoryStore()
	store := &failingStore{MemoryStore: mem}
	var ops []string
	ts := mwServer(t, store, Options{LockTimeout: time.Second}, func(w http.ResponseWriter, r *http.Request) {
		c, _ := ClaimFromContext(r.Context())
		ops = append(ops, c.OperationID)
		w.WriteHeader(http.StatusCreated)
	})
	// The first request: claimed, charged under its operation, crashed.
	first, err := mem.Claim(context.Background(), ClaimRequest{ClientID: "c", Key: "k", Method: "POST", Path: "/v1/payments",
		Fingerprint: mustFingerprint(t, "POST", "/v1/payments", "", "application/json", `{"amount":100}`),
		LockTimeout: time.Second, Retention: time.Hour})
	if err != nil || first.Outcome != Claimed {
		t.Fatal(first, err)
	}
	clock.Advance(time.Minute) // its lease ran out
	store.fail = "begin"
	if r := ts.mustSend(t, keyed("k", `{"amount":100}`)); r.status != http.StatusInternalServerError {
		t.Fatalf("retry with a failing Begin: %d", r.status)
	}
	store.fail = ""
	// Another request with the key.
	r := ts.mustSend(t, keyed("k", `{"amount":9999}`))
	if r.status != http.StatusUnprocessableEntity {
		t.Errorf("another request with the key of a taken-over operation: %d (operations run %v); want 422, operation %s is not finished",
			r.status, ops, first.Claim.OperationID)
	}
}
