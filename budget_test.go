package idem

import (
	"context"
	"errors"
	"math"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNewRetryBudgetDefaults(t *testing.T) {
	tests := []struct {
		capacity  int
		ratio     float64
		wantCap   float64
		wantAfter float64 // tokens after one spend and one success
	}{
		{0, 0, DefaultBudgetCapacity, DefaultBudgetCapacity - 1 + DefaultBudgetRatio},
		{-5, -1, DefaultBudgetCapacity, DefaultBudgetCapacity - 1 + DefaultBudgetRatio},
		{3, 0, 3, 2.1},
		{0, 0.5, DefaultBudgetCapacity, DefaultBudgetCapacity - 0.5},
		{1, 0.25, 1, 0.25},
	}
	for _, tt := range tests {
		b := NewRetryBudget(tt.capacity, tt.ratio)
		if got := b.Tokens(); got != tt.wantCap {
			t.Errorf("NewRetryBudget(%d, %v).Tokens() = %v, want a full budget of %v", tt.capacity, tt.ratio, got, tt.wantCap)
		}
		if !b.spend() {
			t.Fatalf("NewRetryBudget(%d, %v): a full budget refused to spend", tt.capacity, tt.ratio)
		}
		b.succeed()
		if got := b.Tokens(); got != tt.wantAfter {
			t.Errorf("NewRetryBudget(%d, %v): after a spend and a success, Tokens() = %v, want %v", tt.capacity, tt.ratio, got, tt.wantAfter)
		}
	}
}

func TestRetryBudgetSpendsWholeTokens(t *testing.T) {
	b := NewRetryBudget(2, 0.5)
	steps := []struct {
		op        string // "spend" or "succeed"
		wantOK    bool   // for spend
		wantAfter float64
	}{
		{"spend", true, 1},
		{"spend", true, 0},
		{"spend", false, 0},
		{"succeed", false, 0.5},
		{"spend", false, 0.5}, // half a token is no retry
		{"succeed", false, 1},
		{"spend", true, 0},
		{"succeed", false, 0.5},
		{"succeed", false, 1},
		{"succeed", false, 1.5},
		{"succeed", false, 2},
		{"succeed", false, 2}, // full: no more is earned
		{"spend", true, 1},
	}
	for i, s := range steps {
		if s.op == "spend" {
			if ok := b.spend(); ok != s.wantOK {
				t.Fatalf("step %d: spend() = %t, want %t (tokens %v)", i+1, ok, s.wantOK, b.Tokens())
			}
		} else {
			b.succeed()
		}
		if got := b.Tokens(); got != s.wantAfter {
			t.Fatalf("step %d (%s): Tokens() = %v, want %v", i+1, s.op, got, s.wantAfter)
		}
	}
}

func TestRetryBudgetEarnsUpToCapacity(t *testing.T) {
	b := NewRetryBudget(2, 0.3)
	b.spend()
	for _, want := range []float64{1.3, 1.6, 1.9, 2, 2} {
		b.succeed()
		if got := b.Tokens(); got != want {
			t.Fatalf("Tokens() = %v, want %v", got, want)
		}
	}
	// A tiny ratio still earns something: it is rounded up to a millionth.
	tiny := NewRetryBudget(1, 1e-9)
	tiny.spend()
	tiny.succeed()
	if got := tiny.Tokens(); got != 0.000001 {
		t.Errorf("tiny ratio: Tokens() = %v, want 0.000001", got)
	}
}

func TestRetryBudgetConcurrent(t *testing.T) {
	const capacity, goroutines = 50, 64

	// Spends race for a full budget: exactly capacity of them win.
	b := NewRetryBudget(capacity, 0.1)
	var won atomic.Int64
	var wg sync.WaitGroup
	for range goroutines {
		wg.Go(func() {
			for range 10 {
				if b.spend() {
					won.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if won.Load() != capacity || b.Tokens() != 0 {
		t.Fatalf("%d spends won, %v tokens left; want %d and 0", won.Load(), b.Tokens(), capacity)
	}

	// Successes race to refill it: no earning is lost (64×5×0.1 = 32 < 50).
	for range goroutines {
		wg.Go(func() {
			for range 5 {
				b.succeed()
			}
		})
	}
	wg.Wait()
	if got := b.Tokens(); got != 32 {
		t.Fatalf("after %d concurrent successes, Tokens() = %v, want 32", goroutines*5, got)
	}

	// Mixed, with a watcher: the budget never leaves [0, capacity].
	stop := make(chan struct{})
	var watched sync.WaitGroup
	watched.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if tok := b.Tokens(); tok < 0 || tok > capacity {
				t.Errorf("Tokens() = %v, outside [0, %d]", tok, capacity)
				return
			}
		}
	})
	var spent, earned atomic.Int64
	for i := range goroutines {
		wg.Go(func() {
			for range 2000 {
				if i%2 == 0 {
					if b.spend() {
						spent.Add(1)
					}
				} else {
					b.succeed()
					earned.Add(1)
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	watched.Wait()
	if tok := b.Tokens(); tok < 0 || tok > capacity {
		t.Errorf("final Tokens() = %v, outside [0, %d]", tok, capacity)
	}
	// Every spend was paid for by the 32 tokens there were or by earnings.
	if avail := 32 + float64(earned.Load())*0.1; float64(spent.Load()) > avail {
		t.Errorf("%d spends, more than the %v tokens ever available", spent.Load(), avail)
	}
}

// budgetTransport is a wire transport with a short real backoff and a
// budget of its own.
func budgetTransport(t *testing.T, budget *RetryBudget) *Transport {
	t.Helper()
	tr := newTransport(t, RetryPolicy{MaxAttempts: 4, InitialInterval: time.Millisecond, MaxInterval: 2 * time.Millisecond})
	tr.Budget = budget
	return tr
}

func TestTransportRetryBudgetFailsFast(t *testing.T) {
	rec := &recorder{script: []int{503}}
	srv := newServer(t, rec)
	budget := NewRetryBudget(2, 0.1)

	// Two retries spend the budget; the third is refused before it is sent.
	var as attempts
	tr := budgetTransport(t, budget)
	tr.OnAttempt = as.hook
	_, err := post(t, tr, context.Background(), srv.URL, `{}`)
	var rerr *RetryError
	if !errors.As(err, &rerr) || !errors.Is(err, ErrBudgetExhausted) {
		t.Fatalf("err = %v, want a *RetryError with ErrBudgetExhausted", err)
	}
	if n := len(rec.requests()); n != 3 || rerr.Attempts != 3 {
		t.Errorf("server saw %d requests, RetryError says %d attempts; want 3 (MaxAttempts is 4)", n, rerr.Attempts)
	}
	if rerr.Key == "" || rerr.Key != rec.requests()[0].key {
		t.Errorf("RetryError.Key = %q, want the key sent", rerr.Key)
	}
	if last := as[len(as)-1]; last.Retry || last.Reason != "retry budget exhausted" || last.Response == nil || last.Response.StatusCode != 503 {
		t.Errorf("last report %+v, want the 503 given up on for the budget", last)
	}
	if budget.Tokens() != 0 {
		t.Errorf("Tokens() = %v, want 0", budget.Tokens())
	}

	// The budget is shared: another Transport with it cannot retry at all.
	other := budgetTransport(t, budget)
	_, err = post(t, other, context.Background(), srv.URL, `{}`)
	if !errors.As(err, &rerr) || !errors.Is(err, ErrBudgetExhausted) || rerr.Attempts != 1 {
		t.Errorf("err = %v, want a RetryError with ErrBudgetExhausted after 1 attempt", err)
	}
	if n := len(rec.requests()); n != 4 {
		t.Errorf("server saw %d requests in all, want 4", n)
	}
}

func TestTransportRetryBudgetEarnedBySuccess(t *testing.T) {
	rec := &recorder{script: []int{503, 201}}
	srv := newServer(t, rec)
	budget := NewRetryBudget(1, 0.5)
	tr := budgetTransport(t, budget)

	resp, err := post(t, tr, context.Background(), srv.URL, `{}`)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	// One retry spent, one success earned half a token back.
	if got := budget.Tokens(); got != 0.5 {
		t.Errorf("Tokens() = %v, want 0.5", got)
	}
}

func TestTransportConflictPollsDoNotSpendBudget(t *testing.T) {
	rec := &recorder{script: []int{409, 409, 409, 409, 409, 201}, headers: map[string]string{"Retry-After": "0"}}
	srv := newServer(t, rec)
	budget := NewRetryBudget(1, 0.1)
	resp, err := post(t, budgetTransport(t, budget), context.Background(), srv.URL, `{}`)
	if err != nil {
		t.Fatalf("err = %v, want 201 after five 409s with a budget of one retry", err)
	}
	readAll(t, resp)
	if resp.StatusCode != 201 || len(rec.requests()) != 6 {
		t.Errorf("status %d after %d requests, want 201 after 6", resp.StatusCode, len(rec.requests()))
	}
	if got := budget.Tokens(); got != 1 {
		t.Errorf("Tokens() = %v, want the full budget of 1", got)
	}
}

func TestTransportDisableBudget(t *testing.T) {
	rec := &recorder{script: []int{503}}
	srv := newServer(t, rec)
	budget := NewRetryBudget(1, 0.1)
	budget.spend() // empty: it would refuse every retry
	tr := budgetTransport(t, budget)
	tr.DisableBudget = true
	resp, err := post(t, tr, context.Background(), srv.URL, `{}`)
	if err != nil {
		t.Fatalf("err = %v, want the last 503", err)
	}
	if resp.StatusCode != http.StatusServiceUnavailable || readAll(t, resp) != `{"attempt":4}` {
		t.Errorf("got %d, want the fourth 503", resp.StatusCode)
	}
	if n := len(rec.requests()); n != 4 {
		t.Errorf("server saw %d requests, want all 4 attempts", n)
	}
	if got := budget.Tokens(); got != 0 {
		t.Errorf("Tokens() = %v: a disabled budget must not be touched", got)
	}
}

func TestTransportDefaultBudgetIsPerTransport(t *testing.T) {
	rec := &recorder{script: []int{503}}
	srv := newServer(t, rec)
	tr := newTransport(t, RetryPolicy{MaxAttempts: 2, InitialInterval: time.Microsecond, MaxInterval: time.Microsecond})
	// The default budget allows DefaultBudgetCapacity retries in a row.
	for i := range DefaultBudgetCapacity + 1 {
		resp, err := post(t, tr, context.Background(), srv.URL, `{}`)
		if i < DefaultBudgetCapacity {
			if err != nil {
				t.Fatalf("operation %d: %v, want the last 503", i+1, err)
			}
			readAll(t, resp)
			continue
		}
		if !errors.Is(err, ErrBudgetExhausted) {
			t.Fatalf("operation %d: err = %v, want ErrBudgetExhausted", i+1, err)
		}
	}
	// A new Transport has a budget of its own.
	resp, err := post(t, newTransport(t, RetryPolicy{MaxAttempts: 2, InitialInterval: time.Microsecond}), context.Background(), srv.URL, `{}`)
	if err != nil {
		t.Fatalf("a fresh Transport: %v, want its own full budget", err)
	}
	readAll(t, resp)
}

// TestNewRetryBudgetExtremes checks that capacities and ratios at or past
// the edges of their types saturate instead of overflowing, and that a
// small ratio is kept, not rounded up.
func TestNewRetryBudgetExtremes(t *testing.T) {
	t.Run("largest capacity", func(t *testing.T) {
		b := NewRetryBudget(math.MaxInt, 0)
		full := b.Tokens()
		assert.GreaterOrEqual(t, full, 1e12, "saturated, not wrapped")
		require.True(t, b.spend(), "a full budget must allow a retry")
		assert.Equal(t, full-1, b.Tokens())
		b.succeed()
		assert.InDelta(t, full-1+DefaultBudgetRatio, b.Tokens(), 1e-3)
	})
	for _, ratio := range []float64{math.Inf(1), 1e30, math.MaxFloat64, 1e6} {
		b := NewRetryBudget(3, ratio)
		require.True(t, b.spend())
		require.True(t, b.spend())
		b.succeed()
		assert.Equal(t, 3.0, b.Tokens(), "ratio %v: a success refills the budget, no further", ratio)
		b.succeed()
		assert.Equal(t, 3.0, b.Tokens(), "ratio %v", ratio)
	}
	t.Run("largest capacity and ratio", func(t *testing.T) {
		b := NewRetryBudget(math.MaxInt, math.Inf(1))
		require.True(t, b.spend())
		b.succeed()
		b.succeed()
		assert.Equal(t, NewRetryBudget(math.MaxInt, 0).Tokens(), b.Tokens())
	})
	t.Run("NaN ratio takes the default", func(t *testing.T) {
		b := NewRetryBudget(3, math.NaN())
		require.True(t, b.spend())
		b.succeed()
		assert.Equal(t, 2+DefaultBudgetRatio, b.Tokens())
	})
	t.Run("small ratio", func(t *testing.T) {
		b := NewRetryBudget(1, 0.0001)
		require.True(t, b.spend())
		b.succeed()
		assert.Equal(t, 0.0001, b.Tokens())
		for range 9999 {
			b.succeed()
		}
		assert.Equal(t, 1.0, b.Tokens(), "ten thousand successes earn one retry")
	})
}
