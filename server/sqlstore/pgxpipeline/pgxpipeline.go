// Package pgxpipeline gives server/sqlstore pgstore's round trips on pgx's
// database/sql driver (github.com/jackc/pgx/v5/stdlib). Import it for its
// side effect, once, in a service whose *sql.DB is pgx's:
//
//	import _ "github.com/idemkit/idem/server/sqlstore/pgxpipeline"
//
// database/sql sends one statement per round trip, so sqlstore alone sends
// a transaction's BEGIN, and its COMMIT, in round trips of their own. With
// this package, every store made by sqlstore.New on a pgx *sql.DB sends
// the BEGIN with the claim of a key claimed in one transaction, and the
// completion with the COMMIT, in one pgx batch each (as pgstore does): a
// keyed first execution takes two round trips fewer in one transaction,
// and one fewer in two commits, which is most of what sqlstore cost over
// pgstore (BENCHMARKS.md, "sqlstore against pgstore"). The handler's own
// statements still go through database/sql, on the same connection.
//
// It changes nothing for the handler, nor for other drivers; it works
// behind a pooler in transaction mode wherever pgx does (the statements are
// pgx's own prepared statements, as pgstore's are).
package pgxpipeline

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
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
	for _, st := range stmts {
		b.Queue(st.SQL, st.Args...)
	}
	br := c.SendBatch(ctx, b)
	for i, st := range stmts {
		if st.Dest != nil {
			err = br.QueryRow().Scan(st.Dest...)
		} else {
			_, err = br.Exec()
		}
		if err != nil {
			br.Close()
			return i, err
		}
	}
	return len(stmts), br.Close()
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
