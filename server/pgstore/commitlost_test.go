package pgstore_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
)

// cutConn is a client socket the test can cut: after cut, its reads fail
// with io.EOF (a connection the network lost), while the server side goes
// on with what it received.
type cutConn struct {
	net.Conn
	cut atomic.Bool
}

// Write drops a CancelRequest (pgconn sends one, on a new connection,
// when a read fails): it would cancel the COMMIT's trigger. A COMMIT past
// the point a cancel reaches (waiting for a synchronous standby, say)
// commits anyway, and so does one whose cancel the network loses, which
// this plays.
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

// TestLostCommitReadAfterItEnds (found by a review): Complete learns whether a COMMIT whose answer was lost landed from
// the key (hasStatusUnder, FOR SHARE). In two-commit mode the key row
// exists and FOR SHARE waits for the committing transaction; in one
// transaction the key is an uncommitted INSERT that the check's snapshot
// does not see and does not wait for. So a COMMIT still under way when the
// connection is lost reads as "nothing committed": the client gets 500
// saying "nothing of this request was committed", and then the COMMIT
// lands, rows and key. No double run (the retry is Busy, then replays),
// but the client was told a falsehood about money.
//
// Sequence: the handler inserts its row and answers 201; a deferred
// constraint trigger on writes makes the COMMIT take 3 s in the server
// (any slow commit: synchronous replication, fsync); while the backend is in
// it, the client socket is cut; commitLocked's check runs on a new
// connection, found no key, and Complete failed; 3 s later the COMMIT
// landed: the client got 500 and one row was committed. The check now
// waits for the claim's advisory lock first (keysql.WaitKeyLockSQL), which
// the committing transaction holds until it ends, and the client gets 201.
//
// The subtest onetx=false is the control: the same cut in two-commit mode
// passes (the check waits for the COMMIT under way, and the client gets
// 201).
func TestLostCommitReadAfterItEnds(t *testing.T) {
	for _, oneTx := range []bool{true, false} {
		t.Run(fmt.Sprintf("onetx=%v", oneTx), func(t *testing.T) { reviewCommitLost(t, oneTx) })
	}
}

func reviewCommitLost(t *testing.T, oneTx bool) {
	var mu sync.Mutex
	var conns []*cutConn
	var s *service
	s = newService(t, idempotency.Options{OneTransaction: oneTx}, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 1
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			cc := &cutConn{Conn: c}
			mu.Lock()
			conns = append(conns, cc)
			mu.Unlock()
			return cc, nil
		}
	}, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(201)
	})
	ctx := context.Background()
	_, err := s.pool.Exec(ctx, `
CREATE FUNCTION review_slow() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(3); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER review_slow AFTER INSERT ON writes
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION review_slow()`)
	require.NoError(t, err)

	side, err := pgx.Connect(ctx, s.pool.Config().ConnConfig.ConnString())
	require.NoError(t, err)
	defer side.Close(ctx)
	go func() {
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			var n int
			_ = side.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE wait_event = 'PgSleep' AND lower(query) = 'commit' AND datname = current_database()`).Scan(&n)
			if n > 0 {
				mu.Lock()
				for _, c := range conns {
					c.cut.Store(true)
					_ = c.Conn.Close()
				}
				mu.Unlock()
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()

	status, _ := s.send("k")
	t.Logf("client got %d; logs: %s", status, s.logs.String())
	// Wait for the COMMIT under way to end (it sleeps 3 s).
	waitCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for waitCtx.Err() == nil {
		var n int
		require.NoError(t, s.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event = 'PgSleep' AND datname = current_database()`).Scan(&n))
		if n == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("key rows %v, rows %v", s.keyRows(t, "k"), s.committed(t, "k"))
	s.mustMatch(t, "k", status, "a")
	if status >= 500 && len(s.committed(t, "k")) > 0 {
		t.Errorf("the client got %d (\"nothing of this request was committed\") but the row and key committed: %v", status, s.keyRows(t, "k"))
	}
}
