package sqlstoretest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
)

// service is a handler behind Middleware on a sqlstore Store, writing its
// rows (the writes table) through sqlstore.Tx.
type service struct {
	db *sql.DB
	h  http.Handler
}

// newService serves handle behind Middleware on a Store on db.
func newService(db *sql.DB, store idempotency.Store, opts idempotency.Options, handle func(w http.ResponseWriter, r *http.Request, tx *sql.Tx)) *service {
	s := &service{db: db}
	s.h = idempotency.Middleware(store, opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := sqlstore.Tx(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		handle(w, r, tx)
	}))
	return s
}

// send sends a keyed POST of client cli_a and returns the response, or
// the handler's panic.
func send(h http.Handler, key string) (rec *httptest.ResponseRecorder, panicked any) {
	r := httptest.NewRequestWithContext(idempotency.WithClientID(context.Background(), "cli_a"),
		"POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
	r.Header.Set("Idempotency-Key", key)
	rec = httptest.NewRecorder()
	defer func() { panicked = recover() }()
	h.ServeHTTP(rec, r)
	return rec, nil
}

// rows returns how many rows of key are committed.
func rows(t *testing.T, db *sql.DB, key string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRowContext(context.Background(),
		`SELECT count(*) FROM writes WHERE name LIKE $1 || '/%'`, key).Scan(&n))
	return n
}

// keyStatus returns the status of key of cli_a, "" if it has no row.
func keyStatus(t *testing.T, db *sql.DB, key string) string {
	t.Helper()
	var st string
	err := db.QueryRowContext(context.Background(),
		`SELECT status FROM idempotency_keys WHERE client_id = 'cli_a' AND idempotency_key = $1`, key).Scan(&st)
	if errors.Is(err, sql.ErrNoRows) {
		return ""
	}
	require.NoError(t, err)
	return st
}

// testHandlerRows: the handler's rows commit with a stored outcome, once
// however often the key is retried, and roll back when the outcome is not
// stored: a released 4xx, a 5xx, a panic, a fenced completion (the key
// taken from the handler while it ran).
func testHandlerRows(t *testing.T, driver string) {
	db := Open(t, driver)
	store := sqlstore.New(db)
	ctx := context.Background()
	for _, tt := range []struct {
		name   string
		answer func(w http.ResponseWriter, r *http.Request)
		status int // the first answer's status the client gets
		rows   int // the rows committed
		key    string
	}{
		{name: "created", status: 201, rows: 1, answer: func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(201) }},
		{name: "stored 4xx", status: 422, rows: 1, answer: func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(422) }},
		{name: "released 4xx", status: 400, answer: func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(400) }},
		{name: "5xx", status: 503, answer: func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(503) }},
		{name: "panic", answer: func(http.ResponseWriter, *http.Request) { panic("handler failed") }},
		{name: "fenced", status: 409, answer: func(w http.ResponseWriter, r *http.Request) {
			// Another owner took the key meanwhile (as a takeover does).
			_, err := db.ExecContext(ctx, `UPDATE idempotency_keys SET lock_token = lock_token + 1000000
				WHERE idempotency_key = $1`, r.Header.Get("Idempotency-Key"))
			if err != nil {
				panic(err)
			}
			w.WriteHeader(201)
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			key := "key-" + strings.ReplaceAll(tt.name, " ", "-")
			attempt := 0
			s := newService(db, store, idempotency.Options{}, func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
				attempt++
				_, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, fmt.Sprintf("%s/%d", key, attempt))
				if err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				tt.answer(w, r)
			})
			rec, p := send(s.h, key)
			if tt.name == "panic" {
				assert.NotNil(t, p, "the handler's panic")
			} else {
				assert.Equal(t, tt.status, rec.Code)
			}
			assert.Equal(t, tt.rows, rows(t, db, key), "rows committed")
			if tt.rows > 0 { // a retry replays, and writes nothing
				rec, _ := send(s.h, key)
				assert.Equal(t, tt.status, rec.Code, "the retry")
				assert.Equal(t, "true", rec.Header().Get("Idempotent-Replayed"))
				assert.Equal(t, tt.rows, rows(t, db, key), "rows committed after the retry")
			}
		})
	}
}

// testConcurrentKey: one key sent concurrently by many clients makes one
// row: one request runs, the others get 409 or the replay.
func testConcurrentKey(t *testing.T, driver string) {
	db := Open(t, driver)
	var mu sync.Mutex
	ran := 0
	s := newService(db, sqlstore.New(db), idempotency.Options{}, func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
		mu.Lock()
		ran++
		n := ran
		mu.Unlock()
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, fmt.Sprint("key-1/", n)); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(201)
	})
	var wg sync.WaitGroup
	codes := make([]int, 16)
	for i := range codes {
		wg.Go(func() {
			rec, _ := send(s.h, "key-1")
			codes[i] = rec.Code
		})
	}
	wg.Wait()
	for _, c := range codes {
		if c != 201 && c != 409 {
			t.Errorf("a request got %d, want 201 or 409", c)
		}
	}
	assert.Equal(t, 1, ran, "handlers run")
	assert.Equal(t, 1, rows(t, db, "key-1"), "rows committed")
}

// testResponseFidelity: the stored response comes back byte for byte:
// a body with NUL bytes and invalid UTF-8, headers (jsonb) with quotes and
// non-ASCII text; and no headers (SQL NULL) comes back as none.
func testResponseFidelity(t *testing.T, driver string) {
	db := Open(t, driver)
	s := sqlstore.New(db)
	ctx := context.Background()
	for i, resp := range []idempotency.StoredResponse{
		{Status: 201, ContentType: "application/octet-stream", Body: []byte("a\x00b\xff\xfe\x80\"'\\ z"),
			Header: map[string]string{"Location": `/v1/orders/"o\1"`, "X-Note": "café ☕, ok"}},
		{Status: 200, ContentType: "", Body: nil, Header: nil},
		{Status: 204, ContentType: "text/plain; charset=utf-8", Body: []byte{}, Header: map[string]string{}},
	} {
		req := idempotency.ClaimRequest{ClientID: "cli_a", Key: fmt.Sprint("key-", i), Method: "POST", Path: "/v1/orders",
			Fingerprint: []byte{0, 1, 0xff, 0}, LockTimeout: time.Minute, Retention: time.Hour}
		res, err := s.Claim(ctx, req)
		require.NoError(t, err)
		require.Equal(t, idempotency.Claimed, res.Outcome)
		tx, err := s.Begin(ctx, res.Claim)
		require.NoError(t, err)
		require.NoError(t, tx.Complete(ctx, resp))
		again, err := s.Claim(ctx, req)
		require.NoError(t, err)
		require.Equal(t, idempotency.Exists, again.Outcome)
		rec := again.Record
		assert.Equal(t, req.Fingerprint, rec.Fingerprint, "fingerprint")
		assert.Equal(t, idempotency.StatusCompleted, rec.Status)
		assert.False(t, rec.CreatedAt.IsZero() || rec.LockedAt.Before(rec.CreatedAt), "times %v, %v", rec.CreatedAt, rec.LockedAt)
		got := rec.Response
		require.NotNil(t, got)
		assert.Equal(t, resp.Status, got.Status)
		assert.Equal(t, resp.ContentType, got.ContentType)
		assert.Equal(t, string(resp.Body), string(got.Body), "body")
		if len(resp.Header) == 0 {
			assert.Empty(t, got.Header, "headers")
		} else {
			assert.Equal(t, resp.Header, got.Header, "headers")
		}
	}
}

// unit claims key and returns its unit of work and the context a handler
// of it gets.
func unit(t *testing.T, s *sqlstore.Store, key string) (idempotency.Tx, context.Context) {
	t.Helper()
	ctx := context.Background()
	res, err := s.Claim(ctx, idempotency.ClaimRequest{ClientID: "cli_a", Key: key, Method: "POST", Path: "/v1/orders",
		Fingerprint: []byte("a"), LockTimeout: time.Minute})
	require.NoError(t, err)
	require.Equal(t, idempotency.Claimed, res.Outcome)
	tx, err := s.Begin(ctx, res.Claim)
	require.NoError(t, err)
	return tx, idempotency.NewContext(ctx, res.Claim, tx)
}

// testCancelMidStatement: a statement of the handler's whose context ends
// while it runs fails; the handler's success then fails the completion,
// nothing is committed, and the key is released, not left started or
// completed; the retry runs again and commits.
func testCancelMidStatement(t *testing.T, driver string) {
	db := Open(t, driver)
	attempt := 0
	s := newService(db, sqlstore.New(db), idempotency.Options{}, func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
		attempt++
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, fmt.Sprint("key-1/", attempt)); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if attempt == 1 {
			ctx, cancel := context.WithCancel(r.Context())
			go func() {
				waitRunning(db, "pg_sleep(30)")
				cancel()
			}()
			if _, err := tx.ExecContext(ctx, `SELECT pg_sleep(30)`); err == nil {
				panic("the canceled statement succeeded")
			}
		}
		w.WriteHeader(201) // the handler ignores the error
	})
	rec, _ := send(s.h, "key-1")
	assert.Equal(t, 500, rec.Code, "the first attempt")
	assert.Equal(t, 0, rows(t, db, "key-1"), "rows of the canceled attempt")
	assert.Equal(t, "released", keyStatus(t, db, "key-1"))
	rec, _ = send(s.h, "key-1")
	assert.Equal(t, 201, rec.Code, "the retry")
	assert.Equal(t, 1, rows(t, db, "key-1"), "rows after the retry")
}

// waitRunning waits until a statement holding text runs on a session of
// the test's (see pgtest.SchemaURL's application_name).
func waitRunning(db *sql.DB, text string) {
	for range 1000 {
		var n int
		_ = db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()
			AND application_name = current_setting('application_name')`, text).Scan(&n)
		if n > 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// testConnLost: PostgreSQL ends every connection of the pool
// (pg_terminate_backend, as a restart does); the next claim, renewal and
// completion run again on a live connection and succeed.
func testConnLost(t *testing.T, driver string) {
	db, url := OpenURL(t, driver)
	db.SetMaxIdleConns(4)
	s := sqlstore.New(db)
	ctx := context.Background()
	kill := func() {
		t.Helper()
		var conns []*sql.Conn
		for len(conns) < 3 { // fill the pool with live idle connections
			c, err := db.Conn(ctx)
			require.NoError(t, err)
			if c.PingContext(ctx) != nil {
				c.Close() // one the last kill ended
				continue
			}
			conns = append(conns, c)
		}
		var pids []int64
		for _, c := range conns {
			var pid int64
			require.NoError(t, c.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
			pids = append(pids, pid)
			c.Close()
		}
		side := open(t, driver, url)
		for _, pid := range pids {
			_, err := side.ExecContext(ctx, `SELECT pg_terminate_backend($1, 5000)`, pid)
			require.NoError(t, err)
		}
	}
	kill()
	u, hctx := unit(t, s, "key-1")
	_ = hctx
	kill()
	res, err := s.Claim(ctx, idempotency.ClaimRequest{ClientID: "cli_a", Key: "key-1", Method: "POST", Path: "/v1/orders",
		Fingerprint: []byte("a"), LockTimeout: time.Minute})
	require.NoError(t, err, "a claim after the connections were ended")
	assert.Equal(t, idempotency.Exists, res.Outcome)
	kill()
	require.NoError(t, u.Complete(ctx, idempotency.StoredResponse{Status: 201}), "a completion after the connections were ended")
	assert.Equal(t, "completed", keyStatus(t, db, "key-1"))

	// The connection ends under a release that was sent, and waits for
	// the key's row, locked by another transaction: the release runs
	// again on a live connection, and releases the key.
	db.SetMaxIdleConns(0) // drops the idle connections the kills ended
	db.SetMaxIdleConns(4)
	res, err = s.Claim(ctx, idempotency.ClaimRequest{ClientID: "cli_a", Key: "key-2", Method: "POST", Path: "/v1/orders",
		Fingerprint: []byte("a"), LockTimeout: time.Minute})
	require.NoError(t, err)
	side := open(t, driver, url)
	lock, err := side.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = lock.ExecContext(ctx, `SELECT FROM idempotency_keys WHERE idempotency_key = 'key-2' FOR UPDATE`)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- s.Release(ctx, res.Claim, idempotency.ReleaseFailed) }()
	waitRunning(db, "SET status = 'released'")
	_, err = side.ExecContext(ctx, `SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
		WHERE state = 'active' AND query LIKE '%SET status = ''released''%' AND pid <> pg_backend_pid()
			AND application_name = current_setting('application_name')`)
	require.NoError(t, err)
	require.NoError(t, lock.Rollback())
	require.NoError(t, <-done, "a release whose connection ended under it")
	assert.Equal(t, "released", keyStatus(t, db, "key-2"))
}

// testSerializableRenewal: on a database whose
// default_transaction_isolation is serializable, a lease renewal while
// the handler's transaction is open (after its snapshot) only checks that
// the claim owns the key, so the completion commits; a renewal that
// updated the key row would make it fail with a serialization failure.
func testSerializableRenewal(t *testing.T, driver string) {
	db := openAt(t, driver, "serializable")
	s := sqlstore.New(db)
	ctx := context.Background()
	u, hctx := unit(t, s, "key-1")
	require.NoError(t, write(hctx, "key-1/1")) // the snapshot is taken
	c, _ := idempotency.ClaimFromContext(hctx)
	require.NoError(t, s.Renew(ctx, c))
	require.NoError(t, u.Complete(ctx, idempotency.StoredResponse{Status: 201}), "a completion after a renewal under SERIALIZABLE")
	ok, err := written(ctx, db, "key-1/1")
	require.NoError(t, err)
	assert.True(t, ok, "the handler's row committed")
	assert.Equal(t, "completed", keyStatus(t, db, "key-1"))
}
