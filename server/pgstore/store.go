package pgstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// Store is the PostgreSQL [idempotency.Store], on the key table created by
// [Migrate]. It uses the database clock for every lease and retention
// decision, and the lease and retention stored with each key, so any
// number of processes, with any settings, can share one table. The clock
// is statement_timestamp(), the time the statement arrived, never now(),
// the start of its transaction: a completion runs inside the handler's
// transaction, which may have begun long before, and the key's retention
// counts from the completion.
//
// Each operation on a key is one round trip, but for the claims of keys
// that have a row: a claim inserts a new key in one
// (keysql.ClaimInsertSQL); a retry (a request whose first-sent time is a
// second old) reads the key's row first, so a replay or a duplicate of it
// costs one, and a first attempt reads it after the insert, in a second; a
// claim that resumes, replaces or takes over a key costs one more
// (keysql.ClaimSQL), or more in the rare case it lost a race to another
// writer of the key; a renewal, a release and a completion
// each update the row under the claim's fencing token. A completion whose
// handler wrote through [Tx] is the last statement of the
// handler's transaction, sent with its COMMIT in one round trip, so the
// handler's rows and the key's outcome commit together or not at all.
//
// When the connection breaks under a claim, a renewal, a release or a
// completion without a handler transaction, the store runs it once more on
// a live connection, in a way that is safe whether or not the lost
// statement committed: see [Store.Claim]; a completion (a release) that
// finds its key already completed (released) under its own fencing token is
// the lost one, committed, and succeeds. A connection breaks when
// PostgreSQL ends it (SQLSTATE 57P01 admin_shutdown, as after
// pg_terminate_backend or a fast restart, or a connection exception of
// class 08), or when it fails with no word from PostgreSQL: an EOF or a
// network error (a reset, a broken pipe) while the statement is sent or its
// answer read. A statement whose context is done is not run again, nor one
// that got no connection (the pool failed to connect). Other statements
// return the error.
//
// The store's statements and the handlers' transactions ([Tx]) run at the
// session's default_transaction_isolation, which the service sets on the
// pool's connections (docs/server.md, "Isolation"). Under REPEATABLE READ
// or SERIALIZABLE, a statement of the store that loses a race for a key's
// row fails with a serialization failure where READ COMMITTED would wait
// and read the row again: it did nothing, and the store runs it again, as
// it runs again a claim that lost a race under READ COMMITTED. See
// [Store.Renew] for the lease of a handler transaction under those levels.
//
// The zero value is not usable; call [New]. A Store is safe for concurrent
// use by many goroutines and many processes.
type Store struct {
	pool      *pgxpool.Pool
	openIndex keysql.OpenIndex // whether the key table has the open keys' index

	units keysql.Units[*unit] // the units of work of this process (see Renew)

	// The scan plans of the peek's row, of a transaction's ID
	// (keysql.TxIDSQL) and of a claim in one transaction.
	peekPlans, txIDPlans, claimTxPlans scanPlans
}

// New returns a store on pool, whose search_path must reach the table
// created by [Migrate].
func New(pool *pgxpool.Pool) *Store {
	return &Store{pool: pool}
}

// Claim implements [idempotency.Store.Claim] in one round trip for a new
// key (keysql.ClaimInsertSQL) and, for a retry, a replay and a duplicate
// (keysql.ClaimPeekSQL, see peek); in a second for a first attempt whose
// key has a row, or a retry's new key (keysql.ClaimReadSQL, or the insert), and
// with keysql.ClaimSQL after it for a key to resume, replace or take
// over; keysql.ClaimSQL is re-run when it lost a race to a concurrent
// writer of the same key.
//
// When the connection broke under the statement, ended by PostgreSQL or
// failed without a word from it (see errConnLost), and ctx is not done,
// Claim runs it once more on a connection that answers: the statement is
// one transaction, so a retry is safe whatever became of the first. Lost
// before its commit (or before it reached PostgreSQL), it did nothing, and
// the retry claims. Lost after, only its answer is gone, and the retry
// finds the key started and answers Exists: the caller's 409 sends the
// client back after Retry-After, and the key is taken over once its lease
// runs out. Either way the key has one owner at most.
func (s *Store) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	if err := keysql.CheckClaim(req); err != nil {
		return idempotency.ClaimResult{}, err
	}
	if res, ok, err := s.peek(ctx, req); err != nil || ok {
		return res, err // a retry's replay or duplicate: one round trip
	}
	if req.FirstSent.Stale { // a stale request must not insert the key
		return s.claimLoop(ctx, keysql.ClaimReadSQL, req)
	}
	c, claimed, err := s.insertClaim(ctx, req)
	switch {
	case err != nil:
		return idempotency.ClaimResult{}, err
	case claimed:
		return idempotency.ClaimResult{Outcome: idempotency.Claimed, Claim: c}, nil
	}
	return s.claimLoop(ctx, keysql.ClaimReadSQL, req)
}

// peek answers a retry (keysql.Resent) whose key has a row to answer, a
// replay or a duplicate, in one round trip and no transaction, with
// keysql.ClaimPeekSQL; ok is false for any other request, or a key with
// no such row, whose claim goes on. A first attempt does not pay for the
// read: its key seldom has a row.
func (s *Store) peek(ctx context.Context, req idempotency.ClaimRequest) (res idempotency.ClaimResult, ok bool, err error) {
	if !keysql.Resent(req, time.Now()) {
		return res, false, nil
	}
	var peek keysql.PeekRow
	err = s.pool.QueryRow(ctx, keysql.ClaimPeekSQL, keysql.PeekArgs(req)...).Scan(s.peekPlans.into(peek.Dests(&peek.RespHeader)...))
	if errors.Is(err, pgx.ErrNoRows) {
		return res, false, nil
	}
	if err != nil {
		if err = interpretError(err); ctx.Err() == nil && (errors.Is(err, errConnLost) || serializationFailure(err)) {
			err = nil // a read: the claim that follows runs on a live connection
		}
		return res, false, err
	}
	if row := peek.Decide(req); !row.Lost {
		res, err = row.Result(req)
		return res, true, err
	}
	return res, false, nil
}

// insertClaim claims req's key with keysql.ClaimInsertSQL; claimed is
// false when the insert inserted nothing (the key has a row). When the
// connection broke under it, it runs it once more on a connection that
// answers (see Claim).
func (s *Store) insertClaim(ctx context.Context, req idempotency.ClaimRequest) (c idempotency.Claim, claimed bool, err error) {
	c = idempotency.Claim{ClientID: req.ClientID, Key: req.Key, Token: keysql.NewToken(), OperationID: req.OperationID()}
	args := keysql.ClaimInsertArgs(req, c.OperationID, c.Token)
	insert := func(q querier) error {
		tag, err := q.Exec(ctx, keysql.ClaimInsertSQL, args...)
		claimed = err == nil && tag.RowsAffected() == 1 // none: the key has a row
		return err
	}
	for range keysql.MaxRaces {
		claimed = false
		err = interpretError(insert(s.pool))
		if errors.Is(err, errConnLost) && ctx.Err() == nil {
			err = interpretError(s.onLiveConn(ctx, insert))
		}
		if !serializationFailure(err) || ctx.Err() != nil {
			break // else it lost a race under REPEATABLE READ or SERIALIZABLE, and did nothing
		}
	}
	return c, claimed, err
}

// claimLoop runs sql (keysql.ClaimReadSQL or keysql.ClaimSQL), then keysql.ClaimSQL while the
// key is to renew or a race was lost, and returns the outcome.
func (s *Store) claimLoop(ctx context.Context, sql string, req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	retried := false
	for range keysql.MaxRaces {
		row, found, err := s.claimOnce(ctx, s.pool, sql, req)
		if err = interpretError(err); errors.Is(err, errConnLost) && !retried && ctx.Err() == nil {
			retried = true
			err = interpretError(s.onLiveConn(ctx, func(q querier) (err error) {
				row, found, err = s.claimOnce(ctx, q, sql, req)
				return err
			}))
		}
		if serializationFailure(err) && ctx.Err() == nil {
			continue // lost a race under REPEATABLE READ or SERIALIZABLE: the statement did nothing
		}
		if err != nil {
			return idempotency.ClaimResult{}, err
		}
		if !found || row.Lost {
			sql = keysql.ClaimSQL
			continue
		}
		return row.Result(req)
	}
	return idempotency.ClaimResult{}, fmt.Errorf("pgstore: claim of key %q lost %d races in a row", req.Key, keysql.MaxRaces)
}

// querier runs statements: a *pgxpool.Pool, or one *pgxpool.Conn of it.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// claimOnce runs sql (keysql.ClaimReadSQL or keysql.ClaimSQL) once on q; found is false
// when it returned no row.
func (s *Store) claimOnce(ctx context.Context, q querier, sql string, req idempotency.ClaimRequest) (row keysql.ClaimRow, found bool, err error) {
	return scanClaim(q.Query(ctx, sql, keysql.ClaimArgs(req)...))
}

// scanClaim reads the row of a claim statement from rows, as Query
// returned them with err, and closes them; found is false when there was
// no row.
func scanClaim(rows pgx.Rows, err error) (row keysql.ClaimRow, found bool, _ error) {
	if err != nil {
		if rows != nil {
			rows.Close()
		}
		return row, false, err
	}
	defer rows.Close()
	if !rows.Next() {
		return row, false, rows.Err()
	}
	if err = rows.Scan(row.Dests(&row.RespHeader)...); err != nil {
		return row, false, err
	}
	rows.Close()
	return row, true, rows.Err()
}

// Begin implements [idempotency.Store.Begin]. It does not touch the
// database: the handler's transaction ([Tx]) begins on its first
// statement, so no connection is held while the handler does anything else
// (a call to a slow downstream system, say).
func (s *Store) Begin(ctx context.Context, c idempotency.Claim) (idempotency.Tx, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if c.OneTransaction {
		return s.beginInTx(c), nil
	}
	u := &unit{store: s, claim: c}
	s.units.Add(c, u, true)
	return u, nil
}

// Renew implements [idempotency.Store.Renew] in one statement. When the
// connection broke under it, it runs once more on a live connection: a
// renewal done twice is one renewal.
//
// While the claim's handler transaction ([Tx]) is open under
// REPEATABLE READ or SERIALIZABLE, as the database reports its level when
// it begins, Renew only checks that c still owns the
// key, and returns ErrFenced if it does not: the transaction's completion
// updates the key row, which PostgreSQL refuses (a serialization failure)
// once another transaction has updated the row since the transaction's
// snapshot. The lease then runs out a lock timeout after the last renewal.
func (s *Store) Renew(ctx context.Context, c idempotency.Claim) error {
	if c.OneTransaction {
		return s.units.Renew(ctx, c)
	}
	if u, ok := s.units.Of(c); ok {
		return u.renew(ctx)
	}
	return s.ownedUpdate(ctx, c, keysql.RenewSQL, nil, "")
}

// checkOwned returns ErrFenced unless c still owns its key, reading the
// row without writing it.
func (s *Store) checkOwned(ctx context.Context, c idempotency.Claim) error {
	var owned bool
	if err := s.pool.QueryRow(ctx, keysql.OwnedSQL, c.ClientID, c.Key, c.Token).Scan(&owned); err != nil {
		return interpretError(err)
	}
	if !owned {
		return idempotency.ErrFenced
	}
	return nil
}

// Release implements [idempotency.Store.Release] in one statement: the row
// is marked released, with its kind in release_rejected, and keeps its
// operation ID, request and creation time (see keysql.ClaimSQL for what a claim
// does with it). Its lock token stays too; it no longer owns the key, since
// renewal, completion and release require a started row.
//
// When the connection broke under the statement (see errConnLost), Release
// runs it once more on a live connection: if the first did not commit, the
// second releases; if it did, the second finds nothing to release, and the
// key is then released under this claim's token, which only this release
// can have done, so Release succeeds. A key that is neither (completed, or
// claimed again under another token meanwhile) is
// [idempotency.ErrFenced], as without the retry.
//
// A key this claim released already (an earlier Release, or Complete
// after a lost commit) is left as it is, and Release returns nil: the
// statement updates nothing, and one more read tells the two apart, on
// this rare path only.
func (s *Store) Release(ctx context.Context, c idempotency.Claim, kind idempotency.ReleaseKind) error {
	if c.OneTransaction {
		return s.units.Release(ctx, c)
	}
	err := s.ownedUpdate(ctx, c, keysql.ReleaseSQL, []any{kind == idempotency.ReleaseRejected}, idempotency.StatusReleased)
	if !errors.Is(err, idempotency.ErrFenced) {
		return err
	}
	released, rerr := hasStatusUnder(ctx, s.pool, c, idempotency.StatusReleased)
	return keysql.Fenced(released, interpretError(rerr))
}

// ownedUpdate runs sql, an UPDATE of c's key under c's token ($1 to $3,
// then more), and returns ErrFenced when it updated nothing. When the
// connection broke under it, it runs it once more on a live connection;
// if that updates nothing either and after is not empty, a key found in
// status after under c's token was updated by the lost statement.
func (s *Store) ownedUpdate(ctx context.Context, c idempotency.Claim, sql string, more []any, after idempotency.Status) error {
	args := append([]any{c.ClientID, c.Key, c.Token}, more...)
	tag, err := s.pool.Exec(ctx, sql, args...)
	for range keysql.MaxRaces {
		if !serializationFailure(err) || ctx.Err() != nil {
			break
		}
		tag, err = s.pool.Exec(ctx, sql, args...) // it did nothing: run it again
	}
	done := tag.RowsAffected() > 0
	if err = interpretError(err); errors.Is(err, errConnLost) && ctx.Err() == nil {
		err = interpretError(s.onLiveConn(ctx, func(q querier) error {
			tag, err := q.Exec(ctx, sql, args...)
			if done = tag.RowsAffected() > 0; err != nil || done || after == "" {
				return err
			}
			done, err = hasStatusUnder(ctx, q, c, after)
			return err
		}))
	}
	return keysql.Fenced(done, err)
}

// Purge implements [idempotency.Store.Purge]. One call is one short
// statement: it walks the expires_at index, a bound below each key's expiry
// (see keysql.PurgeSQL), from the lowest, so about in the order in which the
// keys expired (the keys claimed first first), passes over the keys
// whose expiry is still to come (those that ran longer than they have
// been past their bound, and keys started without a lease, which never
// expire while started: few, unless a handler without a lease dies) and
// the keys an operator expired before their
// operation's retention ran out, locks at most limit expired keys
// (skipping those another transaction holds) and deletes them by their
// physical address.
// A started key whose lease is renewed has no expiry in the past, so it is
// never purged. A limit that is zero or negative purges nothing.
func (s *Store) Purge(ctx context.Context, limit int) (int64, error) {
	if limit <= 0 {
		return 0, nil
	}
	tag, err := s.pool.Exec(ctx, keysql.PurgeSQL, limit)
	if err != nil {
		return 0, interpretError(err)
	}
	return tag.RowsAffected(), nil
}

// hasStatusUnder tells whether c's key has status under c's lock token:
// after a lost statement of c's owner, whether that statement committed,
// since a token names one ownership (a takeover or a new claim takes
// another) and only the owner completes or releases under it. It waits
// (FOR SHARE) for a transaction still writing the row, such as a
// completion whose COMMIT was sent before the connection broke, and reads
// the row as that left it. A key that is gone (purged) has not.
func hasStatusUnder(ctx context.Context, q querier, c idempotency.Claim, status idempotency.Status) (bool, error) {
	var ours bool
	err := q.QueryRow(ctx, keysql.StatusUnderSQL, c.ClientID, c.Key, c.Token, string(status)).Scan(&ours)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return ours, err
}

// onLiveConn runs f on a connection of the pool that answers a ping, for
// the one retry of a statement whose connection PostgreSQL ended. The
// pool's idle connections may have been ended with it (a restart of the
// server, pg_terminate_backend of every backend), and the pool finds out
// only by using them: each one that fails its ping is closed, which drops
// it from the pool, and the next is tried, up to the pool's size plus one
// (a new connection, then).
func (s *Store) onLiveConn(ctx context.Context, f func(q querier) error) error {
	c, err := s.liveConn(ctx)
	if err != nil {
		return err
	}
	defer c.Release()
	return f(c)
}

// liveConn acquires a connection of the pool that answers a ping (see
// onLiveConn).
func (s *Store) liveConn(ctx context.Context) (*pgxpool.Conn, error) {
	var err error
	for range s.pool.Stat().MaxConns() + 1 {
		var c *pgxpool.Conn
		if c, err = s.pool.Acquire(ctx); err != nil {
			return nil, err
		}
		if err = c.Ping(ctx); err != nil {
			dead := c.Conn().IsClosed()
			c.Release()
			if dead && ctx.Err() == nil {
				continue
			}
			return nil, err
		}
		return c, nil
	}
	return nil, err
}

// interpretError translates an error of pgx into the package's sentinels,
// by SQLSTATE and error type, never by message: errConnLost for a broken
// connection (see connBroken), [idempotency.ErrInvalidText] for text a
// column refuses. Errors it does not know are wrapped with the package
// prefix. errors.Is and errors.As still reach the errors inside: the *pgconn.PgError, the
// context's error, the net.Error.
func interpretError(err error) error {
	if err == nil {
		return nil
	}
	if connBroken(err) {
		return fmt.Errorf("%w: %w", errConnLost, err)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == keysql.CharacterNotInRepertoire {
		return fmt.Errorf("%w: %w", idempotency.ErrInvalidText, err)
	}
	if errors.As(err, &pgErr) && pgErr.Code == keysql.ReadOnlySQLTransaction {
		return fmt.Errorf("%w: %w", idempotency.ErrReadOnly, err)
	}
	return fmt.Errorf("pgstore: %w", err)
}

// connBroken reports whether err says that the connection broke under a
// statement, rather than that the statement failed (see errConnLost).
//
// pgconn closes the connection on any error of its own reads and writes
// and returns that error as it came (wrapped, for a write, in an error
// whose SafeToRetry is true when nothing was sent): an io.EOF or
// io.ErrUnexpectedEOF when the peer closed it, a net.Error (a
// *net.OpError around syscall.ECONNRESET, EPIPE, ETIMEDOUT) when the
// network failed. It closes it too when the statement's context is done,
// and then returns the context's error instead: the caller gave up, and
// that is not a broken connection. Neither is a *pgconn.ConnectError,
// though it may wrap a net.Error: the pool found no connection to send the
// statement on, and a second dial right away would meet the same refusal.
func connBroken(err error) bool {
	var (
		pgErr      *pgconn.PgError
		connectErr *pgconn.ConnectError
		netErr     net.Error
	)
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return false
	case errors.As(err, &connectErr):
		return false
	case errors.As(err, &pgErr):
		return keysql.ConnEnded(pgErr.Code)
	}
	return pgconn.SafeToRetry(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.As(err, &netErr)
}

// serializationFailure reports whether err is a serialization failure or
// a deadlock. The store's own statements each run as a transaction of
// their own, in the database's default isolation level: under REPEATABLE
// READ or SERIALIZABLE, one that loses a race for a key's row to another
// (two takeovers of one stale key, say) fails with serialization_failure
// where READ COMMITTED would have it wait and read the row again. It then
// did nothing, and the store runs it again, as PostgreSQL advises, like a
// statement that lost a race under READ COMMITTED (see [Store.Claim]).
func serializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && keysql.Retryable(pgErr.Code)
}

// errConnLost marks an error of a statement whose connection broke under
// it: PostgreSQL ended it (admin_shutdown, or a connection exception), or
// it failed with no word from PostgreSQL (an EOF, or a network error such
// as a reset or a broken pipe) while the statement was sent or its answer
// read. The connection is gone, and the statement may or may not have
// committed; when pgconn.SafeToRetry(err) is true it was not even sent.
// Errors of a statement whose context is done are not marked, though pgx
// closes the connection under them, and nor are failures to connect (see
// connBroken). [Store] retries Claim, Renew, Release and Complete once on
// another connection, in the ways that are safe for each, unless their
// context is done; other statements return it to the caller.
var errConnLost = errors.New("pgstore: connection lost")
