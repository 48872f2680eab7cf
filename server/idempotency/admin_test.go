package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// plainStore is a Store of one's own that implements neither Inspector nor
// Sweepable.
type plainStore struct{ idempotency.Store }

// events records the events reported to an OnEvent.
type events struct {
	mu  sync.Mutex
	got []idempotency.Event
}

func (e *events) add(ev idempotency.Event) {
	e.mu.Lock()
	e.got = append(e.got, ev)
	e.mu.Unlock()
}

func (e *events) list() []idempotency.Event {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]idempotency.Event(nil), e.got...)
}

// claimKey claims key for client c with the given lease and no retention.
func claimKey(t *testing.T, s idempotency.Store, key string, lease time.Duration) idempotency.Claim {
	t.Helper()
	res, err := s.Claim(context.Background(), idempotency.ClaimRequest{
		ClientID: "c", Key: key, Method: "POST", Path: "/v1/orders",
		Fingerprint: []byte(key), LockTimeout: lease,
	})
	if err != nil || res.Outcome != idempotency.Claimed {
		t.Fatalf("Claim(%s) = %+v, %v", key, res, err)
	}
	return res.Claim
}

// TestAdmin: an operator's release and expiry need a reason, which is
// logged with the key and reported as an event; a refused or empty action
// is neither; a store without Inspector says so.
func TestAdmin(t *testing.T) {
	ctx := context.Background()
	store := idempotency.NewMemoryStore()
	var logs bytes.Buffer
	var ev events
	a := &idempotency.Admin{Store: store, Logger: slog.New(slog.NewTextHandler(&logs, nil)), OnEvent: ev.add}
	owner := claimKey(t, store, "k", time.Hour)

	if _, err := a.ForceRelease(ctx, "c", "k", "", true); err == nil {
		t.Error("ForceRelease without a reason succeeded")
	}
	if _, err := a.ForceRelease(ctx, "c", "k", "stuck", false); !errors.Is(err, idempotency.ErrKeyRunning) {
		t.Errorf("ForceRelease of a running key: %v, want ErrKeyRunning", err)
	}
	if err := store.Renew(ctx, owner); err != nil {
		t.Fatalf("the owner lost its key to refused actions: %v", err)
	}
	was, err := a.ForceRelease(ctx, "c", "k", "INC-42: the handler hangs", true)
	if err != nil || was.Status != idempotency.StatusStarted {
		t.Fatalf("ForceRelease: %+v, %v", was, err)
	}
	if _, err := a.ForceRelease(ctx, "c", "k", "again", false); err != nil {
		t.Errorf("ForceRelease of a released key: %v, want nil", err)
	}
	if _, err := a.Expire(ctx, "c", "k", "INC-42: the client wants a new operation", false); err != nil {
		t.Fatalf("Expire: %v", err)
	}
	if _, err := a.Lookup(ctx, "c", "k", false); err != nil {
		t.Errorf("Lookup of an expired key before the purge: %v", err)
	}
	want := []idempotency.Event{idempotency.EventForceReleased, idempotency.EventExpired}
	if got := ev.list(); len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("events %v, want %v", got, want)
	}
	out := logs.String()
	for _, s := range []string{"operator released a key", `reason="INC-42: the handler hangs"`, "running=true",
		"operator expired a key", `reason="INC-42: the client wants a new operation"`, "key=k", "client=c"} {
		if !strings.Contains(out, s) {
			t.Errorf("the log lacks %q:\n%s", s, out)
		}
	}
	if n := strings.Count(out, "level=WARN"); n != 2 {
		t.Errorf("%d log lines, want 2 (the refused and the empty actions log nothing):\n%s", n, out)
	}
	for e, name := range map[idempotency.Event]string{idempotency.EventSwept: "swept", idempotency.EventSettled: "settled",
		idempotency.EventForceReleased: "force_released", idempotency.EventExpired: "expired"} {
		if e.String() != name {
			t.Errorf("event %d is named %q, want %q", int(e), e, name)
		}
	}

	plain := &idempotency.Admin{Store: plainStore{store}}
	if _, err := plain.Lookup(ctx, "c", "k", false); !errors.Is(err, idempotency.ErrNotInspectable) {
		t.Errorf("Lookup on a store without Inspector: %v, want ErrNotInspectable", err)
	}
	if _, err := plain.Expire(ctx, "c", "k", "r", false); !errors.Is(err, idempotency.ErrNotInspectable) {
		t.Errorf("Expire on a store without Inspector: %v, want ErrNotInspectable", err)
	}
}
