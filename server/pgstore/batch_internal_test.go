package pgstore

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
)

// gate is a pgx tracer that holds the first batch of claims until open is
// closed; arrived is closed when it is held. It counts the batches of
// claims.
type gate struct {
	once          sync.Once
	arrived, open chan struct{}

	mu      sync.Mutex
	batches int
}

func (g *gate) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	for _, q := range data.Batch.QueuedQueries {
		if strings.Contains(q.SQL, "FROM unnest(") { // batchClaimSQL
			g.mu.Lock()
			g.batches++
			g.mu.Unlock()
			g.once.Do(func() {
				close(g.arrived)
				<-g.open
			})
		}
	}
	return ctx
}
func (g *gate) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (g *gate) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData)     {}
func (g *gate) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (g *gate) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// TestBatchClaimsGathered holds a first batch of claims in flight while
// more callers arrive: they are gathered into one next batch, one
// statement for all of them, whatever they hold. Of two callers of one new
// key in that batch, exactly one gets Claimed, the other (claimSQL's
// answer) Exists; the other new keys are claimed by the batch alone.
func TestBatchClaimsGathered(t *testing.T) {
	ctx := context.Background()
	g := &gate{arrived: make(chan struct{}), open: make(chan struct{})}
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 4
		cfg.ConnConfig.Tracer = g
	})
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	s := New(pool)
	s.BatchClaims = true
	claim := func(key string) idempotency.ClaimRequest {
		return idempotency.ClaimRequest{ClientID: "cli", Key: key, Method: "POST", Path: "/v1/orders",
			Fingerprint: []byte("a"), FingerprintVersion: 1, LockTimeout: time.Minute}
	}

	keys := []string{"first", "twice", "twice", "k1", "k2", "k3"}
	results := make([]idempotency.ClaimResult, len(keys))
	errs := make([]error, len(keys))
	var wg sync.WaitGroup
	run := func(i int) {
		wg.Go(func() { results[i], errs[i] = s.Claim(ctx, claim(keys[i])) })
	}
	var opened sync.Once
	open := func() { opened.Do(func() { close(g.open) }) }
	defer func() { open(); wg.Wait() }() // nothing left hanging when the test fails
	run(0)
	<-g.arrived // the first batch is held in flight
	for i := 1; i < len(keys); i++ {
		run(i)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		s.claims.mu.Lock()
		queued := len(s.claims.queue)
		s.claims.mu.Unlock()
		if queued == len(keys)-1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d claims queued, want %d", queued, len(keys)-1)
		}
	}
	open()
	wg.Wait()

	outcomes := make(map[string][]idempotency.Outcome)
	for i, r := range results {
		if errs[i] != nil {
			t.Fatalf("Claim(%s): %v", keys[i], errs[i])
		}
		outcomes[keys[i]] = append(outcomes[keys[i]], r.Outcome)
	}
	for _, k := range []string{"first", "k1", "k2", "k3"} {
		if got := outcomes[k]; len(got) != 1 || got[0] != idempotency.Claimed {
			t.Errorf("%s: %v, want claimed", k, got)
		}
	}
	if got := outcomes["twice"]; len(got) != 2 || got[0] == got[1] ||
		(got[0] != idempotency.Claimed && got[1] != idempotency.Claimed) ||
		(got[0] != idempotency.Exists && got[1] != idempotency.Exists) {
		t.Errorf("the key twice in one batch: %v, want claimed once and exists once", got)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.batches != 2 {
		t.Errorf("%d batches of claims, want 2: the first, then all the others", g.batches)
	}
}
