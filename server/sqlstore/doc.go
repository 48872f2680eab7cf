// Package sqlstore is the PostgreSQL store of package idempotency over
// database/sql, for services written on it: sqlc's database/sql code, GORM,
// sqlx, bun, ent. The idempotency keys live in pgstore's key table, next to
// the service's tables, and a handler's writes commit in the same
// transaction as its key's stored outcome.
//
//	db, err := sql.Open("pgx", dsn) // or "postgres", lib/pq
//	if err := sqlstore.Migrate(ctx, db); err != nil { ... } // the key table only
//	keyed := idempotency.Middleware(sqlstore.New(db), idempotency.Options{ClientID: clientOf})
//	mux.Handle("POST /orders", keyed(http.HandlerFunc(createOrder)))
//
// and in the handler, with sqlc's generated code:
//
//	tx, err := sqlstore.Tx(r.Context()) // database/sql's own *sql.Tx, begun now
//	if err == nil {
//		order, err = queries.New(tx).CreateOrder(r.Context(), params)
//	}
//
// or with GORM (gorm.io/driver/postgres) on the same transaction, whose
// db.Transaction then nests as savepoints:
//
//	gdb, err := gorm.Open(postgres.New(postgres.Config{Conn: tx}), &gorm.Config{SkipDefaultTransaction: true})
//
// [Tx] is database/sql's *sql.Tx, so anything that takes one takes it
// (River's riverdatabasesql InsertTx, sqlx, bun). The order row and the
// key's outcome commit together, a retry gets the stored response and
// finds the row, and a request whose outcome is not stored (a 400, a 5xx,
// a panic, a request taken over while it ran) leaves no row. The
// transaction begins when the handler asks for it, so a handler that
// calls a slow downstream system first holds no connection meanwhile. The
// one rule is pgstore's: never end the transaction; the store checks at
// the end, and fails closed (see [Tx]). It begins at the session's
// default_transaction_isolation (default_transaction_isolation=serializable
// in the DSN, on either driver), as in pgstore.
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
// database/sql sends one statement per round trip, so a first execution
// costs six round trips where pgstore's costs five: the claim, the BEGIN,
// the read of the transaction's ID, the handler's statements, the
// completion and the COMMIT (pgstore sends the ID with the BEGIN and the
// completion with the COMMIT). A retry's replay or duplicate (its
// first-sent time a second old or more) is one statement, a read of the
// key's row sent before the claim, in either mode. Claims in one transaction
// ([idempotency.Options.OneTransaction]) are pgstore's (an advisory lock
// taken without waiting and the key's row inserted in the handler's
// transaction, completed in its commit; see pgstore's package
// documentation), but for
// the round trips. The store is an [idempotency.Inspector] and an
// [idempotency.Sweepable], on pgstore's statements, for the operators' API
// and the sweeper, once [CreateOpenKeysIndex] made the index they walk.
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
