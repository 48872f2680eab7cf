// Package sqlstore is the PostgreSQL store of package idempotency over
// database/sql, for services written on it: sqlc's database/sql code, GORM,
// sqlx, bun, ent. The idempotency keys live in pgstore's key table, next to
// the service's tables, and a handler's writes commit in the same
// transaction as its key's stored outcome.
//
//	import _ "github.com/idemkit/idem/server/sqlstore/pgxpipeline" // on pgx's stdlib: pgstore's round trips
//
//	db, err := sql.Open("pgx", dsn) // or "postgres", lib/pq
//	if err := sqlstore.Migrate(ctx, db); err != nil { ... } // the key table only
//	keyed := idempotency.Middleware(sqlstore.New(db), idempotency.Options{ClientID: clientOf})
//	mux.Handle("POST /orders", keyed(http.HandlerFunc(createOrder)))
//
// and in the handler, with sqlc's generated code:
//
//	tx, _ := sqlstore.TxFromContext(r.Context())
//	order, err := queries.New(tx).CreateOrder(r.Context(), params)
//
// or with GORM (gorm.io/driver/postgres), on the same transaction; GORM's
// own transaction around each write is not needed, the middleware's is the
// one:
//
//	gdb, err := gorm.Open(postgres.New(postgres.Config{Conn: tx}), &gorm.Config{SkipDefaultTransaction: true})
//
// [Tx] has the four methods of sqlc's DBTX and of GORM's ConnPool
// (ExecContext, QueryContext, QueryRowContext, PrepareContext), and no
// Commit or Rollback: the order row and the key's outcome commit together,
// a retry gets the stored response and finds the row, and a request whose
// outcome is not stored (a 400, a 5xx, a panic, a request taken over while
// it ran) leaves no row. The transaction begins on its first statement, so
// a handler that calls a slow downstream system first holds no connection
// meanwhile.
//
// # One table, two stores
//
// The store runs pgstore's statements, from one source (package
// server/internal/keysql), on pgstore's table: [Migrate] and
// pgstore.Migrate apply the same migrations, and replicas on either package
// serve one table side by side, each claiming, taking over, resuming and
// replaying the keys of the other (a service moving from one driver to the
// other does this). Claims before the work, leases and their renewal,
// takeovers, fencing, retention stored with each key, the purge, the
// release policy and the first-sent refusal behave as in pgstore; both
// pass the conformance suite of server/storetest. The drivers: pgx's
// stdlib ("pgx", github.com/jackc/pgx/v5/stdlib) and lib/pq ("postgres");
// the package imports neither, nor any of pgx, so a service on lib/pq
// pulls in no pgx.
//
// # Where it differs from pgstore
//
// On lib/pq, which prepares nothing of its own, the store prepares the
// statements of a first execution (the claims and the completions in the
// handler's transaction): database/sql prepares each once on each
// connection, and PostgreSQL plans it once, not on every run. pgx's stdlib
// caches the statements it runs itself, so on pgx the store prepares
// nothing.
//
// database/sql sends one statement per round trip, and hands out nothing
// but its own types, so:
//
//   - A first execution costs five round trips where pgstore's costs three:
//     the claim, the BEGIN, the handler's statements, the completion and
//     the COMMIT (pgstore sends the BEGIN with the first statement and the
//     completion with the COMMIT), and 1.14 to 1.32 times pgstore's CPU
//     on pgx's stdlib, 1.29 to 1.35 in one transaction (BEGIN and claim
//     apart too), 1.5 on lib/pq, a good part of it lib/pq's own cost (BENCHMARKS.md,
//     "sqlstore against pgstore").
//   - On pgx's stdlib, a service that imports server/sqlstore/pgxpipeline
//     sends the completion with the COMMIT, the BEGIN with the handler's
//     first statement when that is an ExecContext with arguments (as
//     pgstore does), and a claim in one transaction with the BEGIN, in
//     one pgx batch each: pgstore's three round trips in both modes, for
//     about pgstore's CPU (0.93 to 0.97 times in two commits, 0.98 to 1.02
//     in one transaction). The handler's other statements go through
//     database/sql; the store then runs the transaction on a *sql.Conn.
//     lib/pq has no way to send two statements with parameters in one
//     round trip.
//   - Claims in one transaction ([idempotency.Options.OneTransaction]) are
//     pgstore's (an advisory lock taken without waiting, the key inserted,
//     completed, by the completion in the handler's commit; see pgstore's
//     package documentation), but for the round trips above. The store is an
//     [idempotency.Inspector] and an [idempotency.Sweepable], on pgstore's
//     statements, for the operators' API and the sweeper, once
//     [CreateOpenKeysIndex] made the index they walk.
//   - [TxFromContext] lists how the handler's transaction keeps pgstore's
//     rules (refused COMMIT and ROLLBACK, QueryRowContext that reads its
//     row at once, statements that stop working when the request ends)
//     and where database/sql's own types (its Rows and Stmt) end
//     differently, and the one about isolation levels.
//
// The response headers are stored as JSON text in the jsonb column, the
// bodies and fingerprints byte for byte (bytea), and the times are the
// database's clock (statement_timestamp()), as pgstore stores them. A
// driver's errors are translated as pgstore translates pgx's, by SQLSTATE
// (both drivers' errors have a SQLState method) and error type, never by
// message: text a column refuses is [idempotency.ErrInvalidText], a
// serialization failure of the store's own statements runs them again, and
// a connection that broke under a claim, a renewal, a release or a
// completion runs the statement again on a live connection (see [Store]).
package sqlstore
