package sqlstore_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
)

// The tests of a hostile review of b97d897: a piped transaction's BEGIN
// travels with the handler's first ExecContext that has arguments, in one
// pgx batch. Each runs on a *sql.Tx too (forBoth), which is what the
// handler's first statement must behave like.

// keyState returns the status of key's row, or "" without one.
func keyState(t *testing.T, c *pgx.Conn, key string) string {
	t.Helper()
	var st string
	err := c.QueryRow(context.Background(), `SELECT status FROM idempotency_keys WHERE idempotency_key = $1`, key).Scan(&st)
	if errors.Is(err, pgx.ErrNoRows) {
		return ""
	}
	require.NoError(t, err)
	return st
}

// clean asserts the pool's connections all came back, none in a
// transaction.
func clean(t *testing.T, r *reviewDB, watch *pgx.Conn) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); r.db.Stats().InUse != 0 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	assert.Equal(t, 0, r.db.Stats().InUse, "connections in use after the request")
	assert.Equal(t, 0, idleInTx(t, watch), "connections idle in a transaction")
}

// settled waits until no backend of the test's database but watch's and
// those of except runs a statement (a backend whose client went away
// finishes what it received).
func settled(t *testing.T, watch *pgx.Conn, except ...*pgx.Conn) {
	t.Helper()
	pids := []int32{int32(watch.PgConn().PID())}
	for _, c := range except {
		pids = append(pids, int32(c.PgConn().PID()))
	}
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var n int
		require.NoError(t, watch.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = current_setting('application_name') AND NOT pid = ANY($1) AND state <> 'idle'`, pids).Scan(&n))
		if n == 0 {
			return
		}
	}
	t.Error("backends still busy")
}

// waitFor polls watch until a backend of the test's database matches cond
// (a condition on pg_stat_activity), or 10 s pass.
func waitFor(watch *pgx.Conn, cond string) bool {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var n int
		_ = watch.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = current_setting('application_name') AND `+cond).Scan(&n)
		if n > 0 {
			return true
		}
	}
	return false
}

// valuer is a driver.Valuer of a value receiver.
type valuer struct{ s string }

func (v valuer) Value() (driver.Value, error) { return "valuer:" + v.s, nil }

// ptrValuer is a driver.Valuer of a pointer receiver.
type ptrValuer struct{ s string }

func (v *ptrValuer) Value() (driver.Value, error) {
	if v == nil {
		return "nil-ptr-valuer", nil
	}
	return "ptr:" + v.s, nil
}

// badValuer fails to give its value.
type badValuer struct{}

func (badValuer) Value() (driver.Value, error) { return nil, errors.New("bad value") }

// TestReviewFirstExecArgs: the handler's first ExecContext, batched with
// the BEGIN, takes its arguments as database/sql hands them to pgx alone:
// the same value stored, the same error, and a statement that fails
// before it is sent (an argument database/sql refuses, or pgx cannot
// encode) leaves the transaction as it was: the handler goes on, and what
// it writes next commits with its 201.
func TestReviewFirstExecArgs(t *testing.T) { forBoth(t, testReviewFirstExecArgs) }

func testReviewFirstExecArgs(t *testing.T) {
	r := openReview(t, 2)
	_, err := r.db.ExecContext(context.Background(), `CREATE TABLE vals (k text PRIMARY KEY, t text, b bytea, ts timestamptz, j jsonb)`)
	require.NoError(t, err)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgx.ParseConfig(r.url)
			require.NoError(t, err)
			cfg.DefaultQueryExecMode = mode
			db := stdlib.OpenDB(*cfg)
			defer db.Close()
			db.SetMaxOpenConns(2)
			testReviewFirstExecArgsOn(t, &reviewDB{db: db, url: r.url}, strings.ReplaceAll(mode.String(), " ", "-"))
		})
	}
}

func testReviewFirstExecArgsOn(t *testing.T, r *reviewDB, mode string) {
	watch := r.side(t)
	when := time.Date(2026, 3, 4, 5, 6, 7, 890000000, time.FixedZone("x", 3600))
	var nilStr *string
	var nilPtrValuer *ptrValuer
	s := "plain"
	for _, tt := range []struct {
		name, col string
		arg       any
	}{
		{"string", "t", "a'b\\c"},
		{"pointer", "t", &s},
		{"nil pointer", "t", nilStr},
		{"nil", "t", nil},
		{"valuer", "t", valuer{"v"}},
		{"pointer valuer", "t", &ptrValuer{"p"}},
		{"nil pointer valuer", "t", nilPtrValuer},
		{"null string", "t", sql.NullString{}},
		{"valid null string", "t", sql.NullString{String: "ns", Valid: true}},
		{"named", "t", sql.Named("v", "named")},
		{"badly named", "t", sql.Named("1v", "named")},
		{"bytes", "b", []byte{0, 1, 2, 255}},
		{"empty bytes", "b", []byte{}},
		{"nil bytes", "b", []byte(nil)},
		{"time", "ts", when},
		{"raw json", "j", json.RawMessage(`{"a": [1, 2]}`)},
		{"json string", "j", `{"a": 1}`},
		{"failing valuer", "t", badValuer{}},
		{"unencodable", "t", struct{ A chan int }{}},
		{"int", "t", 42},
	} {
		t.Run(tt.name, func(t *testing.T) {
			key := "args-" + mode + "-" + strings.ReplaceAll(tt.name, " ", "-")
			type got struct {
				err error
				n   int64
				val sql.NullString
			}
			var first, second got
			var markErr error
			ran := false
			h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
				run := func(k string) (g got) {
					var res sql.Result
					res, g.err = tx.ExecContext(req.Context(), `INSERT INTO vals (k, `+tt.col+`) VALUES ($1, $2)`, k, tt.arg)
					if g.err != nil {
						return g
					}
					g.n, _ = res.RowsAffected()
					require.NoError(t, tx.QueryRowContext(req.Context(), `SELECT `+tt.col+`::text FROM vals WHERE k = $1`, k).Scan(&g.val))
					return g
				}
				ran = true
				first = run(key + "/1")
				second = run(key + "/2")
				_, markErr = tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/mark")
				w.WriteHeader(201)
			})
			rec := sendKey(h, key)
			require.True(t, ran, "the handler ran: %d %s", rec.Code, rec.Body.String())
			t.Logf("first: %+v; second: %+v", first, second)
			if (first.err == nil) != (second.err == nil) {
				t.Errorf("first statement: %v; the same statement next: %v", first.err, second.err)
			}
			assert.Equal(t, second.val, first.val, "the value stored by the first statement")
			assert.Equal(t, second.n, first.n, "rows affected")
			if first.err != nil && second.err != nil {
				// A statement that fails before it is sent leaves the
				// transaction as it was, as on a *sql.Tx.
				assert.NoError(t, markErr, "a write after the failed statements")
				assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
				assert.Equal(t, 1, countWrites(t, watch, key), "rows committed")
			}
			if first.err == nil && second.err == nil {
				assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
				assert.Equal(t, 1, countWrites(t, watch, key), "rows committed")
			}
			clean(t, r, watch)
		})
	}
}

// TestReviewFirstExecWaitsThenGivesUp: the handler's first ExecContext
// waits for a row lock that a side transaction holds, and its context
// ends (deadline, cancel) while the batch waits on the server; then the
// handler answers 500, ignores the error and answers 201, or answers a
// stored 422. Whatever the handler's statement did on the server must not
// commit; the client's answer matches what committed; the key is left
// completed (with what committed) or released, and a retry then commits
// exactly once; the pool comes back clean.
func TestReviewFirstExecWaitsThenGivesUp(t *testing.T) {
	forBoth(t, testReviewFirstExecWaitsThenGivesUp)
}

func testReviewFirstExecWaitsThenGivesUp(t *testing.T) {
	r := openReview(t, 2)
	watch := r.side(t)
	side := r.side(t)
	ctx := context.Background()
	_, err := r.db.ExecContext(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL);
		INSERT INTO accounts VALUES (1, 100)`)
	require.NoError(t, err)
	for _, how := range []string{"deadline", "cancel"} {
		for _, answer := range []int{500, 201, 422} {
			t.Run(fmt.Sprintf("%s,%d", how, answer), func(t *testing.T) {
				key := fmt.Sprintf("wait-%s-%d", how, answer)
				_, err := watch.Exec(ctx, `UPDATE accounts SET balance = 100 WHERE id = 1`)
				require.NoError(t, err)
				sideTx, err := side.Begin(ctx)
				require.NoError(t, err)
				_, err = sideTx.Exec(ctx, `SELECT * FROM accounts WHERE id = 1 FOR UPDATE`)
				require.NoError(t, err)
				var firstErr error
				retry := false
				h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
					sctx := req.Context()
					if !retry {
						var cancel context.CancelFunc
						if how == "deadline" {
							sctx, cancel = context.WithTimeout(sctx, 300*time.Millisecond)
						} else {
							sctx, cancel = context.WithCancel(sctx)
							go func() {
								if waitFor(watch, `wait_event_type = 'Lock' AND query LIKE '%UPDATE accounts%'`) {
									time.Sleep(50 * time.Millisecond)
								}
								cancel()
							}()
						}
						defer cancel()
					}
					_, firstErr = tx.ExecContext(sctx, `UPDATE accounts SET balance = balance - $1 WHERE id = 1`, 10)
					if retry {
						if firstErr != nil {
							http.Error(w, firstErr.Error(), 500)
							return
						}
						_, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/retry")
						if err != nil {
							http.Error(w, err.Error(), 500)
							return
						}
						w.WriteHeader(201)
						return
					}
					if firstErr == nil {
						http.Error(w, "the statement did not wait", 500)
						return
					}
					// A write of the handler's after the failed one.
					_, _ = tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/after")
					w.WriteHeader(answer)
				})
				rec := sendKey(h, key)
				time.Sleep(100 * time.Millisecond)
				require.NoError(t, sideTx.Commit(ctx)) // the waiting UPDATE, if still on the server, goes on
				settled(t, watch, side)
				var balance int
				require.NoError(t, watch.QueryRow(ctx, `SELECT balance FROM accounts WHERE id = 1`).Scan(&balance))
				st := keyState(t, watch, key)
				rows := countWrites(t, watch, key)
				t.Logf("handler's statement: %v; client %d %q; balance %d; key %q; rows %d", firstErr, rec.Code, strings.TrimSpace(rec.Body.String()), balance, st, rows)
				if how == "deadline" {
					assert.ErrorIs(t, firstErr, context.DeadlineExceeded)
				} else {
					assert.ErrorIs(t, firstErr, context.Canceled)
				}
				assert.Equal(t, 100, balance, "the canceled UPDATE committed")
				ok := rec.Code >= 200 && rec.Code < 300
				assert.Equal(t, ok, rows == 1, "client got %d, %d rows committed", rec.Code, rows)
				switch {
				case rec.Code == 422 || ok:
					assert.Equal(t, "completed", st)
				default:
					assert.Equal(t, "released", st)
				}
				clean(t, r, watch)
				if st == "released" {
					// The retry runs the handler again, once.
					retry = true
					rec := sendKey(h, key)
					assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
					require.NoError(t, watch.QueryRow(ctx, `SELECT balance FROM accounts WHERE id = 1`).Scan(&balance))
					assert.Equal(t, 90, balance, "after the retry")
					assert.Equal(t, "completed", keyState(t, watch, key))
					clean(t, r, watch)
				}
			})
		}
	}
}

// TestReviewFirstExecCut: the connection is cut while the batch of the
// BEGIN and the handler's first statement runs: before PostgreSQL ran the
// INSERT (it waits for a row a side transaction inserted with the same
// key) and after (a trigger sleeps after the row was inserted). The
// handler answers 500, or ignores the error and answers 201. Nothing of
// the cut transaction commits, the client's answer matches what
// committed, a retry commits exactly once, and the pool comes back clean.
func TestReviewFirstExecCut(t *testing.T) { forBoth(t, testReviewFirstExecCut) }

func testReviewFirstExecCut(t *testing.T) {
	ctx := context.Background()
	for _, when := range []string{"before", "after"} {
		for _, answer := range []int{500, 201} {
			t.Run(fmt.Sprintf("%s,%d", when, answer), func(t *testing.T) {
				r := openReview(t, 2)
				watch := r.side(t)
				side := r.side(t)
				_, err := r.db.ExecContext(ctx, `
CREATE FUNCTION review_sleep() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN IF NEW.name LIKE '%/slow' THEN PERFORM pg_sleep(2); END IF; RETURN NULL; END $$;
CREATE TRIGGER review_sleep AFTER INSERT ON writes FOR EACH ROW EXECUTE FUNCTION review_sleep()`)
				require.NoError(t, err)
				key := "cut"
				name := key + "/slow"
				var sideTx pgx.Tx
				wait := `wait_event = 'PgSleep'`
				if when == "before" {
					name = key + "/1"
					wait = `wait_event_type = 'Lock'`
					sideTx, err = side.Begin(ctx)
					require.NoError(t, err)
					_, err = sideTx.Exec(ctx, `INSERT INTO writes (name) VALUES ($1)`, name)
					require.NoError(t, err)
				}
				var firstErr error
				retry := false
				h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
					_, firstErr = tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, name)
					if firstErr != nil && (answer == 500 || retry) {
						http.Error(w, firstErr.Error(), 500)
						return
					}
					w.WriteHeader(201)
				})
				cutDone := make(chan struct{})
				go func() {
					defer close(cutDone)
					if waitFor(watch, wait+` AND query LIKE '%INSERT INTO writes%'`) {
						r.cut()
					}
					if sideTx != nil {
						time.Sleep(200 * time.Millisecond)
						_ = sideTx.Rollback(ctx) // the INSERT, still on the server, goes on
					}
				}()
				rec := sendKey(h, key)
				<-cutDone
				settled(t, watch, side)
				rows := countWrites(t, watch, key)
				st := keyState(t, watch, key)
				t.Logf("handler's statement: %v; client %d %q; rows %d; key %q", firstErr, rec.Code, strings.TrimSpace(rec.Body.String()), rows, st)
				assert.Error(t, firstErr, "the statement of a cut connection")
				ok := rec.Code >= 200 && rec.Code < 300
				assert.Equal(t, ok, rows == 1, "client got %d, %d rows committed", rec.Code, rows)
				assert.Equal(t, 0, rows, "rows of the cut transaction committed")
				if ok {
					assert.Equal(t, "completed", st)
				} else {
					assert.Contains(t, []string{"released", ""}, st)
				}
				clean(t, r, watch)
				retry = true
				rec = sendKey(h, key)
				assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
				assert.Equal(t, 1, countWrites(t, watch, key), "after the retry")
				clean(t, r, watch)
			})
		}
	}
}

// TestReviewFirstExecFails: the handler's first statement fails on the
// server, where it runs (a unique violation) or where it is parsed (an
// unknown table, a type PostgreSQL cannot infer); the handler then answers
// 201 (the client gets a 500, nothing commits, the key is released) or a
// stored 422 (stored alone). Its later statements fail too, as in an
// aborted transaction.
func TestReviewFirstExecFails(t *testing.T) { forBoth(t, testReviewFirstExecFails) }

func testReviewFirstExecFails(t *testing.T) {
	r := openReview(t, 2)
	watch := r.side(t)
	ctx := context.Background()
	_, err := r.db.ExecContext(ctx, `INSERT INTO writes (name) VALUES ('taken/1')`)
	require.NoError(t, err)
	for _, tt := range []struct{ name, sql string }{
		{"unique", `INSERT INTO writes (name) VALUES ($1), ('taken/1')`},
		{"unknown table", `INSERT INTO nowhere (name) VALUES ($1)`},
		{"syntax", `INSERT INTO writes (name) VALUE ($1)`},
		{"indeterminate", `INSERT INTO writes (name) SELECT 'x' WHERE $1 IS NULL`},
	} {
		for _, answer := range []int{201, 422} {
			t.Run(fmt.Sprintf("%s,%d", tt.name, answer), func(t *testing.T) {
				key := fmt.Sprintf("fails-%s-%d", strings.ReplaceAll(tt.name, " ", "-"), answer)
				var firstErr, nextErr error
				h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
					_, firstErr = tx.ExecContext(req.Context(), tt.sql, key+"/1")
					_, nextErr = tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/2")
					w.WriteHeader(answer)
				})
				rec := sendKey(h, key)
				t.Logf("first: %v; next: %v; client %d", firstErr, nextErr, rec.Code)
				assert.Error(t, firstErr)
				assert.Error(t, nextErr, "a statement after a failed one")
				assert.Equal(t, 0, countWrites(t, watch, key), "rows committed")
				if answer == 201 {
					assert.Equal(t, 500, rec.Code)
					assert.Equal(t, "released", keyState(t, watch, key))
				} else {
					assert.Equal(t, 422, rec.Code)
					assert.Equal(t, "completed", keyState(t, watch, key))
					assert.Equal(t, 422, sendKey(h, key).Code, "the replay")
				}
				clean(t, r, watch)
			})
		}
	}
}

// TestReviewFirstExecRefused: a first statement that would end the
// transaction is refused before anything is sent: no connection is taken
// for it, and the handler's next statement begins the transaction, which
// commits with its 201.
func TestReviewFirstExecRefused(t *testing.T) { forBoth(t, testReviewFirstExecRefused) }

func testReviewFirstExecRefused(t *testing.T) {
	r := openReview(t, 2)
	watch := r.side(t)
	for i, q := range []string{`COMMIT`, `SELECT $1::text; COMMIT`, `END`, `ROLLBACK`, `PREPARE TRANSACTION 'x'`, `INSERT INTO writes (name) VALUES ($1); COMMIT`} {
		t.Run(q, func(t *testing.T) {
			key := fmt.Sprint("refused-", i)
			var refErr error
			inUse := -1
			h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
				var args []any
				if strings.Contains(q, "$1") {
					args = []any{key + "/0"}
				}
				_, refErr = tx.ExecContext(req.Context(), q, args...)
				inUse = r.db.Stats().InUse
				if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/1"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				w.WriteHeader(201)
			})
			rec := sendKey(h, key)
			assert.ErrorIs(t, refErr, sqlstore.ErrTxOwned)
			assert.Equal(t, 0, inUse, "connections in use after the refused statement")
			assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
			assert.Equal(t, 1, countWrites(t, watch, key))
			clean(t, r, watch)
		})
	}
}

// TestReviewFirstExecBusy: while the handler's first ExecContext waits on
// the server (for a row lock), a call of another goroutine fails at once
// with the transaction busy, and sends nothing; the first statement then
// commits with the 201.
func TestReviewFirstExecBusy(t *testing.T) { forBoth(t, testReviewFirstExecBusy) }

func testReviewFirstExecBusy(t *testing.T) {
	r := openReview(t, 3)
	watch := r.side(t)
	side := r.side(t)
	ctx := context.Background()
	_, err := r.db.ExecContext(ctx, `INSERT INTO writes (name) VALUES ('busy/0')`)
	require.NoError(t, err)
	sideTx, err := side.Begin(ctx)
	require.NoError(t, err)
	_, err = sideTx.Exec(ctx, `SELECT * FROM writes WHERE name = 'busy/0' FOR UPDATE`)
	require.NoError(t, err)
	var busyErrs []error
	h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
		var wg sync.WaitGroup
		wg.Go(func() {
			if !waitFor(watch, `wait_event_type = 'Lock' AND query LIKE '%busy/%'`) {
				busyErrs = append(busyErrs, errors.New("the first statement never waited"))
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO writes (name) VALUES ($1)`, "busy/2")
			busyErrs = append(busyErrs, err)
			_, err = tx.QueryContext(ctx, `SELECT 1`)
			busyErrs = append(busyErrs, err)
			err = tx.QueryRowContext(ctx, `SELECT 1`).Scan(new(int))
			busyErrs = append(busyErrs, err)
			_, err = tx.PrepareContext(ctx, `SELECT 1`)
			busyErrs = append(busyErrs, err)
			require.NoError(t, sideTx.Commit(ctx))
		})
		_, err := tx.ExecContext(req.Context(), `UPDATE writes SET name = $1 WHERE name = 'busy/0'`, "busy/1")
		wg.Wait()
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(201)
	})
	rec := sendKey(h, "busy")
	assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
	require.Len(t, busyErrs, 4)
	for _, err := range busyErrs {
		assert.ErrorContains(t, err, "in use by another call")
	}
	var names []string
	rows, err := watch.Query(ctx, `SELECT name FROM writes WHERE name LIKE 'busy/%' ORDER BY name`)
	require.NoError(t, err)
	names, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	assert.Equal(t, []string{"busy/1"}, names)
	clean(t, r, watch)
}

// panicValuer panics when pgx asks for its value.
type panicValuer struct{}

func (panicValuer) Value() (driver.Value, error) { panic("value panics") }

// TestReviewFirstExecPanics: the handler panics after its first
// ExecContext, or within it (an argument's Value panics while pgx encodes
// the batch): nothing commits, the pool's one connection comes back clean
// and serves the next request.
func TestReviewFirstExecPanics(t *testing.T) { forBoth(t, testReviewFirstExecPanics) }

func testReviewFirstExecPanics(t *testing.T) {
	r := openReview(t, 1)
	watch := r.side(t)
	for _, within := range []bool{false, true} {
		t.Run(fmt.Sprint("within=", within), func(t *testing.T) {
			key := fmt.Sprint("panic-", within)
			h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
				if within {
					_, _ = tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1), ($2)`, key+"/1", panicValuer{})
				} else if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/1"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				panic("handler failed")
			})
			func() {
				defer func() { _ = recover() }()
				sendKey(h, key)
			}()
			assert.Equal(t, 0, countWrites(t, watch, key), "rows committed")
			clean(t, r, watch)
			h = serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
				if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"-next/1"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				w.WriteHeader(201)
			})
			rec := sendKey(h, key+"-next")
			assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
			assert.Equal(t, 1, countWrites(t, watch, key+"-next"))
			clean(t, r, watch)
		})
	}
}

// TestReviewFirstExecOtherContext: the handler's first ExecContext runs
// under a context that is not the request's (context.Background, or one
// canceled right after the statement): the transaction lives on, and the
// write commits with the 201.
func TestReviewFirstExecOtherContext(t *testing.T) { forBoth(t, testReviewFirstExecOtherContext) }

func testReviewFirstExecOtherContext(t *testing.T) {
	r := openReview(t, 2)
	watch := r.side(t)
	for _, name := range []string{"background", "canceled after"} {
		t.Run(name, func(t *testing.T) {
			key := "other-" + strings.ReplaceAll(name, " ", "-")
			h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
				sctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				if _, err := tx.ExecContext(sctx, `INSERT INTO writes (name) VALUES ($1)`, key+"/1"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				cancel()
				time.Sleep(20 * time.Millisecond)
				if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/2"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				w.WriteHeader(201)
			})
			rec := sendKey(h, key)
			assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
			assert.Equal(t, 2, countWrites(t, watch, key))
			clean(t, r, watch)
		})
	}
}

// TestReviewFirstExecResult: what the first ExecContext's result says is
// what the same statement's says alone: rows affected by INSERT ... ON
// CONFLICT DO NOTHING (0 and 1), an UPDATE of none and of several,
// INSERT ... RETURNING, a SELECT; and LastInsertId's error.
func TestReviewFirstExecResult(t *testing.T) { forBoth(t, testReviewFirstExecResult) }

func testReviewFirstExecResult(t *testing.T) {
	r := openReview(t, 2)
	ctx := context.Background()
	_, err := r.db.ExecContext(ctx, `INSERT INTO writes (name) VALUES ('res/a'), ('res/b'), ('res/c')`)
	require.NoError(t, err)
	for _, tt := range []struct {
		name, sql string
		arg       any
		want      int64
	}{
		{"conflict", `INSERT INTO writes (name) VALUES ($1) ON CONFLICT DO NOTHING`, "res/a", 0},
		{"no conflict", `INSERT INTO writes (name) VALUES ($1) ON CONFLICT DO NOTHING`, "res/new", 1},
		{"update none", `UPDATE writes SET name = name WHERE name = $1`, "res/none", 0},
		{"update several", `UPDATE writes SET name = name WHERE name LIKE $1`, "res/%", 3},
		{"returning", `INSERT INTO writes (name) VALUES ($1) RETURNING name`, "res/ret", 1},
		{"select", `SELECT name FROM writes WHERE name LIKE $1`, "res/%", 3},
		{"delete", `DELETE FROM writes WHERE name = $1`, "res/c", 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			key := "result-" + strings.ReplaceAll(tt.name, " ", "-")
			var n int64
			var nErr, idErr, err error
			h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
				var res sql.Result
				if res, err = tx.ExecContext(req.Context(), tt.sql, tt.arg); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				n, nErr = res.RowsAffected()
				_, idErr = res.LastInsertId()
				w.WriteHeader(409) // not stored: nothing commits
			})
			rec := sendKey(h, key)
			require.NoError(t, err)
			assert.Equal(t, 409, rec.Code)
			assert.NoError(t, nErr)
			assert.Equal(t, tt.want, n, "rows affected")
			assert.EqualError(t, idErr, "LastInsertId is not supported by this driver")
		})
	}
}

// TestReviewFirstExecSetLocal: a first statement that sets the
// transaction's settings, without arguments (SET LOCAL) or with
// (set_config(..., true)), runs in the transaction, after its BEGIN: the
// setting holds for the handler's next statements, and its writes commit.
func TestReviewFirstExecSetLocal(t *testing.T) { forBoth(t, testReviewFirstExecSetLocal) }

func testReviewFirstExecSetLocal(t *testing.T) {
	r := openReview(t, 1)
	watch := r.side(t)
	for _, tt := range []struct {
		name, sql string
		args      []any
	}{
		{"set local", `SET LOCAL lock_timeout = '1234ms'`, nil},
		{"set_config", `SELECT set_config('lock_timeout', $1, true)`, []any{"1234ms"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			key := "set-" + strings.ReplaceAll(tt.name, " ", "-")
			var got, after string
			h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
				if _, err := tx.ExecContext(req.Context(), tt.sql, tt.args...); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/1"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if err := tx.QueryRowContext(req.Context(), `SHOW lock_timeout`).Scan(&got); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				w.WriteHeader(201)
			})
			rec := sendKey(h, key)
			assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
			assert.Equal(t, "1234ms", got)
			assert.Equal(t, 1, countWrites(t, watch, key))
			// The setting went with the transaction: the pool's one
			// connection is back to the default.
			require.NoError(t, r.db.QueryRowContext(context.Background(), `SHOW lock_timeout`).Scan(&after))
			assert.Equal(t, "0", after)
			clean(t, r, watch)
		})
	}
}

// TestReviewFirstExecOneKeyDebit: twelve concurrent requests with one key,
// whose handler's first statement debits an account: exactly one debit
// commits, and every 201 is that one.
func TestReviewFirstExecOneKeyDebit(t *testing.T) { forBoth(t, testReviewFirstExecOneKeyDebit) }

func testReviewFirstExecOneKeyDebit(t *testing.T) {
	r := openReview(t, 4)
	watch := r.side(t)
	ctx := context.Background()
	_, err := r.db.ExecContext(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL);
		INSERT INTO accounts VALUES (1, 1000)`)
	require.NoError(t, err)
	for round, oneTx := range []bool{false, true, false} {
		t.Run(fmt.Sprintf("onetx=%v,%d", oneTx, round), func(t *testing.T) {
			key := fmt.Sprint("debit-", round)
			var mu sync.Mutex
			ran := 0
			h := serve(r.db, idempotency.Options{OneTransaction: oneTx}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
				res, err := tx.ExecContext(req.Context(), `UPDATE accounts SET balance = balance - $1 WHERE id = $2`, 10, 1)
				if err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if n, _ := res.RowsAffected(); n != 1 {
					http.Error(w, "no account", 500)
					return
				}
				mu.Lock()
				ran++
				mu.Unlock()
				w.WriteHeader(201)
			})
			var before int
			require.NoError(t, watch.QueryRow(ctx, `SELECT balance FROM accounts WHERE id = 1`).Scan(&before))
			var wg sync.WaitGroup
			codes := make([]int, 12)
			for i := range codes {
				wg.Go(func() { codes[i] = sendKey(h, key).Code })
			}
			wg.Wait()
			var after int
			require.NoError(t, watch.QueryRow(ctx, `SELECT balance FROM accounts WHERE id = 1`).Scan(&after))
			assert.Equal(t, 10, before-after, "debited; codes %v", codes)
			assert.Contains(t, codes, 201)
			assert.Equal(t, "completed", keyState(t, watch, key))
			clean(t, r, watch)
		})
	}
}
