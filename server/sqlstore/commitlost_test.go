package sqlstore_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
)

// reviewConn is a client socket the test can cut (reads fail with io.EOF
// after cut) and that drops a CancelRequest written on it, as a network
// that loses it would (see pgstore's TestLostCommitReadAfterItEnds).
type reviewConn struct {
	net.Conn
	cut atomic.Bool
}

func (c *reviewConn) Write(b []byte) (int, error) {
	if len(b) == 16 && b[4] == 0x04 && b[5] == 0xd2 && b[6] == 0x16 && b[7] == 0x2e {
		_ = c.Conn.Close()
		return len(b), nil
	}
	return c.Conn.Write(b)
}

func (c *reviewConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if c.cut.Load() {
		return 0, io.EOF
	}
	return n, err
}

// TestLostCommitReadAfterItEnds (found by a review) is pgstore's test of
// the same name on sqlstore (pgx's database/sql driver): a COMMIT under
// way (a deferred trigger makes it take 3 s) when its client socket is cut
// and its CancelRequest lost. It failed in both modes: the Commit's error
// came back as "conn closed", which did not read as a lost connection, so
// commitLocked never asked the key whether the COMMIT landed; the client
// got 500 "nothing of this request was committed", and 3 s later the row
// and the key were committed. Now any failed Commit is checked, after the
// claim's advisory lock in one transaction (see pgstore's test).
func TestLostCommitReadAfterItEnds(t *testing.T) { forBoth(t, testLostCommitReadAfterItEnds) }

func testLostCommitReadAfterItEnds(t *testing.T) {
	for _, oneTx := range []bool{true, false} {
		t.Run(fmt.Sprintf("onetx=%v", oneTx), func(t *testing.T) {
			rdb := openReview(t, 1)
			db, url := rdb.db, rdb.url
			var logs syncBuf
			ctx := context.Background()
			_, err := db.ExecContext(ctx, `
CREATE FUNCTION review_slow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER review_slow AFTER INSERT ON writes
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION review_slow()`)
			require.NoError(t, err)
			h := idempotency.Middleware(sqlstore.New(db), idempotency.Options{OneTransaction: oneTx, Logger: slog.New(slog.NewTextHandler(&logs, nil))})(http.HandlerFunc(
				func(w http.ResponseWriter, r *http.Request) {
					tx, _ := sqlstore.TxFromContext(r.Context())
					if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ('k/1')`); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
					w.WriteHeader(201)
				}))

			side, err := pgx.Connect(ctx, url)
			require.NoError(t, err)
			defer side.Close(ctx)
			polled := make(chan struct{})
			defer func() { <-polled }()
			go func() {
				defer close(polled)
				for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
					var n int
					_ = side.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
						WHERE wait_event = 'PgSleep' AND lower(query) = 'commit' AND application_name = current_setting('application_name')`).Scan(&n)
					if n > 0 {
						rdb.cut()
						return
					}
				}
			}()

			r := httptest.NewRequestWithContext(idempotency.WithClientID(ctx, "cli_a"),
				"POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
			r.Header.Set("Idempotency-Key", "k")
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, r)
			// Wait for the COMMIT under way to end (it sleeps 3 s).
			check, err := pgx.Connect(ctx, url)
			require.NoError(t, err)
			defer check.Close(ctx)
			for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
				var n int
				require.NoError(t, check.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
					WHERE wait_event = 'PgSleep' AND application_name = current_setting('application_name')`).Scan(&n))
				if n == 0 {
					break
				}
			}
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
