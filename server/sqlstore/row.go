package sqlstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
)

// The rows of QueryRowContext. A Tx must return a *sql.Row, which only
// database/sql can make, from the rows of a driver; so the statement runs
// on the request's transaction, its first row is read into driver values
// (as the driver gave them), and rowDB, a database/sql pool over the
// in-process driver below, turns them into the *sql.Row, which converts
// them as database/sql converts any driver's values. The row so made has
// no connection: it leaves nothing pending on the transaction's, and can
// check, when it is scanned, that the request is not over.

// rowDB is the pool of the in-process driver of readRow.
var rowDB = sql.OpenDB(rowConnector{})

// readRow is the first row of a statement of QueryRowContext, read, or its
// error (also the error of a statement of the store's that could not be
// prepared).
type readRow struct {
	u       *unit // nil for an error of the store's
	err     error
	columns []string
	values  []driver.Value
	has     bool // a row was read
	scanned bool
}

// read runs query on q, the request's transaction, and reads its first
// row. The caller holds r.u.
func (r *readRow) read(ctx context.Context, q dbtx, query string, args []any) error {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	if r.columns, err = rows.Columns(); err != nil {
		return err
	}
	if rows.Next() {
		vals := make([]any, len(r.columns))
		ptrs := make([]any, len(vals))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil { // *any: the driver's value, []byte copied
			return err
		}
		r.values = make([]driver.Value, len(vals))
		for i, v := range vals {
			r.values[i] = v
		}
		r.has = true
	}
	// Close reads the rest, and the statement's error if it failed after
	// its first row.
	if err := rows.Close(); err != nil {
		return err
	}
	return rows.Err()
}

// row returns the *sql.Row of r.
func (r *readRow) row() *sql.Row {
	return rowDB.QueryRowContext(context.Background(), "", r)
}

// Columns, Close and Next make r the driver.Rows of its *sql.Row. Next
// fails once the request is over.
func (r *readRow) Columns() []string { return r.columns }

func (r *readRow) Close() error { return nil }

func (r *readRow) Next(dest []driver.Value) error {
	if r.u != nil && r.u.done.Load() {
		return errTxDone
	}
	if !r.has || r.scanned {
		return io.EOF
	}
	r.scanned = true
	copy(dest, r.values)
	return nil
}

// rowConnector, rowConn: the in-process driver of rowDB. Its one query
// returns the readRow passed as its argument, or its error; its
// statements are those handed to a handler (see handedStmt).
type rowConnector struct{}

func (rowConnector) Connect(context.Context) (driver.Conn, error) { return rowConn{}, nil }
func (rowConnector) Driver() driver.Driver                        { return rowDriver{} }

type rowDriver struct{}

func (rowDriver) Open(string) (driver.Conn, error) { return rowConn{}, nil }

type rowConn struct{}

var errRowConn = errors.New("sqlstore: internal: the row driver runs no statements")

func (rowConn) Close() error              { return nil }
func (rowConn) Begin() (driver.Tx, error) { return nil, errRowConn }

// Prepare returns the statement handed to a handler under the name
// query, a token of handed.
func (rowConn) Prepare(query string) (driver.Stmt, error) {
	h, ok := handed.Load(query)
	if !ok {
		return nil, errTxDone
	}
	return stmtProxy{h.(*handedStmt)}, nil
}

// CheckNamedValue passes the *readRow through as it is.
func (rowConn) CheckNamedValue(*driver.NamedValue) error { return nil }

func (rowConn) QueryContext(_ context.Context, _ string, args []driver.NamedValue) (driver.Rows, error) {
	r, ok := args[0].Value.(*readRow)
	if !ok || len(args) != 1 {
		return nil, errRowConn
	}
	if r.err != nil {
		return nil, r.err
	}
	return r, nil
}
