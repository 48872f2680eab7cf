package pgstore

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// ErrTxOwned is returned by Commit and Rollback of the transaction that
// [TxFromContext] gives a handler, and by a statement of its that would end
// the transaction (COMMIT, ROLLBACK, END, ABORT, PREPARE TRANSACTION): the
// middleware commits it with the key's outcome, or rolls it back, from the
// status the handler answers. Such a statement is refused before it is
// sent, and the transaction goes on. A handler that wants its writes
// discarded answers a status that is not stored (a 4xx such as 400 or
// 409, or a 5xx), or writes inside a savepoint (the Tx's Begin) that it
// rolls back.
var ErrTxOwned = errors.New("pgstore: the idempotency middleware commits or rolls back this transaction")

// Errors of the handler's transaction used where it may not be.
var (
	// errTxDone: the request is over; nothing handed out from its
	// transaction runs any more.
	errTxDone = errors.New("pgstore: the request's transaction is over (completed or rolled back with its request)")
	// errTxBusy: another call of the transaction, or of its rows,
	// savepoints or batches, is running, from another goroutine.
	errTxBusy = errors.New("pgstore: the request's transaction is in use by another call (a pgx.Tx is not safe for concurrent use)")
	// errTxEnded: a statement sent past the transaction's checks ended it.
	errTxEnded = fmt.Errorf("pgstore: the request's transaction was ended by the handler (a COMMIT or ROLLBACK sent on its Conn, say), not by pgstore; no statement of the request runs after it (%w)", idempotency.ErrUnitEnded)
)

// TxFromContext returns the transaction of the request in ctx, for a handler
// behind [idempotency.Middleware] on a [Store], serving a request that owns
// its key. Its writes commit in the same commit as the key's stored outcome,
// and roll back whenever the outcome is not stored: a released 4xx, a 5xx
// (unless stored), a panic, a fenced completion. It returns false anywhere
// else (no middleware, another store, a replay), where a handler writes on
// its own.
//
// The transaction begins on its first statement, on a connection of the
// store's pool, so a handler that first calls a slow downstream system
// holds no connection meanwhile; on a route with
// [idempotency.Options.OneTransaction] it began with the claim, and holds
// its connection from the start (see the package documentation). It takes every statement a pgx.Tx takes,
// with the same results, and these differences:
//
//   - Commit and Rollback return [ErrTxOwned] and do nothing (a habitual
//     defer tx.Rollback(ctx) is harmless). A statement that would end the
//     transaction (COMMIT, ROLLBACK, END, ABORT, PREPARE TRANSACTION, alone
//     or among others in one text) is refused with ErrTxOwned before it is
//     sent; BEGIN is let through, as a no-op with a warning. Begin opens a
//     savepoint, as pgx's does, which the handler commits or rolls back
//     itself, and ROLLBACK TO SAVEPOINT works as usual.
//   - QueryRow runs its statement at once and reads its first row; Scan
//     decodes it, and a second Scan returns pgx.ErrNoRows, as with pgx.
//     A row that is never scanned leaves nothing pending.
//   - Everything handed out from it (savepoints, Rows, BatchResults, rows
//     of QueryRow, the transaction itself) stops working when the request
//     ends: a call made after the middleware completed or rolled back the
//     request, from a goroutine that outlived the handler, returns an error
//     and touches no connection. A call made while another is running (two
//     goroutines at once) returns an error instead of racing on the
//     connection (the Conn and the large objects below excepted, which
//     pgstore cannot wrap); a statement that runs before the request ends
//     is part of its transaction, and commits or rolls back with it.
//   - Conn returns the transaction's *pgx.Conn, for pgx APIs that need one
//     (registering types, say), and LargeObjects its large objects. pgstore
//     cannot take these back: once a request has handed either out, its
//     connection is closed when the request ends, never returned to the
//     pool, so that a late use fails instead of running in another
//     request's transaction; Conn returns nil after the request. Statements
//     sent on the Conn bypass the refusal of COMMIT and ROLLBACK above: if
//     one ends the transaction, every later statement of the request fails,
//     and so does the completion, whatever the status, with an error saying
//     that what the handler wrote may have been committed without the key's
//     outcome (a COMMIT AND CHAIN, which leaves a transaction open, is not
//     even seen). Never end the transaction through the Conn.
//
// A write that fails aborts the transaction, as in any PostgreSQL
// transaction: a handler that turns the error into a 409 or a 422 leaves
// nothing committed, and a stored 4xx outcome is then stored alone, while a
// 2xx or 3xx over a failed transaction fails the completion (the key is
// released and the client gets a 500), since it would store a success whose
// writes are gone. A statement that fails before it reaches PostgreSQL (an
// argument pgx cannot encode, say) changes nothing, as with pgx; a first
// statement that cannot get a connection (its context done, say), or whose
// connection breaks before the transaction began, leaves the transaction
// unable to begin: every later statement fails, and so does a 2xx or 3xx
// completion.
//
// Under REPEATABLE READ or SERIALIZABLE (the database's
// default_transaction_isolation, or the handler's SET TRANSACTION), the
// transaction could not update its key once the lease renewal had updated
// it after the transaction's snapshot (SQLSTATE 40001): so while such a
// transaction is open, the renewals only check that the claim still owns
// its key, and the lease is not extended. Such a handler must end its work
// within the lock timeout, after which a retry may take the key over (its
// own completion then fails, and nothing of it is committed). To know the
// level, the transaction reads it with its first statement, in the same
// round trip, and again after each later statement that holds a SET (one
// more round trip).
//
// Like any pgx.Tx, it is meant for one goroutine at a time.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	t, ok := idempotency.TxFromContext(ctx)
	if !ok {
		return nil, false
	}
	u, ok := t.(*unit)
	if !ok {
		return nil, false
	}
	return &txView{u: u}, true
}

// unit is the unit of work of a claim on a Store: the handler's
// transaction, begun on its first statement, and the key's completion.
//
// Every call that uses the transaction's connection holds mu: the
// handler's calls take it with TryLock, and fail rather than wait when
// another call holds it (a pgx.Tx must not be used by two goroutines at
// once; nor must a connection); Complete and Rollback take it with Lock,
// and so wait for a statement under way. Once done, no call of the
// handler's touches the connection again.
type unit struct {
	store *Store
	claim idempotency.Claim
	// inTx is the key of a claim made in one transaction, which the
	// completion writes (see keysql.ClaimTxSQL); nil otherwise. Such a unit's
	// transaction is begun by the claim.
	inTx *inTxKey

	mu     sync.Mutex
	done   bool
	conn   *pgxpool.Conn // nil until the handler's first statement
	tx     pgx.Tx        // on conn
	err    error         // the transaction failed to begin: returned by every later statement
	ended  error         // the transaction ended under the handler: returned by every later statement
	leaked bool          // Conn or LargeObjects handed out: conn is closed at the end, never pooled again

	// lease orders the lease renewals (see renew) with the transaction:
	// held by a renewal while it runs, and to change snapshot.
	lease sync.Mutex
	// snapshot: the transaction is REPEATABLE READ or SERIALIZABLE, or
	// its isolation level may change (it is beginning, or runs a SET):
	// renewals must not update the key row.
	snapshot bool
}

// enter holds u for one call of the handler's that may send a statement:
// it fails when another call holds u, when the request is over, or when
// the transaction ended under the handler. exit releases it.
func (u *unit) enter() error {
	if err := u.enterRead(); err != nil {
		return err
	}
	if err := u.checkOpen(); err != nil {
		u.mu.Unlock()
		return err
	}
	return nil
}

// enterRead is enter for a call that reads what a statement already sent
// returns (rows, batch results).
func (u *unit) enterRead() error {
	if !u.mu.TryLock() {
		return errTxBusy
	}
	if u.done {
		u.mu.Unlock()
		return errTxDone
	}
	return nil
}

func (u *unit) exit() { u.mu.Unlock() }

// checkOpen returns u.ended once the transaction is no longer open on its
// connection: a COMMIT or ROLLBACK that the refusal of scanSQL missed, or
// that the handler sent on the Conn, ended it. The transaction status is
// known only while the connection is idle (no rows or batch pending); a
// pending statement is checked by the next call. The caller holds u.mu.
func (u *unit) checkOpen() error {
	if u.ended != nil || u.tx == nil {
		return u.ended
	}
	pc := u.conn.Conn().PgConn()
	if !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() == 'I' {
		u.ended = errTxEnded
	}
	return u.ended
}

// begun returns the handler's transaction, beginning it on first use with
// no statement of the handler's (see beginWith). The caller holds u.mu.
func (u *unit) begun(ctx context.Context) (pgx.Tx, error) {
	if u.tx != nil || u.err != nil {
		return u.tx, u.err
	}
	conn, err := u.acquire(ctx)
	if err != nil {
		return nil, err
	}
	_, err = u.beginWith(ctx, conn, nil)
	return u.tx, err
}

// acquire gets the transaction's connection from the pool; an error leaves
// the transaction unable to begin. The caller holds u.mu.
func (u *unit) acquire(ctx context.Context) (*pgxpool.Conn, error) {
	conn, err := u.store.pool.Acquire(ctx)
	if err != nil {
		u.err = interpretError(err)
		return nil, u.err
	}
	return conn, nil
}

// firstStatement is a handler's first statement, sent in one round trip
// with the BEGIN.
type firstStatement struct {
	sql  string
	args []any
	read func(br pgx.BatchResults) error // reads its result from the batch
}

// beginWith begins the transaction on conn: BEGIN, the handler's first
// statement if first is not nil, and keysql.ShowIsolationSQL, in one round trip
// (pgx's Batch.BeginTx). It returns the first statement's error, and sent
// when that statement was run. A first statement that failed without
// running (pgx could not encode an argument, or PostgreSQL refused to
// prepare it) is sent again on the transaction begun without it, so that
// it fails as it does on any pgx.Tx: leaving the transaction open after an
// encoding error, aborting it after an error of PostgreSQL's (pgx closes
// the connection of a batch it could not encode: the transaction then
// begins on another). A
// transaction that cannot begin (the connection broke) cannot begin any
// more: its error is every later statement's. The caller holds u.mu.
func (u *unit) beginWith(ctx context.Context, conn *pgxpool.Conn, first *firstStatement) (sent bool, err error) {
	u.pauseRenewals()
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	if first != nil {
		b.Queue(first.sql, first.args...)
	}
	b.Queue(keysql.ShowIsolationSQL)
	br := conn.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil { // the BEGIN
		br.Close()
		var pre pgx.ErrPreprocessingBatch
		switch {
		case first == nil:
		case nothingRan(conn):
			_, err := u.beginWith(ctx, conn, nil)
			return false, err
		case errors.As(err, &pre) && conn.Conn().IsClosed():
			// pgx could not encode the first statement's arguments,
			// and closed the connection without sending the BEGIN
			// queued before it: on another connection, then.
			conn.Release()
			if conn, err = u.acquire(ctx); err != nil {
				return false, err
			}
			_, err := u.beginWith(ctx, conn, nil)
			return false, err
		}
		return false, u.failBegin(conn, err)
	}
	var serr error
	if first != nil {
		serr = first.read(br)
	}
	var isolation string
	ierr := br.QueryRow().Scan(&isolation)
	cerr := br.Close()
	if conn.Conn().IsClosed() {
		// The connection broke under the batch: nothing of the
		// transaction can commit.
		return first != nil, u.failBegin(conn, cmpErr(serr, cerr, errors.New("the connection closed")))
	}
	u.conn, u.tx = conn, br.Tx()
	u.setIsolation(isolation, ierr)
	return first != nil, cmpErr(serr, cerr)
}

// nothingRan reports whether a batch or query that failed on conn ran
// nothing: the connection is up and outside any transaction, as before.
func nothingRan(conn *pgxpool.Conn) bool {
	pc := conn.Conn().PgConn()
	return !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() == 'I'
}

// failBegin gives conn back and leaves the transaction unable to begin,
// for err. The caller holds u.mu.
func (u *unit) failBegin(conn *pgxpool.Conn, err error) error {
	conn.Release() // the pool drops it if it is broken
	u.err = interpretError(err)
	u.setIsolation("", u.err)
	return u.err
}

// cmpErr returns the first error that is not nil.
func cmpErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// The prefix and suffix that beginSimple puts around a first statement.
const (
	simpleBegin = "BEGIN;\n"
	simpleShow  = "\n;" + keysql.ShowIsolationSQL
)

// beginSimple begins the transaction on conn with sql, a first statement
// without arguments, as pgx sends any statement without arguments: in
// PostgreSQL's simple protocol, which takes several statements in one
// text. BEGIN, sql and keysql.ShowIsolationSQL go in one text, so in one round
// trip, and run as they would one after the other: the statements of sql
// in the transaction, until one fails. Its command tag is the one of the
// last statement of sql, as pgx's Exec returns; the position of a syntax
// error is counted from the start of sql. The statement is traced as pgx's
// would be, with the text that was sent. The caller holds u.mu.
func (u *unit) beginSimple(ctx context.Context, conn *pgxpool.Conn, sql string) (pgconn.CommandTag, error) {
	u.pauseRenewals()
	text := simpleBegin + sql + simpleShow
	tctx := ctx
	tracer := conn.Conn().Config().Tracer
	if tracer != nil {
		tctx = tracer.TraceQueryStart(ctx, conn.Conn(), pgx.TraceQueryStartData{SQL: text})
	}
	type result struct {
		tag  pgconn.CommandTag
		last []byte // the first column of the last row
	}
	var results []result
	mrr := conn.Conn().PgConn().Exec(tctx, text)
	for mrr.NextResult() {
		rr := mrr.ResultReader()
		var r result
		for rr.NextRow() {
			if v := rr.Values(); len(v) > 0 {
				r.last = append(r.last[:0], v[0]...)
			}
		}
		r.tag, _ = rr.Close()
		results = append(results, r)
	}
	err := mrr.Close()
	var tag pgconn.CommandTag
	if err == nil && len(results) > 2 { // BEGIN, sql's, SHOW
		tag = results[len(results)-2].tag
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Position > int32(len(simpleBegin)) {
		pgErr.Position -= int32(len(simpleBegin))
	}
	if tracer != nil {
		tracer.TraceQueryEnd(tctx, conn.Conn(), pgx.TraceQueryEndData{CommandTag: tag, Err: err})
	}
	switch {
	case len(results) == 0 && nothingRan(conn):
		// Nothing ran: PostgreSQL parses the whole text before it runs
		// any of it, and refused it (a syntax error of sql's), or
		// nothing reached it (the context was done before the text was
		// sent, say). Begin, then run sql on the transaction, where it
		// fails (or runs) as on any pgx.Tx.
		if _, berr := u.beginWith(ctx, conn, nil); berr != nil {
			return tag, berr
		}
		return u.tx.Exec(ctx, sql)
	case len(results) == 0 || conn.Conn().IsClosed():
		return tag, u.failBegin(conn, cmpErr(err, errors.New("the connection closed")))
	}
	// The transaction began: bound to conn from now on, whatever sql did
	// to it (checkOpen finds out whether it ended it).
	u.conn, u.tx = conn, beganTx(conn)
	var isolation string
	if err == nil {
		isolation = string(results[len(results)-1].last)
	}
	u.setIsolation(isolation, err)
	return tag, err
}

// beganTx returns the pgx.Tx of a transaction begun on conn by a statement
// pgx did not see: pgx's Batch.BeginTx with an empty batch after the
// BEGIN, which sends nothing and yields a transaction on conn.
func beganTx(conn *pgxpool.Conn) pgx.Tx {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.QueuedQueries = b.QueuedQueries[:0] // the BEGIN already ran
	br := conn.SendBatch(context.Background(), b)
	_ = br.Close()
	return br.Tx()
}

// pauseRenewals stops the renewals from updating the key row until
// setIsolation tells whether they may, waiting for a renewal under way: a
// transaction that begins, or runs a SET, may become one under
// REPEATABLE READ or SERIALIZABLE, whose snapshot must not miss a renewal.
func (u *unit) pauseRenewals() {
	u.lease.Lock()
	u.snapshot = true
	u.lease.Unlock()
}

// setIsolation tells the renewals the isolation level that the
// transaction reported (err: it did not, having failed, and so it will not
// complete the key).
func (u *unit) setIsolation(isolation string, err error) {
	u.lease.Lock()
	u.snapshot = err == nil && (isolation == "repeatable read" || isolation == "serializable")
	u.lease.Unlock()
}

// recheckIsolation reads the transaction's isolation level again after a
// statement of the handler's that holds a SET. If it cannot, the renewals
// stay paused. The caller holds u.mu.
func (u *unit) recheckIsolation(ctx context.Context) {
	if u.tx == nil || u.conn.Conn().PgConn().IsBusy() {
		return
	}
	var isolation string
	if err := u.tx.QueryRow(ctx, keysql.ShowIsolationSQL).Scan(&isolation); err == nil {
		u.setIsolation(isolation, nil)
	}
}

// renew renews the claim's lease (see [Store.Renew]). While the
// transaction is REPEATABLE READ or SERIALIZABLE it only checks that the
// claim still owns the key: an update of the key row committed after the
// transaction's snapshot would make its completion fail with a
// serialization failure.
func (u *unit) renew(ctx context.Context) error {
	u.lease.Lock()
	defer u.lease.Unlock()
	if u.snapshot {
		return u.store.checkOwned(ctx, u.claim)
	}
	return u.store.ownedUpdate(ctx, u.claim, keysql.RenewSQL, nil, "")
}

// Complete implements [idempotency.Tx.Complete].
//
// Without a handler transaction it is keysql.CompleteSQL alone. When the
// connection broke under it, it runs once more on a live connection: lost
// before its commit, the first wrote nothing, and the retry completes the
// key; lost after, the retry finds the key completed under this claim's
// token, which only this completion can have done, and Complete succeeds.
//
// With one, it is keysql.CompleteInTxSQL and COMMIT in one round trip. When the
// connection broke under them, they may not have run yet (the batch on its
// way, or waiting on the server for a lock), or be running, or have
// committed. Complete first releases the key under this claim's token: a
// completion that runs later is then fenced and commits nothing, and one
// that ran holds the key's row until its transaction ended, which the
// release waits for. Fenced, the release leaves it to the key: completed
// under this claim's token means committed, writes and all (PostgreSQL
// commits both or neither); otherwise nothing was, and Complete returns
// the error. (A claim in one transaction waits for its advisory lock
// instead, then reads the key.) A
// transaction that the handler ended itself (see [TxFromContext]) fails
// the completion, whatever the status: what it wrote may have been
// committed, and no outcome can be stored with it.
func (u *unit) Complete(ctx context.Context, resp idempotency.StoredResponse) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return errTxDone
	}
	u.done = true
	u.store.units.Remove(u.claim, u)
	if err := ctx.Err(); err != nil {
		u.rollbackLocked(ctx)
		return err
	}
	if !idempotency.ValidStatus(resp.Status) {
		u.rollbackLocked(ctx)
		return fmt.Errorf("pgstore: %w: %d", idempotency.ErrInvalidStatus, resp.Status)
	}
	if err := keysql.CheckText(resp.ContentType); err != nil {
		u.rollbackLocked(ctx)
		return err
	}
	for name, v := range resp.Header {
		if err := keysql.CheckText(name, v); err != nil {
			u.rollbackLocked(ctx)
			return err
		}
	}
	header, err := keysql.HeaderArg(resp.Header)
	if err != nil {
		u.rollbackLocked(ctx)
		return err
	}
	c := u.claim
	args := []any{c.ClientID, c.Key, c.Token, resp.Status, resp.ContentType, header, resp.Body}
	if u.inTx != nil {
		return u.completeInTx(ctx, resp.Status, append(args, u.inTx.args()...))
	}
	if u.tx == nil && u.err != nil && resp.Status < 400 {
		// The handler's first statement failed before its transaction
		// began: a success stored now would have no writes behind it.
		return fmt.Errorf("pgstore: the handler answered %d but its transaction failed to begin (%w); nothing was committed", resp.Status, u.err)
	}
	if u.tx != nil {
		if err := u.checkOpen(); err != nil {
			u.rollbackLocked(ctx)
			return err
		}
		if u.conn.Conn().PgConn().IsBusy() {
			// As pgx's Commit would, it fails: the connection is not free
			// for the completion.
			u.rollbackLocked(ctx)
			return fmt.Errorf("pgstore: the handler answered %d but left rows or a batch of its transaction open; nothing was committed", resp.Status)
		}
		switch u.conn.Conn().PgConn().TxStatus() {
		case 'T': // a transaction in progress: complete and commit it
			return u.commitLocked(ctx, keysql.CompleteInTxSQL, args)
		case 'E': // a write failed: nothing of the handler's can commit
			u.rollbackLocked(ctx)
			if resp.Status < 400 {
				return fmt.Errorf("pgstore: the handler answered %d but its transaction failed; nothing was committed", resp.Status)
			}
		default: // the connection closed
			u.rollbackLocked(ctx)
			return fmt.Errorf("pgstore: the handler's transaction is no longer usable (its connection closed); nothing of it was committed")
		}
	}
	return u.store.ownedUpdate(ctx, c, keysql.CompleteSQL, args[3:], idempotency.StatusCompleted)
}

// commitLocked sends sql (keysql.CompleteInTxSQL, or keysql.CompleteNewInTxSQL) and
// COMMIT on the handler's transaction in one round trip; either fails, and
// PostgreSQL skips the COMMIT, when the claim was fenced. The caller holds
// u.mu.
func (u *unit) commitLocked(ctx context.Context, sql string, args []any) error {
	conn := u.conn
	u.conn, u.tx = nil, nil
	b := &pgx.Batch{}
	b.Queue(sql, args...)
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	// The completion's own error tells a fence; the COMMIT's (a deferred
	// constraint of the handler's tables) never does, whatever its
	// SQLSTATE.
	_, err := br.Exec()
	var pgErr *pgconn.PgError
	fenced := errors.As(err, &pgErr) && keysql.IsFence(sql, pgErr.Code)
	if err == nil {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		u.giveBack(ctx, conn) // idle again: the pool takes it back
		return nil
	}
	if fenced {
		u.rollback(ctx, conn)
		return idempotency.ErrFenced
	}
	err = interpretError(err)
	if !errors.Is(err, errConnLost) {
		u.rollback(ctx, conn)
		return err
	}
	u.giveBack(ctx, conn) // broken: the pool drops it
	var ours bool
	lctx := context.WithoutCancel(ctx)
	if u.inTx == nil {
		// The completion travelled with the COMMIT, and may not have run
		// yet (the batch still on its way, or waiting on the server for a
		// lock): a read would not wait for it (TestLostBatchBeforeItRuns).
		// Release the key under the claim's token first: a completion
		// that runs later is fenced and commits nothing; one that ran
		// holds the key's row until its transaction ends, and the release
		// then finds the key completed under the token (committed, which
		// the read below tells) or still started.
		switch rerr := u.store.ownedUpdate(lctx, u.claim, keysql.ReleaseSQL, []any{false}, ""); {
		case rerr == nil:
			return err // released: nothing of the request commits
		case !errors.Is(rerr, idempotency.ErrFenced):
			return err
		}
	}
	if lerr := u.store.onLiveConn(lctx, func(q querier) (err error) {
		if u.inTx == nil {
			// The release above was fenced: the key's row is no longer
			// started under this claim's token.
			ours, err = hasStatusUnder(lctx, q, u.claim, idempotency.StatusCompleted)
			return err
		}
		// A key claimed in one transaction has no row that a read could
		// wait on until the COMMIT ends, which may still be running: wait
		// for the claim's advisory lock, which the transaction holds until
		// it has committed or rolled back, then read (bounded, so that a
		// backend that never ends does not hold the request forever).
		wctx, cancel := context.WithTimeout(lctx, keysql.LostCommitWait)
		defer cancel()
		c := u.claim
		b := &pgx.Batch{}
		b.Queue("BEGIN")
		b.Queue(keysql.WaitKeyLockSQL, c.ClientID, c.Key)
		b.Queue(keysql.StatusUnderSQL, c.ClientID, c.Key, c.Token, string(idempotency.StatusCompleted))
		b.Queue("COMMIT")
		br := q.SendBatch(wctx, b)
		defer func() {
			if cerr := br.Close(); err == nil {
				err = cerr
			}
		}()
		if _, err = br.Exec(); err != nil {
			return err
		}
		if _, err = br.Exec(); err != nil {
			return err
		}
		if err = br.QueryRow().Scan(&ours); errors.Is(err, pgx.ErrNoRows) {
			ours, err = false, nil
		}
		if err != nil {
			return err
		}
		_, err = br.Exec()
		return err
	}); lerr == nil && ours {
		return nil
	}
	return err
}

// rollback rolls back the transaction on conn and gives conn back.
func (u *unit) rollback(ctx context.Context, conn *pgxpool.Conn) {
	if pc := conn.Conn().PgConn(); !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() != 'I' {
		_, _ = conn.Exec(context.WithoutCancel(ctx), "ROLLBACK")
	}
	u.giveBack(ctx, conn)
}

// giveBack returns conn to the pool, which closes it if it is broken,
// busy or still in a transaction; a connection whose Conn or large
// objects the handler got is closed instead, so that nothing the handler
// kept of it runs in another request.
func (u *unit) giveBack(ctx context.Context, conn *pgxpool.Conn) {
	if !u.leaked {
		conn.Release()
		return
	}
	_ = conn.Hijack().Close(context.WithoutCancel(ctx))
}

// Rollback implements [idempotency.Tx.Rollback]: it rolls back the
// handler's transaction, if it began, and gives back its connection.
func (u *unit) Rollback(ctx context.Context) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if !u.done {
		u.done = true
		u.store.units.Remove(u.claim, u)
	}
	u.rollbackLocked(ctx)
	return nil
}

func (u *unit) rollbackLocked(ctx context.Context) {
	if u.conn != nil {
		u.rollback(ctx, u.conn)
		u.conn, u.tx = nil, nil
	}
}

// txView is the pgx.Tx a handler gets from TxFromContext (sp nil: the
// unit's transaction, begun on its first statement, which the handler may
// not commit or roll back), or a savepoint opened in it (sp).
type txView struct {
	u  *unit
	sp pgx.Tx
}

var _ pgx.Tx = (*txView)(nil)

// on returns the transaction the view's statements run on: the savepoint,
// or the unit's transaction, begun if need be. The caller holds u.mu.
func (t *txView) on(ctx context.Context) (pgx.Tx, error) {
	if t.sp != nil {
		return t.sp, nil
	}
	return t.u.begun(ctx)
}

// refuse returns ErrTxOwned for SQL that would end the transaction.
func refuse(f keysql.Facts) error {
	if f.Control == "" {
		return nil
	}
	return fmt.Errorf("%w: the handler may not send %s", ErrTxOwned, f.Control)
}

// Begin opens a savepoint, a pseudo nested transaction that the handler
// commits or rolls back itself.
func (t *txView) Begin(ctx context.Context) (pgx.Tx, error) {
	return with(ctx, t, func(tx pgx.Tx) (pgx.Tx, error) {
		sp, err := tx.Begin(ctx)
		if err != nil {
			return nil, err
		}
		return &txView{u: t.u, sp: sp}, nil
	})
}

// with runs f on the transaction of t (see on), holding the unit.
func with[T any](ctx context.Context, t *txView, f func(tx pgx.Tx) (T, error)) (T, error) {
	var zero T
	if err := t.u.enter(); err != nil {
		return zero, err
	}
	defer t.u.exit()
	tx, err := t.on(ctx)
	if err != nil {
		return zero, err
	}
	return f(tx)
}

// Commit returns ErrTxOwned on the request's transaction; on a savepoint
// it releases the savepoint.
func (t *txView) Commit(ctx context.Context) error { return t.end(ctx, pgx.Tx.Commit) }

// Rollback returns ErrTxOwned on the request's transaction; on a
// savepoint it rolls back to it.
func (t *txView) Rollback(ctx context.Context) error { return t.end(ctx, pgx.Tx.Rollback) }

// end ends the savepoint with end (pgx.Tx.Commit or Rollback), or returns
// ErrTxOwned on the request's transaction.
func (t *txView) end(ctx context.Context, end func(pgx.Tx, context.Context) error) error {
	if t.sp == nil {
		return ErrTxOwned
	}
	if err := t.u.enter(); err != nil {
		return err
	}
	defer t.u.exit()
	return end(t.sp, ctx)
}

func (t *txView) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	return with(ctx, t, func(tx pgx.Tx) (int64, error) {
		return tx.CopyFrom(ctx, table, columns, src)
	})
}

// SendBatch sends b, whose statements are checked as Exec's are. The
// transaction a batch that calls Batch.BeginTx gets from BatchResults.Tx is
// the request's.
func (t *txView) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	var set bool
	for _, q := range b.QueuedQueries {
		f := keysql.Scan(q.SQL)
		if err := refuse(f); err != nil {
			return pgx.FailedBatchResults(b, err)
		}
		set = set || f.Set
	}
	if err := t.u.enter(); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	defer t.u.exit()
	tx, err := t.on(ctx)
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	if set {
		t.u.pauseRenewals() // read again at the next SET run by Exec or QueryRow
	}
	return &batchView{u: t.u, br: tx.SendBatch(ctx, b)}
}

// LargeObjects returns the large objects of the transaction, beginning it.
// If it cannot begin, or the request is over, the returned value's methods
// fail with pgx.ErrTxClosed. The connection is closed when the request
// ends (see TxFromContext).
func (t *txView) LargeObjects() pgx.LargeObjects {
	if err := t.u.enter(); err != nil {
		return closedTx().LargeObjects()
	}
	defer t.u.exit()
	tx, err := t.on(context.Background())
	if err != nil {
		return closedTx().LargeObjects()
	}
	t.u.leaked = true
	return tx.LargeObjects()
}

// closedTx returns a pgx.Tx that is closed: its statements fail with
// pgx.ErrTxClosed, touching no connection. (pgx makes one for a batch that
// began a transaction and failed before it was sent.)
func closedTx() pgx.Tx {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	return pgx.FailedBatchResults(b, pgx.ErrTxClosed).Tx()
}

func (t *txView) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := refuse(keysql.Scan(sql)); err != nil {
		return nil, err
	}
	return with(ctx, t, func(tx pgx.Tx) (*pgconn.StatementDescription, error) {
		return tx.Prepare(ctx, name, sql)
	})
}

// pipelined reports whether a first statement with args may travel in one
// pgx batch with the BEGIN and behave as it would on its own: conn sends
// its statements in the extended protocol (one statement each, the same
// in a batch and alone), and args hold no pgx option, which a batch reads
// otherwise or not at all. A statement without arguments may: Query sends
// it in the extended protocol too (Exec does not: see beginSimple).
func pipelined(conn *pgxpool.Conn, sql string, args []any) bool {
	if sql == "" || conn.Conn().Config().DefaultQueryExecMode == pgx.QueryExecModeSimpleProtocol {
		return false
	}
	if len(args) > 0 {
		switch args[0].(type) {
		case pgx.QueryExecMode, pgx.QueryRewriter, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
			return false
		}
	}
	return true
}

// Exec runs sql. The first statement of the transaction travels with its
// BEGIN, in one round trip.
func (t *txView) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	f := keysql.Scan(sql)
	if err := refuse(f); err != nil {
		return pgconn.CommandTag{}, err
	}
	u := t.u
	if err := u.enter(); err != nil {
		return pgconn.CommandTag{}, err
	}
	defer u.exit()
	if t.sp == nil && u.tx == nil && u.err == nil {
		conn, err := u.acquire(ctx)
		if err != nil {
			return pgconn.CommandTag{}, err
		}
		if len(args) == 0 {
			return u.beginSimple(ctx, conn, sql)
		}
		if pipelined(conn, sql, args) {
			var tag pgconn.CommandTag
			sent, err := u.beginWith(ctx, conn, &firstStatement{sql, args, func(br pgx.BatchResults) (err error) {
				tag, err = br.Exec()
				return err
			}})
			if sent || err != nil {
				return tag, err
			}
		} else if _, err := u.beginWith(ctx, conn, nil); err != nil {
			return pgconn.CommandTag{}, err
		}
	}
	tx, err := t.on(ctx)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	if f.Set {
		u.pauseRenewals()
		defer u.recheckIsolation(ctx)
	}
	return tx.Exec(ctx, sql, args...)
}

func (t *txView) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	f := keysql.Scan(sql)
	if err := refuse(f); err != nil {
		return nil, err
	}
	var rows pgx.Rows
	_, err := with(ctx, t, func(tx pgx.Tx) (struct{}, error) {
		if f.Set {
			t.u.pauseRenewals() // read again at the next SET run by Exec or QueryRow
		}
		var err error
		rows, err = tx.Query(ctx, sql, args...)
		return struct{}{}, err
	})
	if rows == nil {
		return nil, err
	}
	return &rowsView{u: t.u, rows: rows}, err
}

// QueryRow runs sql at once and reads its first row, which Scan decodes;
// the first statement of the transaction travels with its BEGIN, in one
// round trip.
func (t *txView) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	f := keysql.Scan(sql)
	if err := refuse(f); err != nil {
		return &rowView{err: err}
	}
	u := t.u
	if err := u.enter(); err != nil {
		return &rowView{err: err}
	}
	defer u.exit()
	r := &rowView{u: u}
	if t.sp == nil && u.tx == nil && u.err == nil {
		conn, err := u.acquire(ctx)
		if err != nil {
			return &rowView{err: err}
		}
		if pipelined(conn, sql, args) {
			sent, err := u.beginWith(ctx, conn, &firstStatement{sql, args, func(br pgx.BatchResults) error {
				return r.read(br.Query())
			}})
			if sent {
				return r
			}
			if err != nil {
				return &rowView{err: err}
			}
		} else if _, err := u.beginWith(ctx, conn, nil); err != nil {
			return &rowView{err: err}
		}
	}
	tx, err := t.on(ctx)
	if err != nil {
		return &rowView{err: err}
	}
	if f.Set {
		u.pauseRenewals()
		defer u.recheckIsolation(ctx)
	}
	_ = r.read(tx.Query(ctx, sql, args...))
	return r
}

// Conn returns the transaction's connection, beginning it; nil if it
// cannot begin, or once the request is over. The connection is closed when
// the request ends (see TxFromContext).
func (t *txView) Conn() *pgx.Conn {
	if err := t.u.enterRead(); err != nil {
		return nil
	}
	defer t.u.exit()
	tx, err := t.on(context.Background())
	if err != nil {
		return nil
	}
	t.u.leaked = true
	return tx.Conn()
}

// rowView is the row of QueryRow: its statement's first row, read when it
// ran, or its error.
type rowView struct {
	u       *unit // nil for an error found before the statement ran
	err     error
	typeMap *pgtype.Map // of the connection the row was read on
	fields  []pgconn.FieldDescription
	values  [][]byte
	has     bool // a row was read
	scanned bool
}

// read reads the first row of rows and closes them (which reads the rest,
// and the statement's error if it failed after its first row).
func (r *rowView) read(rows pgx.Rows, err error) error {
	if err != nil {
		if rows != nil {
			rows.Close()
		}
		r.err = err
		return err
	}
	if rows.Next() {
		r.has = true
		r.typeMap = rows.TypeMap()
		r.fields = append([]pgconn.FieldDescription(nil), rows.FieldDescriptions()...)
		for _, v := range rows.RawValues() {
			if v != nil {
				v = append(make([]byte, 0, len(v)), v...)
			}
			r.values = append(r.values, v)
		}
	}
	rows.Close()
	r.err = rows.Err()
	return r.err
}

// Scan decodes the row into dest, as pgx's Row does: the statement's
// error if it failed, pgx.ErrNoRows if it returned no row or the row was
// scanned already.
func (r *rowView) Scan(dest ...any) error {
	if r.u == nil {
		return r.err
	}
	// Decoding uses the connection's type map: only while the request
	// holds the connection, which no other request uses meanwhile.
	if err := r.u.enterRead(); err != nil {
		return err
	}
	defer r.u.exit()
	if r.err != nil {
		return r.err
	}
	if !r.has || r.scanned {
		return pgx.ErrNoRows
	}
	r.scanned = true
	if err := pgx.ScanRow(r.typeMap, r.fields, r.values, dest...); err != nil {
		r.err = err
		return err
	}
	return nil
}

// rowsView is the Rows of Query: pgx's, read only while the request is not
// over.
type rowsView struct {
	u    *unit
	rows pgx.Rows
	err  error // of a call refused by the unit
}

var _ pgx.Rows = (*rowsView)(nil)

func (r *rowsView) Close() {
	if r.u.enterRead() != nil {
		return // the request's end dealt with the connection
	}
	defer r.u.exit()
	r.rows.Close()
}

func (r *rowsView) Err() error {
	if r.err != nil {
		return r.err
	}
	if err := r.u.enterRead(); err != nil {
		return err
	}
	defer r.u.exit()
	return r.rows.Err()
}

func (r *rowsView) CommandTag() pgconn.CommandTag {
	if r.u.enterRead() != nil {
		return pgconn.CommandTag{}
	}
	defer r.u.exit()
	return r.rows.CommandTag()
}

func (r *rowsView) FieldDescriptions() []pgconn.FieldDescription { return r.rows.FieldDescriptions() }

func (r *rowsView) Next() bool {
	if err := r.u.enterRead(); err != nil {
		r.err = err
		return false
	}
	defer r.u.exit()
	return r.rows.Next()
}

func (r *rowsView) Scan(dest ...any) error {
	if err := r.u.enterRead(); err != nil {
		return err
	}
	defer r.u.exit()
	return r.rows.Scan(dest...)
}

func (r *rowsView) Values() ([]any, error) {
	if err := r.u.enterRead(); err != nil {
		return nil, err
	}
	defer r.u.exit()
	return r.rows.Values()
}

func (r *rowsView) RawValues() [][]byte {
	if r.u.enterRead() != nil {
		return nil
	}
	defer r.u.exit()
	return r.rows.RawValues()
}

// Conn returns the connection, as the transaction's Conn does.
func (r *rowsView) Conn() *pgx.Conn {
	if r.u.enterRead() != nil {
		return nil
	}
	defer r.u.exit()
	r.u.leaked = true
	return r.rows.Conn()
}

func (r *rowsView) TypeMap() *pgtype.Map {
	if r.u.enterRead() != nil {
		return nil
	}
	defer r.u.exit()
	return r.rows.TypeMap()
}

// batchView is the BatchResults of SendBatch: pgx's, read only while the
// request is not over.
type batchView struct {
	u  *unit
	br pgx.BatchResults
}

var _ pgx.BatchResults = (*batchView)(nil)

func (b *batchView) Exec() (pgconn.CommandTag, error) {
	if err := b.u.enterRead(); err != nil {
		return pgconn.CommandTag{}, err
	}
	defer b.u.exit()
	return b.br.Exec()
}

func (b *batchView) Query() (pgx.Rows, error) {
	if err := b.u.enterRead(); err != nil {
		return nil, err
	}
	defer b.u.exit()
	rows, err := b.br.Query()
	if rows == nil {
		return nil, err
	}
	return &rowsView{u: b.u, rows: rows}, err
}

// QueryRow reads the next result's first row, as QueryRow of the
// transaction does.
func (b *batchView) QueryRow() pgx.Row {
	if err := b.u.enterRead(); err != nil {
		return &rowView{err: err}
	}
	defer b.u.exit()
	r := &rowView{u: b.u}
	_ = r.read(b.br.Query())
	return r
}

func (b *batchView) Close() error {
	if err := b.u.enterRead(); err != nil {
		return err
	}
	defer b.u.exit()
	return b.br.Close()
}

// Tx returns nil for a batch that began no transaction; the request's
// transaction for one that called Batch.BeginTx (its BEGIN, inside the
// request's transaction, is a no-op).
func (b *batchView) Tx() pgx.Tx {
	if b.br.Tx() == nil {
		return nil
	}
	return &txView{u: b.u}
}
