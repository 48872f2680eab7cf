package sqlstore_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
	"github.com/idemkit/idem/server/sqlstore/internal/sqlstoretest"
)

// statements counts the statements pgx sends; on database/sql each is a
// round trip of its own.
type statements struct{ n atomic.Int64 }

func (s *statements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	s.n.Add(1)
	return ctx
}

func (*statements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestRetryReplayIsOneStatement: a retry (its first-sent time a while ago)
// of a completed key is answered with one statement, in both modes; a
// first attempt's claim of a new key is one statement too.
func TestRetryReplayIsOneStatement(t *testing.T) {
	ctx := context.Background()
	_, url := sqlstoretest.OpenURL(t, "pgx")
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	count := &statements{}
	cfg.Tracer = count
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { db.Close() })
	s := sqlstore.New(db)
	sent := time.Now().Add(-time.Minute).Truncate(time.Second)
	for _, mode := range []struct {
		name  string
		claim func(idempotency.ClaimRequest) (idempotency.ClaimResult, error)
	}{
		{"two commits", func(r idempotency.ClaimRequest) (idempotency.ClaimResult, error) { return s.Claim(ctx, r) }},
		{"one transaction", func(r idempotency.ClaimRequest) (idempotency.ClaimResult, error) { return s.ClaimInTx(ctx, r) }},
	} {
		req := idempotency.ClaimRequest{ClientID: "c", Key: "retry-" + mode.name, Method: "POST", Path: "/v1/orders",
			Fingerprint: []byte("fp"), LockTimeout: time.Minute, Retention: time.Hour}
		res, err := mode.claim(req)
		if err != nil || res.Outcome != idempotency.Claimed {
			t.Fatalf("%s: claim: %v, %v; want Claimed", mode.name, res.Outcome, err)
		}
		tx, err := s.Begin(ctx, res.Claim)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Complete(ctx, idempotency.StoredResponse{Status: 201, Body: []byte("{}")}); err != nil {
			t.Fatal(err)
		}
		retry := req
		retry.FirstSent.Sent = sent
		before := count.n.Load()
		res, err = mode.claim(retry)
		if err != nil || res.Outcome != idempotency.Exists || res.Record.Status != idempotency.StatusCompleted {
			t.Fatalf("%s: retry: %v, %v; want Exists, completed", mode.name, res.Outcome, err)
		}
		if n := count.n.Load() - before; n != 1 {
			t.Errorf("%s: a retry's replay took %d statements, want 1", mode.name, n)
		}
	}
	before := count.n.Load()
	res, err := s.Claim(ctx, idempotency.ClaimRequest{ClientID: "c", Key: "new", Method: "POST", Path: "/v1/orders",
		Fingerprint: []byte("fp"), LockTimeout: time.Minute, Retention: time.Hour})
	if err != nil || res.Outcome != idempotency.Claimed {
		t.Fatalf("new key: %v, %v; want Claimed", res.Outcome, err)
	}
	if n := count.n.Load() - before; n != 1 {
		t.Errorf("a first attempt's claim of a new key took %d statements, want 1", n)
	}
}
