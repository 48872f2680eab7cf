package sqlstoretest

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
)

// testHandlerEndsTransaction ends the request's *sql.Tx from the handler
// in every way database/sql and SQL allow (its Commit and Rollback,
// COMMIT, END, ROLLBACK, COMMIT AND CHAIN, a COMMIT hidden by
// standard_conforming_strings, COMMIT then a failing transaction of the
// handler's own, PREPARE TRANSACTION, a DO block), writing before and
// after, answering a success or a server error, in two commits and in one
// transaction. The store polices no SQL; it checks at the end and fails
// closed: the key is completed with idempotency.UnitEndedResponse, the
// retry gets it replayed without running again, and no row is committed
// twice.
func testHandlerEndsTransaction(t *testing.T, driver string) {
	for _, oneTx := range []bool{false, true} {
		for _, tt := range []struct {
			name   string
			end    func(ctx context.Context, tx *sql.Tx) error
			status int
			ended  bool // the transaction's writes may have committed: fail closed
		}{
			{"Commit", func(_ context.Context, tx *sql.Tx) error { return tx.Commit() }, 201, true},
			{"Commit, then a 500", func(_ context.Context, tx *sql.Tx) error { return tx.Commit() }, 500, true},
			{"COMMIT", execSQL("COMMIT"), 201, true},
			{"COMMIT, then a 503", execSQL("COMMIT"), 503, true},
			{"END", execSQL("END"), 201, true},
			{"ROLLBACK, then a write", execSQL("ROLLBACK"), 201, true},
			{"COMMIT AND CHAIN", execSQL("COMMIT AND CHAIN"), 201, true},
			{"COMMIT AND CHAIN, then a 500", execSQL("COMMIT AND CHAIN"), 500, true},
			{"COMMIT hidden by standard_conforming_strings", func(ctx context.Context, tx *sql.Tx) error {
				if _, err := tx.ExecContext(ctx, `SET LOCAL standard_conforming_strings = off`); err != nil {
					return err
				}
				_, err := tx.ExecContext(ctx, `SELECT '\' '; COMMIT; -- '`)
				return err
			}, 201, true},
			{"COMMIT, then a failing transaction of its own", func(ctx context.Context, tx *sql.Tx) error {
				_, _ = tx.ExecContext(ctx, "COMMIT")
				_, _ = tx.ExecContext(ctx, "BEGIN")
				_, _ = tx.ExecContext(ctx, "SELECT 1/0")
				return nil
			}, 201, true},
			{"COMMIT, then rows left open", func(ctx context.Context, tx *sql.Tx) error {
				if _, err := tx.ExecContext(ctx, "COMMIT"); err != nil {
					return err
				}
				_, err := tx.QueryContext(ctx, "SELECT 1") // never closed
				return err
			}, 201, true},
			{"PREPARE TRANSACTION", execSQL("PREPARE TRANSACTION 'idem_sqlstore_ended'"), 201, false},
			{"a DO block that commits", execSQL("DO $$ BEGIN COMMIT; END $$"), 201, false},
		} {
			t.Run(fmt.Sprintf("onetx=%v/%s", oneTx, tt.name), func(t *testing.T) {
				db := Open(t, driver)
				ctx := context.Background()
				t.Cleanup(func() { _, _ = db.ExecContext(ctx, `ROLLBACK PREPARED 'idem_sqlstore_ended'`) })
				runs := 0
				s := newService(db, sqlstore.New(db), idempotency.Options{OneTransaction: oneTx}, func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
					runs++
					key := r.Header.Get("Idempotency-Key")
					if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, fmt.Sprintf("%s/before/%d", key, runs)); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
					_ = tt.end(r.Context(), tx) // an error too leaves the transaction as it is
					_, _ = tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, fmt.Sprintf("%s/after/%d", key, runs))
					w.WriteHeader(tt.status)
				})
				rec, p := send(s.h, "k")
				require.Nil(t, p)
				first := rows(t, db, "k")
				if tt.ended {
					assert.Equal(t, http.StatusInternalServerError, rec.Code, "the answer to a request whose handler ended its transaction")
				}
				again, p := send(s.h, "k")
				require.Nil(t, p)
				replayed := again.Header().Get("Idempotent-Replayed") == "true"
				if tt.ended || rec.Code == http.StatusInternalServerError && replayed {
					assert.Equal(t, http.StatusInternalServerError, again.Code, "the retry")
					assert.True(t, replayed, "the retry is a replay of the stored 500")
					assert.Contains(t, again.Body.String(), "ended the transaction", "the replayed problem")
					assert.Equal(t, 1, runs, "the handler ran again under a key whose writes may have committed")
					assert.Equal(t, first, rows(t, db, "k"), "rows after the retry")
				} else {
					assert.Zero(t, first, "rows of a request whose transaction did not commit")
				}
			})
		}
	}
}

// execSQL ends a transaction with query.
func execSQL(query string) func(ctx context.Context, tx *sql.Tx) error {
	return func(ctx context.Context, tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, query)
		return err
	}
}

// testDuplicateWhileHandlerEnded holds a handler after it wrote a row and
// committed the key's transaction itself, and sends a duplicate meanwhile:
// the duplicate gets 409 without running (the key's hold outlives the
// handler's COMMIT, in one transaction too), the held request ends as the
// store fails it closed, the retry replays that, and the row was written
// once.
func testDuplicateWhileHandlerEnded(t *testing.T, driver string) {
	for _, oneTx := range []bool{false, true} {
		t.Run(fmt.Sprintf("onetx=%v", oneTx), func(t *testing.T) {
			db := Open(t, driver)
			entered, release := make(chan struct{}), make(chan struct{})
			var once sync.Once
			open := func() { once.Do(func() { close(release) }) }
			defer open()
			var runs atomic.Int32
			s := newService(db, sqlstore.New(db), idempotency.Options{OneTransaction: oneTx}, func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
				if runs.Add(1) > 1 {
					w.WriteHeader(http.StatusCreated)
					return
				}
				if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ('k/a')`); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				_, _ = tx.ExecContext(r.Context(), "COMMIT")
				close(entered)
				<-release
				w.WriteHeader(http.StatusCreated)
			})
			first := make(chan int, 1)
			go func() {
				rec, _ := send(s.h, "k")
				first <- rec.Code
			}()
			<-entered
			dup, _ := send(s.h, "k")
			assert.Equal(t, http.StatusConflict, dup.Code, "a duplicate while the first request runs")
			assert.Equal(t, int32(1), runs.Load(), "handler runs")
			open()
			assert.Equal(t, http.StatusInternalServerError, <-first, "the request whose handler ended its transaction")
			again, _ := send(s.h, "k")
			assert.Equal(t, http.StatusInternalServerError, again.Code, "the retry")
			assert.Equal(t, "true", again.Header().Get("Idempotent-Replayed"), "the retry replays the stored 500")
			assert.Equal(t, int32(1), runs.Load(), "handler runs")
			assert.Equal(t, 1, rows(t, db, "k"), "rows of the key")
		})
	}
}

// testRolledBackDoesNotWaitOnDuplicate holds, in one transaction, a
// handler that wrote a row and rolled back the key's transaction itself,
// which takes the key's row and its hold with it; a duplicate then claims
// the key and is held in its handler, its row uncommitted. The first
// request, let go, is answered at once (the store fails it closed, finds
// the key the duplicate's, and answers 409), never waiting on the
// duplicate's uncommitted row; the duplicate commits its row and its key,
// which the retry replays.
func testRolledBackDoesNotWaitOnDuplicate(t *testing.T, driver string) {
	db := Open(t, driver)
	enteredA, enteredB := make(chan struct{}), make(chan struct{})
	releaseA, releaseB := make(chan struct{}), make(chan struct{})
	var onceA, onceB sync.Once
	openA := func() { onceA.Do(func() { close(releaseA) }) }
	openB := func() { onceB.Do(func() { close(releaseB) }) }
	defer openA()
	defer openB()
	var runs atomic.Int32
	s := newService(db, sqlstore.New(db), idempotency.Options{OneTransaction: true}, func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
		n := runs.Add(1)
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, fmt.Sprintf("k/%d", n)); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		entered, release := enteredB, releaseB
		if n == 1 {
			_, _ = tx.ExecContext(r.Context(), "ROLLBACK")
			entered, release = enteredA, releaseA
		}
		close(entered)
		<-release
		w.WriteHeader(http.StatusCreated)
	})
	first, second := make(chan int, 1), make(chan int, 1)
	go func() {
		rec, _ := send(s.h, "k")
		first <- rec.Code
	}()
	<-enteredA
	go func() {
		rec, _ := send(s.h, "k")
		second <- rec.Code
	}()
	<-enteredB // the duplicate runs: the first request's hold went with its rollback

	waiting, stop := pgtest.WatchLockWait(func(q string, n *int) error { return db.QueryRow(q).Scan(n) }, 1, "true")
	defer stop()
	openA()
	select {
	case status := <-first:
		// Fenced: the key is the duplicate's, whose outcome a retry gets.
		assert.Equal(t, http.StatusConflict, status, "the request whose handler ended its transaction")
	case <-waiting:
		t.Error("the first request waits on the duplicate's uncommitted row")
		openB()
		<-first
	}
	openB()
	assert.Equal(t, http.StatusCreated, <-second, "the duplicate")
	again, _ := send(s.h, "k")
	assert.Equal(t, http.StatusCreated, again.Code, "the retry")
	assert.Equal(t, "true", again.Header().Get("Idempotent-Replayed"), "the retry replays the duplicate's outcome")
	assert.Equal(t, int32(2), runs.Load(), "handler runs")
	assert.Equal(t, 1, rows(t, db, "k"), "rows of the key")
}

// testPreparedTransaction ends the key's transaction with PREPARE
// TRANSACTION on a cluster that allows it (max_prepared_transactions above
// 0, which testHandlerEndsTransaction's server has not), so that the
// handler's writes commit whenever an operator commits the prepared
// transaction: the key never runs again, before that COMMIT PREPARED or
// after it, and the row is committed once. With two commits the key is
// completed with the stored 500 at once; in one transaction the prepared
// transaction holds the key's row and lock, and the key answers 409.
func testPreparedTransaction(t *testing.T, driver string) {
	db := open(t, driver, pgtest.ClusterURL(t, "max_prepared_transactions=2"))
	ctx := context.Background()
	require.NoError(t, sqlstore.Migrate(ctx, db))
	_, err := db.ExecContext(ctx, writesSQL)
	require.NoError(t, err)
	for _, oneTx := range []bool{false, true} {
		t.Run(fmt.Sprintf("onetx=%v", oneTx), func(t *testing.T) {
			key := fmt.Sprintf("k-%v", oneTx)
			gid := "idem_prepared_" + key
			t.Cleanup(func() { _, _ = db.ExecContext(ctx, "ROLLBACK PREPARED '"+gid+"'") })
			runs := 0
			s := newService(db, sqlstore.New(db), idempotency.Options{OneTransaction: oneTx}, func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
				runs++
				// A name of each run's own: a second run must not wait on
				// the first's prepared row.
				if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, fmt.Sprintf("%s/before/%d", key, runs)); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if _, err := tx.ExecContext(r.Context(), "PREPARE TRANSACTION '"+gid+"'"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})
			want := http.StatusInternalServerError
			if oneTx {
				want = http.StatusConflict
			}
			rec, p := send(s.h, key)
			require.Nil(t, p)
			assert.Equal(t, want, rec.Code, "the answer to a request whose handler prepared its transaction")
			var prepared int
			require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM pg_prepared_xacts WHERE gid = $1`, gid).Scan(&prepared))
			require.Equal(t, 1, prepared, "the handler's transaction is prepared")

			again, _ := send(s.h, key)
			assert.Equal(t, want, again.Code, "a retry while the transaction is prepared")
			assert.Equal(t, 1, runs, "the handler ran again while its prepared writes may still commit")
			_, err := db.ExecContext(ctx, "COMMIT PREPARED '"+gid+"'")
			require.NoError(t, err)
			again, _ = send(s.h, key)
			assert.Equal(t, want, again.Code, "a retry once the prepared transaction committed")
			assert.Equal(t, 1, runs, "the handler ran again after its writes committed")
			assert.Equal(t, 1, rows(t, db, key), "rows committed")
		})
	}
}
