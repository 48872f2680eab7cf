// Package pgxpipeline gives server/sqlstore pgstore's round trips on pgx's
// database/sql driver (github.com/jackc/pgx/v5/stdlib). Import it for its
// side effect, once, in a service whose *sql.DB is pgx's:
//
//	import _ "github.com/idemkit/idem/server/sqlstore/pgxpipeline"
//
// database/sql sends one statement per round trip, so sqlstore alone sends
// a transaction's BEGIN, and its COMMIT, in round trips of their own. With
// this package, every store made by sqlstore.New on a pgx *sql.DB sends
// the BEGIN with the claim of a key claimed in one transaction, or with
// the handler's first statement when that is an ExecContext with
// arguments, and the completion with the COMMIT, in one pgx batch each (as
// pgstore does): a keyed first execution takes pgstore's three round
// trips, two fewer than without, which was all of what sqlstore cost over
// pgstore (BENCHMARKS.md, "sqlstore against pgstore"). The handler's
// other statements go through database/sql, on the same connection; its
// first ExecContext goes to pgx with the arguments database/sql would
// have handed it (a first statement without arguments, which pgx sends
// in the simple protocol, or with pgx's query options, goes alone after
// the BEGIN).
//
// It changes nothing for the handler, nor for other drivers; it works
// behind a pooler in transaction mode wherever pgx does (the statements are
// pgx's own prepared statements, as pgstore's are).
package pgxpipeline

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/server/internal/sqlpipe"
)

func init() {
	sqlpipe.Register(stdlib.GetDefaultDriver(), runner{})
}

// runner runs a round trip as a pgx batch.
type runner struct{}

// conn returns the pgx connection of a driver connection of pgx's stdlib.
func conn(driverConn any) (*pgx.Conn, error) {
	c, ok := driverConn.(interface{ Conn() *pgx.Conn })
	if !ok {
		return nil, fmt.Errorf("pgxpipeline: a driver connection of type %T is not pgx's", driverConn)
	}
	return c.Conn(), nil
}

func (runner) Run(ctx context.Context, driverConn any, stmts ...sqlpipe.Stmt) (int, error) {
	c, err := conn(driverConn)
	if err != nil {
		return 0, err
	}
	b := &pgx.Batch{}
	handler := false
	for _, st := range stmts {
		if st.Handler && !batchable(st.Args) {
			return 0, sqlpipe.ErrAlone
		}
		handler = handler || st.Handler
		b.Queue(st.SQL, st.Args...)
	}
	br := c.SendBatch(ctx, b)
	for i, st := range stmts {
		if st.Dest != nil {
			err = br.QueryRow().Scan(st.Dest...)
		} else {
			var tag pgconn.CommandTag
			tag, err = br.Exec()
			if st.Affected != nil {
				*st.Affected = tag.RowsAffected()
			}
		}
		if err != nil {
			br.Close()
			if i == 0 && handler {
				err = notSent(c, err)
			}
			return i, err
		}
	}
	return len(stmts), br.Close()
}

// notSent returns err, the error of a batch's first statement, as a
// *sqlpipe.NotSentError when nothing of the batch ran on the server: pgx
// encodes the arguments of a batch sent in a pipeline once its statements
// are prepared, and closes the connection when one fails (the statements
// before it were queued); in the other modes, it fails before sending,
// and the connection stays open outside any transaction.
func notSent(c *pgx.Conn, err error) error {
	var pre pgx.ErrPreprocessingBatch
	if errors.As(err, &pre) {
		if strings.HasPrefix(pre.Error(), "error preprocessing batch (build)") {
			return &sqlpipe.NotSentError{Err: pre.Unwrap()}
		}
		return err
	}
	var pgErr *pgconn.PgError
	if pc := c.PgConn(); !errors.As(err, &pgErr) && !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() == 'I' {
		return &sqlpipe.NotSentError{Err: err}
	}
	return err
}

// batchable reports whether a handler's statement with args is sent in a
// batch as pgx's stdlib sends it alone (pgx.Conn.Exec): not without
// arguments, which Exec sends in the simple protocol (one text that may
// hold several statements), nor with pgx's options among them (a
// QueryExecMode, a QueryRewriter such as pgx.NamedArgs), which a batch
// does not take as Exec does.
func batchable(args []any) bool {
	if len(args) == 0 {
		return false
	}
	for _, a := range args {
		switch a.(type) {
		case pgx.QueryExecMode, pgx.QueryRewriter:
			return false
		}
	}
	return true
}

func (runner) Status(driverConn any) sqlpipe.Status {
	c, err := conn(driverConn)
	if err != nil {
		return sqlpipe.Closed
	}
	switch pc := c.PgConn(); {
	case pc.IsClosed():
		return sqlpipe.Closed
	case pc.IsBusy():
		return sqlpipe.Busy
	case pc.TxStatus() == 'I':
		return sqlpipe.Idle
	}
	return sqlpipe.InTx
}
