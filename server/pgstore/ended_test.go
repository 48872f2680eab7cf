package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// commitRewriter is a pgx.QueryRewriter that sends COMMIT instead of its
// statement: a driver feature that ends the transaction behind any check
// of the SQL text.
type commitRewriter struct{}

func (commitRewriter) RewriteQuery(context.Context, *pgx.Conn, string, []any) (string, []any, error) {
	return "COMMIT", nil, nil
}

// TestHandlerEndsTransaction ends the request's transaction from the
// handler in every way there is (pgx's Commit and Rollback, COMMIT,
// ROLLBACK, COMMIT AND CHAIN and PREPARE TRANSACTION as SQL, on the
// transaction or its Conn, a COMMIT hidden from any SQL reader by
// standard_conforming_strings, a query rewriter, a DO block, a COMMIT
// followed by a transaction of the handler's own that fails), writing
// before and after, and answering a success or a server error. The store
// does not police the SQL; it checks at the end, and fails closed: a
// transaction that is no longer the one it began, or no longer open,
// completes the key with idempotency.UnitEndedResponse, and the retry gets
// that 500 replayed without running again. Whatever happens, no row is
// committed twice, and a retry never runs a request whose writes may have
// committed.
func TestHandlerEndsTransaction(t *testing.T) {
	for _, oneTx := range []bool{false, true} {
		testHandlerEndsTransaction(t, oneTx)
	}
}

func testHandlerEndsTransaction(t *testing.T, oneTx bool) {
	for _, tt := range []struct {
		name   string
		end    func(ctx context.Context, tx pgx.Tx) error
		status int
		ended  bool // the transaction's writes may have committed: fail closed
	}{
		{"pgx Commit", func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) }, 201, true},
		{"pgx Commit, then a 500", func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) }, 500, true},
		{"pgx Rollback, then a write on the Conn", func(ctx context.Context, tx pgx.Tx) error {
			if err := tx.Rollback(ctx); err != nil {
				return err
			}
			_, err := tx.Conn().Exec(ctx, `INSERT INTO writes (name) VALUES ($1)`, "autocommitted")
			return err
		}, 201, true},
		{"COMMIT", endWith("COMMIT"), 201, true},
		{"COMMIT, then a 503", endWith("COMMIT"), 503, true},
		{"ROLLBACK, then a write", endWith("ROLLBACK"), 201, true},
		{"END", endWith("END"), 201, true},
		{"COMMIT AND CHAIN", endWith("COMMIT AND CHAIN"), 201, true},
		{"COMMIT AND CHAIN, then a 500", endWith("COMMIT AND CHAIN"), 500, true},
		{"ROLLBACK AND CHAIN", endWith("ROLLBACK AND CHAIN"), 201, true},
		{"COMMIT on the Conn", func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Conn().Exec(ctx, "COMMIT")
			return err
		}, 201, true},
		{"COMMIT hidden by standard_conforming_strings", func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL standard_conforming_strings = off`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `SELECT '\' '; COMMIT; -- '`)
			return err
		}, 201, true},
		{"COMMIT hidden by a unicode-escaped SET", func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL U&"standard\005fconforming\005fstrings" = off`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `SELECT '\' '; COMMIT; -- '`)
			return err
		}, 201, true},
		{"a query rewriter", func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "SELECT 1", commitRewriter{})
			return err
		}, 201, true},
		{"COMMIT, then a failing transaction of its own", func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "COMMIT; BEGIN; SELECT 1/0")
			_ = err // the division fails, leaving the handler's own transaction aborted
			return nil
		}, 201, true},
		{"rows left open, the transaction not ended", func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Query(ctx, "SELECT 1")
			return err
		}, 201, false},
		{"COMMIT, then rows left open", func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
				return err
			}
			_, err := tx.Query(ctx, "SELECT 1") // never closed: the connection stays busy
			return err
		}, 201, true},
		{"COMMIT AND CHAIN, then rows left open and a 500", func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "COMMIT AND CHAIN"); err != nil {
				return err
			}
			_, err := tx.Query(ctx, "SELECT 1")
			return err
		}, 500, true},
		{"PREPARE TRANSACTION", endWith("PREPARE TRANSACTION 'idem_ended_test'"), 201, false},
		{"a DO block that commits", endWith("DO $$ BEGIN COMMIT; END $$"), 201, false},
	} {
		t.Run(fmt.Sprintf("onetx=%v/%s", oneTx, tt.name), func(t *testing.T) {
			ctx := context.Background()
			runs := 0
			var s *service
			s = newService(t, idempotency.Options{OneTransaction: oneTx}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
				runs++
				if err := insert(r.Context(), tx, s.row(r, "before")); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				_ = tt.end(r.Context(), tx) // an error too leaves the transaction as it is
				_ = insert(r.Context(), tx, s.row(r, "after"))
				w.WriteHeader(tt.status)
			})
			t.Cleanup(func() { // a prepared transaction outlives its session
				_, _ = s.pool.Exec(ctx, `ROLLBACK PREPARED 'idem_ended_test'`)
			})
			status, p := s.send("k")
			require.Nil(t, p)
			first := s.committed(t, "k")
			if tt.ended {
				assert.Equal(t, http.StatusInternalServerError, status, "the answer to a request whose handler ended its transaction")
			}
			again, body, replayed := s.sendAgain(t, "k")
			switch {
			case tt.ended || status == http.StatusInternalServerError && replayed:
				assert.Equal(t, http.StatusInternalServerError, again, "the retry")
				assert.True(t, replayed, "the retry is a replay of the stored 500")
				assert.Contains(t, body, "ended the transaction", "the replayed problem")
				assert.Equal(t, 1, runs, "the handler ran again under a key whose writes may have committed")
				assert.Equal(t, first, s.committed(t, "k"), "rows after the retry")
			default:
				// Nothing of the first committed: the retry may run.
				assert.Empty(t, first, "rows of a request whose transaction did not commit")
			}
			for _, label := range s.committed(t, "k") {
				assert.NotEqual(t, 2, strings.Count(strings.Join(s.committed(t, "k"), ","), label), "row %s committed twice", label)
			}
		})
	}
}

// endWith ends a transaction with sql.
func endWith(sql string) func(ctx context.Context, tx pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, sql)
		return err
	}
}

// sendAgain sends key again and returns the status, the body and whether
// it was a replay.
func (s *service) sendAgain(t *testing.T, key string) (status int, body string, replayed bool) {
	t.Helper()
	r := httptest.NewRequestWithContext(idempotency.WithClientID(context.Background(), "cli_a"),
		"POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
	r.Header.Set("Idempotency-Key", key)
	rec := httptest.NewRecorder()
	s.h.ServeHTTP(rec, r)
	return rec.Code, rec.Body.String(), rec.Header().Get("Idempotent-Replayed") == "true"
}

// TestDuplicateWhileHandlerEndedTransactionDoesNotRun holds a handler
// after it wrote a row and committed the key's transaction itself, and
// sends a duplicate meanwhile: the duplicate gets 409 without running (the
// key's hold outlives the handler's COMMIT, in one transaction too), the
// held request ends as the store fails it closed, and the key's row was
// written once.
func TestDuplicateWhileHandlerEndedTransactionDoesNotRun(t *testing.T) {
	for _, oneTx := range []bool{false, true} {
		t.Run(fmt.Sprintf("onetx=%v", oneTx), func(t *testing.T) {
			g := newGate()
			defer g.Open()
			var runs atomic.Int32
			var s *service
			s = newService(t, idempotency.Options{OneTransaction: oneTx}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
				if runs.Add(1) > 1 {
					w.WriteHeader(http.StatusCreated)
					return
				}
				if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				_, _ = tx.Exec(r.Context(), "COMMIT")
				close(g.entered)
				<-g.open
				w.WriteHeader(http.StatusCreated)
			})
			first := make(chan int, 1)
			go func() {
				status, _ := s.send("k")
				first <- status
			}()
			<-g.entered
			status, _ := s.send("k")
			assert.Equal(t, http.StatusConflict, status, "a duplicate while the first request runs")
			assert.Equal(t, int32(1), runs.Load(), "handler runs")
			g.Open()
			assert.Equal(t, http.StatusInternalServerError, <-first, "the request whose handler ended its transaction")
			again, _, replayed := s.sendAgain(t, "k")
			assert.Equal(t, http.StatusInternalServerError, again, "the retry")
			assert.True(t, replayed, "the retry replays the stored 500")
			assert.Equal(t, int32(1), runs.Load(), "handler runs")
			assert.Equal(t, []string{"a"}, s.committed(t, "k"), "rows of the key")
		})
	}
}

// TestRequestWhoseHandlerRolledBackDoesNotWaitOnDuplicate holds, in one
// transaction, a handler that wrote a row and rolled back the key's
// transaction itself, which takes the key's row and its hold with it; a
// duplicate then claims the key and is held in its handler, its row
// uncommitted. The first request, let go, is answered at once (the store
// fails it closed, finds the key the duplicate's, and answers 409), never waiting on
// the duplicate's uncommitted row, however long that runs; the duplicate
// commits its row and its key, which the retry replays.
func TestRequestWhoseHandlerRolledBackDoesNotWaitOnDuplicate(t *testing.T) {
	ga, gb := newGate(), newGate()
	defer ga.Open()
	defer gb.Open()
	var runs atomic.Int32
	var s *service
	s = newService(t, idempotency.Options{OneTransaction: true}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		g, label := gb, "b"
		if runs.Add(1) == 1 {
			g, label = ga, "a"
		}
		if err := insert(r.Context(), tx, s.row(r, label)); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if label == "a" {
			_, _ = tx.Exec(r.Context(), "ROLLBACK")
		}
		close(g.entered)
		<-g.open
		w.WriteHeader(http.StatusCreated)
	})
	first, second := make(chan int, 1), make(chan int, 1)
	var firstBody string
	go func() {
		status, body, _ := s.sendAgain(t, "k")
		firstBody = body
		first <- status
	}()
	<-ga.entered
	go func() {
		status, _ := s.send("k")
		second <- status
	}()
	<-gb.entered // the duplicate runs: the first request's hold went with its rollback

	count := func(q string, n *int) error { return s.pool.QueryRow(context.Background(), q).Scan(n) }
	waiting, stop := pgtest.WatchLockWait(count, 1, "true")
	defer stop()
	ga.Open()
	select {
	case status := <-first:
		// Fenced: the key is the duplicate's, whose outcome a retry gets.
		assert.Equal(t, http.StatusConflict, status, "the request whose handler ended its transaction")
		assert.Contains(t, firstBody, "handler ended the transaction", "the problem of that request")
	case <-waiting:
		t.Error("the first request waits on the duplicate's uncommitted row")
		gb.Open()
		<-first
	}
	gb.Open()
	assert.Equal(t, http.StatusCreated, <-second, "the duplicate")
	again, _, replayed := s.sendAgain(t, "k")
	assert.Equal(t, http.StatusCreated, again, "the retry")
	assert.True(t, replayed, "the retry replays the duplicate's outcome")
	assert.Equal(t, int32(2), runs.Load(), "handler runs")
	assert.Equal(t, []string{"b"}, s.committed(t, "k"), "rows of the key")
}

// TestPreparedTransactionFailsClosed ends the key's transaction with
// PREPARE TRANSACTION on a server that allows it (max_prepared_transactions
// above 0, which TestHandlerEndsTransaction's server has not): the
// handler's writes then commit whenever an operator commits the prepared
// transaction. The key never runs again, before that COMMIT PREPARED or
// after it, and the rows are committed once.
func TestPreparedTransactionFailsClosed(t *testing.T) {
	url := pgtest.ClusterURL(t, "max_prepared_transactions=2")
	for _, oneTx := range []bool{false, true} {
		t.Run(fmt.Sprintf("onetx=%v", oneTx), func(t *testing.T) {
			ctx := context.Background()
			gid := fmt.Sprintf("idem_prepared_%v", oneTx)
			runs := 0
			var s *service
			s = newService(t, idempotency.Options{OneTransaction: oneTx}, onCluster(t, url), func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
				runs++
				if err := insert(r.Context(), tx, s.row(r, "before")); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if _, err := tx.Exec(r.Context(), "PREPARE TRANSACTION '"+gid+"'"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})
			t.Cleanup(func() { _, _ = s.pool.Exec(ctx, "ROLLBACK PREPARED '"+gid+"'") })

			// With two commits the key is completed with the stored 500
			// at once; in one transaction the prepared transaction holds
			// the key's row and lock, so the key is 409 (busy), and stays
			// so once committed: started, without a lease, never taken over.
			want := http.StatusInternalServerError
			if oneTx {
				want = http.StatusConflict
			}
			status, p := s.send("k")
			require.Nil(t, p)
			assert.Equal(t, want, status, "the answer to a request whose handler prepared its transaction")
			var prepared int
			require.NoError(t, s.pool.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_xacts WHERE gid = $1`, gid).Scan(&prepared))
			require.Equal(t, 1, prepared, "the handler's transaction is prepared")

			again, _, _ := s.sendAgain(t, "k")
			assert.Equal(t, want, again, "a retry while the transaction is prepared")
			assert.Equal(t, 1, runs, "the handler ran again while its prepared writes may still commit")

			_, err := s.pool.Exec(ctx, "COMMIT PREPARED '"+gid+"'")
			require.NoError(t, err)
			again, _, _ = s.sendAgain(t, "k")
			assert.Equal(t, want, again, "a retry once the prepared transaction committed")
			assert.Equal(t, 1, runs, "the handler ran again after its writes committed")
			assert.Equal(t, []string{"before"}, s.committed(t, "k"), "rows committed")
		})
	}
}

// onCluster points a test pool's connections at the cluster of url, in a
// schema of the pool's name (its search_path), created there.
func onCluster(t *testing.T, url string) func(*pgxpool.Config) {
	return func(cfg *pgxpool.Config) {
		ctx := context.Background()
		c, err := pgx.ParseConfig(url)
		require.NoError(t, err)
		conn, err := pgx.ConnectConfig(ctx, c)
		require.NoError(t, err)
		defer conn.Close(ctx)
		schema := cfg.ConnConfig.RuntimeParams["search_path"]
		_, err = conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize())
		require.NoError(t, err)
		cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database = c.Host, c.Port, c.Database
		cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = c.TLSConfig, c.Fallbacks
	}
}

// TestCompletionChecksItsTransactionFirst: a handler commits the
// transaction it was given and begins another at REPEATABLE READ, and a
// renewal then updates the key's row. The completion must fail on the
// transaction's ID before its UPDATE runs (which would fail otherwise,
// with a serialization failure the store does not read as the handler's
// end): the key fails closed, and a retry is answered, never run again.
func TestCompletionChecksItsTransactionFirst(t *testing.T) {
	ctx := context.Background()
	s, _ := newStore(t, nil)
	r := leased(req("key-chained", "a"), time.Minute, time.Hour)
	c := mustClaim(t, s, r, idempotency.Claimed).Claim
	tx, hctx := unitOf(t, s, c)
	ptx, err := pgstore.Tx(hctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ptx.Exec(hctx, `COMMIT; BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1`); err != nil {
		t.Fatal(err)
	}
	if err := s.Renew(ctx, c); err != nil {
		t.Fatalf("Renew: %v", err)
	}
	if err := tx.Complete(ctx, created("1")); !errors.Is(err, idempotency.ErrUnitEnded) {
		t.Fatalf("Complete = %v; want ErrUnitEnded (the key failed closed)", err)
	}
	if res := mustClaim(t, s, r, idempotency.Exists); res.Record.Response == nil || res.Record.Response.Status != 500 {
		t.Errorf("the retry's claim: %+v; want the stored 500", res.Record)
	}
}
