package sqlstore

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// ErrNoTx is returned by [Tx] for a context that holds no request behind
// [idempotency.Middleware] on a [Store] that owns its key: no middleware,
// another store, a replay. A handler that writes anyway does it in a
// transaction of its own.
var ErrNoTx = errors.New("sqlstore: no request's transaction in this context (not behind the idempotency middleware on a sqlstore Store)")

// errTxDone: the request is over; its transaction is not begun any more.
var errTxDone = errors.New("sqlstore: the request's transaction is over (completed or rolled back with its request)")

// Tx returns the transaction of the request in ctx, beginning it on the
// first call, for a handler behind [idempotency.Middleware] on a [Store]
// serving a request that owns its key. It is database/sql's own *sql.Tx,
// begun at the session's default_transaction_isolation (docs/server.md,
// "Isolation"): sqlc's DBTX, GORM's ConnPool
// (db.Transaction nests as savepoints), River's riverdatabasesql InsertTx
// take it as it is. Its writes commit in the same commit as the key's
// stored outcome, and roll back whenever the outcome is not stored. It
// returns [ErrNoTx] anywhere else, and the error of the BEGIN if it
// failed (every later call returns it too).
//
// The one rule, as with pgstore.Tx: never end it (its Commit or Rollback,
// a deferred Rollback included, or COMMIT, ROLLBACK, COMMIT AND CHAIN,
// PREPARE TRANSACTION as SQL).
// sqlstore polices none of the handler's SQL; at the end it checks that
// the transaction is still the one it began and still open, and when the
// handler ended it, it completes the key with
// [idempotency.UnitEndedResponse] and never runs the request again. Like
// any *sql.Tx, it is for the handler's lifetime only: the middleware ends
// it when the handler returns.
func Tx(ctx context.Context) (*sql.Tx, error) {
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

	// inTx are the parameters of keysql.CompleteNewSQL from $8 on, for a
	// claim made in one transaction, whose key's row goes with a
	// transaction that rolls back; nil otherwise. Such a unit's
	// transaction is begun by the claim.
	inTx []any

	mu   sync.Mutex
	done bool
	conn *sql.Conn // nil until the transaction began
	tx   *sql.Tx   // on conn
	xid  string    // the transaction's ID, read when it began (keysql.TxIDSQL, or the claim in one transaction)
	err  error     // the transaction failed to begin: returned by every later Tx

	// snap: the transaction keeps one snapshot to its end (REPEATABLE
	// READ or SERIALIZABLE, as keysql.TxIDSQL read it): renewals only
	// check. A claim in one transaction has no lease and leaves it false.
	snapshot sync.Mutex // guards snap; held by a renewal while it runs, and by begin
	snap     bool
}

// begin returns the unit's transaction, beginning it on first use, and
// reads its ID and its level (keysql.TxIDSQL).
//
// The level is known only from that answer, and the transaction's
// snapshot is taken before it, so renewals are held off from before the
// BEGIN until the level is known, as in pgstore: one that updates the key
// row finishes first, before the snapshot, and the next knows whether it
// may. The lock is taken before a connection is acquired, never while one
// is held: a renewal holding it may be waiting for a connection (issue
// 30's deadlock).
func (u *unit) begin(ctx context.Context) (*sql.Tx, error) {
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
	if u.err = u.beginLocked(ctx); u.err != nil {
		return nil, u.err
	}
	if err := u.tx.QueryRowContext(ctx, keysql.TxIDSQL).Scan(&u.xid, &u.snap); err != nil {
		u.rollbackLocked()
		u.err = interpretError(err)
		return nil, u.err
	}
	return u.tx, nil
}

// beginLocked begins the transaction, at the session's default level, on
// a connection of the pool acquired under ctx; the transaction itself
// outlives ctx (database/sql would roll it back when the context of its
// BeginTx ends): the middleware ends it. The caller holds u.mu.
func (u *unit) beginLocked(ctx context.Context) error {
	conn, err := u.store.db.Conn(ctx)
	if err != nil {
		return interpretError(err)
	}
	tx, err := conn.BeginTx(context.WithoutCancel(ctx), nil)
	if err != nil {
		conn.Close()
		return interpretError(err)
	}
	u.conn, u.tx = conn, tx
	return nil
}

// renew renews the claim's lease. While the transaction is being begun it
// waits (see begin); while it is open at REPEATABLE READ or SERIALIZABLE
// it only checks that the claim still owns the key: an update of the key
// row committed after the transaction's snapshot would make its
// completion fail with a serialization failure.
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
// Without a handler transaction it is keysql.CompleteSQL alone, run once
// more on a live connection when the connection broke under it (see
// [Store.Release]). With one, it is keysql.CompleteInTxSQL in the
// handler's transaction, then COMMIT. The completion fails with
// division_by_zero when the claim was fenced, and with keysql.TxChangedCode
// when the handler ended the transaction (see [Tx]), which fails closed.
// When the connection broke under the COMMIT, whether it committed is
// learnt from the key: completed under this claim's token means committed,
// writes and all; otherwise nothing was, and Complete returns the error.
func (u *unit) Complete(ctx context.Context, resp idempotency.StoredResponse) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return errTxDone
	}
	u.done = true
	u.store.units.Remove(u.claim, u)
	args, err := completeArgs(ctx, u.claim, resp)
	if err != nil {
		return cmp.Or(u.rollbackChecked(ctx), err)
	}
	if u.inTx != nil && u.tx == nil {
		return idempotency.ErrFenced // its transaction ended: the key went with it
	}
	if u.tx == nil {
		if u.err != nil && resp.Status < 400 {
			// The transaction failed to begin: a success stored now
			// would have no writes behind it.
			return fmt.Errorf("sqlstore: the handler answered %d but its transaction failed to begin (%w); nothing was committed", resp.Status, u.err)
		}
		return u.store.ownedUpdate(ctx, u.claim, keysql.CompleteSQL, args[3:], idempotency.StatusCompleted)
	}
	query := keysql.CompleteInTxSQL
	_, err = on{u.store, u.tx}.ExecContext(ctx, query, append(args, u.xid)...)
	switch c := code(err); {
	case err == nil:
		return u.commitLocked(ctx)
	case c == keysql.TxChangedCode, errors.Is(err, sql.ErrTxDone):
		// In another transaction, or none; or the handler called the
		// *sql.Tx's Commit or Rollback.
		return u.failClosed(ctx, "the handler ended the transaction")
	case keysql.IsFence(query, c):
		u.rollbackLocked()
		return idempotency.ErrFenced
	case c == inFailedTransaction || connBroken(err):
		// Aborted by a failed statement, or its connection lost: nothing
		// of it commits, unless the handler committed the transaction
		// Tx began and went on in another.
		u.rollbackLocked()
		if ended, err := u.committed(ctx); err != nil || ended {
			return err
		}
		if resp.Status < 400 {
			return fmt.Errorf("sqlstore: the handler answered %d but its transaction failed; nothing was committed", resp.Status)
		}
		if u.inTx != nil { // its row rolled back with the transaction
			return u.store.ownedUpdate(ctx, u.claim, keysql.CompleteNewSQL, append(args[3:7], u.inTx...), idempotency.StatusCompleted)
		}
		return u.store.ownedUpdate(ctx, u.claim, keysql.CompleteSQL, args[3:], idempotency.StatusCompleted)
	default:
		// Nothing of the transaction commits now, but an error no check
		// above reads (a driver out of step with the server, say, under
		// rows the handler left open) may follow the handler's own COMMIT.
		u.rollbackLocked()
		if ended, err := u.committed(ctx); err != nil || ended {
			return err
		}
		return interpretError(err)
	}
}

// commitLocked commits the handler's transaction, its completion in it.
// Whatever the COMMIT's error says (a driver may report a connection cut
// under it as "conn closed", which reads like a failure before sending),
// the COMMIT may have landed: the key, once that transaction ended, tells.
// The caller holds u.mu.
func (u *unit) commitLocked(ctx context.Context) error {
	err := interpretError(u.tx.Commit())
	u.conn.Close()
	u.conn, u.tx = nil, nil
	if err == nil {
		return nil
	}
	lctx := context.WithoutCancel(ctx)
	var ours bool
	if lerr := u.store.onLiveConn(lctx, func(q querier) error {
		if u.inTx != nil {
			// The row of a key claimed in one transaction was inserted by
			// it, and no read waits for it while its COMMIT runs: wait for
			// the claim's advisory lock,
			// which that transaction holds until it ends, bounded.
			wctx, cancel := context.WithTimeout(lctx, keysql.LostCommitWait)
			defer cancel()
			if _, err := q.ExecContext(wctx, keysql.WaitKeyLockSQL, u.claim.ClientID, u.claim.Key); err != nil {
				return err
			}
		}
		var err error
		ours, err = hasStatusUnder(lctx, q, u.claim, idempotency.StatusCompleted)
		return err
	}); lerr == nil && ours {
		return nil
	}
	return err
}

// committed reports whether the transaction Tx began committed: the
// handler committed it, and its later statements ran elsewhere. Then the
// key fails closed, and err wraps idempotency.ErrUnitEnded.
func (u *unit) committed(ctx context.Context) (bool, error) {
	var status *string
	if err := u.store.db.QueryRowContext(context.WithoutCancel(ctx), keysql.TxStatusSQL, u.xid).Scan(&status); err != nil {
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
	u.rollbackLocked()
	resp := idempotency.UnitEndedResponse()
	args := []any{resp.Status, resp.ContentType, nil, resp.Body}
	query := keysql.CompleteSQL
	if u.inTx != nil {
		query = keysql.CompleteNewSQL
		args = append(args, u.inTx...)
	}
	if err := u.store.ownedUpdate(lctx, u.claim, query, args, idempotency.StatusCompleted); err != nil {
		return fmt.Errorf("sqlstore: %s (%w), and the key could not be completed: %w", why, idempotency.ErrUnitEnded, err)
	}
	return fmt.Errorf("sqlstore: %s: %w", why, idempotency.ErrUnitEnded)
}

// completeArgs checks resp and returns the parameters of
// keysql.CompleteSQL for it.
func completeArgs(ctx context.Context, c idempotency.Claim, resp idempotency.StoredResponse) ([]any, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if !idempotency.ValidStatus(resp.Status) {
		return nil, fmt.Errorf("sqlstore: %w: %d", idempotency.ErrInvalidStatus, resp.Status)
	}
	if err := keysql.CheckText(resp.ContentType); err != nil {
		return nil, err
	}
	for name, v := range resp.Header {
		if err := keysql.CheckText(name, v); err != nil {
			return nil, err
		}
	}
	header, err := keysql.HeaderArg(resp.Header)
	if err != nil {
		return nil, err
	}
	return []any{c.ClientID, c.Key, c.Token, resp.Status, resp.ContentType, header, resp.Body}, nil
}

// inFailedTransaction is the SQLSTATE of a statement sent in a
// transaction that a failed statement aborted.
const inFailedTransaction = "25P02"

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
	if u.tx == nil {
		return nil
	}
	_, err := u.tx.ExecContext(context.WithoutCancel(ctx), keysql.TxGuardSQL, u.xid)
	switch c := code(err); {
	case err == nil:
		u.rollbackLocked()
		return nil
	case c == keysql.TxChangedCode, errors.Is(err, sql.ErrTxDone):
		return u.failClosed(ctx, "the handler ended the transaction")
	}
	u.rollbackLocked() // aborted, or its connection lost
	_, err = u.committed(ctx)
	return err
}

// rollbackLocked rolls back the transaction, if it began, and gives back
// its connection. The caller holds u.mu.
func (u *unit) rollbackLocked() {
	if u.tx == nil {
		return
	}
	_ = u.tx.Rollback()
	u.conn.Close()
	u.conn, u.tx = nil, nil
}
