// Package sqlpipe is how server/sqlstore sends several statements in one
// round trip on a database/sql driver that can: database/sql sends one
// statement per round trip, so a BEGIN cannot travel with the statement
// after it, nor a completion with its COMMIT. A package of the driver's
// (server/sqlstore/pgxpipeline, for pgx's stdlib) registers a Runner for
// the driver's type; sqlstore asks For one when it is made, and runs those
// statements through database/sql's Conn.Raw.
package sqlpipe

import (
	"context"
	"database/sql/driver"
	"errors"
	"reflect"
	"sync"
)

// Stmt is one statement of a round trip.
type Stmt struct {
	SQL  string
	Args []any
	// Dest are the destinations of the statement's first row, scanned as
	// the driver scans (a row that is not there is an error wrapping
	// sql.ErrNoRows); nil for a statement whose rows are not read.
	Dest []any
	// Affected, if not nil, receives the number of rows the statement
	// affected (of a statement whose rows are not read).
	Affected *int64
	// Handler marks a statement of the handler's, with the arguments it
	// gave database/sql (sql.NamedArg unwrapped): Run sends it as the
	// driver sends it alone, or sends nothing and returns ErrAlone when it
	// cannot do that in one round trip with others.
	Handler bool
}

// ErrAlone is returned by [Runner.Run], which sent nothing, when a
// handler's statement must be sent alone: the driver would send it
// otherwise in a round trip of its own (pgx's stdlib sends a statement
// without arguments in the simple protocol, which takes several statements
// in one text; arguments may carry the driver's options).
var ErrAlone = errors.New("sqlpipe: the statement must be sent alone")

// NotSentError is the error of [Runner.Run] when a handler's statement
// failed before anything of the round trip ran on the server (its
// arguments could not be encoded): Err is the error the driver returns
// for the statement sent alone. The connection, which ran nothing, may
// have been closed.
type NotSentError struct{ Err error }

func (e *NotSentError) Error() string { return e.Err.Error() }
func (e *NotSentError) Unwrap() error { return e.Err }

// Runner runs statements on the connections of one driver.
type Runner interface {
	// Run sends stmts on driverConn (what database/sql's Conn.Raw hands
	// out) in one round trip, and reads their results in order; the
	// first that fails ends it. i is the index of the statement whose
	// result err is, or len(stmts) for an error of none in particular
	// (of the round trip's end). PostgreSQL runs none of the statements
	// after one that failed.
	Run(ctx context.Context, driverConn any, stmts ...Stmt) (i int, err error)
	// Status reports the state of driverConn.
	Status(driverConn any) Status
}

// Status is the state of a driver connection.
type Status int

const (
	// Idle: open, not busy, outside any transaction: fit to go back to
	// the pool.
	Idle Status = iota
	// InTx: open, not busy, in a transaction (or a failed one).
	InTx
	// Busy: open, and a statement's results are being read (rows left
	// open); no other statement may be sent on it.
	Busy
	// Closed: a round trip that failed on it may have run, in part or
	// whole.
	Closed
)

var runners sync.Map // reflect.Type of a driver.Driver → Runner

// Register makes r the Runner of the drivers of drv's type.
func Register(drv driver.Driver, r Runner) { runners.Store(reflect.TypeOf(drv), r) }

// Suspend removes the Runner of drv's type until restore is called: the
// tests of a driver's stores without it, in a binary that registered it.
func Suspend(drv driver.Driver) (restore func()) {
	t := reflect.TypeOf(drv)
	r, ok := runners.LoadAndDelete(t)
	return func() {
		if ok {
			runners.Store(t, r)
		}
	}
}

// For returns the Runner registered for drv's type, or nil.
func For(drv driver.Driver) Runner {
	if r, ok := runners.Load(reflect.TypeOf(drv)); ok {
		return r.(Runner)
	}
	return nil
}
