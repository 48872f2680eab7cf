package server

import (
	"context"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// DBRoundTrips counts the round trips that pgx connections make to
// PostgreSQL. It is a pgx tracer: set it as the ConnConfig.Tracer of the
// pool before the pool is created, and pass it to [Config.DBRoundTrips], so
// that /metrics shows
//
//	idem_db_round_trips_total{kind="query"}    Query, QueryRow and Exec: one statement, one round trip
//	idem_db_round_trips_total{kind="batch"}    SendBatch: a pipelined batch, one round trip
//	idem_db_round_trips_total{kind="prepare"}  a statement prepared on a connection for the first time
//	idem_db_round_trips_total{kind="connect"}  a new connection (its handshake is several)
//
// A load test divides the change of the sum by the requests it sent to get
// the round trips per request. Not counted: the pool's liveness pings of
// connections idle for more than a second, and the prepare step of a
// batch's statements new to a connection (once per statement and
// connection). A statement that fails is counted: it was sent.
//
// The zero value is ready to use. A DBRoundTrips is safe for concurrent use
// by any number of connections and pools.
type DBRoundTrips struct {
	query, batch, prepare, connect atomic.Int64
}

// Total returns the round trips counted so far, of every kind.
func (c *DBRoundTrips) Total() int64 {
	return c.query.Load() + c.batch.Load() + c.prepare.Load() + c.connect.Load()
}

// TraceQueryStart implements pgx.QueryTracer: one statement is one round
// trip (in pgx's default statement-cache mode, once it is prepared).
func (c *DBRoundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.query.Add(1)
	return ctx
}

// TraceQueryEnd implements pgx.QueryTracer.
func (c *DBRoundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TraceBatchStart implements pgx.BatchTracer: a batch is sent as one
// pipeline, whatever it holds.
func (c *DBRoundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.batch.Add(1)
	return ctx
}

// TraceBatchQuery implements pgx.BatchTracer.
func (c *DBRoundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

// TraceBatchEnd implements pgx.BatchTracer.
func (c *DBRoundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// TracePrepareStart implements pgx.PrepareTracer.
func (c *DBRoundTrips) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return ctx
}

// TracePrepareEnd implements pgx.PrepareTracer: a statement the connection
// had already prepared costs nothing; pgx asks the database otherwise.
func (c *DBRoundTrips) TracePrepareEnd(_ context.Context, _ *pgx.Conn, data pgx.TracePrepareEndData) {
	if !data.AlreadyPrepared {
		c.prepare.Add(1)
	}
}

// TraceConnectStart implements pgx.ConnectTracer.
func (c *DBRoundTrips) TraceConnectStart(ctx context.Context, _ pgx.TraceConnectStartData) context.Context {
	c.connect.Add(1)
	return ctx
}

// TraceConnectEnd implements pgx.ConnectTracer.
func (c *DBRoundTrips) TraceConnectEnd(context.Context, pgx.TraceConnectEndData) {}
