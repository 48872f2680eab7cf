package server

import (
	"context"
	"errors"
	"slices"
	"testing"
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
// turn, each taking the matching duration of took on clock.
type scriptedPurges struct {
	*MemoryStore
	clock   *fakeClock
	batches []int64
	took    []time.Duration
	limits  []int // the limit of each call
}

func (s *scriptedPurges) Purge(ctx context.Context, retention time.Duration, limit int) (int64, error) {
	i := len(s.limits)
	s.limits = append(s.limits, limit)
	if i >= len(s.batches) {
		return 0, errors.New("purged more batches than scripted")
	}
	s.clock.Advance(s.took[i])
	return s.batches[i], nil
}

// pacedServer returns a server on store whose purge pauses are recorded,
// not slept; pause, if not nil, is called with each of them instead.
func pacedServer(t *testing.T, store *scriptedPurges, cfg Config, pause func(time.Duration) error) (*Server, *[]time.Duration) {
	t.Helper()
	cfg.Store = store
	cfg.Logger = testLogger(t)
	srv, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	var pauses []time.Duration
	srv.now = store.clock.Now
	srv.sleep = func(ctx context.Context, d time.Duration) error {
		pauses = append(pauses, d)
		store.clock.Advance(d)
		if pause != nil {
			return pause(d)
		}
		return nil
	}
	return srv, &pauses
}

// TestPurgePacing checks the pace of a purge working through a backlog:
// after each full batch it pauses in proportion to the time the batch took,
// never after the last, short one.
func TestPurgePacing(t *testing.T) {
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
			srv, pauses := pacedServer(t, store, Config{PurgeBatch: tt.batch, PurgeDutyCycle: tt.duty}, nil)
			n, err := srv.Purge(context.Background())
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
			wantLimit := tt.batch
			if wantLimit == 0 {
				wantLimit = DefaultPurgeBatch
			}
			for _, l := range store.limits {
				if l != wantLimit {
					t.Errorf("Store.Purge limit %d, want %d", l, wantLimit)
				}
			}
		})
	}
}

// TestPurgeStopsDuringPause cancels the purge during a pause: it returns
// what it deleted so far and the context's error, and purges no more.
func TestPurgeStopsDuringPause(t *testing.T) {
	store := &scriptedPurges{MemoryStore: NewMemoryStore(), clock: newFakeClock(),
		batches: []int64{10, 10, 10}, took: []time.Duration{time.Millisecond, time.Millisecond, time.Millisecond}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv, pauses := pacedServer(t, store, Config{PurgeBatch: 10}, func(time.Duration) error {
		cancel()
		return ctx.Err()
	})
	n, err := srv.Purge(ctx)
	if n != 10 || !errors.Is(err, context.Canceled) {
		t.Errorf("Purge = %d, %v; want 10, context.Canceled", n, err)
	}
	if len(store.limits) != 1 || len(*pauses) != 1 {
		t.Errorf("%d batches and %d pauses after the cancellation, want 1 and 1", len(store.limits), len(*pauses))
	}
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
