package pgstore_test

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
)

// The one-transaction mode (idempotency.Options.OneTransaction) through a
// real Middleware on a real Store and PostgreSQL.

// keyRows returns the status of each row of key in the key table.
func (s *service) keyRows(t *testing.T, key string) []string {
	t.Helper()
	rows, err := s.pool.Query(context.Background(),
		`SELECT status FROM idempotency_keys WHERE client_id = 'cli_a' AND idempotency_key = $1`, key)
	require.NoError(t, err)
	statuses, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return statuses
}

// gate holds the handler that enters it until it is opened.
type gate struct {
	entered chan struct{} // closed when the first handler enters
	open    chan struct{}
	once    sync.Once
}

func newGate() *gate { return &gate{entered: make(chan struct{}), open: make(chan struct{})} }

// Open lets the held handler go; a test defers it, so that no handler is
// left held whatever happened.
func (g *gate) Open() { g.once.Do(func() { close(g.open) }) }

// TestOneTransactionDuplicateAtOnce holds the first request of a key in its
// handler, after its write: its duplicates, with the same body and with
// another, get 409 at once, while it is held (no lock, no row to wait
// on), and nothing of it is visible, key included. Once it is let go it
// commits its row and its key in one commit; then the retry replays it
// and another body gets 422. Its claim is one with no lease (the
// middleware's own tests hold such a claim for many lock timeouts, on a
// fake clock, and see no renewal), and none is renewed while it is held.
func TestOneTransactionDuplicateAtOnce(t *testing.T) {
	g := newGate()
	defer g.Open()
	var renewed sync.Map
	var s *service
	s = newService(t, idempotency.Options{OneTransaction: true, LockTimeout: 30 * time.Millisecond,
		OnEvent: func(e idempotency.Event) { renewed.Store(e, true) }}, nil,
		func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
			claim, _ := idempotency.ClaimFromContext(r.Context())
			assert.True(t, claim.OneTransaction, "claim %+v, want one in one transaction", claim)
			if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			select {
			case <-g.entered:
			default:
				close(g.entered)
				<-g.open
			}
			w.WriteHeader(http.StatusCreated)
		})
	first := make(chan int, 1)
	go func() {
		status, _ := s.send("k1")
		first <- status
	}()
	<-g.entered
	for _, body := range []string{`{"item":"book"}`, `{"item":"pen"}`} {
		// Answered while the first is held, never once it is let go.
		dup := make(chan int, 1)
		go func() {
			status, _ := s.sendBody("k1", body)
			dup <- status
		}()
		select {
		case status := <-dup:
			require.Equal(t, http.StatusConflict, status, "duplicate %s while the first runs; logs:\n%s", body, s.logs.String())
		case <-time.After(30 * time.Second):
			g.Open()
			t.Fatalf("duplicate %s still waits for the first request after 30s", body)
		}
	}
	assert.Empty(t, s.keyRows(t, "k1"), "key rows while the first request runs")
	assert.Empty(t, s.committed(t, "k1"), "rows committed while the first request runs")
	g.Open()
	require.Equal(t, http.StatusCreated, <-first, s.logs.String())
	_, renewals := renewed.Load(idempotency.EventRenewed)
	assert.False(t, renewals, "a lease was renewed")

	assert.Equal(t, []string{"completed"}, s.keyRows(t, "k1"))
	s.mustMatch(t, "k1", http.StatusCreated, "a")
	s.mustReplay(t, "k1", http.StatusCreated, "a")
	status, _ := s.sendBody("k1", `{"item":"pen"}`)
	assert.Equal(t, http.StatusUnprocessableEntity, status)
	s.mustMatch(t, "k1", http.StatusCreated, "a")
}

// TestOneTransactionFailureLeavesNoKey fails the first request of a key
// after its write: a 500, a panic, its connection cut while the handler
// runs (as when the service crashes: PostgreSQL rolls its transaction
// back), and the handler's transaction's connection cut before a 201 it
// answers. Nothing is committed, key row included, and the retry runs at
// once, under a lock timeout of an hour that no takeover could have waited
// out, and commits its one row.
func TestOneTransactionFailureLeavesNoKey(t *testing.T) {
	for _, fail := range []string{"500", "panic", "connection cut, then a write", "connection cut, then 201"} {
		t.Run(fail, func(t *testing.T) {
			first := true
			var s *service
			s = newService(t, idempotency.Options{OneTransaction: true, LockTimeout: time.Hour}, nil,
				func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
					ctx := r.Context()
					if err := insert(ctx, tx, s.row(r, "a")); err != nil {
						http.Error(w, err.Error(), http.StatusInternalServerError)
						return
					}
					if !first {
						w.WriteHeader(http.StatusCreated)
						return
					}
					first = false
					switch fail {
					case "500":
						w.WriteHeader(http.StatusInternalServerError)
						return
					case "panic":
						panic("after the write")
					}
					var pid int32
					require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
					_, err := s.pool.Exec(ctx, `SELECT pg_terminate_backend($1, 10000)`, pid)
					require.NoError(t, err)
					if fail == "connection cut, then a write" {
						if err := insert(ctx, tx, s.row(r, "b")); err != nil {
							http.Error(w, err.Error(), http.StatusInternalServerError)
							return
						}
					}
					w.WriteHeader(http.StatusCreated)
				})
			status, p := s.send("k1")
			assert.Equal(t, fail == "panic", p != nil, "panic: %v", p)
			if p == nil {
				assert.Equal(t, http.StatusInternalServerError, status, s.logs.String())
			}
			assert.Empty(t, s.keyRows(t, "k1"), "key rows after the failure")
			s.mustMatch(t, "k1", status)

			status, p = s.send("k1")
			require.Nil(t, p)
			require.Equal(t, http.StatusCreated, status, s.logs.String())
			s.mustMatch(t, "k1", status, "a")
			s.mustReplay(t, "k1", http.StatusCreated, "a")
		})
	}
}

// trips counts the round trips of a pool's connections: each query and
// each batch (a pipeline) is one.
type trips struct{ n atomic.Int64 }

func (c *trips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *trips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *trips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *trips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *trips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// TestOneTransactionRoundTrips pins the round trips of a request in one
// transaction whose handler makes one write: a first execution costs three
// (the claim with the BEGIN, the write, the completion with the COMMIT),
// as in two commits, with one commit; a replay and a duplicate cost two
// (the claim with the BEGIN, and the ROLLBACK).
func TestOneTransactionRoundTrips(t *testing.T) {
	counter := &trips{}
	entered := make(chan struct{}, 1)
	g := newGate()
	defer g.Open()
	var s *service
	s = newService(t, idempotency.Options{OneTransaction: true}, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.Tracer = counter
		cfg.MaxConns = 2
	}, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if r.Header.Get("Idempotency-Key") == "held" {
			entered <- struct{}{}
			<-g.open
		}
		w.WriteHeader(http.StatusCreated)
	})
	for i, tt := range []struct {
		name string
		key  func(j int) string
		want int64
	}{
		{"first execution", func(j int) string { return fmt.Sprint("k", j) }, 3},
		{"replay", func(int) string { return "k0" }, 2},
	} {
		// The first send prepares the statements on the connections.
		for j := range 2 {
			before := counter.n.Load()
			status, _ := s.send(tt.key(j))
			require.Equal(t, http.StatusCreated, status, s.logs.String())
			if got := counter.n.Load() - before; j == 1 && got != tt.want {
				t.Errorf("%d: %s: %d round trips, want %d", i, tt.name, got, tt.want)
			}
		}
	}
	held := make(chan int, 1)
	go func() {
		status, _ := s.send("held")
		held <- status
	}()
	<-entered
	for j := range 2 {
		before := counter.n.Load()
		status, _ := s.send("held")
		require.Equal(t, http.StatusConflict, status, s.logs.String())
		if got := counter.n.Load() - before; j == 1 && got != 2 {
			t.Errorf("duplicate: %d round trips, want 2", got)
		}
	}
	g.Open()
	require.Equal(t, http.StatusCreated, <-held)
}

// TestOneTransactionDeferredConflictIsNotFenced: a deferred unique
// constraint of the handler's own table fails the COMMIT with the SQLSTATE
// of a fenced completion (unique_violation), but under another name: the
// request fails as its commit failed, not as a claim taken over, and
// nothing of it commits, key included.
func TestOneTransactionDeferredConflictIsNotFenced(t *testing.T) {
	var s *service
	s = newService(t, idempotency.Options{OneTransaction: true}, nil,
		func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
			if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if _, err := tx.Exec(r.Context(), `INSERT INTO deferred_dup VALUES (1), (1)`); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
	_, err := s.pool.Exec(context.Background(),
		`CREATE TABLE deferred_dup (v int, CONSTRAINT deferred_dup_v_key UNIQUE (v) DEFERRABLE INITIALLY DEFERRED)`)
	require.NoError(t, err)
	status, _ := s.send("k1")
	assert.Equal(t, http.StatusInternalServerError, status, s.logs.String())
	assert.NotContains(t, s.logs.String(), "fenced", "a failed COMMIT reported as a fenced claim")
	assert.Contains(t, s.logs.String(), "deferred_dup_v_key")
	assert.Empty(t, s.keyRows(t, "k1"), "key rows")
	s.mustMatch(t, "k1", status)
}
