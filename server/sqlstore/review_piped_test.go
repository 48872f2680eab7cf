package sqlstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
)

// The tests of a hostile review of the piped transactions (pgxpipeline).

// reviewDB is a pgx stdlib pool on a schema of its own (key table and
// writes table), whose client sockets the test can cut.
type reviewDB struct {
	db  *sql.DB
	url string

	mu    sync.Mutex
	conns []*reviewConn
}

func openReview(t *testing.T, maxOpen int) *reviewDB {
	t.Helper()
	url := pgtest.SchemaURL(t)
	cfg, err := pgx.ParseConfig(url)
	require.NoError(t, err)
	r := &reviewDB{url: url}
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		rc := &reviewConn{Conn: c}
		r.mu.Lock()
		r.conns = append(r.conns, rc)
		r.mu.Unlock()
		return rc, nil
	}
	r.db = stdlib.OpenDB(*cfg)
	t.Cleanup(func() { r.db.Close() })
	r.db.SetMaxOpenConns(maxOpen)
	ctx := context.Background()
	require.NoError(t, sqlstore.Migrate(ctx, r.db))
	_, err = r.db.ExecContext(ctx, `CREATE TABLE writes (name text PRIMARY KEY)`)
	require.NoError(t, err)
	return r
}

// cut cuts every client socket of the pool opened so far.
func (r *reviewDB) cut() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.conns {
		c.cut.Store(true)
		_ = c.Conn.Close()
	}
}

// side opens a connection of its own on the test's schema.
func (r *reviewDB) side(t *testing.T) *pgx.Conn {
	t.Helper()
	c, err := pgx.Connect(context.Background(), r.url)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func sendKey(h http.Handler, key string) *httptest.ResponseRecorder {
	r := httptest.NewRequestWithContext(idempotency.WithClientID(context.Background(), "cli_a"),
		"POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
	r.Header.Set("Idempotency-Key", key)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	return rec
}

func countWrites(t *testing.T, c *pgx.Conn, key string) int {
	t.Helper()
	var n int
	require.NoError(t, c.QueryRow(context.Background(),
		`SELECT count(*) FROM writes WHERE name LIKE $1 || '/%'`, key).Scan(&n))
	return n
}

// TestReviewLostBatchBeforeItRuns: in two commits (no OneTransaction), the
// completion and the COMMIT travel in one batch. The connection is lost
// while the batch waits on the server (here for a table lock, or in a
// trigger; on a network, the batch may simply not have arrived yet). On
// 7b93656 the store then read the key on another connection to learn
// whether the COMMIT landed, but nothing made that read wait for the
// batch: the key row was not locked yet, so it read "not completed", the
// client was told "nothing of this request was committed" (500), and then
// the batch ran, completion and COMMIT, and the handler's row and the 201
// committed ("lock"). On a *sql.Tx the COMMIT is sent only after the
// completion answered, so a lost connection before then commits nothing.
// Now the store releases the key under its token instead of reading it:
// a completion that runs later is fenced ("sleep"); one that ran first
// makes the release wait for its COMMIT, and the store reports it
// committed ("lock").
func TestReviewLostBatchBeforeItRuns(t *testing.T) { forBoth(t, testReviewLostBatchBeforeItRuns) }

func testReviewLostBatchBeforeItRuns(t *testing.T) {
	// lock: the completion waits for a table lock, queued before the
	// store's next statement on the key row; sleep: a statement-level
	// trigger delays it before it locks the row, so that the store's next
	// statement on the key row runs first.
	for _, delay := range []string{"lock", "sleep"} {
		t.Run(delay, func(t *testing.T) { testReviewLostBatch(t, delay) })
	}
}

func testReviewLostBatch(t *testing.T, delay string) {
	r := openReview(t, 1)
	ctx := context.Background()
	var logs syncBuf
	side := r.side(t)
	_, err := r.db.ExecContext(ctx, `
CREATE FUNCTION review_slow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN IF current_setting('review.slow', true) = 'on' THEN PERFORM pg_sleep(2); END IF; RETURN NULL; END $$;
CREATE TRIGGER review_slow BEFORE UPDATE ON idempotency_keys FOR EACH STATEMENT EXECUTE FUNCTION review_slow()`)
	require.NoError(t, err)
	var slow func(tx sqlstore.Tx)
	var released atomic.Int32
	count := func(e idempotency.Event) {
		if e == idempotency.EventReleased {
			released.Add(1)
		}
	}
	h := idempotency.Middleware(sqlstore.New(r.db), idempotency.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil)), OnEvent: count})(http.HandlerFunc(
		func(w http.ResponseWriter, req *http.Request) {
			tx, _ := sqlstore.TxFromContext(req.Context())
			key := req.Header.Get("Idempotency-Key")
			if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/1"); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			if slow != nil {
				slow(tx)
			}
			w.WriteHeader(201)
		}))
	// Warm-up: the one connection caches the statements of a request.
	require.Equal(t, 201, sendKey(h, "warm").Code)

	var sideTx pgx.Tx
	wait := `wait_event_type = 'Lock'`
	if delay == "lock" {
		// A side transaction holds a SHARE lock on the key table while
		// the completion is sent (as a CREATE INDEX would): the
		// completion's UPDATE waits for it; a read (FOR SHARE) does not.
		sideTx, err = side.Begin(ctx)
		require.NoError(t, err)
		slow = func(sqlstore.Tx) {
			_, err := sideTx.Exec(ctx, `LOCK TABLE idempotency_keys IN SHARE MODE`)
			require.NoError(t, err)
		}
	} else {
		wait = `wait_event = 'PgSleep'`
		slow = func(tx sqlstore.Tx) {
			_, err := tx.ExecContext(ctx, `SET LOCAL review.slow = 'on'`)
			require.NoError(t, err)
		}
	}
	watch := r.side(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			var n int
			_ = watch.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE `+wait+` AND application_name = current_setting('application_name') AND query LIKE '%UPDATE%idempotency_keys%'`).Scan(&n)
			if n > 0 {
				r.cut() // the batch's connection is lost while it waits
				if sideTx != nil {
					time.Sleep(time.Second)
					_ = sideTx.Commit(ctx) // the batch goes on, on the server
				}
				return
			}
		}
		if sideTx != nil {
			_ = sideTx.Rollback(ctx)
		}
	}()
	rec := sendKey(h, "k")
	<-done
	// Let the old backend finish what it received.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		var n int
		require.NoError(t, watch.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = current_setting('application_name') AND pid <> pg_backend_pid() AND pid <> $1 AND state <> 'idle'`, side.PgConn().PID()).Scan(&n))
		if n == 0 {
			break
		}
	}
	rows := countWrites(t, watch, "k")
	var status string
	_ = watch.QueryRow(ctx, `SELECT status FROM idempotency_keys WHERE idempotency_key = 'k'`).Scan(&status)
	t.Logf("client got %d (%s); rows committed %d; key %q", rec.Code, strings.TrimSpace(rec.Body.String()), rows, status)
	t.Logf("logs: %s", logs.String())
	if ok := rec.Code >= 200 && rec.Code < 300; ok != (rows == 1) {
		t.Errorf("the client got %d, and %d rows are committed", rec.Code, rows)
	}
	if (rows == 1) != (status == "completed") {
		t.Errorf("%d rows are committed, and the key is %q", rows, status)
	}
	// A key released, by Complete after the lost batch or by the
	// middleware, is one EventReleased.
	want := int32(0)
	if status == "released" {
		want = 1
	}
	if got := released.Load(); got != want {
		t.Errorf("the key is %q; %d EventReleased counted, want %d", status, got, want)
	}
}

// syncBuf is a strings.Builder safe for the logger's goroutines.
type syncBuf struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuf) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

var _ io.Writer = (*syncBuf)(nil)

// serve serves handle behind the middleware on a store on db.
func serve(db *sql.DB, opts idempotency.Options, handle func(w http.ResponseWriter, r *http.Request, tx sqlstore.Tx)) http.Handler {
	return idempotency.Middleware(sqlstore.New(db), opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := sqlstore.TxFromContext(r.Context())
		if !ok {
			http.Error(w, "no transaction", 500)
			return
		}
		handle(w, r, tx)
	}))
}

// TestReviewStatementOfDoneContext: a handler's statement sent with a
// context that is already done fails with the context's error and leaves
// the transaction as it was, as on a *sql.Tx (database/sql checks the
// context before it takes the Tx's connection): the handler goes on, and
// its rows commit with its outcome. Piped, pgx's stdlib reports such a
// statement as driver.ErrBadConn (nothing was sent), on which database/sql
// closes the *sql.Conn of the transaction: the handler's earlier writes
// are lost, its later statements fail with "connection is already
// closed", and the client gets a 500 for what commits on a *sql.Tx.
func TestReviewStatementOfDoneContext(t *testing.T) { forBoth(t, testReviewStatementOfDoneContext) }

func testReviewStatementOfDoneContext(t *testing.T) {
	r := openReview(t, 2)
	watch := r.side(t)
	for _, tt := range []struct {
		oneTx, first bool
	}{{false, false}, {true, false}, {false, true}} {
		oneTx := tt.oneTx
		// first: the statement of a done context is the handler's first,
		// which begins the transaction (in two commits): on a *sql.Tx too,
		// the transaction then failed to begin for good.
		t.Run(fmt.Sprintf("onetx=%v,first=%v", oneTx, tt.first), func(t *testing.T) {
			key := fmt.Sprintf("k-%v-%v", oneTx, tt.first)
			var doneErr error
			h := serve(r.db, idempotency.Options{OneTransaction: oneTx}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
				// An optional write under a deadline already past: its
				// error is ignored.
				dctx, cancel := context.WithTimeout(req.Context(), -time.Second)
				defer cancel()
				if tt.first {
					_, doneErr = tx.ExecContext(dctx, `INSERT INTO writes (name) VALUES ($1)`, key+"/optional")
				}
				if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/1"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if !tt.first {
					_, doneErr = tx.ExecContext(dctx, `INSERT INTO writes (name) VALUES ($1)`, key+"/optional")
				}
				if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/2"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				w.WriteHeader(201)
			})
			rec := sendKey(h, key)
			assert.ErrorIs(t, doneErr, context.DeadlineExceeded, "the statement of a done context")
			assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
			assert.Equal(t, 2, countWrites(t, watch, key), "rows committed")
		})
	}
}

// TestReviewMisbehavingHandlersLeaveCleanPool: handlers that leave rows
// open, prepare statements and keep them, panic with rows open, or use
// their transaction from a goroutine that outlives them: nothing of theirs
// commits, the pool's connections all come back, none inside a
// transaction, and a later request on the same one-connection pool
// commits exactly its own row.
func TestReviewMisbehavingHandlersLeaveCleanPool(t *testing.T) {
	forBoth(t, testReviewMisbehavingHandlersLeaveCleanPool)
}

func testReviewMisbehavingHandlersLeaveCleanPool(t *testing.T) {
	r := openReview(t, 1)
	watch := r.side(t)
	ctx := context.Background()
	late := make(chan func(), 16)
	var lateWG sync.WaitGroup
	for _, oneTx := range []bool{false, true} {
		for name, handle := range map[string]func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx, key string){
			"rows left open": func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx, key string) {
				rows, err := tx.QueryContext(req.Context(), `SELECT generate_series(1, 100000)`)
				if err != nil {
					panic(err)
				}
				rows.Next()
				w.WriteHeader(201)
			},
			"stmt rows left open": func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx, key string) {
				st, err := tx.PrepareContext(req.Context(), `SELECT generate_series(1, $1::int)`)
				if err != nil {
					panic(err)
				}
				rows, err := st.QueryContext(req.Context(), 100000)
				if err != nil {
					panic(err)
				}
				rows.Next()
				w.WriteHeader(201)
			},
			"panic with rows open": func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx, key string) {
				st, err := tx.PrepareContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`)
				if err != nil {
					panic(err)
				}
				if _, err := st.ExecContext(req.Context(), key+"/stmt"); err != nil {
					panic(err)
				}
				rows, err := tx.QueryContext(req.Context(), `SELECT generate_series(1, 100000)`)
				if err != nil {
					panic(err)
				}
				rows.Next()
				panic("handler failed")
			},
			"late goroutine": func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx, key string) {
				st, err := tx.PrepareContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`)
				if err != nil {
					panic(err)
				}
				rows, err := tx.QueryContext(req.Context(), `SELECT generate_series(1, 100000)`)
				if err != nil {
					panic(err)
				}
				rows.Next()
				rows.Close()
				qrows, err := st.QueryContext(req.Context(), key+"/stmt-query")
				if err != nil {
					panic(err)
				}
				qrows.Close()
				lateWG.Add(1)
				late <- func() {
					defer lateWG.Done()
					for range 20 {
						_, _ = st.ExecContext(ctx, key+"/late/stmt")
						_, _ = tx.ExecContext(ctx, `INSERT INTO writes (name) VALUES ($1)`, key+"/late/tx")
						if rows, err := tx.QueryContext(ctx, `SELECT 1`); err == nil {
							rows.Close()
						}
						time.Sleep(time.Millisecond)
					}
				}
				w.WriteHeader(201)
			},
		} {
			t.Run(fmt.Sprintf("%s,onetx=%v", name, oneTx), func(t *testing.T) {
				key := fmt.Sprintf("k-%s-%v", strings.ReplaceAll(name, " ", "-"), oneTx)
				h := serve(r.db, idempotency.Options{OneTransaction: oneTx}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
					if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, key+"/1"); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
					handle(w, req, tx, key)
				})
				finished := make(chan struct{})
				go func() {
					defer close(finished)
					defer func() { _ = recover() }()
					sendKey(h, key)
				}()
				select {
				case <-finished:
				case <-time.After(20 * time.Second):
					t.Fatal("the request hangs")
				}
				select {
				case f := <-late:
					go f()
				default:
				}
				lateWG.Wait()
				want := 0
				if name == "late goroutine" {
					want = 2 // its own rows, with its 201; none of the late ones
				}
				assert.Equal(t, want, countWrites(t, watch, key)-countWrites(t, watch, key+"/late"), "rows committed")
				assert.Equal(t, 0, countWrites(t, watch, key+"/late"), "late rows committed")
				assert.Equal(t, 0, r.db.Stats().InUse, "connections in use after the request")
				assert.Equal(t, 0, idleInTx(t, watch), "connections idle in a transaction")
				// The pool's one connection is clean: a write outside any
				// transaction commits at once.
				_, err := r.db.ExecContext(ctx, `INSERT INTO writes (name) VALUES ($1)`, key+"-after/1")
				require.NoError(t, err)
				assert.Equal(t, 1, countWrites(t, watch, key+"-after"), "a write after the request")
			})
		}
	}
}

// TestReviewFailuresInAndAtCommit: a statement that fails inside a
// savepoint rolled back, a statement that fails and aborts the
// transaction (then 2xx, 4xx stored), a deferred constraint that fails
// the COMMIT: the client's answer matches what committed, on both
// transactions, in both modes of claim.
func TestReviewFailuresInAndAtCommit(t *testing.T) { forBoth(t, testReviewFailuresInAndAtCommit) }

func testReviewFailuresInAndAtCommit(t *testing.T) {
	r := openReview(t, 2)
	watch := r.side(t)
	ctx := context.Background()
	_, err := r.db.ExecContext(ctx, `CREATE TABLE deferred (v int, CONSTRAINT deferred_v UNIQUE (v) DEFERRABLE INITIALLY DEFERRED);
		INSERT INTO deferred VALUES (1)`)
	require.NoError(t, err)
	insert := func(req *http.Request, tx sqlstore.Tx, name string) error {
		_, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, name)
		return err
	}
	for _, tt := range []struct {
		name   string
		handle func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx, key string)
		status int // the client's
		rows   int
		keySt  string // "" for none
	}{
		{"savepoint", func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx, key string) {
			_, err := tx.ExecContext(req.Context(), `SAVEPOINT a`)
			require.NoError(t, err)
			require.Error(t, insert(req, tx, key+"/1"), "a duplicate")
			_, err = tx.ExecContext(req.Context(), `ROLLBACK TO SAVEPOINT a`)
			require.NoError(t, err)
			require.NoError(t, insert(req, tx, key+"/2"))
			w.WriteHeader(201)
		}, 201, 2, "completed"},
		{"aborted then 201", func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx, key string) {
			require.Error(t, insert(req, tx, key+"/1"), "a duplicate")
			w.WriteHeader(201)
		}, 500, 1, "released"},
		{"aborted then 422", func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx, key string) {
			require.Error(t, insert(req, tx, key+"/1"), "a duplicate")
			w.WriteHeader(422)
		}, 422, 0, "completed"},
		{"deferred constraint", func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx, key string) {
			_, err := tx.ExecContext(req.Context(), `INSERT INTO deferred VALUES (1)`)
			require.NoError(t, err)
			w.WriteHeader(201)
		}, 500, 0, "released"},
	} {
		for _, oneTx := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s,onetx=%v", tt.name, oneTx), func(t *testing.T) {
				key := fmt.Sprintf("k-%s-%v", strings.ReplaceAll(tt.name, " ", "-"), oneTx)
				h := serve(r.db, idempotency.Options{OneTransaction: oneTx}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
					require.NoError(t, insert(req, tx, key+"/1"))
					tt.handle(w, req, tx, key)
				})
				rec := sendKey(h, key)
				assert.Equal(t, tt.status, rec.Code, "%s", rec.Body.String())
				rows := tt.rows
				if tt.rows == 1 && tt.status == 500 {
					rows = 0
				}
				assert.Equal(t, rows, countWrites(t, watch, key), "rows committed")
				var st string
				_ = watch.QueryRow(ctx, `SELECT status FROM idempotency_keys WHERE idempotency_key = $1`, key).Scan(&st)
				want := tt.keySt
				if oneTx && want == "released" {
					want = "" // its key went with the rollback
				}
				assert.Equal(t, want, st, "the key")
				assert.Equal(t, 0, r.db.Stats().InUse)
			})
		}
	}
}

// TestReviewHandlerSetsIsolation: in two commits, the handler's first
// statement begins the transaction, and may set its isolation level, as
// on a *sql.Tx: nothing the store sends with the BEGIN may take a
// snapshot before it.
func TestReviewHandlerSetsIsolation(t *testing.T) { forBoth(t, testReviewHandlerSetsIsolation) }

func testReviewHandlerSetsIsolation(t *testing.T) {
	r := openReview(t, 2)
	watch := r.side(t)
	var level string
	h := serve(r.db, idempotency.Options{}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
		if _, err := tx.ExecContext(req.Context(), `SET TRANSACTION ISOLATION LEVEL SERIALIZABLE`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if err := tx.QueryRowContext(req.Context(), `SHOW transaction_isolation`).Scan(&level); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ('k/1')`); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(201)
	})
	rec := sendKey(h, "k")
	assert.Equal(t, 201, rec.Code, "%s", rec.Body.String())
	assert.Equal(t, "serializable", level)
	assert.Equal(t, 1, countWrites(t, watch, "k"))
}

// TestReviewConcurrentKeyAndHammer: one key sent concurrently (in one
// transaction and in two commits) makes exactly one committed row; and a
// goroutine of the handler's that hammers its transaction (statements,
// rows, a prepared statement) while the middleware completes it either
// runs inside the transaction or fails: whatever ran before the
// completion commits with it, nothing after, and the pool comes back
// clean.
func TestReviewConcurrentKeyAndHammer(t *testing.T) { forBoth(t, testReviewConcurrentKeyAndHammer) }

func testReviewConcurrentKeyAndHammer(t *testing.T) {
	r := openReview(t, 4)
	watch := r.side(t)
	ctx := context.Background()
	for _, oneTx := range []bool{false, true} {
		t.Run(fmt.Sprintf("concurrent,onetx=%v", oneTx), func(t *testing.T) {
			key := fmt.Sprintf("c-%v", oneTx)
			var mu sync.Mutex
			ran := 0
			h := serve(r.db, idempotency.Options{OneTransaction: oneTx}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
				mu.Lock()
				ran++
				n := ran
				mu.Unlock()
				if _, err := tx.ExecContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`, fmt.Sprint(key, "/", n)); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				w.WriteHeader(201)
			})
			var wg sync.WaitGroup
			codes := make([]int, 12)
			for i := range codes {
				wg.Go(func() { codes[i] = sendKey(h, key).Code })
			}
			wg.Wait()
			ok := 0
			for _, c := range codes {
				if c == 201 {
					ok++
				}
			}
			assert.Equal(t, 1, countWrites(t, watch, key), "rows committed; codes %v", codes)
			assert.GreaterOrEqual(t, ok, 1, "codes %v", codes)
		})
		t.Run(fmt.Sprintf("hammer,onetx=%v", oneTx), func(t *testing.T) {
			for i := range 10 {
				key := fmt.Sprintf("h-%v-%d", oneTx, i)
				var stop sync.WaitGroup
				var mu sync.Mutex
				var okNames []string // the hammer's writes that succeeded
				h := serve(r.db, idempotency.Options{OneTransaction: oneTx}, func(w http.ResponseWriter, req *http.Request, tx sqlstore.Tx) {
					st, err := tx.PrepareContext(req.Context(), `INSERT INTO writes (name) VALUES ($1)`)
					if err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
					stop.Go(func() {
						for j := range 400 {
							name := fmt.Sprintf("%s/x%d", key, j)
							var err error
							switch j % 3 {
							case 0:
								_, err = st.ExecContext(ctx, name)
							case 1:
								_, err = tx.ExecContext(ctx, `INSERT INTO writes (name) VALUES ($1)`, name)
							case 2:
								var rows *sql.Rows
								if rows, err = tx.QueryContext(ctx, `INSERT INTO writes (name) VALUES ($1) RETURNING name`, name); err == nil {
									for rows.Next() {
									}
									err = rows.Close()
								}
							}
							if err == nil {
								mu.Lock()
								okNames = append(okNames, name)
								mu.Unlock()
							}
						}
					})
					time.Sleep(time.Duration(i) * time.Millisecond)
					w.WriteHeader(201)
				})
				rec := sendKey(h, key)
				stop.Wait()
				n := countWrites(t, watch, key)
				if rec.Code == 201 {
					// Every write that succeeded before the completion
					// committed; none after (they fail).
					assert.Equal(t, len(okNames), n, "request %d: rows committed, writes that succeeded", i)
				} else {
					assert.Equal(t, 0, n, "request %d got %d: rows committed", i, rec.Code)
				}
				assert.Equal(t, 0, r.db.Stats().InUse)
			}
			assert.Equal(t, 0, idleInTx(t, watch), "connections idle in a transaction")
		})
	}
}

// idleInTx returns how many connections of the test's database are idle
// in a transaction, once those the store closed have ended: the backend
// of a connection closed in a transaction rolls it back when it reads the
// close, a moment later (on a busy machine, a while), while one the pool
// kept in a transaction stays so (5 s at most).
func idleInTx(t *testing.T, watch *pgx.Conn) int {
	t.Helper()
	var n int
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		require.NoError(t, watch.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = current_setting('application_name') AND state LIKE 'idle in transaction%'`).Scan(&n))
		if n == 0 || time.Now().After(deadline) {
			return n
		}
	}
}
