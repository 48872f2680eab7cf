package pgstore_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// service is a handler of one's own behind Middleware on a Store, which
// writes its rows (the writes table) through pgstore.Tx, for the tests
// that check, through a real Middleware on a real Store and PostgreSQL,
// that the committed rows match what the client was told.
type service struct {
	store   *pgstore.Store
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
	s := &service{store: store, pool: pool, logs: &syncBuffer{}}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(s.logs, nil))
	}
	s.h = idempotency.Middleware(store, opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := pgstore.Tx(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
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
