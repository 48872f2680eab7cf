package server

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// The sweeper itself is idempotency.Sweeper's, tested there and in the
// stores' conformance suites; these tests check the payments API's
// settlement on both storages: a charge becomes the payment and the 201 the
// client would have had, no charge releases the key, and a late retry or a
// second sweeper settles nothing twice.

func TestSweepMemory(t *testing.T) { testSweep(t, memoryStorage) }

func TestSweepPostgres(t *testing.T) { testSweep(t, postgresStorage) }

func testSweep(t *testing.T, newStorage newStorageFunc) {
	for _, tt := range []struct {
		name string
		fn   func(t *testing.T, newStorage newStorageFunc)
	}{
		{"CrashedPaymentCompleted", testSweepCrashedPayment},
		{"UnchargedPaymentReleased", testSweepUncharged},
		{"FailedPaymentWithChargeCompleted", testSweepFailedWithCharge},
		{"LateRetryRace", testSweepLateRetry},
		{"GraceRespected", testSweepGraceRespected},
	} {
		t.Run(tt.name, func(t *testing.T) { tt.fn(t, newStorage) })
	}
}

// Timing of these tests: a lease and a grace (and so processor timeout)
// far longer than any charge on a loaded machine; a test ages the keys
// past them (testServer.elapse) rather than waiting.
const (
	sweepLock  = time.Minute
	sweepGrace = time.Minute
)

// sweepConfig returns a config whose payments crash after their charge
// (the first n) and whose sweeper takes keys sweepGrace after they were
// abandoned.
func sweepConfig(crashes int) Config {
	return Config{
		LockTimeout: sweepLock,
		SweepGrace:  sweepGrace,
		AfterCharge: (&crashOnce{n: crashes}).afterCharge,
	}
}

// sweepNow runs one pass of ts's sweeper and checks what it did.
func sweepNow(t *testing.T, ts *testServer, want idempotency.SweepResult) {
	t.Helper()
	got, err := ts.Sweep(context.Background())
	if err != nil || got != want {
		t.Fatalf("Sweep = %+v, %v; want %+v", got, err, want)
	}
}

// testSweepCrashedPayment: a payment whose server crashed after the charge,
// and whose client never came back, is found once the lease and the grace
// passed, and settled from its charge: one payment, written with the key's
// completion; the client's retry, whenever it comes, gets the 201 it
// would have had.
func testSweepCrashedPayment(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), sweepConfig(1))
	if r := ts.send(t, keyed("k-crash", payment)); r.err == nil {
		t.Fatalf("crashed request answered %d %s", r.status, r.body)
	}
	sweepNow(t, ts, idempotency.SweepResult{}) // the lease is live
	ts.elapse(t, sweepLock+sweepGrace+time.Second)
	sweepNow(t, ts, idempotency.SweepResult{Found: 1, Completed: 1})
	if n, p := ts.charges.created.Load(), ts.payments(t); n != 1 || p != 1 {
		t.Fatalf("%d charges and %d payments after the sweep, want 1 and 1", n, p)
	}
	r := ts.mustSend(t, keyed("k-crash", payment))
	if r.status != http.StatusCreated || !r.replayed() {
		t.Fatalf("the retry after the sweep: %d replayed=%v %s, want the stored 201", r.status, r.replayed(), r.body)
	}
	p := r.created(t, "k-crash")
	got, err := ts.storage.Payments.GetPayment(context.Background(), "client_a", p.ID)
	if err != nil || got.Customer != "cus_123" || got.Amount != 4200 || got.ChargeID != p.Charge || got.IdempotencyKey != "k-crash" {
		t.Errorf("the swept payment %+v, %v; want the one the replay names (%+v)", got, err, p)
	}
	if got := ts.counter(t, "idem_keys_swept_total") + ts.counter(t, "idem_keys_settled_total"); got != 2 {
		t.Errorf("swept + settled = %v, want 2", got)
	}
	sweepNow(t, ts, idempotency.SweepResult{})
}

// testSweepUncharged: a payment released after the processor refused it,
// whose client never came back, has no charge: the sweeper releases its
// key, writes nothing, and leaves it alone from then on; the client's
// retry still runs the payment.
func testSweepUncharged(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), sweepConfig(0))
	ts.Processor().FailNext(100)
	if r := ts.mustSend(t, keyed("k-down", payment)); r.status != http.StatusBadGateway {
		t.Fatalf("payment with the processor down: %d %s, want 502", r.status, r.body)
	}
	ts.Processor().FailNext(0)
	ts.elapse(t, sweepGrace+time.Second)
	sweepNow(t, ts, idempotency.SweepResult{Found: 1, Released: 1})
	if n, p := ts.charges.created.Load(), ts.payments(t); n != 0 || p != 0 {
		t.Fatalf("%d charges and %d payments after the sweep, want none", n, p)
	}
	ts.elapse(t, sweepGrace+time.Second) // released as rejected: never swept
	sweepNow(t, ts, idempotency.SweepResult{})
	r := ts.mustSend(t, keyed("k-down", payment))
	if r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("the retry after the sweep: %d replayed=%v %s, want a fresh 201", r.status, r.replayed(), r.body)
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
}

// testSweepFailedWithCharge: a payment that failed after its charge (the
// 500 of an injected failure after the write) is released with its
// operation; the sweeper finds its charge and completes it.
func testSweepFailedWithCharge(t *testing.T, newStorage newStorageFunc) {
	cfg := sweepConfig(0)
	cfg.Faults.FailAfterWriteRate = 1
	ts := newTestServer(t, newStorage(t), cfg)
	if r := ts.mustSend(t, keyed("k-500", payment)); r.status != http.StatusInternalServerError {
		t.Fatalf("payment failing after its write: %d %s, want 500", r.status, r.body)
	}
	if p := ts.payments(t); p != 0 {
		t.Fatalf("%d payments after the 500, want none", p)
	}
	ts.elapse(t, sweepGrace+time.Second)
	sweepNow(t, ts, idempotency.SweepResult{Found: 1, Completed: 1})
	if n, p := ts.charges.created.Load(), ts.payments(t); n != 1 || p != 1 {
		t.Fatalf("%d charges and %d payments after the sweep, want 1 and 1", n, p)
	}
	r := ts.mustSend(t, keyed("k-500", payment))
	if r.status != http.StatusCreated || !r.replayed() {
		t.Fatalf("the retry after the sweep: %d replayed=%v %s", r.status, r.replayed(), r.body)
	}
	r.created(t, "k-500")
}

// testSweepLateRetry: late retries race two sweepers for crashed payments;
// whichever takes a key, each operation ends with one charge and one
// payment, and every retry ends with the 201 of that payment.
func testSweepLateRetry(t *testing.T, newStorage newStorageFunc) {
	const n = 6
	ts := newTestServer(t, newStorage(t), sweepConfig(n))
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "k-race-" + string(rune('a'+i))
		if r := ts.send(t, keyed(keys[i], payment)); r.err == nil {
			t.Fatalf("crashed request answered %d", r.status)
		}
	}
	ts.elapse(t, sweepLock+sweepGrace+time.Second)
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			if _, err := ts.Sweep(context.Background()); err != nil {
				t.Error(err)
			}
		})
	}
	bodies := make([][]byte, n)
	for i, key := range keys {
		wg.Go(func() {
			for tries := 0; tries < 100; tries++ {
				r := ts.send(t, keyed(key, payment))
				if r.err != nil {
					t.Error(r.err)
					return
				}
				if r.status == http.StatusConflict {
					time.Sleep(20 * time.Millisecond) // the sweeper holds it
					continue
				}
				if r.status != http.StatusCreated {
					t.Errorf("retry of %s: %d %s", key, r.status, r.body)
				}
				bodies[i] = r.body
				return
			}
			t.Errorf("retry of %s: still 409 after 100 tries", key)
		})
	}
	wg.Wait()
	if c, p := ts.charges.created.Load(), ts.payments(t); c != n || p != n {
		t.Errorf("%d charges and %d payments for %d operations, want one each", c, p, n)
	}
	t.Logf("settled by a sweeper: %v, taken over by a retry: %v",
		ts.counter(t, "idem_keys_settled_total"), ts.counter(t, "idem_keys_taken_over_total"))
	for i, key := range keys {
		again := ts.mustSend(t, keyed(key, payment))
		if !again.replayed() || !bytes.Equal(again.body, bodies[i]) {
			t.Errorf("%s: the replay %s differs from the answer %s", key, again.body, bodies[i])
		}
	}
}

// testSweepGraceRespected: within the grace the sweeper leaves an
// abandoned payment to its client, whose retry takes it over.
func testSweepGraceRespected(t *testing.T, newStorage newStorageFunc) {
	cfg := sweepConfig(1)
	cfg.SweepGrace = time.Hour
	ts := newTestServer(t, newStorage(t), cfg)
	if r := ts.send(t, keyed("k-crash", payment)); r.err == nil {
		t.Fatalf("crashed request answered %d", r.status)
	}
	ts.elapse(t, sweepLock+time.Second)
	sweepNow(t, ts, idempotency.SweepResult{})
	r := ts.mustSend(t, keyed("k-crash", payment))
	if r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("the retry: %d replayed=%v, want a fresh 201 (taken over)", r.status, r.replayed())
	}
}

// TestSweepTimes: the grace and the processor timeout adapt to each other
// when one is left out, and a grace shorter than the timeout is refused.
func TestSweepTimes(t *testing.T) {
	for _, tt := range []struct {
		name                   string
		cfg                    Config
		wantGrace, wantTimeout time.Duration
		wantErr                string
	}{
		{"defaults", Config{}, idempotency.DefaultSweepGrace, DefaultProcessorTimeout, ""},
		{"a long timeout lengthens the grace", Config{ProcessorTimeout: 2 * time.Minute}, 2 * time.Minute, 2 * time.Minute, ""},
		{"a short grace shortens the timeout", Config{SweepGrace: 5 * time.Second}, 5 * time.Second, 5 * time.Second, ""},
		{"a long grace keeps the timeout", Config{SweepGrace: time.Hour}, time.Hour, DefaultProcessorTimeout, ""},
		{"both", Config{SweepGrace: 10 * time.Second, ProcessorTimeout: 10 * time.Second}, 10 * time.Second, 10 * time.Second, ""},
		{"no sweeper: the timeout alone", Config{SweepGrace: time.Second, NoSweep: true}, 0, DefaultProcessorTimeout, ""},
		{"grace below the timeout", Config{SweepGrace: time.Second, ProcessorTimeout: 2 * time.Second}, 0, 0, "shorter than"},
		{"negative", Config{SweepInterval: -1}, 0, 0, "negative"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			grace, timeout, err := sweepTimes(tt.cfg)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Errorf("sweepTimes = %v, want an error saying %q", err, tt.wantErr)
				}
				if _, err := New(Config{Storage: NewMemoryStorage().Storage(), SweepGrace: tt.cfg.SweepGrace,
					ProcessorTimeout: tt.cfg.ProcessorTimeout, SweepInterval: tt.cfg.SweepInterval}); err == nil {
					t.Error("New accepted the config")
				}
				return
			}
			if err != nil || grace != tt.wantGrace || timeout != tt.wantTimeout {
				t.Errorf("sweepTimes = %v, %v, %v; want %v, %v", grace, timeout, err, tt.wantGrace, tt.wantTimeout)
			}
		})
	}
}

// TestRunSweeps: Run runs the sweeper beside the purge, until its context
// ends; without one (NoSweep, or a store that cannot be swept) it purges
// only.
func TestRunSweeps(t *testing.T) {
	ts := newTestServer(t, memoryStorage(t), Config{
		LockTimeout: time.Minute, SweepGrace: time.Minute, SweepInterval: 20 * time.Millisecond,
		AfterCharge: (&crashOnce{n: 1}).afterCharge,
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- ts.Run(ctx) }()
	if r := ts.send(t, keyed("k", payment)); r.err == nil {
		t.Fatalf("crashed request answered %d", r.status)
	}
	ts.elapse(t, 3*time.Minute) // the lease and the grace run out
	for deadline := time.Now().Add(10 * time.Second); ts.counter(t, "idem_keys_settled_total") == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the sweeper did not settle the crashed payment within 10s")
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v, want nil", err)
	}
	if p := ts.payments(t); p != 1 {
		t.Errorf("%d payments, want 1", p)
	}

	storage := memoryStorage(t)
	storage.Keys = &scriptedPurges{Store: storage.Keys, batches: []int64{0, 0, 0, 0}}
	for _, s := range []*testServer{
		newTestServer(t, memoryStorage(t), Config{NoSweep: true}),
		newTestServer(t, storage, Config{}),
	} {
		if _, err := s.Sweep(context.Background()); err == nil {
			t.Error("Sweep without a sweeper succeeded")
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if err := s.Run(ctx); err != nil {
			t.Errorf("Run without a sweeper = %v, want nil", err)
		}
	}
}
