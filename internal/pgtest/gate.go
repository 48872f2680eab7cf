package pgtest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Gate is a lock that a test holds on a session of its own: a trigger that
// runs [Gate.Wait] holds the statement or the COMMIT it fires in until the
// test opens the gate, where a test would otherwise make it sleep for long
// enough. The lock's second key is the pid of that session, so that the
// gates of tests that run at once on one database are apart. A Gate is
// not safe for concurrent use.
type Gate struct {
	conn *pgx.Conn
	once sync.Once
}

// NewGate connects to url (a [SchemaURL], whose application_name
// [Gate.LoseCommit] goes by) and closes a gate there. The gate is opened and
// its session closed when the test ends.
func NewGate(t testing.TB, url string) *Gate {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("pgtest: gate: %v", err)
	}
	g := &Gate{conn: conn}
	t.Cleanup(func() {
		g.Open()
		conn.Close(ctx)
	})
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock(4242, $1)`, g.PID()); err != nil {
		t.Fatalf("pgtest: gate: %v", err)
	}
	return g
}

// PID is the pid of the gate's session, for a test that tells the
// sessions of the code under test from its own.
func (g *Gate) PID() uint32 { return g.conn.PgConn().PID() }

// Wait is the PL/pgSQL statement that waits at the gate until it opens.
func (g *Gate) Wait() string {
	return fmt.Sprintf("PERFORM pg_advisory_xact_lock_shared(4242, %d)", g.PID())
}

// Open lets what waits at the gate go on, and what comes to it later. It
// may be called more than once.
func (g *Gate) Open() {
	g.once.Do(func() {
		_, _ = g.conn.Exec(context.Background(), `SELECT pg_advisory_unlock(4242, $1)`, g.PID())
	})
}

// LoseCommit cuts a COMMIT's answer while the COMMIT is under way: in a
// goroutine of its own, it waits until a COMMIT of the test's sessions
// waits at the gate and calls cut (which cuts the client's socket); then
// until another session of the test waits on a lock (the code under test,
// for that COMMIT to end) or answered is closed; then it opens the gate,
// and closes the channel it returns. It gives up waiting after 20s.
func (g *Gate) LoseCommit(cut func(), answered <-chan struct{}) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer g.Open()
		count := func(q string, n *int) error { return g.conn.QueryRow(context.Background(), q).Scan(n) }
		timeout := time.After(20 * time.Second)
		committing, stop := WatchLockWait(count, 1, `wait_event = 'advisory' AND lower(query) = 'commit'`)
		defer stop()
		select {
		case <-committing:
		case <-timeout:
			return
		}
		cut()
		waiting, stopWaiting := WatchLockWait(count, 1, `lower(query) <> 'commit'`)
		defer stopWaiting()
		select {
		case <-waiting:
		case <-answered:
		case <-timeout:
		}
	}()
	return done
}

// AwaitCommits waits, for 20s at most, until no session of the test is
// running a COMMIT: a COMMIT whose answer was lost has landed or not.
func (g *Gate) AwaitCommits(t testing.TB) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		var n int
		if err := g.conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE lower(query) = 'commit' AND state = 'active' AND application_name = current_setting('application_name')`).Scan(&n); err != nil {
			t.Fatalf("pgtest: gate: %v", err)
		}
		if n == 0 {
			return
		}
	}
}
