package pgstore

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// gate is a pgx tracer that holds the first batched completion until
// open is closed; arrived is closed when it is held.
type gate struct {
	once          sync.Once
	arrived, open chan struct{}
}

func (g *gate) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.Contains(data.SQL, "WITH ORDINALITY AS c(client") { // batchCompleteSQL
		g.once.Do(func() {
			close(g.arrived)
			<-g.open
		})
	}
	return ctx
}
func (g *gate) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestPostgresBatchCompletionFallsBack completes three keys with
// BatchCompletions, the second and third in one batch whose payments share
// an ID: the batch fails as a whole, and the two are run again one at a
// time, so one completes with its payment and the other gets
// ErrDuplicatePayment and writes nothing, while the first, in a batch of
// its own, completes.
func TestPostgresBatchCompletionFallsBack(t *testing.T) {
	ctx := context.Background()
	g := &gate{arrived: make(chan struct{}), open: make(chan struct{})}
	pool := migratedTracedPool(t, g, 4)
	s := NewPostgresStore(pool)
	var err error
	s.BatchCompletions = true

	txs := make([]Tx, 3)
	claims := make([]Claim, 3)
	for i, id := range []string{"pay_1", "pay_dup", "pay_dup"} {
		key := string(rune('a' + i))
		claims[i] = mustClaim(t, s, claimReq("cli", key, key), Claimed).Claim
		if txs[i], err = s.Begin(ctx, claims[i]); err != nil {
			t.Fatal(err)
		}
		p := Payment{ID: id, ClientID: "cli", Customer: "cus_" + key, Amount: 100, Currency: "usd",
			IdempotencyKey: key, OperationID: claims[i].OperationID}
		if err := s.CreatePayment(ctx, txs[i], p); err != nil {
			t.Fatal(err)
		}
	}
	errs := make([]error, 3)
	var wg sync.WaitGroup
	complete := func(i int) {
		wg.Go(func() { errs[i] = txs[i].Complete(ctx, StoredResponse{Status: 201, Body: []byte(`{}`)}) })
	}
	complete(0)
	<-g.arrived // its batch waits at the gate
	waitQueued := func(n int) {
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			s.completions.mu.Lock()
			queued := len(s.completions.queue)
			s.completions.mu.Unlock()
			if queued == n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d completions queued, want %d", queued, n)
			}
		}
	}
	complete(1)
	complete(2)
	waitQueued(2) // the next batch: both
	close(g.open)
	wg.Wait()

	if errs[0] != nil {
		t.Errorf("completion in a batch of its own: %v", errs[0])
	}
	dup, ok := 0, 0
	for _, err := range errs[1:] {
		switch {
		case err == nil:
			ok++
		case errors.Is(err, ErrDuplicatePayment):
			dup++
		default:
			t.Errorf("completion of the failed batch: %v", err)
		}
	}
	if ok != 1 || dup != 1 {
		t.Fatalf("the failed batch's completions: %d succeeded, %d duplicates; want 1 and 1 (errors %v)", ok, dup, errs)
	}
	var completed, payments int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'completed') FROM idempotency_keys`).Scan(&completed); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM payments`).Scan(&payments); err != nil {
		t.Fatal(err)
	}
	if completed != 2 || payments != 2 {
		t.Errorf("%d keys completed, %d payments; want 2 and 2", completed, payments)
	}
}
