package storetest

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
)

// testCompleteStatusRange completes keys with the edges of the status
// range: every store keeps 100 to 599, the HTTP status codes, and refuses
// any other with an error wrapping ErrInvalidStatus, committing nothing of
// the unit of work and leaving the key started.
func testCompleteStatusRange(t *testing.T, b Backend) {
	ctx := context.Background()
	for _, st := range []int{100, 200, 599} {
		key := fmt.Sprintf("kept-%d", st)
		req := request("cli_a", key, "a")
		c := claim(t, b.Store, req, idempotency.Claimed).Claim
		resp := idempotency.StoredResponse{Status: st, ContentType: "text/plain", Body: []byte("x")}
		if err := complete(t, b, c, resp, key+"-w"); err != nil {
			t.Fatalf("Complete with status %d: %v, want it stored", st, err)
		}
		mustBeWritten(t, b, key+"-w", true)
		if rec := claim(t, b.Store, req, idempotency.Exists).Record; rec.Response == nil || rec.Response.Status != st {
			t.Errorf("replay of status %d: %+v", st, rec.Response)
		}
	}
	for _, st := range []int{0, 99, 600, 999, 1000, -1} {
		key := fmt.Sprintf("refused-%d", st)
		req := request("cli_a", key, "a")
		c := claim(t, b.Store, req, idempotency.Claimed).Claim
		tx, wctx := begin(t, b, c)
		if err := b.Write(wctx, key+"-w"); err != nil {
			t.Fatal(err)
		}
		resp := idempotency.StoredResponse{Status: st, ContentType: "text/plain", Body: []byte("x")}
		if err := tx.Complete(ctx, resp); !errors.Is(err, idempotency.ErrInvalidStatus) {
			t.Errorf("Complete with status %d: %v, want an error wrapping ErrInvalidStatus", st, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Errorf("Rollback after a refused Complete: %v", err)
		}
		mustBeWritten(t, b, key+"-w", false)
		if got := status(t, b.Store, req); got != idempotency.StatusStarted {
			t.Errorf("key of a completion with status %d: %q, want started", st, got)
		}
		release(t, b.Store, c, idempotency.ReleaseFailed)
	}
}

// testDoneContext calls Release, Complete and Renew with a context that is
// already done: each returns the context's error and changes nothing, so
// the key stays started and owned by its claim, which then releases it,
// renews it and completes it with live contexts.
func testDoneContext(t *testing.T, b Backend) {
	ctx := context.Background()
	done, cancel := context.WithCancel(ctx)
	cancel()

	req := withLockTimeout(request("cli_a", "key", "a"))
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	if err := b.Store.Release(done, c, idempotency.ReleaseRejected); !errors.Is(err, context.Canceled) {
		t.Errorf("Release with a done context: %v, want context.Canceled", err)
	}
	if got := status(t, b.Store, request("cli_a", "key", "other")); got != idempotency.StatusStarted {
		t.Errorf("after a Release with a done context: %q, want started", got)
	}
	if err := b.Store.Renew(done, c); !errors.Is(err, context.Canceled) {
		t.Errorf("Renew with a done context: %v, want context.Canceled", err)
	}

	tx, wctx := begin(t, b, c)
	if err := b.Write(wctx, "w"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(done, created("o1")); !errors.Is(err, context.Canceled) {
		t.Errorf("Complete with a done context: %v, want context.Canceled", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("Rollback after a refused Complete: %v", err)
	}
	mustBeWritten(t, b, "w", false)
	if got := status(t, b.Store, request("cli_a", "key", "other")); got != idempotency.StatusStarted {
		t.Errorf("after a Complete with a done context: %q, want started", got)
	}

	if err := b.Store.Renew(ctx, c); err != nil {
		t.Errorf("Renew after the calls with a done context: %v, want the key still owned", err)
	}
	if err := complete(t, b, c, created("o1"), "w2"); err != nil {
		t.Errorf("Complete after the calls with a done context: %v", err)
	}
	mustBeWritten(t, b, "w2", true)
}
