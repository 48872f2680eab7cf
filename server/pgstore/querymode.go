package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strings"

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
// session) while pgx's query mode needs each connection to keep its
// session from one round trip to the next: cache_statement, pgx's
// default, prepares named statements on it, and describe_exec binds in a
// second round trip the statement it prepared in the first. Set
// default_query_exec_mode=exec in the connection string (or
// simple_protocol, or cache_describe), or pool in session mode; see
// docs/operations.md, "Poolers".
//
//	var qm *pgstore.QueryModeError
//	if errors.As(err, &qm) { ... qm.Mode ... }
type QueryModeError struct {
	// Mode is the pool's query mode (pgx.ConnConfig.DefaultQueryExecMode).
	Mode pgx.QueryExecMode
	// Err is the error of PostgreSQL that showed it, if any: nil when
	// CheckQueryMode saw connections share sessions.
	Err error
}

func (e *QueryModeError) Error() string {
	const msg = "the database connections share PostgreSQL sessions, as through a pooler in transaction mode, " +
		"where pgx's query mode %s cannot work: set default_query_exec_mode=exec in the connection string, or pool in session mode"
	if e.Err == nil {
		return "pgstore: " + fmt.Sprintf(msg, modeName(e.Mode))
	}
	return fmt.Sprintf("pgstore: %v: "+strings.Replace(msg, "share", "seem to share", 1), e.Err, modeName(e.Mode))
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

// probeRounds is how many statements each of CheckQueryMode's two
// connections runs.
const probeRounds = 3

// CheckQueryMode returns a [*QueryModeError] when pool's query mode needs
// a session of its own for each connection and the pool's connections
// are seen sharing sessions; nil otherwise, and whenever the mode needs
// no session of its own. It opens two connections of its own, with the
// pool's configuration and hooks, outside the pool, and has them ask for their
// backend's process ID in turn, a few times each. A connection to
// PostgreSQL, or through a pooler in session mode, keeps one backend as
// long as it is open, and two open at once have two: a connection that
// sees two backends, or two that see one, are the sign of a pooler that
// shares sessions. PgBouncer in transaction mode shows it at once,
// whether it hands out the session it used last (two connections see one)
// or its sessions in turn (server_round_robin: each sees several). A
// pooler that gives each statement of each connection the same session
// every time goes unseen, and then does no harm; the errors of
// PostgreSQL that sessions shared under such a query mode cause are
// translated where this package can (see QueryModeError). [Migrate] calls
// it first.
func CheckQueryMode(ctx context.Context, pool *pgxpool.Pool) error {
	cfg := pool.Config().ConnConfig
	if !needsSession(cfg.DefaultQueryExecMode) {
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
	var seen [2]map[uint32]bool
	for i := range seen {
		seen[i] = map[uint32]bool{}
	}
	for range probeRounds {
		for i, c := range conns {
			var pid uint32
			// In the simple protocol, which works whatever the pooler.
			if err := c.QueryRow(ctx, `SELECT pg_backend_pid()`, pgx.QueryExecModeSimpleProtocol).Scan(&pid); err != nil {
				return fmt.Errorf("pgstore: checking the query mode: %w", err)
			}
			seen[i][pid] = true
			if len(seen[i]) > 1 || seen[1-i][pid] {
				return &QueryModeError{Mode: cfg.DefaultQueryExecMode}
			}
		}
	}
	return nil
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
