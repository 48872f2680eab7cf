package pgstore

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
)

// ErrTxOwned is returned by Commit and Rollback of the transaction that
// [TxFromContext] gives a handler: the middleware commits it with the key's
// outcome, or rolls it back, from the status the handler answers. A
// handler that wants its writes discarded answers a status that is not
// stored (a 4xx such as 400 or 409, or a 5xx), or writes inside a savepoint
// (the Tx's Begin) that it rolls back.
var ErrTxOwned = errors.New("pgstore: the idempotency middleware commits or rolls back this transaction")

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
// holds no connection meanwhile. Its Commit and Rollback return
// [ErrTxOwned] and do nothing (a habitual defer tx.Rollback(ctx) is
// harmless); its Begin opens a savepoint, as pgx's does. A write that fails
// aborts the transaction, as in any PostgreSQL transaction: a handler that
// turns the error into a 409 or a 422 leaves nothing committed, and a
// stored 4xx outcome is then stored alone, while a 2xx or 3xx over a failed
// transaction fails the completion (the key is released and the client
// gets a 500), since it would store a success whose writes are gone.
//
// Like any pgx.Tx, it must not be used by two goroutines at once.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	t, ok := idempotency.TxFromContext(ctx)
	if !ok {
		return nil, false
	}
	u, ok := t.(*unit)
	if !ok {
		return nil, false
	}
	return &handlerTx{u: u}, true
}

// unit is the unit of work of a claim on a Store: the handler's
// transaction, begun on its first statement, and the key's completion.
type unit struct {
	store *Store
	claim idempotency.Claim

	mu   sync.Mutex
	done bool
	conn *pgxpool.Conn // nil until the handler's first statement
	tx   pgx.Tx        // on conn
	err  error         // of the begin, returned by every later statement
}

// begin returns the handler's transaction, beginning it on first use.
func (u *unit) begin(ctx context.Context) (pgx.Tx, error) {
	tx, _, err := u.beginWith(ctx, nil)
	return tx, err
}

// beginWith is begin that, when it begins the transaction, sends first in
// the same round trip as the BEGIN (pgx's Batch.BeginTx), reads its result
// with read and reports sent. With first nil, or once the transaction has
// begun, it sends nothing: the caller runs its statement on the returned
// transaction. A first statement that fails leaves the transaction begun
// and aborted, as any failed statement does.
func (u *unit) beginWith(ctx context.Context, first *firstStatement) (tx pgx.Tx, sent bool, err error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	switch {
	case u.done:
		return nil, false, errTxDone
	case u.tx != nil || u.err != nil:
		return u.tx, false, u.err
	}
	conn, err := u.store.pool.Acquire(ctx)
	if err != nil {
		u.err = interpretError(err)
		return nil, false, u.err
	}
	if first == nil {
		tx, err := conn.Begin(ctx)
		if err != nil {
			conn.Release()
			u.err = interpretError(err)
			return nil, false, u.err
		}
		u.conn, u.tx = conn, tx
		return tx, false, nil
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(first.sql, first.args...)
	br := conn.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil { // the BEGIN
		br.Close()
		conn.Release()
		u.err = interpretError(err)
		return nil, false, u.err
	}
	serr := first.read(br)
	cerr := br.Close()
	tx = br.Tx()
	if conn.Conn().IsClosed() || conn.Conn().PgConn().TxStatus() == 'I' {
		// The transaction did not survive the batch (its connection
		// broke): nothing of it can commit.
		conn.Release()
		u.err = interpretError(cmpErr(serr, cerr, errors.New("the transaction ended")))
		return nil, true, u.err
	}
	u.conn, u.tx = conn, tx
	return tx, true, cmpErr(serr, cerr)
}

// firstStatement is a handler's first statement, sent with the BEGIN.
type firstStatement struct {
	sql  string
	args []any
	read func(br pgx.BatchResults) error // reads its result from the batch
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

// errTxDone is returned when a finished unit of work is used again.
var errTxDone = errors.New("pgstore: unit of work already completed or rolled back")

// completeSQL completes a key its claim still owns ($1 client, $2 key, $3
// token) with the response ($4 status, $5 content type, $6 headers, $7
// body); the key expires its retention from now. It updates no row when
// the claim was fenced.
const completeSQL = `
UPDATE idempotency_keys SET
    status = 'completed',
    response_status = $4,
    response_content_type = $5,
    response_headers = $6,
    response_body = $7,
    expires_at = ` + finishedExpiryExpr + `
WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'`

// completeInTxSQL is completeSQL as the last statement of the handler's
// transaction, sent in one pipeline with its COMMIT. It fails with
// division_by_zero when it completed nothing (the claim was fenced): the
// error makes PostgreSQL skip the COMMIT queued behind it, so the
// handler's writes are never committed without the key's outcome. A
// fenced completion is the only way this statement divides by zero.
const completeInTxSQL = `
WITH done AS (` + completeSQL + `
    RETURNING 1)
SELECT 1 / (SELECT count(*)::integer FROM done)`

// divisionByZero is the SQLSTATE of a fenced completeInTxSQL.
const divisionByZero = "22012"

// Complete implements [idempotency.Tx.Complete].
//
// Without a handler transaction it is completeSQL alone. When the
// connection broke under it, it runs once more on a live connection: lost
// before its commit, the first wrote nothing, and the retry completes the
// key; lost after, the retry finds the key completed under this claim's
// token, which only this completion can have done, and Complete succeeds.
//
// With one, it is completeInTxSQL and COMMIT in one round trip. When the
// connection broke under them, whether they committed is learnt from the
// key: completed under this claim's token means committed, writes and
// all (PostgreSQL commits both or neither); otherwise nothing was, and
// Complete returns the error (the middleware then releases the key, which
// waits for a commit still under way, and fails if it landed).
func (u *unit) Complete(ctx context.Context, resp idempotency.StoredResponse) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return errTxDone
	}
	u.done = true
	if err := ctx.Err(); err != nil {
		u.rollbackLocked(ctx)
		return err
	}
	if !idempotency.ValidStatus(resp.Status) {
		u.rollbackLocked(ctx)
		return fmt.Errorf("pgstore: %w: %d", idempotency.ErrInvalidStatus, resp.Status)
	}
	if err := checkText(resp.ContentType); err != nil {
		u.rollbackLocked(ctx)
		return err
	}
	for name, v := range resp.Header {
		if err := checkText(name, v); err != nil {
			u.rollbackLocked(ctx)
			return err
		}
	}
	var header any // SQL NULL when there is nothing to replay
	if len(resp.Header) > 0 {
		header = resp.Header
	}
	c := u.claim
	args := []any{c.ClientID, c.Key, c.Token, resp.Status, resp.ContentType, header, resp.Body}
	if u.tx == nil && u.err != nil && resp.Status < 400 {
		// The handler's first statement failed before its transaction
		// began: a success stored now would have no writes behind it.
		return fmt.Errorf("pgstore: the handler answered %d but its transaction failed to begin (%w); nothing was committed", resp.Status, u.err)
	}
	if u.tx != nil {
		switch u.conn.Conn().PgConn().TxStatus() {
		case 'T': // a transaction in progress: complete and commit it
			return u.commitLocked(ctx, args)
		case 'E': // a write failed: nothing of the handler's can commit
			u.rollbackLocked(ctx)
			if resp.Status < 400 {
				return fmt.Errorf("pgstore: the handler answered %d but its transaction failed; nothing was committed", resp.Status)
			}
		default:
			u.rollbackLocked(ctx)
			return fmt.Errorf("pgstore: the handler's transaction is no longer open; nothing of it was committed")
		}
	}
	return u.store.ownedUpdate(ctx, c, completeSQL, args[3:], idempotency.StatusCompleted)
}

// commitLocked sends completeInTxSQL and COMMIT on the handler's
// transaction in one round trip. The caller holds u.mu.
func (u *unit) commitLocked(ctx context.Context, args []any) error {
	conn := u.conn
	u.conn, u.tx = nil, nil
	b := &pgx.Batch{}
	b.Queue(completeInTxSQL, args...)
	b.Queue("COMMIT")
	err := conn.SendBatch(ctx, b).Close()
	if err == nil {
		conn.Release() // idle again: the pool takes it back
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == divisionByZero {
		rollback(ctx, conn)
		return idempotency.ErrFenced
	}
	err = interpretError(err)
	if !errors.Is(err, errConnLost) {
		rollback(ctx, conn)
		return err
	}
	conn.Release() // broken: the pool drops it
	var ours bool
	if lerr := u.store.onLiveConn(context.WithoutCancel(ctx), func(q querier) (err error) {
		ours, err = hasStatusUnder(ctx, q, u.claim, idempotency.StatusCompleted)
		return err
	}); lerr == nil && ours {
		return nil
	}
	return err
}

// rollback rolls back the transaction on conn and returns conn to the pool,
// which closes it if it is still in a transaction.
func rollback(ctx context.Context, conn *pgxpool.Conn) {
	_, _ = conn.Exec(context.WithoutCancel(ctx), "ROLLBACK")
	conn.Release()
}

// Rollback implements [idempotency.Tx.Rollback]: it rolls back the
// handler's transaction, if it began, and returns its connection.
func (u *unit) Rollback(ctx context.Context) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.done = true
	u.rollbackLocked(ctx)
	return nil
}

func (u *unit) rollbackLocked(ctx context.Context) {
	if u.conn != nil {
		rollback(ctx, u.conn)
		u.conn, u.tx = nil, nil
	}
}

// handlerTx is the pgx.Tx a handler gets from TxFromContext: the unit's
// transaction, begun on the first statement, which the handler may not
// commit or roll back.
type handlerTx struct{ u *unit }

var _ pgx.Tx = (*handlerTx)(nil)

// Begin opens a savepoint, a pseudo nested transaction that the handler
// commits or rolls back itself.
func (t *handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := t.u.begin(ctx)
	if err != nil {
		return nil, err
	}
	return tx.Begin(ctx)
}

// Commit returns ErrTxOwned: the middleware commits.
func (t *handlerTx) Commit(context.Context) error { return ErrTxOwned }

// Rollback returns ErrTxOwned: the middleware rolls back.
func (t *handlerTx) Rollback(context.Context) error { return ErrTxOwned }

func (t *handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	tx, err := t.u.begin(ctx)
	if err != nil {
		return 0, err
	}
	return tx.CopyFrom(ctx, table, columns, src)
}

func (t *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	tx, err := t.u.begin(ctx)
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return tx.SendBatch(ctx, b)
}

// LargeObjects returns the large objects of the transaction, beginning it.
// If it cannot begin, the returned value's methods fail with the error of
// the next statement.
func (t *handlerTx) LargeObjects() pgx.LargeObjects {
	tx, err := t.u.begin(context.Background())
	if err != nil {
		return pgx.LargeObjects{}
	}
	return tx.LargeObjects()
}

func (t *handlerTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	tx, err := t.u.begin(ctx)
	if err != nil {
		return nil, err
	}
	return tx.Prepare(ctx, name, sql)
}

// Exec runs sql; the first statement of the transaction travels with its
// BEGIN, in one round trip.
func (t *handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	var tag pgconn.CommandTag
	tx, sent, err := t.u.beginWith(ctx, &firstStatement{sql, args, func(br pgx.BatchResults) (err error) {
		tag, err = br.Exec()
		return err
	}})
	if sent || err != nil {
		return tag, err
	}
	return tx.Exec(ctx, sql, args...)
}

func (t *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	tx, err := t.u.begin(ctx)
	if err != nil {
		return nil, err
	}
	return tx.Query(ctx, sql, args...)
}

// QueryRow runs sql when its row is scanned; the first statement of the
// transaction travels with its BEGIN, in one round trip.
func (t *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return firstRow{t.u, ctx, sql, args}
}

// firstRow is the row of QueryRow, run when it is scanned.
type firstRow struct {
	u    *unit
	ctx  context.Context
	sql  string
	args []any
}

func (r firstRow) Scan(dest ...any) error {
	tx, sent, err := r.u.beginWith(r.ctx, &firstStatement{r.sql, r.args, func(br pgx.BatchResults) error {
		return br.QueryRow().Scan(dest...)
	}})
	if sent || err != nil {
		return err
	}
	return tx.QueryRow(r.ctx, r.sql, r.args...).Scan(dest...)
}

// Conn returns the transaction's connection, beginning it; nil if it
// cannot begin.
func (t *handlerTx) Conn() *pgx.Conn {
	tx, err := t.u.begin(context.Background())
	if err != nil {
		return nil
	}
	return tx.Conn()
}
