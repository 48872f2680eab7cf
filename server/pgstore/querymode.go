package pgstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// SQLSTATEs of the errors that sessions shared between connections cause
// in a query mode that needs a session of its own (see queryModeError).
const (
	invalidSQLStatementName    = "26000" // a named or unnamed prepared statement that does not exist
	duplicatePreparedStatement = "42P05" // a prepared statement of that name exists already
	protocolViolation          = "08P01" // e.g. a Bind with other parameters than its statement's
)

// QueryModeError is the error of [CheckQueryMode], [Migrate] and
// [CreateOpenKeysIndex] when the connections of the pool reach PostgreSQL
// through a pooler that hands one session to several of them (a pooler in
// transaction mode, such as PgBouncer with pool_mode = transaction, where
// each transaction, and each statement outside one, may run on another
// session) while pgx's query mode needs what it left on one session in
// the next round trip: describe_exec binds in a second round trip the
// statement it prepared in the first, and cache_statement, pgx's default,
// runs named statements it prepared once, which only a pooler that keeps
// them for its clients serves (PgBouncer 1.21 and later, with
// max_prepared_statements above 0). Set default_query_exec_mode=exec in
// the connection string (or simple_protocol, or cache_describe), or pool
// in session mode; see docs/operations.md, "Poolers".
//
//	var qm *pgstore.QueryModeError
//	if errors.As(err, &qm) { ... qm.Mode ... }
type QueryModeError struct {
	// Mode is the pool's query mode (pgx.ConnConfig.DefaultQueryExecMode).
	Mode pgx.QueryExecMode
	// Err is the error of PostgreSQL that showed it, if any: nil when
	// CheckQueryMode saw connections share sessions in describe_exec.
	Err error
}

func (e *QueryModeError) Error() string {
	why := "it binds, in a second round trip, the statement it prepared in the first"
	fix := "set default_query_exec_mode=exec in the connection string, or pool in session mode"
	if e.Mode == pgx.QueryExecModeCacheStatement {
		why = "the pooler does not keep the statements a client prepares"
		fix += ", or have the pooler keep prepared statements (PgBouncer 1.21 or later: max_prepared_statements)"
	}
	shared := "the database connections share PostgreSQL sessions"
	if e.Err != nil {
		shared = fmt.Sprintf("%v: the database connections seem to share PostgreSQL sessions", e.Err)
	}
	return fmt.Sprintf("pgstore: %s, as through a pooler in transaction mode, where pgx's query mode %s cannot work (%s): %s",
		shared, modeName(e.Mode), why, fix)
}

// modeName returns the name of mode in a connection string
// (default_query_exec_mode=...).
func modeName(mode pgx.QueryExecMode) string {
	switch mode {
	case pgx.QueryExecModeCacheStatement:
		return "cache_statement"
	case pgx.QueryExecModeCacheDescribe:
		return "cache_describe"
	case pgx.QueryExecModeDescribeExec:
		return "describe_exec"
	case pgx.QueryExecModeExec:
		return "exec"
	case pgx.QueryExecModeSimpleProtocol:
		return "simple_protocol"
	}
	return mode.String()
}

func (e *QueryModeError) Unwrap() error { return e.Err }

// needsSession reports whether pgx's query mode mode uses, in one round
// trip, what it left on the session in an earlier one. exec and
// simple_protocol send each statement whole; cache_describe sends it
// whole too, and only reads the types of its parameters and columns from
// a description it got once, from any session.
func needsSession(mode pgx.QueryExecMode) bool {
	return mode == pgx.QueryExecModeCacheStatement || mode == pgx.QueryExecModeDescribeExec
}

// probeRounds bounds the statements of each of CheckQueryMode's steps;
// sharedRounds, the simple SELECTs that look for shared sessions, which
// other clients of a busy pooler make less likely to show in few rounds
// (replicas that start together are such clients).
const (
	probeRounds  = 3
	sharedRounds = 25
)

// probeMoveTimeout bounds CheckQueryMode's wait for a session while it
// holds one in a transaction: a pooler with one session to hand out
// would keep it waiting for itself.
const probeMoveTimeout = 5 * time.Second

// CheckQueryMode returns a [*QueryModeError] when pool's query mode cannot
// work with the way its connections reach PostgreSQL; nil otherwise, and
// at once when the mode needs nothing of a session from one round trip to
// the next (exec, simple_protocol, cache_describe). It opens two
// connections of its own, with the pool's configuration and hooks,
// outside the pool, and first has them ask for their backend's process ID
// in turn, a few times each. A connection to PostgreSQL, or through a
// pooler in session mode, keeps one backend as long as it is open, and two
// open at once have two: a connection that sees two backends, or two that
// see one, are the sign of a pooler that shares sessions. PgBouncer in
// transaction mode shows it at once, whether it hands out the session it
// used last (two connections see one) or its sessions in turn
// (server_round_robin: each sees several). With sessions shared,
// describe_exec is refused: no pooler keeps a statement between a client's
// round trips, and the statement found in the second may be another
// client's, run with the first one's arguments. cache_statement is tried:
// one connection prepares a named statement, then runs it on another
// session, the other connection holding the first in a transaction
// meanwhile; a pooler that keeps prepared statements for its clients
// (PgBouncer 1.21 and later, with max_prepared_statements above 0)
// prepares it there too and passes, and the error of one that does not
// is returned as a QueryModeError. A pooler that gives each connection
// the same session every time goes unseen, and then does no harm; the
// errors of PostgreSQL that sessions shared under such a query mode cause
// later are translated where this package can (see QueryModeError).
// [Migrate] calls it first.
func CheckQueryMode(ctx context.Context, pool *pgxpool.Pool) error {
	mode := pool.Config().ConnConfig.DefaultQueryExecMode
	if !needsSession(mode) {
		return nil
	}
	var conns [2]*pgx.Conn
	for i := range conns {
		c, err := connect(ctx, pool)
		if err != nil {
			return fmt.Errorf("pgstore: checking the query mode: %w", err)
		}
		defer c.Close(context.WithoutCancel(ctx))
		conns[i] = c
	}
	shared, err := sessionsShared(ctx, conns)
	switch {
	case err != nil:
		return fmt.Errorf("pgstore: checking the query mode: %w", err)
	case !shared:
		return nil
	case mode == pgx.QueryExecModeDescribeExec:
		return &QueryModeError{Mode: mode}
	}
	if err := statementsKept(ctx, conns); err != nil {
		if qm := asQueryModeError(mode, err); qm != err {
			return qm
		}
		return fmt.Errorf("pgstore: checking the query mode: %w", err)
	}
	return nil
}

// sessionsShared reports whether the two connections are seen sharing
// sessions (see CheckQueryMode).
func sessionsShared(ctx context.Context, conns [2]*pgx.Conn) (bool, error) {
	var seen [2]map[uint32]bool
	for i := range seen {
		seen[i] = map[uint32]bool{}
	}
	for range sharedRounds {
		for i, c := range conns {
			pid, err := backend(ctx, c)
			if err != nil {
				return false, err
			}
			seen[i][pid] = true
			if len(seen[i]) > 1 || seen[1-i][pid] {
				return true, nil
			}
		}
	}
	return false, nil
}

// backend returns the process ID of the backend that runs a statement of
// c, sent in the simple protocol, which works whatever the pooler.
func backend(ctx context.Context, c *pgx.Conn) (pid uint32, err error) {
	err = c.QueryRow(ctx, `SELECT pg_backend_pid()`, pgx.QueryExecModeSimpleProtocol).Scan(&pid)
	return pid, err
}

// statementsKept returns nil when a statement that the first connection
// prepared runs on another session than the one it last ran on, or when
// that could not be brought about; else the error of PostgreSQL that
// running it there got (see CheckQueryMode).
func statementsKept(ctx context.Context, conns [2]*pgx.Conn) error {
	c, other := conns[0], conns[1]
	var b [8]byte
	_, _ = rand.Read(b[:])
	name := "idem_query_mode_check_" + hex.EncodeToString(b[:])
	if _, err := c.Prepare(ctx, name, `SELECT pg_backend_pid()`); err != nil {
		return err
	}
	run := func(ctx context.Context) (pid uint32, err error) {
		err = c.QueryRow(ctx, name).Scan(&pid)
		return pid, err
	}
	// Best effort: where a pooler does not keep it, it stays on the
	// session it was prepared on, under its random name, until that ends.
	defer c.Deallocate(context.WithoutCancel(ctx), name) //nolint:errcheck // see above
	last, err := run(ctx)
	if err != nil {
		return err
	}
	for range probeRounds {
		// Hold the session the statement last ran on, if the other
		// connection gets it, and run the statement meanwhile.
		tx, err := other.Begin(ctx)
		if err != nil {
			return err
		}
		held, err := backend(ctx, other)
		if err == nil && held == last {
			mctx, cancel := context.WithTimeout(ctx, probeMoveTimeout)
			_, err = run(mctx)
			timedOut := errors.Is(mctx.Err(), context.DeadlineExceeded)
			cancel()
			if rerr := tx.Rollback(ctx); err == nil {
				err = rerr
			}
			if timedOut && ctx.Err() == nil {
				return nil // no other session to run it on: nothing shown
			}
			return err
		}
		if rerr := tx.Rollback(ctx); err == nil {
			err = rerr
		}
		if err != nil {
			return err
		}
		if last, err = run(ctx); err != nil {
			return err
		}
	}
	return nil // the session could not be held: nothing shown
}

// queryModeError returns err as a *QueryModeError when pool's query mode
// needs a session of its own and err is an error of PostgreSQL that
// sessions shared under such a mode cause: a prepared statement that
// does not exist (26000) or exists already (42P05), or, in describe_exec,
// a Bind whose parameters are not those of the statement it finds
// (08P01). Otherwise it returns err.
func queryModeError(pool *pgxpool.Pool, err error) error {
	if err == nil {
		return nil
	}
	return asQueryModeError(pool.Config().ConnConfig.DefaultQueryExecMode, err)
}

// asQueryModeError is queryModeError for the query mode mode.
func asQueryModeError(mode pgx.QueryExecMode, err error) error {
	var pgErr *pgconn.PgError
	if !needsSession(mode) || !errors.As(err, &pgErr) {
		return err
	}
	switch pgErr.Code {
	case invalidSQLStatementName, duplicatePreparedStatement:
		return &QueryModeError{Mode: mode, Err: err}
	case protocolViolation:
		if mode == pgx.QueryExecModeDescribeExec {
			return &QueryModeError{Mode: mode, Err: err}
		}
	}
	return err
}

// connect opens a connection outside pool as pool opens its own: with its
// connection configuration, its BeforeConnect (which may set a password
// that expires, say) and its AfterConnect. The caller closes it.
func connect(ctx context.Context, pool *pgxpool.Pool) (*pgx.Conn, error) {
	cfg := pool.Config() // a copy
	if cfg.BeforeConnect != nil {
		if err := cfg.BeforeConnect(ctx, cfg.ConnConfig); err != nil {
			return nil, err
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		return nil, err
	}
	if cfg.AfterConnect != nil {
		if err := cfg.AfterConnect(ctx, conn); err != nil {
			conn.Close(context.WithoutCancel(ctx))
			return nil, err
		}
	}
	return conn, nil
}
