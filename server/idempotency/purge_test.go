package idempotency

import (
	"context"
	"errors"
	"math"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

func TestPurgePause(t *testing.T) {
	for _, tt := range []struct {
		took time.Duration
		duty float64
		want time.Duration
	}{
		{40 * time.Millisecond, 0.25, 120 * time.Millisecond},
		{40 * time.Millisecond, 0.5, 40 * time.Millisecond},
		{40 * time.Millisecond, 0.8, 10 * time.Millisecond},
		{40 * time.Millisecond, 1, 0},
		{2 * time.Second, 0.1, 18 * time.Second}, // a slow database gets a long rest
		{0, 0.25, 0},
		{-time.Millisecond, 0.25, 0}, // a clock that went back
	} {
		if got := purgePause(tt.took, tt.duty); got != tt.want {
			t.Errorf("purgePause(%v, %v) = %v, want %v", tt.took, tt.duty, got, tt.want)
		}
	}
}

// scriptedPurges is a Store whose Purge deletes the counts of batches in
// turn, each taking the matching duration of took on clock, or failing
// with the matching error of errs.
type scriptedPurges struct {
	*MemoryStore
	clock   *fakeClock
	batches []int64
	took    []time.Duration
	errs    []error

	mu     sync.Mutex
	limits []int // the limit of each call
}

func (s *scriptedPurges) Purge(ctx context.Context, limit int) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i := len(s.limits)
	s.limits = append(s.limits, limit)
	if i >= len(s.batches) {
		return 0, errors.New("purged more batches than scripted")
	}
	if s.clock != nil && i < len(s.took) {
		s.clock.Advance(s.took[i])
	}
	if i < len(s.errs) && s.errs[i] != nil {
		return 0, s.errs[i]
	}
	return s.batches[i], nil
}

func (s *scriptedPurges) calls() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.limits)
}

// paced returns p with its pauses recorded, not slept, on store's clock;
// pause, if not nil, is called with each of them too.
func paced(t *testing.T, p *Purger, store *scriptedPurges, pause func(time.Duration) error) *[]time.Duration {
	t.Helper()
	p.Store = store
	p.Logger = testLogger(t)
	var pauses []time.Duration
	p.now = store.clock.Now
	p.sleep = func(ctx context.Context, d time.Duration) error {
		pauses = append(pauses, d)
		store.clock.Advance(d)
		if pause != nil {
			return pause(d)
		}
		return nil
	}
	return &pauses
}

// TestPurgerPacing checks the pace of a purge working through a backlog:
// after each full batch it pauses in proportion to the time the batch took,
// never after the last, short one.
func TestPurgerPacing(t *testing.T) {
	ms := time.Millisecond
	for _, tt := range []struct {
		name       string
		batch      int
		duty       float64
		batches    []int64
		took       []time.Duration
		wantPauses []time.Duration
	}{
		{"defaults", 0, 0, []int64{500, 500, 7}, []time.Duration{40 * ms, 80 * ms, 5 * ms},
			[]time.Duration{120 * ms, 240 * ms}},
		{"half", 10, 0.5, []int64{10, 10, 10, 0}, []time.Duration{10 * ms, 30 * ms, 20 * ms, ms},
			[]time.Duration{10 * ms, 30 * ms, 20 * ms}},
		{"back to back", 10, 1, []int64{10, 10, 9}, []time.Duration{10 * ms, 10 * ms, 10 * ms},
			[]time.Duration{0, 0}},
		{"nothing to purge", 10, 0.25, []int64{0}, []time.Duration{ms}, nil},
		{"one short batch", 10, 0.25, []int64{9}, []time.Duration{ms}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			store := &scriptedPurges{MemoryStore: NewMemoryStore(), clock: newFakeClock(), batches: tt.batches, took: tt.took}
			var reported []int64
			p := &Purger{Batch: tt.batch, DutyCycle: tt.duty, OnPurged: func(n int64) { reported = append(reported, n) }}
			pauses := paced(t, p, store, nil)
			n, err := p.Purge(context.Background())
			if err != nil {
				t.Fatalf("Purge: %v", err)
			}
			var want int64
			for _, b := range tt.batches {
				want += b
			}
			if n != want {
				t.Errorf("Purge = %d, want %d", n, want)
			}
			if !slices.Equal(*pauses, tt.wantPauses) {
				t.Errorf("pauses %v, want %v", *pauses, tt.wantPauses)
			}
			if !slices.Equal(reported, tt.batches) {
				t.Errorf("OnPurged got %v, want each batch %v", reported, tt.batches)
			}
			wantLimit := tt.batch
			if wantLimit == 0 {
				wantLimit = DefaultPurgeBatch
			}
			for _, l := range store.calls() {
				if l != wantLimit {
					t.Errorf("Store.Purge limit %d, want %d", l, wantLimit)
				}
			}
			if p.Batch != tt.batch || p.DutyCycle != tt.duty {
				t.Errorf("Purge wrote its defaults back: Batch %d, DutyCycle %v", p.Batch, p.DutyCycle)
			}
		})
	}
}

// TestPurgerStopsDuringPause cancels the purge during a pause: it returns
// what it deleted so far and the context's error, and purges no more.
func TestPurgerStopsDuringPause(t *testing.T) {
	store := &scriptedPurges{MemoryStore: NewMemoryStore(), clock: newFakeClock(),
		batches: []int64{10, 10, 10}, took: []time.Duration{time.Millisecond, time.Millisecond, time.Millisecond}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	p := &Purger{Batch: 10}
	pauses := paced(t, p, store, func(time.Duration) error {
		cancel()
		return ctx.Err()
	})
	n, err := p.Purge(ctx)
	if n != 10 || !errors.Is(err, context.Canceled) {
		t.Errorf("Purge = %d, %v; want 10, context.Canceled", n, err)
	}
	if len(store.calls()) != 1 || len(*pauses) != 1 {
		t.Errorf("%d batches and %d pauses after the cancellation, want 1 and 1", len(store.calls()), len(*pauses))
	}
}

// TestPurgerStoreError stops a purge at the failing batch, with what the
// batches before it deleted.
func TestPurgerStoreError(t *testing.T) {
	errDB := errors.New("database gone")
	store := &scriptedPurges{MemoryStore: NewMemoryStore(), clock: newFakeClock(),
		batches: []int64{10, 10, 10}, took: []time.Duration{time.Millisecond, time.Millisecond}, errs: []error{nil, errDB}}
	p := &Purger{Batch: 10}
	paced(t, p, store, nil)
	if n, err := p.Purge(context.Background()); n != 10 || !errors.Is(err, errDB) {
		t.Errorf("Purge = %d, %v; want 10, the store's error", n, err)
	}
}

// TestPurgerRefusesInvalid checks that a Purger that cannot run says so at
// once, from Purge and from Run, without touching the store.
func TestPurgerRefusesInvalid(t *testing.T) {
	for _, tt := range []struct {
		name string
		p    Purger
	}{
		{"no store", Purger{}},
		{"negative interval", Purger{Interval: -time.Second}},
		{"negative batch", Purger{Batch: -1}},
		{"negative duty cycle", Purger{DutyCycle: -0.5}},
		{"duty cycle over 1", Purger{DutyCycle: 1.5}},
		{"NaN duty cycle", Purger{DutyCycle: math.NaN()}},
		{"infinite duty cycle", Purger{DutyCycle: math.Inf(1)}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			store := &scriptedPurges{MemoryStore: NewMemoryStore()}
			p := tt.p
			if tt.name != "no store" {
				p.Store = store
			}
			p.Logger = testLogger(t)
			if _, err := p.Purge(context.Background()); err == nil {
				t.Error("Purge succeeded, want an error")
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := p.Run(ctx); err == nil {
				t.Error("Run returned nil, want an error at once")
			}
			if n := len(store.calls()); n != 0 {
				t.Errorf("the store was purged %d times", n)
			}
		})
	}
}

// TestPurgerRun checks that Run purges at once and then every Interval,
// goes on after a failed purge, and returns nil when its context ends.
func TestPurgerRun(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := &scriptedPurges{MemoryStore: NewMemoryStore(),
			batches: []int64{0, 0, 0, 0}, errs: []error{nil, errors.New("database gone"), nil, nil}}
		p := &Purger{Store: store, Interval: time.Minute, Batch: 10, Logger: testLogger(t)}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error)
		go func() { done <- p.Run(ctx) }()
		synctest.Wait()
		if n := len(store.calls()); n != 1 {
			t.Errorf("%d purges at start, want 1", n)
		}
		time.Sleep(3*time.Minute + time.Second)
		synctest.Wait()
		if n := len(store.calls()); n != 4 {
			t.Errorf("%d purges after three intervals (one failing), want 4", n)
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v after its context ended, want nil", err)
		}
	})
}

// TestSleepCtx checks the real pause: it ends with its context, and a
// non-positive pause returns at once.
func TestSleepCtx(t *testing.T) {
	if err := sleepCtx(context.Background(), 0); err != nil {
		t.Errorf("sleepCtx(0) = %v", err)
	}
	if err := sleepCtx(context.Background(), time.Microsecond); err != nil {
		t.Errorf("sleepCtx(1µs) = %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := sleepCtx(ctx, time.Hour); !errors.Is(err, context.Canceled) {
		t.Errorf("sleepCtx(canceled, 1h) = %v, want context.Canceled", err)
	}
	if err := sleepCtx(ctx, 0); !errors.Is(err, context.Canceled) {
		t.Errorf("sleepCtx(canceled, 0) = %v, want context.Canceled", err)
	}
}

// TestPurgerMemoryStore purges a real store: the expired keys go, in
// batches, and the running ones stay.
func TestPurgerMemoryStore(t *testing.T) {
	ctx := context.Background()
	s, clock := newClockedMemoryStore()
	for _, key := range []string{"a", "b", "c", "d", "e"} {
		req := claimReq("x", key, "fp")
		req.Retention = time.Minute
		c := mustClaim(t, s, req, Claimed).Claim
		if err := s.Release(ctx, c, ReleaseRejected); err != nil {
			t.Fatal(err)
		}
	}
	running := claimReq("x", "running", "fp")
	running.LockTimeout, running.Retention = time.Hour, time.Minute
	mustClaim(t, s, running, Claimed)
	clock.Advance(2 * time.Minute)
	var batches []int64
	p := &Purger{Store: s, Batch: 2, DutyCycle: 1, Logger: testLogger(t), OnPurged: func(n int64) { batches = append(batches, n) }}
	if n, err := p.Purge(ctx); n != 5 || err != nil {
		t.Errorf("Purge = %d, %v; want 5", n, err)
	}
	if !slices.Equal(batches, []int64{2, 2, 1}) {
		t.Errorf("batches %v, want [2 2 1]", batches)
	}
	mustClaim(t, s, running, Exists)
}
