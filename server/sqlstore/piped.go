package sqlstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"reflect"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/idemkit/idem/server/internal/sqlpipe"
)

// Piped transactions. On a driver with a registered sqlpipe.Runner (pgx's
// stdlib, with server/sqlstore/pgxpipeline imported), the store runs the
// handler's transaction itself, on a *sql.Conn, rather than as a *sql.Tx:
// it sends the BEGIN of a claim in one transaction with the claim, and
// every completion with its COMMIT, in one round trip each, as pgstore
// does (database/sql sends a *sql.Tx's BEGIN and COMMIT in round trips of
// their own). The handler's statements go through database/sql on the same
// connection.
//
// A *sql.Tx ends whatever the handler left running when it ends (its rows,
// its statements); a *sql.Conn does not, and its Close waits for them. So,
// in both modes, the rows of the handler's queries run under a context
// that the request's end cancels, and the handler's prepared statements
// are stand-ins of rowDB whose queries run through the unit (see
// handedStmt); both end with the request. The store also knows which rows
// are open: the driver's connection cannot take a statement while they
// are (pgx's resets the open rows' state on such a statement, which made
// a later Rows.Next panic), so the handler's next statement fails with
// errRowsOpen, and rows left open when the handler answers fail the
// completion.

// dbtx runs a handler's statements: the *sql.Tx of the request, or the
// *sql.Conn of its piped transaction.
type dbtx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	PrepareContext(ctx context.Context, query string) (*sql.Stmt, error)
}

// errRowsOpen is the error of a statement of the request's transaction
// sent while rows of the transaction are open.
var errRowsOpen = errors.New("sqlstore: rows of the request's transaction are open: close them before its next statement")

// runOn runs stmts on conn in one round trip (see sqlpipe.Runner.Run). An
// error without an SQLSTATE on a connection that closed under it wraps
// errConnLost: the round trip may have run.
func (s *Store) runOn(ctx context.Context, conn *sql.Conn, stmts ...sqlpipe.Stmt) (i int, err error) {
	rerr := conn.Raw(func(dc any) error {
		i, err = s.pipe.Run(ctx, dc, stmts...)
		if err != nil && code(err) == "" && s.pipe.Status(dc) == sqlpipe.Closed && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
			err = errors.Join(errConnLost, err)
		}
		return nil
	})
	if rerr != nil { // the Conn is done: nothing was sent
		return 0, rerr
	}
	return i, err
}

// giveBack returns conn to the pool when it is idle (open, outside any
// transaction), after a ROLLBACK if it is in one; otherwise (closed, still
// in a transaction, or busy with rows the handler left open, which a
// statement sent now could break under the handler's hands) it closes it,
// once those rows are closed, and PostgreSQL rolls back whatever it had
// begun. The caller has canceled the handler's rows.
func (s *Store) giveBack(conn *sql.Conn) {
	_ = conn.Raw(func(dc any) error {
		switch s.pipe.Status(dc) {
		case sqlpipe.Idle:
			return nil
		case sqlpipe.InTx:
			_, _ = s.pipe.Run(context.Background(), dc, sqlpipe.Stmt{SQL: "ROLLBACK"})
			if s.pipe.Status(dc) == sqlpipe.Idle {
				return nil
			}
		}
		return driver.ErrBadConn // database/sql closes it
	})
	conn.Close()
}

// handedRows are rows handed to the handler, with the cancel of their
// context.
type handedRows struct {
	rows   *sql.Rows
	cancel context.CancelFunc
}

// query runs f, a query of the handler's, under a context that the end of
// the request cancels, and keeps its rows. The caller holds u.mu.
func (u *unit) query(ctx context.Context, f func(ctx context.Context) (*sql.Rows, error)) (*sql.Rows, error) {
	qctx, cancel := context.WithCancel(ctx)
	rows, err := f(qctx)
	if err != nil {
		cancel()
		return nil, err
	}
	u.rows = append(u.rows, handedRows{rows, cancel})
	return rows, nil
}

// rowsOpenLocked forgets the handed rows that are closed, and reports
// whether any are left. The caller holds u.mu.
func (u *unit) rowsOpenLocked() bool {
	open := u.rows[:0]
	for _, r := range u.rows {
		if _, err := r.rows.Columns(); err == nil { // closed rows say so
			open = append(open, r)
		} else {
			r.cancel()
		}
	}
	clear(u.rows[len(open):])
	u.rows = open
	return len(open) > 0
}

// endHandedLocked ends what was handed to the handler: its rows are
// canceled (database/sql closes them) and its statements closed. The
// caller holds u.mu.
func (u *unit) endHandedLocked() {
	for _, r := range u.rows {
		r.cancel()
	}
	u.rows = nil
	for _, st := range u.stmts {
		st.close()
	}
	u.stmts = nil
}

// The statements of PrepareContext in a piped transaction. A *sql.Stmt
// prepared on the transaction's *sql.Conn would run queries whose rows only
// the caller's context can close, and database/sql's Conn.Close waits for
// them; so the handler gets a *sql.Stmt of rowDB instead, whose statement
// runs the one prepared on the connection (real) through the unit, as the
// transaction's own calls do: each call holds the unit, its rows end with
// the request, and it fails with ErrUnitEnded once the request is over.

// handedStmt is a statement handed to a handler: proxy, on rowDB, runs
// real, prepared on the transaction's connection.
type handedStmt struct {
	u     *unit
	real  *sql.Stmt
	proxy *sql.Stmt
	token string // the name proxy is prepared under on rowDB
}

// handed are the statements handed to handlers, by token, while their
// requests run.
var handed sync.Map

// handedSeq numbers the tokens of handed.
var handedSeq atomic.Uint64

// prepare prepares query on conn, the unit's, and returns the statement
// handed to the handler. The caller holds u.mu.
func (u *unit) prepare(ctx context.Context, conn dbtx, query string) (*sql.Stmt, error) {
	real, err := conn.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	h := &handedStmt{u: u, real: real, token: "sqlstore statement " + strconv.FormatUint(handedSeq.Add(1), 10)}
	handed.Store(h.token, h)
	if h.proxy, err = rowDB.PrepareContext(ctx, h.token); err != nil {
		handed.Delete(h.token)
		real.Close()
		return nil, err
	}
	u.stmts = append(u.stmts, h)
	return h.proxy, nil
}

// close closes the statement, for the end of its request.
func (h *handedStmt) close() {
	handed.Delete(h.token)
	h.proxy.Close()
	h.real.Close()
}

// stmtProxy is the driver statement of a handedStmt.
type stmtProxy struct{ h *handedStmt }

func (stmtProxy) Close() error  { return nil }
func (stmtProxy) NumInput() int { return -1 } // real checks its arguments

func (stmtProxy) Exec([]driver.Value) (driver.Result, error) { return nil, errRowConn }
func (stmtProxy) Query([]driver.Value) (driver.Rows, error)  { return nil, errRowConn }

func (p stmtProxy) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	h := p.h
	return with(ctx, handlerTx{h.u}, "", false, func(dbtx) (driver.Result, error) {
		return h.real.ExecContext(ctx, namedArgs(args)...)
	})
}

func (p stmtProxy) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	h := p.h
	return with(ctx, handlerTx{h.u}, "", false, func(dbtx) (driver.Rows, error) {
		rows, err := h.u.query(ctx, func(ctx context.Context) (*sql.Rows, error) {
			return h.real.QueryContext(ctx, namedArgs(args)...)
		})
		if err != nil {
			return nil, err
		}
		return &rowsProxy{rows: rows}, nil
	})
}

// namedArgs returns args, which rowConn passed through as the caller
// gave them, as the arguments of a database/sql call.
func namedArgs(args []driver.NamedValue) []any {
	out := make([]any, len(args))
	for i, a := range args {
		if a.Name != "" {
			out[i] = sql.Named(a.Name, a.Value)
		} else {
			out[i] = a.Value
		}
	}
	return out
}

// rowsProxy are the driver rows of a handedStmt's query: the values of
// the real rows, as the driver gave them, which database/sql's rows of
// rowDB then convert as it converts any driver's.
type rowsProxy struct {
	rows  *sql.Rows
	vals  []any
	ptrs  []any
	types []*sql.ColumnType
}

func (r *rowsProxy) Columns() []string {
	c, _ := r.rows.Columns()
	return c
}

func (r *rowsProxy) Close() error { return r.rows.Close() }

func (r *rowsProxy) Next(dest []driver.Value) error {
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return io.EOF
	}
	if len(r.ptrs) != len(dest) {
		r.vals = make([]any, len(dest))
		r.ptrs = make([]any, len(dest))
		for i := range r.vals {
			r.ptrs[i] = &r.vals[i]
		}
	}
	if err := r.rows.Scan(r.ptrs...); err != nil { // *any: the driver's value, []byte copied
		return err
	}
	for i, v := range r.vals {
		dest[i] = v
	}
	return nil
}

// columnType returns the real rows' type of column i, or nil.
func (r *rowsProxy) columnType(i int) *sql.ColumnType {
	if r.types == nil {
		r.types, _ = r.rows.ColumnTypes()
	}
	if i < len(r.types) {
		return r.types[i]
	}
	return nil
}

func (r *rowsProxy) ColumnTypeDatabaseTypeName(i int) string {
	if t := r.columnType(i); t != nil {
		return t.DatabaseTypeName()
	}
	return ""
}

func (r *rowsProxy) ColumnTypeScanType(i int) reflect.Type {
	if t := r.columnType(i); t != nil {
		return t.ScanType()
	}
	return reflect.TypeFor[any]()
}

func (r *rowsProxy) ColumnTypeNullable(i int) (nullable, ok bool) {
	if t := r.columnType(i); t != nil {
		return t.Nullable()
	}
	return false, false
}
