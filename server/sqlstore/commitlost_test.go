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

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
)

// cutConn is a client socket the test can cut (reads fail with io.EOF
// after cut) and that drops a CancelRequest written on it, as a network
// that loses it would (see pgstore's TestLostCommitReadAfterItEnds).
type cutConn struct {
	net.Conn
	cut atomic.Bool
}

func (c *cutConn) Write(b []byte) (int, error) {
	if len(b) == 16 && b[4] == 0x04 && b[5] == 0xd2 && b[6] == 0x16 && b[7] == 0x2e {
		_ = c.Conn.Close()
		return len(b), nil
	}
	return c.Conn.Write(b)
}

func (c *cutConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if c.cut.Load() {
		return 0, io.EOF
	}
	return n, err
}

// TestLostCommitReadAfterItEnds is pgstore's test of the same name on
// sqlstore (pgx's database/sql driver): a COMMIT under way (a deferred
// trigger holds it at a gate until the store's check waits for it, or the
// client has its answer) when its client socket is cut and its
// CancelRequest lost. The Commit's error comes back as "conn closed",
// which does not read as a lost connection; any failed Commit is checked
// against the key, after the claim's advisory lock in one transaction, so
// the client is told the COMMIT landed.
func TestLostCommitReadAfterItEnds(t *testing.T) {
	for _, oneTx := range []bool{true, false} {
		t.Run(fmt.Sprintf("onetx=%v", oneTx), func(t *testing.T) {
			rdb := openCuttable(t, 1)
			db, url := rdb.db, rdb.url
			var logs syncBuf
			ctx := context.Background()
			g := pgtest.NewGate(t, url)
			_, err := db.ExecContext(ctx, `
CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN `+g.Wait()+`; RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON writes
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()`)
			require.NoError(t, err)
			h := idempotency.Middleware(sqlstore.New(db), idempotency.Options{OneTransaction: oneTx, Logger: slog.New(slog.NewTextHandler(&logs, nil))})(http.HandlerFunc(
				func(w http.ResponseWriter, r *http.Request) {
					tx, err := sqlstore.Tx(r.Context())
					if err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
					if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ('k/1')`); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
					w.WriteHeader(201)
				}))

			answered := make(chan struct{})
			lost := g.LoseCommit(rdb.cut, answered)
			r := httptest.NewRequestWithContext(idempotency.WithClientID(ctx, "cli_a"),
				"POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
			r.Header.Set("Idempotency-Key", "k")
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, r)
			close(answered)
			<-lost
			g.AwaitCommits(t)
			check, err := pgx.Connect(ctx, url)
			require.NoError(t, err)
			defer check.Close(ctx)
			var rows int
			require.NoError(t, check.QueryRow(ctx, `SELECT count(*) FROM writes WHERE name LIKE 'k/%'`).Scan(&rows))
			t.Logf("client got %d (%s); rows committed %d", rec.Code, strings.TrimSpace(rec.Body.String()), rows)
			t.Logf("logs: %s", logs.String())
			if ok := rec.Code >= 200 && rec.Code < 300; ok != (rows == 1) {
				t.Errorf("the client got %d, and %d rows are committed", rec.Code, rows)
			}
		})
	}
}

// cutDB is a pgx stdlib pool on a schema of its own (key table and
// writes table), whose client sockets the test can cut.
type cutDB struct {
	db  *sql.DB
	url string

	mu    sync.Mutex
	conns []*cutConn
}

func openCuttable(t *testing.T, maxOpen int) *cutDB {
	t.Helper()
	url := pgtest.SchemaURL(t)
	cfg, err := pgx.ParseConfig(url)
	require.NoError(t, err)
	r := &cutDB{url: url}
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		rc := &cutConn{Conn: c}
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
func (r *cutDB) cut() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.conns {
		c.cut.Store(true)
		_ = c.Conn.Close()
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
