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

	"github.com/idemkit/idem/internal/pgtest"
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

// cutConns are the client sockets of a pool of one connection, which the
// test can cut all at once.
type cutConns struct {
	mu    sync.Mutex
	conns []*cutConn
}

// onePool configures a pool of one connection whose sockets are c's.
func (c *cutConns) onePool(cfg *pgxpool.Config) {
	cfg.MaxConns = 1
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		nc, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		cc := &cutConn{Conn: nc}
		c.mu.Lock()
		c.conns = append(c.conns, cc)
		c.mu.Unlock()
		return cc, nil
	}
}

// cutAll cuts every socket opened so far.
func (c *cutConns) cutAll() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, cc := range c.conns {
		cc.cut.Store(true)
		_ = cc.Conn.Close()
	}
}

// TestLostCommitReadAfterItEnds: Complete learns whether a COMMIT whose answer was lost landed from
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
// constraint trigger on writes holds the COMMIT in the server at a gate
// (any slow commit: synchronous replication, fsync); while the backend is
// in it, the client socket is cut; commitLocked's check runs on a new
// connection, found no key, and Complete failed; once the gate opened the
// COMMIT landed: the client got 500 and one row was committed. The check
// now waits for the claim's advisory lock first (keysql.WaitKeyLockSQL),
// which the committing transaction holds until it ends, and the client
// gets 201. The gate opens once the check waits, or the client has its
// answer.
//
// The subtest onetx=false is the control: the same cut in two-commit mode
// passes (the check waits for the COMMIT under way, and the client gets
// 201).
func TestLostCommitReadAfterItEnds(t *testing.T) {
	for _, oneTx := range []bool{true, false} {
		t.Run(fmt.Sprintf("onetx=%v", oneTx), func(t *testing.T) { lostCommit(t, oneTx) })
	}
}

func lostCommit(t *testing.T, oneTx bool) {
	conns := &cutConns{}
	var s *service
	s = newService(t, idempotency.Options{OneTransaction: oneTx}, conns.onePool, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(201)
	})
	ctx := context.Background()
	g := pgtest.NewGate(t, s.pool.Config().ConnConfig.ConnString())
	_, err := s.pool.Exec(ctx, `
CREATE FUNCTION slow_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN `+g.Wait()+`; RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow_write AFTER INSERT ON writes
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_write()`)
	require.NoError(t, err)

	answered := make(chan struct{})
	lost := g.LoseCommit(conns.cutAll, answered)
	status, _ := s.send("k")
	close(answered)
	<-lost
	t.Logf("client got %d; logs: %s", status, s.logs.String())
	g.AwaitCommits(t)
	t.Logf("key rows %v, rows %v", s.keyRows(t, "k"), s.committed(t, "k"))
	s.mustMatch(t, "k", status, "a")
	if status >= 500 && len(s.committed(t, "k")) > 0 {
		t.Errorf("the client got %d (\"nothing of this request was committed\") but the row and key committed: %v", status, s.keyRows(t, "k"))
	}
}

// TestLostBatchBeforeItRuns: in two commits the completion travels with the COMMIT
// in one batch, and the connection may be lost while the batch has not
// run yet: on its way, or, here, waiting on the server for a table lock
// ("lock": a side transaction holds SHARE on the key table, as a CREATE
// INDEX would) or in a trigger ("trigger", held at a gate until the
// client has its answer). A read of the key (FOR SHARE)
// does not wait for a completion that has not locked the row: it read
// "started", the client got 500 "nothing of this request was committed",
// and then the batch ran and committed the row and the 201. Complete now
// releases the key under its token first: a completion that runs later is
// fenced and commits nothing ("trigger": the release runs first); one that
// ran first makes the release wait for its COMMIT, and the store reports
// it committed ("lock"). The middleware's release of the key that
// Complete released counts as one (EventReleased), as any release does.
func TestLostBatchBeforeItRuns(t *testing.T) {
	for _, delay := range []string{"lock", "trigger"} {
		t.Run(delay, func(t *testing.T) { lostBatch(t, delay) })
	}
}

func lostBatch(t *testing.T, delay string) {
	conns := &cutConns{}
	var s *service
	var slow func(ctx context.Context, tx pgx.Tx)
	var released atomic.Int32
	count := func(e idempotency.Event) {
		if e == idempotency.EventReleased {
			released.Add(1)
		}
	}
	s = newService(t, idempotency.Options{OnEvent: count}, conns.onePool, func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
		if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if slow != nil {
			slow(r.Context(), tx)
		}
		w.WriteHeader(201)
	})
	ctx := context.Background()
	url := s.pool.Config().ConnConfig.ConnString()
	g := pgtest.NewGate(t, url)
	_, err := s.pool.Exec(ctx, `
CREATE FUNCTION slow_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN IF current_setting('idem_test.slow', true) = 'on' THEN `+g.Wait()+`; END IF; RETURN NULL; END $$;
CREATE TRIGGER slow_write BEFORE UPDATE ON idempotency_keys FOR EACH STATEMENT EXECUTE FUNCTION slow_write()`)
	require.NoError(t, err)
	status, _ := s.send("warm") // the one connection prepares the statements of a request
	require.Equal(t, 201, status)

	side, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer side.Close(ctx)
	var sideTx pgx.Tx
	batch := `query LIKE '%UPDATE%idempotency_keys%'`
	if delay == "lock" {
		sideTx, err = side.Begin(ctx)
		require.NoError(t, err)
		slow = func(ctx context.Context, _ pgx.Tx) {
			_, err := sideTx.Exec(ctx, `LOCK TABLE idempotency_keys IN SHARE MODE`)
			require.NoError(t, err)
		}
	} else {
		batch += ` AND wait_event = 'advisory'`
		slow = func(ctx context.Context, tx pgx.Tx) {
			_, err := tx.Exec(ctx, `SET LOCAL idem_test.slow = 'on'`)
			require.NoError(t, err)
		}
	}
	watch, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer watch.Close(ctx)
	watchCount := func(q string, n *int) error { return watch.QueryRow(ctx, q).Scan(n) }
	done := make(chan struct{})
	go func() {
		defer close(done)
		waiting, stop := pgtest.WatchLockWait(watchCount, 1, batch)
		defer stop()
		select {
		case <-waiting:
		case <-time.After(10 * time.Second):
			if sideTx != nil {
				_ = sideTx.Rollback(ctx)
			}
			return
		}
		conns.cutAll()
		if sideTx != nil {
			// The store, cut off, releases the key on another
			// connection: once that release queues behind the lock
			// too, the batch goes on, on the server.
			both, stopBoth := pgtest.WatchLockWait(watchCount, 2, `query LIKE '%idempotency_keys%'`)
			defer stopBoth()
			select {
			case <-both:
			case <-time.After(10 * time.Second):
			}
			_ = sideTx.Commit(ctx)
		}
	}()
	status, _ = s.send("k")
	<-done
	g.Open()
	// Let the old backend finish what it received.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		var n int
		require.NoError(t, watch.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = current_setting('application_name') AND pid <> pg_backend_pid() AND pid NOT IN ($1, $2) AND state <> 'idle'`,
			side.PgConn().PID(), g.PID()).Scan(&n))
		if n == 0 {
			break
		}
	}
	t.Logf("client got %d; key rows %v, rows %v; logs: %s", status, s.keyRows(t, "k"), s.committed(t, "k"), s.logs.String())
	s.mustMatch(t, "k", status, "a")
	if status >= 500 && len(s.committed(t, "k")) > 0 {
		t.Errorf("the client got %d (\"nothing of this request was committed\") but the row and key committed: %v", status, s.keyRows(t, "k"))
	}
	want := int32(0) // completed: nothing released
	if status >= 500 {
		want = 1 // released by Complete; the middleware's Release counts it
	}
	if got := released.Load(); got != want {
		t.Errorf("the client got %d; %d EventReleased counted, want %d", status, got, want)
	}
}
