package sqlstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// Store is the PostgreSQL [idempotency.Store] over database/sql, on the
// key table created by [Migrate] (pgstore's, statement for statement: see
// the package documentation). It uses the database clock for every lease
// and retention decision, and the lease and retention stored with each
// key, so any number of processes, with any settings, on pgstore or on
// this package, can share one table.
//
// A new key is claimed by one statement (an INSERT that does nothing when
// the key has a row); a key that has a row is read by a second, and
// resumed, replaced or taken over by a third, run again when it lost a
// race to another writer of the key. A renewal, a release and a completion
// each update the row under the claim's fencing token. A completion whose
// handler wrote through [TxFromContext] runs in the handler's transaction,
// before its COMMIT, so the handler's rows and the key's outcome commit
// together or not at all.
//
// When the connection breaks under a claim, a renewal, a release or a
// completion without a handler transaction (PostgreSQL ended it, or it
// failed with an EOF or a network error), the store runs the statement
// once more on a connection that answers a ping, as pgstore does: each is
// safe to run twice, and a completion (a release) that finds its key
// completed (released) under its own token is the lost one, committed. A
// statement whose context is done is not run again. A statement that lost
// a race under REPEATABLE READ or SERIALIZABLE (a serialization failure)
// did nothing, and runs again.
//
// The zero value is not usable; call [New]. A Store is safe for concurrent
// use by many goroutines and many processes.
type Store struct {
	db      *sql.DB
	stmts   sync.Map    // query text → *sql.Stmt: the store's statements, prepared on first use
	prepare bool        // the driver does not cache statements: prepare those of a first execution
	ready   atomic.Bool // all of prepared are in stmts (see prepareAll)

	units keysql.Units[*unit] // the units of work of this process (see Renew)

	openIndex keysql.OpenIndex // whether the key table has the open keys' index
}

// New returns a store on db, a pool of a PostgreSQL driver (pgx's stdlib,
// "pgx", or lib/pq, "postgres"), whose search_path must reach the table
// created by [Migrate].
func New(db *sql.DB) *Store {
	return &Store{db: db, prepare: !caches(db.Driver())}
}

// stmt returns query prepared on the pool, preparing it on first use;
// database/sql prepares it again on each connection that runs it, once.
func (s *Store) stmt(ctx context.Context, query string) (*sql.Stmt, error) {
	if v, ok := s.stmts.Load(query); ok {
		return v.(*sql.Stmt), nil
	}
	st, err := s.db.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	if v, loaded := s.stmts.LoadOrStore(query, st); loaded {
		st.Close()
		return v.(*sql.Stmt), nil
	}
	return st, nil
}

// prepareAll prepares every statement of prepared on the pool, once per
// store, before a claim holds a connection: a statement prepared on the
// pool takes a connection of its own, which a request holding its
// transaction's connection must never wait for (with as many requests as
// the pool has connections, each would wait for another's). Prepared on
// the pool, database/sql prepares it again on each transaction's own
// connection (Tx.StmtContext), which takes no other.
func (s *Store) prepareAll(ctx context.Context) error {
	if !s.prepare || s.ready.Load() {
		return nil
	}
	for query := range prepared {
		if _, err := s.stmt(ctx, query); err != nil {
			return err
		}
	}
	s.ready.Store(true)
	return nil
}

// prepared are the statements of a first execution, which run on every
// request, and which the store prepares on a driver that does not cache
// statements itself (see caches): PostgreSQL then parses and plans each
// once per connection, not on every run. The others run as they are: a
// statement prepared costs a round trip more on each connection that runs
// it for the first time, which the rare ones would pay more often than
// they gain (the claims of a takeover race, say, each on a new
// connection).
var prepared = map[string]bool{keysql.ClaimInsertSQL: true, keysql.CompleteInTxSQL: true,
	keysql.ClaimTxSQL: true}

// caches reports whether driver caches the statements it runs as prepared
// statements of its own: pgx's stdlib does (pgx's default
// QueryExecModeCacheStatement), and database/sql's prepared statements
// change nothing measurable on it (bench/cmd/sqlcost), but for the round
// trips that prepare them on each new connection; lib/pq does not, and
// makes PostgreSQL parse and plan every statement on every run without
// them (measured in bench/NOTES.md). The driver is known by its package, so that
// this package imports neither.
func caches(driver driver.Driver) bool {
	t := reflect.TypeOf(driver)
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return strings.HasPrefix(t.PkgPath(), "github.com/jackc/pgx/")
}

// on runs the store's statements on the pool, or on tx when it is not
// nil, prepared when the store prepares them.
type on struct {
	s  *Store
	tx *sql.Tx
}

// stmt returns query prepared for o, or nil when it runs as it is.
func (o on) stmt(ctx context.Context, query string) (*sql.Stmt, error) {
	if !o.s.prepare || !prepared[query] {
		return nil, nil
	}
	st, err := o.s.stmt(ctx, query)
	if err != nil || o.tx == nil {
		return st, err
	}
	return o.tx.StmtContext(ctx, st), nil
}

func (o on) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	switch st, err := o.stmt(ctx, query); {
	case err != nil:
		return nil, err
	case st != nil:
		return st.ExecContext(ctx, args...)
	case o.tx != nil:
		return o.tx.ExecContext(ctx, query, args...)
	}
	return o.s.db.ExecContext(ctx, query, args...)
}

func (o on) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	// A statement that could not be prepared runs as it is, and fails, if
	// it does, with the same error.
	if st, err := o.stmt(ctx, query); err == nil && st != nil {
		return st.QueryRowContext(ctx, args...)
	}
	if o.tx != nil {
		return o.tx.QueryRowContext(ctx, query, args...)
	}
	return o.s.db.QueryRowContext(ctx, query, args...)
}

// querier runs statements: the store's pool, or one *sql.Conn of it.
type querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// Claim implements [idempotency.Store.Claim]: keysql.ClaimInsertSQL for a
// new key, keysql.ClaimReadSQL to read a key that has a row, and
// keysql.ClaimSQL after it for a key to resume, replace or take over. A
// request whose first-sent check is stale starts with the read, and never
// inserts.
func (s *Store) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	if err := keysql.CheckClaim(req); err != nil {
		return idempotency.ClaimResult{}, err
	}
	if err := s.prepareAll(ctx); err != nil {
		return idempotency.ClaimResult{}, interpretError(err)
	}
	if res, ok, err := s.peek(ctx, req); err != nil || ok {
		return res, err
	}
	if !req.FirstSent.Stale { // a stale request must not insert the key
		c, claimed, err := s.insertClaim(ctx, req)
		switch {
		case err != nil:
			return idempotency.ClaimResult{}, err
		case claimed:
			return idempotency.ClaimResult{Outcome: idempotency.Claimed, Claim: c}, nil
		}
	}
	return s.claimLoop(ctx, keysql.ClaimReadSQL, req)
}

// peek answers a retry (keysql.Resent) whose key has a row to answer, a
// replay or a duplicate, in one round trip, with keysql.ClaimPeekSQL; ok
// is false for any other request, or a key with no such row, whose claim
// goes on. database/sql cannot send the read with the claim, so a first
// attempt does not pay for it.
func (s *Store) peek(ctx context.Context, req idempotency.ClaimRequest) (res idempotency.ClaimResult, ok bool, err error) {
	if !keysql.Resent(req, time.Now()) {
		return res, false, nil
	}
	var peek keysql.PeekRow
	found := false
	err = s.run(ctx, func(q querier) error {
		err := q.QueryRowContext(ctx, keysql.ClaimPeekSQL, keysql.PeekArgs(req)...).Scan(peek.Dests(header{&peek.RespHeader})...)
		found = err == nil
		if errors.Is(err, sql.ErrNoRows) {
			return nil
		}
		return err
	})
	if err != nil || !found {
		return res, false, err
	}
	if row := peek.Decide(req); !row.Lost {
		res, err = row.Result(req)
		return res, true, err
	}
	return res, false, nil
}

// insertClaim claims req's key with keysql.ClaimInsertSQL; claimed is
// false when the key has a row.
func (s *Store) insertClaim(ctx context.Context, req idempotency.ClaimRequest) (c idempotency.Claim, claimed bool, err error) {
	c = idempotency.Claim{ClientID: req.ClientID, Key: req.Key, Token: keysql.NewToken(), OperationID: req.OperationID()}
	args := keysql.ClaimInsertArgs(req, c.OperationID, c.Token)
	err = s.run(ctx, func(q querier) error {
		res, err := q.ExecContext(ctx, keysql.ClaimInsertSQL, args...)
		claimed = false // none inserted: the key has a row
		if err == nil {
			var n int64
			n, err = res.RowsAffected()
			claimed = err == nil && n == 1
		}
		return err
	})
	return c, claimed, err
}

// claimLoop runs query (keysql.ClaimReadSQL or keysql.ClaimSQL), then runs
// keysql.ClaimSQL while the key is to renew or a race was lost, and
// returns the outcome.
func (s *Store) claimLoop(ctx context.Context, query string, req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	for range keysql.MaxRaces {
		var row keysql.ClaimRow
		found := false
		err := s.run(ctx, func(q querier) (err error) {
			row, found, err = claimOnce(ctx, q, query, req)
			return err
		})
		if err != nil {
			return idempotency.ClaimResult{}, err
		}
		if !found || row.Lost {
			query = keysql.ClaimSQL
			continue
		}
		return row.Result(req)
	}
	return idempotency.ClaimResult{}, fmt.Errorf("sqlstore: claim of key %q lost %d races in a row", req.Key, keysql.MaxRaces)
}

// claimOnce runs query, a claim statement, once on q; found is false when
// it returned no row.
func claimOnce(ctx context.Context, q querier, query string, req idempotency.ClaimRequest) (row keysql.ClaimRow, found bool, err error) {
	err = q.QueryRowContext(ctx, query, keysql.ClaimArgs(req)...).Scan(row.Dests(header{&row.RespHeader})...)
	if errors.Is(err, sql.ErrNoRows) {
		return row, false, nil
	}
	return row, err == nil, err
}

// run runs f, a statement that is safe to run again, on the pool: again,
// on a connection that answers, when the connection broke under it and
// ctx is not done; and again while it lost a race under REPEATABLE READ or
// SERIALIZABLE, and did nothing. It returns f's error, interpreted.
func (s *Store) run(ctx context.Context, f func(q querier) error) error {
	var err error
	for range keysql.MaxRaces {
		err = interpretError(f(on{s: s}))
		if errors.Is(err, errConnLost) && ctx.Err() == nil {
			err = interpretError(s.onLiveConn(ctx, f))
		}
		if !retryable(err) || ctx.Err() != nil {
			return err
		}
	}
	return err
}

// Begin implements [idempotency.Store.Begin]. It does not touch the
// database: the handler's transaction ([TxFromContext]) begins on its
// first statement, so no connection is held while the handler does
// anything else.
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

// Renew implements [idempotency.Store.Renew] in one statement,
// keysql.RenewSQL. When the connection broke under it, it runs once more
// on a live connection: a renewal done twice is one renewal.
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
	if err := s.db.QueryRowContext(ctx, keysql.OwnedSQL, c.ClientID, c.Key, c.Token).Scan(&owned); err != nil {
		return interpretError(err)
	}
	if !owned {
		return idempotency.ErrFenced
	}
	return nil
}

// Release implements [idempotency.Store.Release] in one statement,
// keysql.ReleaseSQL, as pgstore's does: the row is marked released, and
// keeps its operation ID. When the connection broke under it, it runs once
// more, and a key then found released under this claim's token was
// released by the lost statement. A key this claim released already (an
// earlier Release, or Complete after a lost commit) is left as it is, and
// Release returns nil, as pgstore's.
func (s *Store) Release(ctx context.Context, c idempotency.Claim, kind idempotency.ReleaseKind) error {
	if c.OneTransaction {
		return s.units.Release(ctx, c)
	}
	err := s.ownedUpdate(ctx, c, keysql.ReleaseSQL, []any{kind == idempotency.ReleaseRejected}, idempotency.StatusReleased)
	if !errors.Is(err, idempotency.ErrFenced) {
		return err
	}
	released, rerr := hasStatusUnder(ctx, on{s: s}, c, idempotency.StatusReleased)
	return keysql.Fenced(released, interpretError(rerr))
}

// ownedUpdate runs query, an UPDATE of c's key under c's token ($1 to $3,
// then more), and returns ErrFenced when it updated nothing. When the
// connection broke under it, it runs it once more on a live connection;
// if that updates nothing either and after is not empty, a key found in
// status after under c's token was updated by the lost statement.
func (s *Store) ownedUpdate(ctx context.Context, c idempotency.Claim, query string, more []any, after idempotency.Status) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	args := append([]any{c.ClientID, c.Key, c.Token}, more...)
	retried := false
	var done bool
	err := s.run(ctx, func(q querier) error {
		res, err := q.ExecContext(ctx, query, args...)
		if err != nil {
			retried = retried || connBroken(err)
			return err
		}
		n, err := res.RowsAffected()
		if done = n > 0; err != nil || done || !retried || after == "" {
			return err
		}
		done, err = hasStatusUnder(ctx, q, c, after)
		return err
	})
	return keysql.Fenced(done, err)
}

// hasStatusUnder tells whether c's key has status under c's lock token:
// after a lost statement of c's owner, whether that statement committed
// (see keysql.StatusUnderSQL).
func hasStatusUnder(ctx context.Context, q querier, c idempotency.Claim, status idempotency.Status) (bool, error) {
	var ours bool
	err := q.QueryRowContext(ctx, keysql.StatusUnderSQL, c.ClientID, c.Key, c.Token, string(status)).Scan(&ours)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return ours, err
}

// Purge implements [idempotency.Store.Purge] in one statement,
// keysql.PurgeSQL, as pgstore's: at most limit expired keys, those whose
// bound below the expiry is lowest first, skipping those another
// transaction holds and those an operator expired before their
// operation's retention ran out. A limit that is zero or negative purges nothing.
func (s *Store) Purge(ctx context.Context, limit int) (int64, error) {
	if limit <= 0 {
		return 0, nil
	}
	res, err := on{s: s}.ExecContext(ctx, keysql.PurgeSQL, limit)
	if err != nil {
		return 0, interpretError(err)
	}
	n, err := res.RowsAffected()
	return n, interpretError(err)
}

// onLiveConn runs f on a connection of the pool that answers a ping, for
// the one retry of a statement whose connection broke. The pool's idle
// connections may have broken with it (a restart of the server); each one
// that fails its ping is closed, which drops it from the pool when the
// driver reports it bad, and the next is tried, up to the pool's open
// connections plus one.
func (s *Store) onLiveConn(ctx context.Context, f func(q querier) error) error {
	var err error
	for range s.db.Stats().OpenConnections + 1 {
		var c *sql.Conn
		if c, err = s.db.Conn(ctx); err != nil {
			return err
		}
		if err = c.PingContext(ctx); err != nil {
			c.Close()
			if connBroken(err) && ctx.Err() == nil {
				continue
			}
			return err
		}
		err = f(c)
		c.Close()
		return err
	}
	return err
}

// header scans the response headers (jsonb, which database/sql's drivers
// return as its JSON text) into a map; SQL NULL is no headers.
type header struct{ m *map[string]string }

func (h header) Scan(src any) error {
	*h.m = nil
	var text []byte
	switch v := src.(type) {
	case nil:
		return nil
	case string:
		text = []byte(v)
	case []byte:
		text = v
	default:
		return fmt.Errorf("sqlstore: response headers of type %T", src)
	}
	return json.Unmarshal(text, h.m)
}

// sqlState is the SQLSTATE of a PostgreSQL error, as both drivers report
// it (pgconn.PgError and pq.Error have the method), without importing
// either.
type sqlState interface{ SQLState() string }

// code returns the SQLSTATE of err, or "".
func code(err error) string {
	var e sqlState
	if errors.As(err, &e) {
		return e.SQLState()
	}
	return ""
}

// retryable reports whether err says that a statement lost a race and did
// nothing (see keysql.Retryable).
func retryable(err error) bool { return keysql.Retryable(code(err)) }

// interpretError translates a driver's error into the package's
// sentinels, by SQLSTATE and error type, never by message: errConnLost for
// a broken connection (see connBroken), [idempotency.ErrInvalidText] for
// text a column refuses. Errors it does not know are wrapped with the
// package prefix; errors.Is and errors.As still reach the errors inside.
func interpretError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, errConnLost), errors.Is(err, idempotency.ErrInvalidText), errors.Is(err, idempotency.ErrReadOnly):
		return err
	case connBroken(err):
		return fmt.Errorf("%w: %w", errConnLost, err)
	case code(err) == keysql.CharacterNotInRepertoire:
		return fmt.Errorf("%w: %w", idempotency.ErrInvalidText, err)
	case code(err) == keysql.ReadOnlySQLTransaction:
		return fmt.Errorf("%w: %w", idempotency.ErrReadOnly, err)
	}
	return fmt.Errorf("sqlstore: %w", err)
}

// connBroken reports whether err says that the connection broke under a
// statement, rather than that the statement failed: PostgreSQL ended it
// (admin_shutdown, a connection exception), or it failed with no word from
// PostgreSQL: driver.ErrBadConn (database/sql returns it when its own
// retries on fresh connections ran out), an EOF, a network error. An error
// of a statement whose context is done is not: the caller gave up.
func connBroken(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	if c := code(err); c != "" {
		return keysql.ConnEnded(c)
	}
	var netErr net.Error
	return errors.Is(err, driver.ErrBadConn) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.As(err, &netErr)
}

// errConnLost marks an error of a statement whose connection broke under
// it (see connBroken): the statement may or may not have committed.
var errConnLost = errors.New("sqlstore: connection lost")
