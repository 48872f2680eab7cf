package sqlstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"unicode"
	"unicode/utf8"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
	"github.com/idemkit/idem/server/internal/sqlpipe"
)

// Tx is the unit of work of a request, for database/sql code: the four
// methods of sqlc's generated DBTX and of GORM's ConnPool, so that
// queries.New(tx) or a GORM session on it writes in the key's transaction.
// It has no Commit or Rollback: the middleware commits the transaction
// with the key's outcome, or rolls it back (see [TxFromContext]).
type Tx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	PrepareContext(ctx context.Context, query string) (*sql.Stmt, error)
}

// ErrTxOwned is returned by a statement of the transaction that
// [TxFromContext] gives a handler that would end it (COMMIT, ROLLBACK,
// END, ABORT, PREPARE TRANSACTION): the middleware commits it with the
// key's outcome, or rolls it back, from the status the handler answers.
// Such a statement is refused before it is sent, and the transaction goes
// on. A handler that wants its writes discarded answers a status that is
// not stored (a 4xx such as 400 or 409, or a 5xx), or writes inside a
// savepoint (SAVEPOINT, ROLLBACK TO SAVEPOINT) that it rolls back.
var ErrTxOwned = errors.New("sqlstore: the idempotency middleware commits or rolls back this transaction")

// Errors of the handler's transaction used where it may not be.
var (
	// errTxDone: the request is over; nothing handed out from its
	// transaction runs any more.
	errTxDone = fmt.Errorf("sqlstore: the request's transaction is over (completed or rolled back with its request): %w", idempotency.ErrUnitEnded)
	// errTxBusy: another call of the transaction is running, from
	// another goroutine.
	errTxBusy = errors.New("sqlstore: the request's transaction is in use by another call (a transaction is not safe for concurrent use)")
)

// TxFromContext returns the transaction of the request in ctx, for a
// handler behind [idempotency.Middleware] on a [Store], serving a request
// that owns its key. Its writes commit in the same commit as the key's
// stored outcome, and roll back whenever the outcome is not stored: a
// released 4xx, a 5xx (unless stored), a panic, a fenced completion. It
// returns false anywhere else (no middleware, another store, a replay),
// where a handler writes on its own.
//
// The transaction begins on its first statement, on a connection of the
// store's pool, so a handler that first calls a slow downstream system
// holds no connection meanwhile. It follows pgstore's rules for a
// handler's transaction, as far as database/sql allows:
//
//   - A statement that would end the transaction (COMMIT, ROLLBACK, END,
//     ABORT, PREPARE TRANSACTION, alone or among others in one text) is
//     refused with [ErrTxOwned] before it is sent, by ExecContext,
//     QueryContext, QueryRowContext and PrepareContext alike. SAVEPOINT
//     and ROLLBACK TO SAVEPOINT work as usual.
//   - QueryRowContext runs its statement at once and reads its first row
//     before it returns, so a row that is never scanned leaves nothing
//     pending on the connection; Scan decodes it as database/sql does.
//   - The transaction, and the rows of QueryRowContext, stop working when
//     the request ends: a call made after the middleware completed or
//     rolled back the request (from a goroutine that outlived the handler)
//     returns an error wrapping [idempotency.ErrUnitEnded] and touches no
//     connection. A call made while another is running, from another
//     goroutine, returns an error instead of waiting.
//
// Where it differs from pgstore, because database/sql hands out its own
// types: the *sql.Rows of QueryContext and the *sql.Stmt of PrepareContext
// are database/sql's; when the request ends they are closed, and a late
// use fails with database/sql's own error (context.Canceled from Rows.Err,
// "statement is closed"), not with ErrUnitEnded. While rows of the
// transaction are open (QueryContext's, or those of a prepared
// statement's query), its next statement fails at once, as the connection
// cannot take one, and rows still open when the handler answers fail the
// completion, so nothing of the request is committed. The rows of a
// prepared statement's query report each column's database type name,
// scan type and nullability, not its length or decimal size. The
// transaction's round trips: the BEGIN and the first statement take one
// each (pgstore sends them together); the completion and the COMMIT take
// one each. On pgx's stdlib with server/sqlstore/pgxpipeline imported,
// the store sends them as pgstore does (it then runs the transaction on a
// *sql.Conn rather than as a *sql.Tx): the BEGIN with a first ExecContext
// that has arguments (taken as database/sql hands them to pgx), or with
// the claim in one transaction; the completion with the COMMIT. The
// transaction runs in the database's default isolation level; under
// REPEATABLE READ or SERIALIZABLE, a lease renewal while it is open makes
// the completion fail with a serialization failure (nothing is committed,
// and the key is released), where pgstore, which reads the level with the
// BEGIN, stops renewing instead: such a handler must answer within a
// third of the lock timeout.
//
// A write that fails aborts the transaction, as in any PostgreSQL
// transaction: a stored 4xx outcome is then stored alone, while a 2xx or
// 3xx fails the completion (the key is released and the client gets a
// 500). Like any *sql.Tx, it is meant for one goroutine at a time.
func TxFromContext(ctx context.Context) (Tx, bool) {
	t, ok := idempotency.TxFromContext(ctx)
	if !ok {
		return nil, false
	}
	u, ok := t.(*unit)
	if !ok {
		return nil, false
	}
	return handlerTx{u}, true
}

// unit is the unit of work of a claim on a Store: the handler's
// transaction, begun on its first statement, and the key's completion.
//
// Every call that uses the transaction holds mu: the handler's calls take
// it with TryLock, and fail rather than wait when another call holds it;
// Complete and Rollback take it with Lock, and so wait for a statement
// under way. Once done, no call of the handler's touches the connection
// again.
type unit struct {
	store *Store
	claim idempotency.Claim

	// inTx are the parameters of keysql.CompleteNewSQL from $8 on, for a
	// claim made in one transaction, whose completion inserts the key;
	// nil otherwise. Such a unit's transaction is begun by the claim.
	inTx []any

	mu   sync.Mutex
	done atomic.Bool // set under mu; read by the rows of QueryRowContext without it
	conn *sql.Conn   // nil until the handler's first statement; while set, the transaction is open on it
	tx   *sql.Tx     // on conn; nil when the store pipes the transaction (see piped.go)
	err  error       // the transaction failed to begin: returned by every later statement
	// pending: the store pipes the transaction and holds conn, but has
	// not sent its BEGIN yet: it goes with the handler's first statement
	// when that is an ExecContext the driver can pipe (see execFirst).
	pending bool

	// A piped transaction's rows and statements handed to the handler,
	// which end with the request (see piped.go).
	rows  []handedRows
	stmts []*handedStmt
}

// q returns what runs the handler's statements: the *sql.Tx, or the
// *sql.Conn of a piped transaction.
func (u *unit) q() dbtx {
	if u.tx != nil {
		return u.tx
	}
	return u.conn
}

// enter holds u for one call of the handler's, beginning the transaction
// if need be: it fails when another call holds u, when the request is
// over, or when the transaction could not begin. exit releases it. A
// piped transaction's BEGIN is left pending for exec, the handler's
// ExecContext, which sends it with its statement (execFirst), and sent
// now for any other call.
func (u *unit) enter(ctx context.Context, exec bool) (dbtx, error) {
	if !u.mu.TryLock() {
		return nil, errTxBusy
	}
	if u.done.Load() {
		u.mu.Unlock()
		return nil, errTxDone
	}
	if u.conn == nil && u.err == nil {
		u.begin(ctx)
	}
	if u.pending && !exec {
		u.sendBegin(ctx)
	}
	if u.err != nil {
		u.mu.Unlock()
		return nil, u.err
	}
	if u.rowsOpenLocked() {
		u.mu.Unlock()
		return nil, errRowsOpen
	}
	return u.q(), nil
}

func (u *unit) exit() { u.mu.Unlock() }

// begin begins the transaction on a connection of the pool, acquired
// under ctx; the transaction itself outlives ctx (database/sql would roll
// it back when the context of its BeginTx ends): the middleware ends it.
// An error leaves the transaction unable to begin. The caller holds u.mu.
func (u *unit) begin(ctx context.Context) {
	conn, err := u.store.db.Conn(ctx)
	if err != nil {
		u.err = interpretError(err)
		return
	}
	if u.store.pipe != nil {
		u.conn, u.pending = conn, true // BEGIN: see enter
		return
	}
	tx, err := conn.BeginTx(context.WithoutCancel(ctx), nil)
	if err != nil {
		conn.Close()
		u.err = interpretError(err)
		return
	}
	u.conn, u.tx = conn, tx
}

// sendBegin sends the pending BEGIN of a piped transaction alone. An
// error leaves the transaction unable to begin. The caller holds u.mu.
func (u *unit) sendBegin(ctx context.Context) {
	u.pending = false
	if _, err := u.conn.ExecContext(context.WithoutCancel(ctx), "BEGIN"); err != nil {
		u.beginFailed(err)
	}
}

// beginFailed gives back the connection of a transaction whose BEGIN
// failed, and leaves the transaction unable to begin.
func (u *unit) beginFailed(err error) {
	u.store.giveBack(u.conn)
	u.conn = nil
	u.err = interpretError(err)
}

// execFirst runs the handler's first statement, an ExecContext, with the
// pending BEGIN of a piped transaction, in one round trip (pgstore's BEGIN
// travels with the first statement too), or after it when the driver
// must send the statement alone. The caller holds u.mu.
func (u *unit) execFirst(ctx context.Context, query string, args []any) (sql.Result, error) {
	u.pending = false
	var n int64
	var i int
	err := sqlpipe.ErrAlone // database/sql refuses the arguments itself
	if plain, ok := plainArgs(args); ok {
		i, err = u.store.runOn(ctx, u.conn, sqlpipe.Stmt{SQL: "BEGIN"},
			sqlpipe.Stmt{SQL: query, Args: plain, Affected: &n, Handler: true})
	}
	var notSent *sqlpipe.NotSentError
	switch {
	case errors.As(err, &notSent):
		// Nothing ran: the transaction has not begun, and the handler's
		// next statement begins it, as it goes on in a *sql.Tx whose
		// statement failed before it was sent.
		u.store.giveBack(u.conn)
		u.conn = nil
		return nil, notSent.Err
	case errors.Is(err, sqlpipe.ErrAlone):
		if u.sendBegin(ctx); u.err != nil {
			return nil, u.err
		}
		return u.conn.ExecContext(ctx, query, args...)
	case err != nil && i == 0:
		u.beginFailed(err)
		return nil, u.err
	case err != nil:
		return nil, err
	}
	return driver.RowsAffected(n), nil
}

// plainArgs returns args as database/sql hands them to a driver that takes
// every value as it is (pgx's stdlib): sql.NamedArg by its value. ok is
// false when database/sql would refuse them (a name that does not begin
// with a letter).
func plainArgs(args []any) (_ []any, ok bool) {
	var out []any
	for i, a := range args {
		if na, ok := a.(sql.NamedArg); ok {
			if r, _ := utf8.DecodeRuneInString(na.Name); na.Name != "" && !unicode.IsLetter(r) {
				return nil, false
			}
			if out == nil {
				out = slices.Clone(args)
			}
			out[i] = na.Value
		}
	}
	if out == nil {
		return args, true
	}
	return out, true
}

// Complete implements [idempotency.Tx.Complete].
//
// Without a handler transaction it is keysql.CompleteSQL alone, run once
// more on a live connection when the connection broke under it (see
// [Store.Release]). With one, it is keysql.CompleteInTxSQL in the
// handler's transaction, then COMMIT. The completion fails with
// division_by_zero when the claim was fenced, and the transaction is then
// rolled back. When the connection broke under the COMMIT, whether it
// committed is learnt from the key: completed under this claim's token
// means committed, writes and all; otherwise nothing was, and Complete
// returns the error (the middleware then releases the key). A piped
// completion, sent with its COMMIT, may not have run yet when the
// connection broke, so the key is released under the claim's token first,
// as pgstore does: a completion that runs later is fenced, and one that
// ran makes the release wait for its end.
func (u *unit) Complete(ctx context.Context, resp idempotency.StoredResponse) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done.Load() {
		return errTxDone
	}
	u.done.Store(true)
	u.store.units.Remove(u.claim, u)
	args, err := completeArgs(ctx, u.claim, resp)
	if err != nil {
		u.rollbackLocked()
		return err
	}
	if u.inTx != nil {
		return u.completeInTx(ctx, resp.Status, args)
	}
	if u.conn == nil && u.err != nil && resp.Status < 400 {
		// The handler's first statement failed before its transaction
		// began: a success stored now would have no writes behind it.
		return fmt.Errorf("sqlstore: the handler answered %d but its transaction failed to begin (%w); nothing was committed", resp.Status, u.err)
	}
	if u.conn != nil {
		done, err := u.commitLocked(ctx, keysql.CompleteInTxSQL, resp.Status, args)
		if done {
			return err
		}
	}
	return u.store.ownedUpdate(ctx, u.claim, keysql.CompleteSQL, args[3:], idempotency.StatusCompleted)
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

// commitLocked completes the key in the handler's transaction with query
// (keysql.CompleteInTxSQL, or keysql.CompleteNewInTxSQL) and commits it. done is false when the handler's transaction failed (a write of its
// aborted it) and the outcome, a 4xx, is to be stored alone, as pgstore
// stores it. The caller holds u.mu.
func (u *unit) commitLocked(ctx context.Context, query string, status int, args []any) (done bool, _ error) {
	if u.rowsOpenLocked() {
		u.rollbackLocked()
		return true, fmt.Errorf("sqlstore: the handler answered %d but left rows of its transaction open; nothing was committed", status)
	}
	piped := u.tx == nil
	ended, err := u.sendCompletion(ctx, query, args)
	if !ended {
		switch c := code(err); {
		case keysql.IsFence(query, c):
			u.rollbackLocked()
			return true, idempotency.ErrFenced
		case c == inFailedTransaction:
			u.rollbackLocked()
			if status < 400 {
				return true, fmt.Errorf("sqlstore: the handler answered %d but its transaction failed; nothing was committed", status)
			}
			return false, nil
		default:
			u.rollbackLocked()
			return true, interpretError(err)
		}
	}
	if err == nil {
		return true, nil
	}
	// Whatever the COMMIT's error says (a driver may report a connection
	// cut under it as "conn closed", which reads like a failure before
	// sending), the COMMIT may have landed: read the key once it ended.
	var ours bool
	oneTx := u.inTx != nil
	lctx := context.WithoutCancel(ctx)
	if piped && !oneTx {
		// The completion travelled with the COMMIT, and may not have run
		// yet (the round trip still on its way, or waiting for a lock):
		// nothing makes a read wait for it. Release the key under the
		// claim's token instead: a completion that runs later is fenced
		// and commits nothing; one that ran first holds the key's row
		// until its transaction ends, and the release then finds the key
		// completed under the token (committed) or still started.
		switch rerr := u.store.ownedUpdate(lctx, u.claim, keysql.ReleaseSQL, []any{false}, ""); {
		case rerr == nil:
			return true, err // released: nothing of the request commits
		case !errors.Is(rerr, idempotency.ErrFenced):
			return true, err
		}
	}
	if lerr := u.store.onLiveConn(lctx, func(q querier) error {
		if oneTx {
			// A key claimed in one transaction has no row to wait on
			// while its COMMIT runs: wait for the claim's advisory lock,
			// which that transaction holds until it ends (this statement
			// holds it only to its own end), bounded.
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
		return true, nil
	}
	return true, err
}

// sendCompletion sends query, the completion, then the COMMIT, and gives
// back the connection: in one round trip on a piped transaction, in two
// on a *sql.Tx. ended is false when the completion itself failed, with a
// PostgreSQL error of its own: nothing was committed, and the transaction
// is left to the caller. Otherwise the transaction ended, and err, the
// COMMIT's error (or that of a connection that broke under either), may
// hide a COMMIT that landed. The caller holds u.mu.
func (u *unit) sendCompletion(ctx context.Context, query string, args []any) (ended bool, err error) {
	u.endHandedLocked()
	if u.tx != nil {
		if _, err := (on{u.store, u.tx}).ExecContext(ctx, query, args...); err != nil {
			return false, err
		}
		err = interpretError(u.tx.Commit())
		u.conn.Close()
		u.conn, u.tx = nil, nil
		return true, err
	}
	i, err := u.store.runOn(ctx, u.conn, sqlpipe.Stmt{SQL: query, Args: args}, sqlpipe.Stmt{SQL: "COMMIT"})
	if err != nil && i == 0 && code(err) != "" && !keysql.ConnEnded(code(err)) {
		return false, err
	}
	u.store.giveBack(u.conn)
	u.conn = nil
	return true, interpretError(err)
}

// inFailedTransaction is the SQLSTATE of a statement sent in a
// transaction that a failed statement aborted.
const inFailedTransaction = "25P02"

// Rollback implements [idempotency.Tx.Rollback]: it rolls back the
// handler's transaction, if it began, and gives back its connection.
func (u *unit) Rollback(context.Context) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.done.Store(true)
	u.store.units.Remove(u.claim, u)
	u.rollbackLocked()
	return nil
}

// rollbackLocked rolls back the transaction, if it began, and gives back
// its connection. The caller holds u.mu.
func (u *unit) rollbackLocked() {
	u.endHandedLocked()
	switch {
	case u.tx != nil:
		_ = u.tx.Rollback()
		u.conn.Close()
		u.conn, u.tx = nil, nil
	case u.conn != nil:
		u.store.giveBack(u.conn) // rolls back
		u.conn = nil
	}
}

// handlerTx is the Tx a handler gets from TxFromContext.
type handlerTx struct{ u *unit }

// refuse returns ErrTxOwned for SQL that would end the transaction.
func refuse(query string) error {
	if f := keysql.Scan(query); f.Control != "" {
		return fmt.Errorf("%w: the handler may not send %s", ErrTxOwned, f.Control)
	}
	return nil
}

// with runs f on the request's transaction, holding the unit, unless
// query would end the transaction. exec says f is ExecContext's, which
// sends a pending BEGIN itself (see unit.enter).
func with[T any](ctx context.Context, t handlerTx, query string, exec bool, f func(q dbtx) (T, error)) (T, error) {
	var zero T
	if err := refuse(query); err != nil {
		return zero, err
	}
	if err := ctx.Err(); err != nil {
		// As a *sql.Tx does: pgx's stdlib reports a statement of a done
		// context as driver.ErrBadConn, on which database/sql closes a
		// piped transaction's *sql.Conn, and a first statement would leave
		// the transaction unable to begin.
		return zero, err
	}
	q, err := t.u.enter(ctx, exec)
	if err != nil {
		return zero, err
	}
	defer t.u.exit()
	return f(q)
}

// ExecContext runs query in the request's transaction.
func (t handlerTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	return with(ctx, t, query, true, func(q dbtx) (sql.Result, error) {
		if t.u.pending {
			return t.u.execFirst(ctx, query, args)
		}
		return q.ExecContext(ctx, query, args...)
	})
}

// QueryContext runs query in the request's transaction. The rows are
// database/sql's, closed when the request ends.
func (t handlerTx) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return with(ctx, t, query, false, func(q dbtx) (*sql.Rows, error) {
		return t.u.query(ctx, func(ctx context.Context) (*sql.Rows, error) { return q.QueryContext(ctx, query, args...) })
	})
}

// QueryRowContext runs query in the request's transaction and reads its
// first row at once (see TxFromContext).
func (t handlerTx) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	r := &readRow{u: t.u}
	_, r.err = with(ctx, t, query, false, func(q dbtx) (struct{}, error) { return struct{}{}, r.read(ctx, q, query, args) })
	return r.row()
}

// PrepareContext prepares query in the request's transaction. The
// statement is closed when the request ends.
func (t handlerTx) PrepareContext(ctx context.Context, query string) (*sql.Stmt, error) {
	return with(ctx, t, query, false, func(q dbtx) (*sql.Stmt, error) { return t.u.prepare(ctx, q, query) })
}
