// Package keysql is the one source of the key table's SQL, shared by the
// stores that serve it: server/pgstore (pgx) and server/sqlstore
// (database/sql). It holds the statements (claims, renewal, completion,
// release, purge, the inspector's and the sweeper's reads and writes), the
// expressions they share over a key row (expiry, staleness), the
// migrations and the open keys' index, and the driver-neutral Go around
// them: a claim's parameters and the reading of its row, the SQLSTATEs
// the stores map to the idempotency sentinels, and the guard that reads a
// handler's SQL for statements that would end its transaction.
//
// It imports no database driver, as river's riverdriver keeps one set of
// queries behind riverpgxv5 and riverdatabasesql: a fix to a claim or a
// purge lands in both stores at once. What differs between the drivers
// (batches, pipelining, the encoding of jsonb) stays in each store.
//
// Each statement takes positional parameters ($1, $2, ...) of plain Go
// types (string, []byte, int64, int32, bool, time.Time, or nil for SQL
// NULL), which both pgx and database/sql's PostgreSQL drivers encode in
// every query mode; the response headers go as their JSON text
// (HeaderArg), cast to jsonb in the statement.
package keysql
