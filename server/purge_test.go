package server

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// The pacing of the purge is idempotency.Purger's, tested there; these tests
// check the server's wiring of it: its settings, its store and the
// idem_keys_purged_total counter.

// scriptedPurges is a key store whose Purge deletes the counts of batches
// in turn and records the limit of each call.
type scriptedPurges struct {
	idempotency.Store
	mu      sync.Mutex
	batches []int64
	limits  []int
}

func (s *scriptedPurges) Purge(ctx context.Context, limit int) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i := len(s.limits)
	s.limits = append(s.limits, limit)
	if i >= len(s.batches) {
		return 0, errors.New("purged more batches than scripted")
	}
	return s.batches[i], nil
}

// TestServerPurge checks that Server.Purge purges the configured key store
// in batches of Config.PurgeBatch until one comes back short, and counts
// what it deleted on idem_keys_purged_total.
func TestServerPurge(t *testing.T) {
	for _, tt := range []struct {
		name      string
		batch     int
		batches   []int64
		wantLimit int
	}{
		{"default batch", 0, []int64{idempotency.DefaultPurgeBatch, 7}, idempotency.DefaultPurgeBatch},
		{"batch of 3", 3, []int64{3, 3, 1}, 3},
		{"nothing to purge", 3, []int64{0}, 3},
	} {
		t.Run(tt.name, func(t *testing.T) {
			storage := memoryStorage(t)
			keys := &scriptedPurges{Store: storage.Keys, batches: tt.batches}
			storage.Keys = keys
			ts := newTestServer(t, storage, Config{PurgeBatch: tt.batch, PurgeDutyCycle: 1})
			n, err := ts.Purge(context.Background())
			var want int64
			for _, b := range tt.batches {
				want += b
			}
			if err != nil || n != want {
				t.Fatalf("Purge = %d, %v; want %d, nil", n, err, want)
			}
			if len(keys.limits) != len(tt.batches) {
				t.Errorf("%d Store.Purge calls, want %d", len(keys.limits), len(tt.batches))
			}
			for _, l := range keys.limits {
				if l != tt.wantLimit {
					t.Errorf("Store.Purge limit %d, want %d", l, tt.wantLimit)
				}
			}
			if got := ts.counter(t, "idem_keys_purged_total"); got != float64(want) {
				t.Errorf("idem_keys_purged_total = %v, want %d", got, want)
			}
		})
	}
}

// TestServerRun checks that the purge job deletes the expired keys of the
// server's store, at start and on every tick, counts them, and stops with
// its context.
func TestServerRun(t *testing.T) {
	const retention = time.Minute
	ts := newTestServer(t, memoryStorage(t), Config{Retention: retention, PurgeInterval: 20 * time.Millisecond, PurgeBatch: 1})
	ts.mustSend(t, keyed("k1", payment))
	ts.mustSend(t, keyed("k2", payment))
	ts.elapse(t, retention+time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- ts.Run(ctx) }()
	deadline := time.Now().Add(5 * time.Second)
	for ts.counter(t, "idem_keys_purged_total") < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v", err)
	}
	if got := ts.counter(t, "idem_keys_purged_total"); got != 2 {
		t.Errorf("purged %v keys, want 2", got)
	}
	if r := ts.mustSend(t, keyed("k1", payment)); r.status != 201 || r.replayed() {
		t.Errorf("purged key: %d replayed=%v, want a new operation", r.status, r.replayed())
	}
}

// TestServerRunErrors checks that purge settings out of range stop Run and
// Purge at once, with an error naming the setting.
func TestServerRunErrors(t *testing.T) {
	for _, tt := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"negative batch", Config{PurgeBatch: -1}, "negative"},
		{"negative interval", Config{PurgeInterval: -time.Second}, "negative"},
		{"duty cycle over 1", Config{PurgeDutyCycle: 1.5}, "DutyCycle"},
		{"negative duty cycle", Config{PurgeDutyCycle: -0.5}, "DutyCycle"},
		{"NaN duty cycle", Config{PurgeDutyCycle: math.NaN()}, "DutyCycle"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ts := newTestServer(t, memoryStorage(t), tt.cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := ts.Run(ctx); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Run = %v, want an error with %q", err, tt.want)
			}
			if _, err := ts.Purge(ctx); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Purge = %v, want an error with %q", err, tt.want)
			}
		})
	}
}
