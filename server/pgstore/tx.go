package pgstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// ErrNoTx is returned by [Tx] for a context that holds no request behind
// [idempotency.Middleware] on a [Store] that owns its key: no middleware,
// another store, a replay. A handler that writes anyway does it in a
// transaction of its own.
var ErrNoTx = errors.New("pgstore: no request's transaction in this context (not behind the idempotency middleware on a pgstore Store)")

// errTxDone: the request is over; its transaction is not begun any more.
var errTxDone = errors.New("pgstore: the request's transaction is over (completed or rolled back with its request)")

// Tx returns the transaction of the request in ctx, beginning it on the
// first call, for a handler behind [idempotency.Middleware] on a [Store]
// serving a request that owns its key. It is pgx's own pgx.Tx, begun on a
// connection of the store's pool at the session's
// default_transaction_isolation (docs/server.md, "Isolation"), and its
// writes commit in the same commit as the key's stored outcome; they
// roll back whenever the outcome is not stored: a released 4xx, a 5xx
// (unless stored), a panic, a fenced completion. It returns [ErrNoTx]
// anywhere else, and the error of the BEGIN if it failed (every later
// call returns it too, and a 2xx or 3xx answer then fails the
// completion: nothing was written).
//
// The transaction begins when Tx is first called, so a handler that first
// calls a slow downstream system, then Tx, holds no connection meanwhile;
// on a route with [idempotency.Options.OneTransaction] it began with the
// claim.
//
// The one rule: never end it. Its Commit and Rollback (pgx's habitual
// defer tx.Rollback(ctx) included: the middleware ends the transaction
// after the handler returns), a COMMIT, ROLLBACK, COMMIT AND CHAIN or
// PREPARE TRANSACTION sent as SQL, on it or on its Conn, end it behind the
// middleware's back, and what the handler wrote may then be committed
// without the key's outcome. pgstore does not police
// the handler's SQL; it checks at the end: when the transaction is no
// longer the one it began, or no longer open, it completes the key with
// [idempotency.UnitEndedResponse] (a 500 that says so) and never runs the
// request again under it. Savepoints (its Begin) are the handler's to end.
// Like any pgx.Tx it is for one goroutine at a time, and for the handler's
// lifetime only: the middleware ends it when the handler returns.
func Tx(ctx context.Context) (pgx.Tx, error) {
	t, ok := idempotency.TxFromContext(ctx)
	if !ok {
		return nil, ErrNoTx
	}
	u, ok := t.(*unit)
	if !ok {
		return nil, ErrNoTx
	}
	return u.begin(ctx)
}

// unit is the unit of work of a claim on a Store: the handler's
// transaction, begun by Tx (or by a claim in one transaction), and the
// key's completion. mu orders Tx, Complete and Rollback.
type unit struct {
	store *Store
	claim idempotency.Claim
	// inTx is the key of a claim made in one transaction, which
	// keysql.CompleteNewSQL writes when its row went with a rollback (see
	// keysql.ClaimTxSQL); nil otherwise. Such a unit's
	// transaction is begun by the claim.
	inTx *inTxKey

	mu   sync.Mutex
	done bool
	conn *pgxpool.Conn // nil until the transaction began
	tx   pgx.Tx        // pgx's own, on conn
	xid  string        // the transaction's ID (pg_current_xact_id()), recorded when it began
	err  error         // the transaction failed to begin: returned by every later Tx

	// snap: the transaction keeps one snapshot to its end (REPEATABLE
	// READ or SERIALIZABLE, as keysql.TxIDSQL read it), so renewals must
	// not update the key row (see renew). A claim in one transaction has
	// no lease, hence no renewals, and leaves it false.
	snapshot sync.Mutex // guards snap; held by a renewal while it runs, and by begin
	snap     bool
}

// begin returns the unit's transaction, beginning it on first use: BEGIN
// and keysql.TxIDSQL in one round trip (see beginOn), which reads the
// transaction's ID and its level.
//
// The level is known only from that answer, and the transaction's snapshot
// is taken before it, so renewals are held off from before the BEGIN is
// sent until the level is known: one that updates the key row finishes
// first, before the snapshot, and the next knows whether it may. The lock
// is taken before a connection is acquired, never while one is held, since
// a renewal holding it may itself be waiting for a connection of the pool
// (a pool full of begins waiting for renewals, and renewals waiting for
// connections, never moves: issue 30). The renewals of this claim wait
// while the begin waits for a connection, which they would need too.
func (u *unit) begin(ctx context.Context) (pgx.Tx, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return nil, errTxDone
	}
	if u.tx != nil || u.err != nil {
		return u.tx, u.err
	}
	u.snapshot.Lock()
	defer u.snapshot.Unlock()
	conn, err := u.store.pool.Acquire(ctx)
	if err != nil {
		u.err = interpretError(err)
		return nil, u.err
	}
	var xid string
	var snap bool
	tx, err := beginOn(ctx, conn, keysql.TxIDSQL, nil, func(br pgx.BatchResults) error {
		return br.QueryRow().Scan(u.store.txIDPlans.into(&xid, &snap))
	})
	if err != nil {
		conn.Release() // the pool drops it unless it is idle and outside a transaction
		u.err = interpretError(err)
		return nil, u.err
	}
	u.conn, u.tx, u.xid, u.snap = conn, tx, xid, snap
	return tx, nil
}

// beginOn begins a transaction on conn, at the session's default level,
// and runs one statement in it, in one round trip: sql with args, whose
// result read reads (keysql.TxIDSQL, or a claim in one transaction, which
// reads the transaction's ID itself).
func beginOn(ctx context.Context, conn *pgxpool.Conn, sql string, args []any, read func(pgx.BatchResults) error) (pgx.Tx, error) {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(sql, args...)
	br := conn.SendBatch(ctx, b)
	_, err := br.Exec()
	if err == nil {
		err = read(br)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return br.Tx(), err
}

// renew renews the claim's lease (see [Store.Renew]). While the
// transaction is being begun it waits (see begin); while it is open at
// REPEATABLE READ or SERIALIZABLE it only checks that the claim still owns
// the key: an update of the key row committed after the transaction's
// snapshot would make its completion fail with a serialization failure.
func (u *unit) renew(ctx context.Context) error {
	u.snapshot.Lock()
	defer u.snapshot.Unlock()
	if u.snap {
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
// With one, it first checks that the transaction is still the one Tx
// began and still open (see settle); then keysql.CompleteInTxSQL and
// COMMIT go in one round trip, and the completion's check of the
// transaction's ID aborts it, COMMIT included, when it is another (a
// COMMIT AND CHAIN ended the first). When the connection broke under them, they
// may not have run yet (the batch on its way, or waiting on the server for
// a lock), or be running, or have committed. Complete first releases the
// key under this claim's token: a completion that runs later is then
// fenced and commits nothing, and one that ran holds the key's row until
// its transaction ended, which the release waits for. Fenced, the release
// leaves it to the key: completed under this claim's token means
// committed, writes and all (PostgreSQL commits both or neither);
// otherwise nothing was, and Complete returns the error. (A claim in one
// transaction waits for its advisory lock instead, then reads the key.)
func (u *unit) Complete(ctx context.Context, resp idempotency.StoredResponse) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return errTxDone
	}
	u.done = true
	u.store.units.Remove(u.claim, u)
	if err := ctx.Err(); err != nil {
		return cmp.Or(u.rollbackChecked(ctx), err)
	}
	if !idempotency.ValidStatus(resp.Status) {
		return cmp.Or(u.rollbackChecked(ctx), fmt.Errorf("pgstore: %w: %d", idempotency.ErrInvalidStatus, resp.Status))
	}
	if err := keysql.CheckText(resp.ContentType); err != nil {
		return cmp.Or(u.rollbackChecked(ctx), err)
	}
	for name, v := range resp.Header {
		if err := keysql.CheckText(name, v); err != nil {
			return cmp.Or(u.rollbackChecked(ctx), err)
		}
	}
	header, err := keysql.HeaderArg(resp.Header)
	if err != nil {
		return cmp.Or(u.rollbackChecked(ctx), err)
	}
	c := u.claim
	args := []any{c.ClientID, c.Key, c.Token, resp.Status, resp.ContentType, header, resp.Body}
	if u.inTx != nil && u.tx == nil {
		return idempotency.ErrFenced // its transaction ended: the key went with it
	}
	if u.tx == nil {
		if u.err != nil && resp.Status < 400 {
			// The transaction failed to begin: a success stored now
			// would have no writes behind it.
			return fmt.Errorf("pgstore: the handler answered %d but its transaction failed to begin (%w); nothing was committed", resp.Status, u.err)
		}
		return u.store.ownedUpdate(ctx, c, keysql.CompleteSQL, args[3:], idempotency.StatusCompleted)
	}
	open, err := u.settle(ctx)
	switch {
	case err != nil:
		return err
	case !open && resp.Status < 400:
		return fmt.Errorf("pgstore: the handler answered %d but its transaction failed (a statement of it failed, or its connection closed); nothing was committed", resp.Status)
	case !open: // a refusal stored alone, as without a transaction
		if u.inTx != nil { // its row rolled back with the transaction
			return u.store.ownedUpdate(ctx, c, keysql.CompleteNewSQL, append(args[3:], u.inTx.args()...), idempotency.StatusCompleted)
		}
		return u.store.ownedUpdate(ctx, c, keysql.CompleteSQL, args[3:], idempotency.StatusCompleted)
	}
	return u.commitLocked(ctx, keysql.CompleteInTxSQL, args)
}

// errBusy: the handler returned with rows or a batch of its transaction
// still open, so the connection is not free for the completion (pgx's
// Commit fails the same way).
var errBusy = errors.New("pgstore: the handler left rows or a batch of its transaction open; nothing was committed")

// settle finds out what became of the handler's transaction before it is
// completed or rolled back. open: it is still in progress on its
// connection, and the caller checks that it is the one Tx began
// (keysql.CompleteInTxSQL's check, or keysql.TxGuardSQL) with its next
// statement. Otherwise the connection is
// given back and nothing of the transaction is left: it was aborted by a
// failed statement, or its connection closed, or the handler left it busy
// (errBusy; the pool drops it), and nothing of it committed
// unless the transaction Tx began committed, which keysql.TxStatusSQL tells
// (the handler committed it, then began another that failed); or the
// connection is outside any transaction, which only the handler can have
// done (a COMMIT, a ROLLBACK, PREPARE TRANSACTION, its Commit or
// Rollback). The handler's end fails closed (see failClosed). The caller
// holds u.mu.
func (u *unit) settle(ctx context.Context) (open bool, err error) {
	conn := u.conn
	pc := conn.Conn().PgConn()
	busy := pc.IsBusy()
	switch {
	case busy: // the pool drops a busy connection (below)
	case !pc.IsClosed() && pc.TxStatus() == 'T':
		return true, nil
	case !pc.IsClosed() && pc.TxStatus() == 'I':
		u.conn, u.tx = nil, nil
		conn.Release()
		return false, u.failClosed(ctx, "the handler ended the transaction")
	}
	// Busy, aborted, or the connection closed.
	_ = u.rollbackLocked(ctx)
	if ended, err := u.committed(ctx); err != nil || ended {
		return false, err
	}
	if busy {
		return false, errBusy
	}
	return false, nil
}

// committed reports whether the transaction Tx began committed
// (keysql.TxStatusSQL), after the caller rolled back what was left on its
// connection: only the handler can have committed it, and then began
// another; it then fails the key closed (see failClosed), whose error it
// returns. The caller holds u.mu.
func (u *unit) committed(ctx context.Context) (bool, error) {
	var status *string
	if err := u.store.pool.QueryRow(context.WithoutCancel(ctx), keysql.TxStatusSQL, u.xid).Scan(&status); err != nil {
		return false, interpretError(err)
	}
	if status == nil || *status != "committed" {
		return false, nil
	}
	return true, u.failClosed(ctx, "the handler committed the transaction, then began another")
}

// failClosed ends what is left of the handler's transaction and completes
// the key with idempotency.UnitEndedResponse under the claim's token (for
// a claim in one transaction: inserts it so, if its row went with a
// rollback), so that nothing runs again
// under it. The caller holds u.mu.
func (u *unit) failClosed(ctx context.Context, why string) error {
	lctx := context.WithoutCancel(ctx)
	_ = u.rollbackLocked(lctx)
	resp := idempotency.UnitEndedResponse()
	c := u.claim
	args := []any{resp.Status, resp.ContentType, nil, resp.Body}
	sql := keysql.CompleteSQL
	if u.inTx != nil {
		sql = keysql.CompleteNewSQL
		args = append(args, u.inTx.args()...)
	}
	if err := u.store.ownedUpdate(lctx, c, sql, args, idempotency.StatusCompleted); err != nil {
		return fmt.Errorf("pgstore: %s (%w), and the key could not be completed: %w", why, idempotency.ErrUnitEnded, err)
	}
	return fmt.Errorf("pgstore: %s: %w", why, idempotency.ErrUnitEnded)
}

// commitLocked sends sql (keysql.CompleteInTxSQL) and COMMIT on the
// handler's transaction in one
// round trip, with args and then the transaction's ID: the completion fails
// when the transaction is not the one Tx began, or when the claim was
// fenced, and PostgreSQL then skips the COMMIT. The caller holds u.mu.
func (u *unit) commitLocked(ctx context.Context, sql string, args []any) error {
	conn := u.conn
	b := &pgx.Batch{}
	b.Queue(sql, append(args, u.xid)...)
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	// The completion's own error tells: an ended transaction, or a
	// fence; the COMMIT's (a deferred constraint of the handler's tables)
	// never does, whatever its SQLSTATE.
	var pgErr *pgconn.PgError
	_, err := br.Exec()
	other := errors.As(err, &pgErr) && pgErr.Code == keysql.TxChangedCode
	fenced := errors.As(err, &pgErr) && keysql.IsFence(sql, pgErr.Code)
	if err == nil {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	switch {
	case err == nil:
		u.conn, u.tx = nil, nil
		conn.Release() // idle again: the pool takes it back
		return nil
	case other:
		return u.failClosed(ctx, "the handler ended the transaction and began another (a COMMIT AND CHAIN, say)")
	case fenced:
		_ = u.rollbackLocked(ctx)
		return idempotency.ErrFenced
	}
	err = interpretError(err)
	if !errors.Is(err, errConnLost) {
		// The completion checked first that it ran in the transaction Tx
		// began (keysql.CompleteInTxSQL), so whatever failed after, that
		// transaction rolls back whole.
		_ = u.rollbackLocked(ctx)
		return err
	}
	u.conn, u.tx = nil, nil
	conn.Release() // broken: the pool drops it
	var ours bool
	lctx := context.WithoutCancel(ctx)
	if u.inTx == nil {
		// The completion travelled with the COMMIT, and may not have run
		// yet (the batch still on its way, or waiting on the server for a
		// lock): a read would not wait for it.
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
		// The row of a key claimed in one transaction was inserted by
		// the transaction, and no read waits for it until the COMMIT ends,
		// which may still be running: wait
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

// rollbackLocked rolls back the transaction, if it began, and gives back
// its connection; the pool drops a connection that is broken, busy or
// still in a transaction. The caller holds u.mu.
func (u *unit) rollbackLocked(ctx context.Context) error {
	conn := u.conn
	if conn == nil {
		return nil
	}
	u.conn, u.tx = nil, nil
	if pc := conn.Conn().PgConn(); !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() != 'I' {
		_, _ = conn.Exec(context.WithoutCancel(ctx), "ROLLBACK")
	}
	conn.Release()
	return nil
}

// Rollback implements [idempotency.Tx.Rollback]: it rolls back the
// handler's transaction, if it began, and gives back its connection. A
// transaction the handler ended itself (see [Tx]) completes the key with
// idempotency.UnitEndedResponse instead, and the error wraps
// idempotency.ErrUnitEnded: the middleware must not release it.
func (u *unit) Rollback(ctx context.Context) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if !u.done {
		u.done = true
		u.store.units.Remove(u.claim, u)
	}
	return u.rollbackChecked(ctx)
}

// rollbackChecked is Rollback's work: the transaction rolled back, unless
// the handler ended it, which fails closed. The caller holds u.mu.
func (u *unit) rollbackChecked(ctx context.Context) error {
	if u.conn == nil {
		return nil
	}
	open, err := u.settle(ctx)
	if err != nil || !open {
		if errors.Is(err, errBusy) {
			return nil // rolled back: the pool dropped the connection
		}
		return err
	}
	// Still ours? A COMMIT AND CHAIN leaves another transaction open.
	_, err = u.conn.Exec(ctx, keysql.TxGuardSQL, u.xid)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == keysql.TxChangedCode {
		return u.failClosed(ctx, "the handler ended the transaction and began another (a COMMIT AND CHAIN, say)")
	}
	return u.rollbackLocked(ctx)
}
