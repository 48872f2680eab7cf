package idempotency_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/testhooks"
)

func leave(context.Context, idempotency.KeyInfo) (idempotency.Settlement, error) {
	return idempotency.Settlement{}, nil
}

// TestSweeperRefuses: a Sweeper that cannot run says why at once, from Run
// and from Sweep: no Store or Settle, a negative setting, a store without
// Sweepable.
func TestSweeperRefuses(t *testing.T) {
	store := idempotency.NewMemoryStore()
	for _, tt := range []struct {
		name string
		s    idempotency.Sweeper
		want error
	}{
		{"no store", idempotency.Sweeper{Settle: leave}, nil},
		{"no hook", idempotency.Sweeper{Store: store}, nil},
		{"negative grace", idempotency.Sweeper{Store: store, Settle: leave, Grace: -1}, nil},
		{"negative batch", idempotency.Sweeper{Store: store, Settle: leave, Batch: -1}, nil},
		{"not sweepable", idempotency.Sweeper{Store: plainStore{store}, Settle: leave}, idempotency.ErrNotSweepable},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			err := tt.s.Run(ctx)
			if err == nil || (tt.want != nil && !errors.Is(err, tt.want)) {
				t.Errorf("Run = %v, want an error (%v)", err, tt.want)
			}
			if _, err := tt.s.Sweep(ctx); err == nil {
				t.Error("Sweep succeeded")
			}
		})
	}
}

// TestSweeperRun: Run sweeps at once and at every interval, reports its
// events, and returns nil when its context ends.
func TestSweeperRun(t *testing.T) {
	store := idempotency.NewMemoryStore()
	owner := claimKey(t, store, "k", time.Minute)
	var ev events
	s := &idempotency.Sweeper{
		Store:    store,
		Grace:    time.Minute,
		Interval: 5 * time.Millisecond,
		Logger:   slog.New(slog.DiscardHandler),
		OnEvent:  ev.add,
		Settle: func(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
			return idempotency.Settlement{Response: &idempotency.StoredResponse{Status: 201}}, nil
		},
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- s.Run(ctx) }()
	testhooks.ElapseMemoryStore(store, 3*time.Minute) // the lease and the grace run out
	for {
		k, err := store.Lookup(context.Background(), "c", "k", false)
		if err != nil {
			t.Fatal(err)
		}
		if k.Status == idempotency.StatusCompleted {
			break
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v after its context ended, want nil", err)
	}
	if got := ev.list(); len(got) != 2 || got[0] != idempotency.EventSwept || got[1] != idempotency.EventSettled {
		t.Errorf("events %v, want [swept settled]", got)
	}
	if err := store.Renew(context.Background(), owner); !errors.Is(err, idempotency.ErrFenced) {
		t.Errorf("the dead owner's renewal after the sweep: %v, want ErrFenced", err)
	}
}

// TestSweeperThroughSealed: a store wrapped by Sealed is still Sweepable
// and an Inspector, and a settlement made through it is sealed at rest,
// like a handler's outcome, and opens for the replay.
func TestSweeperThroughSealed(t *testing.T) {
	store := idempotency.NewMemoryStore()
	secret := make([]byte, 32)
	keys, err := idempotency.NewSealKeys(idempotency.SealKey{ID: "k1", Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	sealed := idempotency.Sealed(store, keys)
	if _, ok := sealed.(idempotency.Sweepable); !ok {
		t.Fatal("Sealed(MemoryStore) is not Sweepable")
	}
	if _, ok := sealed.(idempotency.Inspector); !ok {
		t.Fatal("Sealed(MemoryStore) is not an Inspector")
	}
	claimKey(t, store, "k", time.Minute)
	testhooks.ElapseMemoryStore(store, 3*time.Minute) // the lease and the grace ran out
	s := &idempotency.Sweeper{
		Store:  sealed,
		Grace:  time.Minute,
		Logger: slog.New(slog.DiscardHandler),
		Settle: func(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
			return idempotency.Settlement{Response: &idempotency.StoredResponse{Status: 201, ContentType: "application/json", Body: []byte(`{"id":"pay_1"}`)}}, nil
		},
	}
	if res, err := s.Sweep(context.Background()); err != nil || res.Completed != 1 {
		t.Fatalf("Sweep = %+v, %v; want one completed", res, err)
	}
	req := idempotency.ClaimRequest{ClientID: "c", Key: "k", Method: "POST", Path: "/other", Fingerprint: []byte("other")}
	raw, err := store.Claim(context.Background(), req)
	if err != nil || raw.Record == nil || raw.Record.Response == nil {
		t.Fatalf("raw record: %+v, %v", raw, err)
	}
	if !strings.HasPrefix(raw.Record.Response.ContentType, idempotency.SealedMediaType) {
		t.Errorf("the settlement is stored in the clear: %q", raw.Record.Response.Body)
	}
	opened, err := sealed.Claim(context.Background(), req)
	if err != nil || opened.Record == nil || string(opened.Record.Response.Body) != `{"id":"pay_1"}` {
		t.Errorf("through Sealed: %+v, %v; want the settlement opened", opened.Record, err)
	}
}
