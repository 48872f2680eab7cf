package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// The tests of this file use the request's transaction as a careless or
// hostile handler would, through a real Middleware on a real Store and
// PostgreSQL, and check after each that the committed rows match what the
// client was told: a 2xx commits the handler's rows exactly once, however
// often the request is retried; any other answer commits nothing.

// service is a handler of one's own behind Middleware on a Store, which
// writes its rows (the writes table) through TxFromContext.
type service struct {
	pool    *pgxpool.Pool
	h       http.Handler
	logs    *syncBuffer // what the middleware logged
	attempt atomic.Int64
}

// newService serves handle behind Middleware on a Store on a fresh schema
// (configure sets up its pool, if not nil), with opts; the middleware logs
// to s.logs.
func newService(t *testing.T, opts idempotency.Options, configure func(*pgxpool.Config), handle func(w http.ResponseWriter, r *http.Request, tx pgx.Tx)) *service {
	t.Helper()
	store, pool := newStore(t, configure)
	s := &service{pool: pool, logs: &syncBuffer{}}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(s.logs, nil))
	}
	s.h = idempotency.Middleware(store, opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, ok := pgstore.TxFromContext(r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		handle(w, r, tx)
	}))
	return s
}

// send sends a keyed POST of client cli_a and returns the status the
// client got, or the handler's panic (status 0).
func (s *service) send(key string) (status int, panicked any) {
	return s.sendBody(key, `{"item":"book"}`)
}

// sendBody is send with another body.
func (s *service) sendBody(key, body string) (status int, panicked any) {
	r := httptest.NewRequestWithContext(idempotency.WithClientID(context.Background(), "cli_a"),
		"POST", "/v1/orders", strings.NewReader(body))
	r.Header.Set("Idempotency-Key", key)
	rec := httptest.NewRecorder()
	defer func() {
		if p := recover(); p != nil {
			status, panicked = 0, p
		}
	}()
	s.h.ServeHTTP(rec, r)
	return rec.Code, nil
}

// row is the name of a row the handler of key writes, labelled label,
// unique to each attempt, so that a row written twice under one key (a
// retry that ran again) shows as two rows.
func (s *service) row(r *http.Request, label string) string {
	return fmt.Sprintf("%s/%s/%d", r.Header.Get("Idempotency-Key"), label, s.attempt.Add(1))
}

// insert writes the row name through q.
func insert(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, name string) error {
	_, err := q.Exec(ctx, `INSERT INTO writes (name) VALUES ($1)`, name)
	return err
}

// committed returns the labels of the committed rows of key, sorted.
func (s *service) committed(t *testing.T, key string) []string {
	t.Helper()
	rows, err := s.pool.Query(context.Background(),
		`SELECT split_part(name, '/', 2) FROM writes WHERE name LIKE $1 || '/%' ORDER BY 1`, key)
	require.NoError(t, err)
	labels, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return labels
}

// mustMatch checks that the rows of key match what its client was told:
// want (the labels, each exactly once) after a 2xx, none otherwise.
func (s *service) mustMatch(t *testing.T, key string, status int, want ...string) {
	t.Helper()
	got := s.committed(t, key)
	if status >= 200 && status < 300 {
		assert.Equal(t, want, got, "rows of key %s, whose client got %d", key, status)
		return
	}
	assert.Empty(t, got, "rows of key %s, whose client got %d", key, status)
}

// mustReplay sends key again and checks that the client gets status,
// replayed, and that the rows are still want.
func (s *service) mustReplay(t *testing.T, key string, status int, want ...string) {
	t.Helper()
	got, p := s.send(key)
	require.Nil(t, p)
	assert.Equal(t, status, got, "retry of %s", key)
	s.mustMatch(t, key, got, want...)
}

// syncBuffer is a bytes.Buffer safe for concurrent writes, for logs.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// TestAbuseTransactionControl: a handler sends COMMIT, ROLLBACK and their
// kin itself, through every method of the transaction, of a savepoint and
// of a batch, alone or among other statements, and goes on writing and
// answers 201 (as the handler did after its raw ROLLBACK). Each is
// refused with ErrTxOwned before it is sent, the transaction goes on, and
// the rows written around it commit once with the key, so a retry replays
// them. Before the refusal, a raw ROLLBACK made the later writes
// autocommit, and every retry added a row.
func TestAbuseTransactionControl(t *testing.T) {
	statements := []string{
		"COMMIT", "commit", "END", "end transaction", "ABORT", "ROLLBACK", "rollback work",
		"COMMIT AND CHAIN", "ROLLBACK AND NO CHAIN", "PREPARE TRANSACTION 'tx1'", "COMMIT PREPARED 'tx1'",
		"/* a comment */ COMMIT", "-- a comment\nROLLBACK",
		"INSERT INTO writes (name) VALUES ('smuggled'); COMMIT",
		"SELECT ';' ; SELECT $q$ ; $q$; rollback",
	}
	type sender func(ctx context.Context, tx pgx.Tx, sql string) error
	senders := map[string]sender{
		"Exec": func(ctx context.Context, tx pgx.Tx, sql string) error {
			_, err := tx.Exec(ctx, sql)
			return err
		},
		"QueryRow": func(ctx context.Context, tx pgx.Tx, sql string) error {
			var x any
			return tx.QueryRow(ctx, sql).Scan(&x)
		},
		"Query": func(ctx context.Context, tx pgx.Tx, sql string) error {
			rows, err := tx.Query(ctx, sql)
			if err == nil {
				rows.Close()
			}
			return err
		},
		"SendBatch": func(ctx context.Context, tx pgx.Tx, sql string) error {
			b := &pgx.Batch{}
			b.Queue(`SELECT 1`)
			b.Queue(sql)
			return tx.SendBatch(ctx, b).Close()
		},
		"Prepare": func(ctx context.Context, tx pgx.Tx, sql string) error {
			_, err := tx.Prepare(ctx, "raw", sql)
			return err
		},
		"savepoint Exec": func(ctx context.Context, tx pgx.Tx, sql string) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			_, err = sp.Exec(ctx, sql)
			if rerr := sp.Commit(ctx); rerr != nil {
				return rerr
			}
			return err
		},
	}
	var refused atomic.Int64
	var current struct {
		sync.Mutex
		send sender
		sql  string
		when string // "first": as the transaction's first statement
	}
	var s *service
	s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		ctx := r.Context()
		current.Lock()
		send, sql, when := current.send, current.sql, current.when
		current.Unlock()
		if when != "first" {
			if err := insert(ctx, tx, s.row(r, "a")); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		if err := send(ctx, tx, sql); errors.Is(err, pgstore.ErrTxOwned) {
			refused.Add(1)
		} else {
			t.Errorf("%q: %v, want ErrTxOwned", sql, err)
		}
		// The handler: the error is ignored, the work goes on.
		if err := insert(ctx, tx, s.row(r, "b")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	n := 0
	for name, send := range senders {
		for _, when := range []string{"first", "after a write"} {
			for _, sql := range statements {
				n++
				key := fmt.Sprintf("k%d", n)
				current.Lock()
				current.send, current.sql, current.when = send, sql, when
				current.Unlock()
				status, p := s.send(key)
				require.Nil(t, p)
				want := []string{"a", "b"}
				if when == "first" {
					want = []string{"b"}
				}
				if !assert.Equal(t, http.StatusCreated, status, "%s %s %q", name, when, sql) {
					continue
				}
				s.mustMatch(t, key, status, want...)
				s.mustReplay(t, key, http.StatusCreated, want...)
			}
		}
	}
	assert.Equal(t, int64(n), refused.Load())
	var smuggled int
	require.NoError(t, s.pool.QueryRow(context.Background(), `SELECT count(*) FROM writes WHERE name = 'smuggled'`).Scan(&smuggled))
	assert.Zero(t, smuggled, "a statement sent in one text with a COMMIT")
}

// TestAbuseSavepointStatements: the statements a pgx.Tx takes that look
// like transaction control but stay inside the transaction run as usual:
// SAVEPOINT, ROLLBACK TO SAVEPOINT, RELEASE SAVEPOINT, and BEGIN (a no-op
// with a warning). What the handler rolled back to its savepoint is gone,
// the rest commits once with the key.
func TestAbuseSavepointStatements(t *testing.T) {
	var s *service
	s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		ctx := r.Context()
		for _, step := range []string{"BEGIN", "a", "SAVEPOINT s1", "dropped", "ROLLBACK TO SAVEPOINT s1",
			"rollback transaction to s1", "b", "RELEASE SAVEPOINT s1", "start transaction", "c"} {
			var err error
			if strings.ToLower(step) == step && !strings.Contains(step, " ") {
				err = insert(ctx, tx, s.row(r, step))
			} else {
				_, err = tx.Exec(ctx, step)
			}
			if err != nil {
				http.Error(w, step+": "+err.Error(), http.StatusInternalServerError)
				return
			}
		}
		w.WriteHeader(http.StatusCreated)
	})
	status, _ := s.send("k1")
	require.Equal(t, http.StatusCreated, status, s.logs.String())
	s.mustMatch(t, "k1", status, "a", "b", "c")
	s.mustReplay(t, "k1", http.StatusCreated, "a", "b", "c")
}

// TestAbuseConnBypass: a handler ends the transaction through its Conn,
// which pgstore cannot check before it is sent. Every later statement of
// the request fails, nothing autocommits after it, and the completion
// fails whatever the status, with a message that does not claim that
// nothing was committed. The Conn is closed once the request is over: the
// handler cannot use it in another request's transaction.
//
// What a raw COMMIT committed before it stays committed without the key's
// outcome: that is the limit of the Conn, documented on TxFromContext.
func TestAbuseConnBypass(t *testing.T) {
	kept := make(chan *pgx.Conn, 1)
	var later error
	var s *service
	s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		ctx := r.Context()
		verb := r.Header.Get("X-Verb")
		if err := insert(ctx, tx, s.row(r, "a")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		conn := tx.Conn()
		kept <- conn
		if _, err := conn.Exec(ctx, verb); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		later = insert(ctx, tx, s.row(r, "b")) // ignored, as a careless handler would
		w.WriteHeader(http.StatusCreated)
	})
	send := func(key, verb string) (int, string) {
		r := httptest.NewRequestWithContext(idempotency.WithClientID(context.Background(), "cli_a"),
			"POST", "/v1/orders", strings.NewReader(`{}`))
		r.Header.Set("Idempotency-Key", key)
		r.Header.Set("X-Verb", verb)
		rec := httptest.NewRecorder()
		s.h.ServeHTTP(rec, r)
		return rec.Code, rec.Body.String()
	}
	for i, verb := range []string{"ROLLBACK", "COMMIT"} {
		key := fmt.Sprintf("k%d", i)
		status, body := send(key, verb)
		// The client is told the truth: not "nothing was committed".
		assert.Contains(t, body, "may have been committed", "%s: the answer after the handler's %s", key, verb)
		assert.Error(t, later, "%s: a statement after the handler's %s", key, verb)
		assert.Equal(t, http.StatusInternalServerError, status, "%s: the handler's %s, then 201", key, verb)
		assert.Contains(t, s.logs.String(), "may have been committed without the key's outcome")
		conn := <-kept
		_, err := conn.Exec(context.Background(), `INSERT INTO writes (name) VALUES ($1)`, key+"/late/0")
		assert.Error(t, err, "a statement on the Conn after the request")
		got := s.committed(t, key)
		assert.NotContains(t, got, "b", "a write after the handler's %s", verb)
		assert.NotContains(t, got, "late")
		if verb == "ROLLBACK" {
			s.mustMatch(t, key, status) // nothing committed: true
		} else {
			assert.Equal(t, []string{"a"}, got, "the raw COMMIT committed what came before it (the Conn's limit)")
		}
	}
	// The pool lost no connection to it: a well-behaved request runs.
	s2 := newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	status, _ := s2.send("after")
	assert.Equal(t, http.StatusCreated, status)
}

// TestAbuseMultiCommand: a statement that holds two commands, without
// arguments, as the transaction's first statement or a later one, runs as
// on any pgx.Tx (before, as the first it always failed with 42601, being
// sent in the extended protocol with its BEGIN). Its rows commit once with
// the key. A syntax error in it aborts the transaction, at the position
// pgx would report, and a 201 over it commits nothing.
func TestAbuseMultiCommand(t *testing.T) {
	two := func(r *http.Request, s *service) string {
		return fmt.Sprintf(`INSERT INTO writes (name) VALUES ('%s'); INSERT INTO writes (name) VALUES ('%s')`,
			s.row(r, "m1"), s.row(r, "m2"))
	}
	var s *service
	s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		ctx := r.Context()
		if r.Header.Get("Idempotency-Key") == "later" {
			if err := insert(ctx, tx, s.row(r, "a")); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		tag, err := tx.Exec(ctx, two(r, s))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if tag.String() != "INSERT 0 1" {
			t.Errorf("command tag %q, want the last command's, INSERT 0 1", tag)
		}
		w.WriteHeader(http.StatusCreated)
	})
	for key, want := range map[string][]string{"first": {"m1", "m2"}, "later": {"a", "m1", "m2"}} {
		status, _ := s.send(key)
		require.Equal(t, http.StatusCreated, status, "%s: %s", key, s.logs.String())
		s.mustMatch(t, key, status, want...)
		s.mustReplay(t, key, http.StatusCreated, want...)
	}

	// A syntax error (PostgreSQL runs none of the text), and an unknown
	// column (found when the second command runs, after the first).
	for bad, at := range map[string]string{
		`INSERT INTO writes (name) VALUES ('x'); INSERT INTO writes (name) VALUS ('y')`: "VALUS",
		`INSERT INTO writes (name) VALUES ('x'); INSERT INTO writes (nom) VALUES ('y')`: "nom",
	} {
		var pos int32
		var afterErr error
		s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
			_, err := tx.Exec(r.Context(), bad)
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) {
				pos = pgErr.Position
			}
			afterErr = insert(r.Context(), tx, s.row(r, "a"))
			w.WriteHeader(http.StatusCreated) // a careless handler: 201 anyway
		})
		status, _ := s.send("bad")
		assert.Equal(t, int32(strings.Index(bad, at)+1), pos, "position of the error in %q", bad)
		assert.Error(t, afterErr, "a write in the aborted transaction")
		assert.Equal(t, http.StatusInternalServerError, status)
		s.mustMatch(t, "bad", status)
		mustBeWritten(t, s.pool, "x", false) // the first command of the text
	}
}

// TestAbuseClientSideError: the first statement fails before it reaches
// PostgreSQL (an argument pgx cannot encode), as Exec, QueryRow or a
// statement of a batch: as on any pgx.Tx, nothing happened, the
// transaction goes on, and the handler's next writes commit once with the
// key. Before, the error of that first statement came back from every
// later one.
func TestAbuseClientSideError(t *testing.T) {
	unencodable := make(chan int)
	fail := map[string]func(ctx context.Context, tx pgx.Tx) error{
		"Exec": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO writes (name) VALUES ($1)`, unencodable)
			return err
		},
		"QueryRow": func(ctx context.Context, tx pgx.Tx) error {
			var name string
			return tx.QueryRow(ctx, `INSERT INTO writes (name) VALUES ($1) RETURNING name`, unencodable).Scan(&name)
		},
		"ExecArgCount": func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO writes (name) VALUES ($1) ON CONFLICT DO NOTHING`, "x", "y")
			return err
		},
	}
	var failure atomic.Value
	var s *service
	s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		ctx := r.Context()
		if err := failure.Load().(func(context.Context, pgx.Tx) error)(ctx, tx); err == nil {
			t.Errorf("%s: the failing statement succeeded", r.Header.Get("Idempotency-Key"))
		}
		if err := insert(ctx, tx, s.row(r, "a")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	for name, f := range fail {
		failure.Store(f)
		status, _ := s.send(name)
		require.Equal(t, http.StatusCreated, status, "%s: %s", name, s.logs.String())
		s.mustMatch(t, name, status, "a")
		s.mustReplay(t, name, http.StatusCreated, "a")
	}
}

// TestAbuseServerSideFirstError: the first statement names a table that
// does not exist, which PostgreSQL refuses when pgx prepares it, before
// the BEGIN that travels with it runs. As on any pgx.Tx, the transaction
// is aborted: the next write fails, and a 201 over it commits nothing.
func TestAbuseServerSideFirstError(t *testing.T) {
	var next error
	var s *service
	s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		ctx := r.Context()
		if _, err := tx.Exec(ctx, `INSERT INTO no_such_table (name) VALUES ($1)`, "x"); err == nil {
			t.Error("insert into a missing table succeeded")
		}
		next = insert(ctx, tx, s.row(r, "a"))
		w.WriteHeader(http.StatusCreated)
	})
	status, _ := s.send("k1")
	var pgErr *pgconn.PgError
	if assert.ErrorAs(t, next, &pgErr) {
		assert.Equal(t, "25P02", pgErr.Code, "a write after the failed first statement: in_failed_sql_transaction")
	}
	assert.Equal(t, http.StatusInternalServerError, status)
	s.mustMatch(t, "k1", status)
}

// TestAbuseQueryRow: QueryRow runs its statement once, when it is called,
// as pgx's does. An INSERT ... RETURNING scanned twice inserts one row
// (the second Scan returns pgx.ErrNoRows); one never scanned still
// inserts its row, and leaves the transaction usable. Before, every Scan
// ran the statement again.
func TestAbuseQueryRow(t *testing.T) {
	const returning = `INSERT INTO writes (name) VALUES ($1) RETURNING name`
	var s *service
	s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		ctx := r.Context()
		fail := func(err error) { http.Error(w, err.Error(), http.StatusInternalServerError) }
		if r.Header.Get("Idempotency-Key") == "later" {
			if err := insert(ctx, tx, s.row(r, "a")); err != nil {
				fail(err)
				return
			}
		}
		row := tx.QueryRow(ctx, returning, s.row(r, "twice"))
		var name string
		if err := row.Scan(&name); err != nil {
			fail(err)
			return
		}
		if err := row.Scan(&name); !errors.Is(err, pgx.ErrNoRows) {
			t.Errorf("second Scan: %v, want pgx.ErrNoRows", err)
		}
		tx.QueryRow(ctx, returning, s.row(r, "never")) // never scanned
		if err := insert(ctx, tx, s.row(r, "z")); err != nil {
			fail(err)
			return
		}
		// A failing statement's error comes from Scan.
		if err := tx.QueryRow(ctx, `SELECT 1/0`).Scan(&name); err == nil {
			t.Error("QueryRow of 1/0 scanned without error")
		}
		w.WriteHeader(http.StatusCreated)
	})
	for key, want := range map[string][]string{"first": {"never", "twice", "z"}, "later": {"a", "never", "twice", "z"}} {
		status, _ := s.send(key)
		// The 1/0 aborted the transaction: a 201 over it commits nothing.
		assert.Equal(t, http.StatusInternalServerError, status, key)
		s.mustMatch(t, key, status, want...)
	}

	// Without the failing statement: the rows commit, once.
	s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		ctx := r.Context()
		row := tx.QueryRow(ctx, returning, s.row(r, "twice"))
		var name string
		for range 3 {
			_ = row.Scan(&name)
		}
		tx.QueryRow(ctx, returning, s.row(r, "never"))
		w.WriteHeader(http.StatusCreated)
	})
	status, _ := s.send("k1")
	require.Equal(t, http.StatusCreated, status, s.logs.String())
	s.mustMatch(t, "k1", status, "never", "twice")
	s.mustReplay(t, "k1", http.StatusCreated, "never", "twice")
}

// TestAbuseOutlivingGoroutine: a handler leaves behind a goroutine that
// keeps its transaction, a savepoint, open rows, a batch and a row of
// QueryRow, and uses them once the request is over, while another
// request's transaction is open on the same pooled connection (a pool of
// one). Every late call fails, and none of them lands in the other
// request's transaction, which commits only its own row. Before, a late
// write through the savepoint ran inside the other request's transaction
// and committed with its 201.
func TestAbuseOutlivingGoroutine(t *testing.T) {
	type kept struct {
		tx, sp pgx.Tx
		row    pgx.Row
		lo     pgx.LargeObjects
	}
	keep := make(chan kept, 1)
	holding := make(chan struct{})
	release := make(chan struct{})
	var s *service
	s = newService(t, idempotency.Options{}, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 },
		func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
			ctx := r.Context()
			if r.Header.Get("Idempotency-Key") == "b" { // the other request: holds its transaction open
				if err := insert(ctx, tx, s.row(r, "b")); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				close(holding)
				<-release
				w.WriteHeader(http.StatusCreated)
				return
			}
			var k kept
			k.tx = tx
			var err error
			if k.sp, err = tx.Begin(ctx); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if err := insert(ctx, k.sp, s.row(r, "a")); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			k.row = tx.QueryRow(ctx, `SELECT 'x'`)
			k.lo = tx.LargeObjects()
			keep <- k
			w.WriteHeader(http.StatusServiceUnavailable) // nothing of a is committed
		})
	status, _ := s.send("a")
	require.Equal(t, http.StatusServiceUnavailable, status)
	k := <-keep

	done := make(chan struct{})
	go func() {
		defer close(done)
		s.send("b")
	}()
	<-holding // b's transaction is open, on the pool's one connection
	ctx := context.Background()
	var x string
	assert.Error(t, insert(ctx, k.sp, "a/late/0"), "late write through the savepoint")
	assert.Error(t, insert(ctx, k.tx, "a/late/0"), "late write through the transaction")
	_, err := k.sp.Begin(ctx)
	assert.Error(t, err, "late savepoint of a savepoint")
	_, err = k.tx.Begin(ctx)
	assert.Error(t, err, "late savepoint")
	assert.Error(t, k.sp.Commit(ctx), "late release of the savepoint")
	assert.Error(t, k.tx.QueryRow(ctx, `SELECT 'x'`).Scan(&x), "late QueryRow")
	assert.Error(t, k.row.Scan(&x), "late Scan of a row read during the request")
	_, err = k.tx.Query(ctx, `SELECT 1`)
	assert.Error(t, err, "late Query")
	assert.Error(t, k.tx.SendBatch(ctx, &pgx.Batch{QueuedQueries: []*pgx.QueuedQuery{{SQL: `SELECT 1`}}}).Close(), "late batch")
	assert.Nil(t, k.tx.Conn(), "late Conn")
	_, err = k.lo.Create(ctx, 0)
	assert.Error(t, err, "late large object, from the request")
	lo := k.tx.LargeObjects()
	_, err = lo.Create(ctx, 0)
	assert.Error(t, err, "late large object")
	_, err = k.tx.CopyFrom(ctx, pgx.Identifier{"writes"}, []string{"name"}, pgx.CopyFromRows([][]any{{"a/late/1"}}))
	assert.Error(t, err, "late CopyFrom")
	close(release)
	<-done
	s.mustMatch(t, "a", http.StatusServiceUnavailable)
	assert.Equal(t, []string{"b"}, s.committed(t, "b"), "the other request's rows")
}

// TestAbuseOutlivingRows: rows and a batch obtained during the request and
// read after it fail instead of reading a connection that another request
// may use; the request that left them open fails its completion (as a
// pgx.Tx's Commit does with rows open), commits nothing, and the pool gets
// no connection in an unknown state back.
func TestAbuseOutlivingRows(t *testing.T) {
	type kept struct {
		rows pgx.Rows
		br   pgx.BatchResults
	}
	keep := make(chan kept, 2)
	var s *service
	s = newService(t, idempotency.Options{}, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 },
		func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
			ctx := r.Context()
			if err := insert(ctx, tx, s.row(r, "a")); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			switch r.Header.Get("Idempotency-Key") {
			case "rows":
				rows, err := tx.Query(ctx, `SELECT generate_series(1, 3)`)
				if err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				rows.Next()
				keep <- kept{rows: rows}
			case "batch":
				b := &pgx.Batch{}
				b.Queue(`SELECT 1`)
				b.Queue(`SELECT 2`)
				br := tx.SendBatch(ctx, b)
				keep <- kept{br: br}
			}
			w.WriteHeader(http.StatusCreated)
		})
	status, _ := s.send("rows")
	assert.Equal(t, http.StatusInternalServerError, status, "rows left open")
	s.mustMatch(t, "rows", status)
	k := <-keep
	assert.False(t, k.rows.Next(), "late Next")
	assert.Error(t, k.rows.Err())
	var n int
	assert.Error(t, k.rows.Scan(&n), "late Scan")
	assert.Nil(t, k.rows.RawValues())
	k.rows.Close()

	status, _ = s.send("batch")
	assert.Equal(t, http.StatusInternalServerError, status, "batch left open")
	s.mustMatch(t, "batch", status)
	k = <-keep
	_, err := k.br.Exec()
	assert.Error(t, err, "late batch Exec")
	assert.Error(t, k.br.Close(), "late batch Close")

	status, _ = s.send("after")
	assert.Equal(t, http.StatusCreated, status, "a request after them, on the pool of one: %s", s.logs.String())
	s.mustMatch(t, "after", status, "a")
}

// TestAbuseConcurrentUse: a handler uses its transaction from several
// goroutines at once. A call made while another runs fails instead of
// racing on the connection (go test -race finds no race); the writes that
// succeeded commit once with the key, and those that failed do not.
func TestAbuseConcurrentUse(t *testing.T) {
	var ok atomic.Int64
	var s *service
	s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for range 10 {
					if insert(r.Context(), tx, s.row(r, "w")) == nil {
						ok.Add(1)
					}
				}
			})
		}
		wg.Wait()
		w.WriteHeader(http.StatusCreated)
	})
	status, _ := s.send("k1")
	require.Equal(t, http.StatusCreated, status, s.logs.String())
	got := s.committed(t, "k1")
	assert.Len(t, got, int(ok.Load()), "committed rows, against the writes that succeeded")
	assert.NotZero(t, ok.Load())
	s.mustReplay(t, "k1", http.StatusCreated, got...)
}

// TestAbusePanicAfterWrite: a handler panics after writing. Nothing is
// committed, the panic goes on up, and the retry (which does not panic)
// runs again and commits its row once.
func TestAbusePanicAfterWrite(t *testing.T) {
	var panics atomic.Bool
	panics.Store(true)
	var s *service
	s = newService(t, idempotency.Options{}, nil, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if panics.Swap(false) {
			panic("after the write")
		}
		w.WriteHeader(http.StatusCreated)
	})
	status, p := s.send("k1")
	assert.Equal(t, "after the write", p)
	s.mustMatch(t, "k1", status)
	status, p = s.send("k1")
	require.Nil(t, p)
	assert.Equal(t, http.StatusCreated, status)
	s.mustMatch(t, "k1", status, "a")
	s.mustReplay(t, "k1", http.StatusCreated, "a")
}

// TestAbuseSerializable: under REPEATABLE READ or SERIALIZABLE (the
// database's default, or set by the handler's first or a later
// statement), a handler holds its transaction across lease renewals while
// a duplicate waits for it (WaitForCompletion). The completion commits
// and the duplicate gets the replay: one row. Before, the renewal's update
// of the key row made every such completion fail with 40001, and each
// retry ran the handler again and failed the same way.
func TestAbuseSerializable(t *testing.T) {
	const lease = 3 * time.Second // renewed every second; the handler sleeps two (a busy machine may add to it)
	for _, tt := range []struct {
		name      string
		isolation string   // the pool's default_transaction_isolation
		sets      []string // the handler's statements before its write
	}{
		{"database default", "serializable", nil},
		{"SET TRANSACTION first", "", []string{"SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"}},
		{"SET TRANSACTION after another SET", "", []string{"SET LOCAL lock_timeout = '5s'", "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var s *service
			s = newService(t, idempotency.Options{LockTimeout: lease, WaitForCompletion: 10 * time.Second},
				withIsolation(tt.isolation), func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
					ctx := r.Context()
					for _, set := range tt.sets {
						if _, err := tx.Exec(ctx, set); err != nil {
							http.Error(w, err.Error(), http.StatusInternalServerError)
							return
						}
					}
					if err := insert(ctx, tx, s.row(r, "a")); err != nil {
						http.Error(w, err.Error(), http.StatusInternalServerError)
						return
					}
					time.Sleep(2 * lease / 3) // across renewals, within the lease
					w.WriteHeader(http.StatusCreated)
				})
			statuses := make(chan int, 2)
			var wg sync.WaitGroup
			for i := range 2 {
				wg.Go(func() {
					time.Sleep(time.Duration(i) * 100 * time.Millisecond) // the second is the duplicate
					status, _ := s.send("k1")
					statuses <- status
				})
			}
			wg.Wait()
			close(statuses)
			for status := range statuses {
				assert.Equal(t, http.StatusCreated, status, s.logs.String())
			}
			s.mustMatch(t, "k1", http.StatusCreated, "a")
		})
	}
}
