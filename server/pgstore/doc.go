// Package pgstore is the PostgreSQL store of package idempotency, on pgx v5:
// the idempotency keys live in a table of their own, next to the service's
// tables, and a handler's writes commit in the same transaction as its key's
// stored outcome.
//
//	if err := pgstore.Migrate(ctx, pool); err != nil { ... } // the key table only
//	keyed := idempotency.Middleware(pgstore.New(pool), idempotency.Options{ClientID: clientOf})
//	mux.Handle("POST /orders", keyed(http.HandlerFunc(createOrder)))
//
// and in the handler:
//
//	tx, err := pgstore.Tx(r.Context()) // pgx's own pgx.Tx, begun now
//	if err == nil {
//		_, err = tx.Exec(r.Context(), `INSERT INTO orders (id, item) VALUES ($1, $2)`, id, item)
//	}
//
// The order row and the key's outcome then commit together, in one commit
// sent with the key's completion: a retry gets the stored response and finds
// the row, and a request whose outcome is not stored (a 400, a 5xx, a panic,
// a request taken over while it ran) leaves no row. The transaction begins
// when the handler asks for it, so a handler that calls a slow downstream
// system first holds no connection meanwhile.
//
// The transaction is pgx's own: it takes everything a pgx.Tx takes (query
// rewriters, every query mode, batches, CopyFrom, its Conn, River's
// InsertTx), and is the middleware's to end. pgstore polices none of the
// handler's SQL: at the end it checks that the transaction is still the one
// it began and still open, and when the handler ended it (see [Tx]) it
// completes the key with a 500 that says so and never runs the request
// again: it fails closed. It begins at the session's
// default_transaction_isolation, which the service sets on the pool's
// connections, the role or the database, and the store reads the level the
// transaction has from PostgreSQL (docs/server.md, "Isolation"). A key's
// times are the database's clock when each event happens
// (statement_timestamp()), so a key completed by a transaction that stayed
// open for a long time is kept its whole retention after the completion.
//
// Round trips: a first execution costs the claim (one INSERT, committed on
// its own so that a duplicate sees the key at once), then the handler's own
// transaction as it would cost without the middleware, whose COMMIT carries
// the key's completion in the same round trip; a retry's replay costs one
// round trip. docs/server.md ("Round trips") counts every case. See [Store]
// for what happens when a connection breaks, and [Migrate] and
// [CreateOpenKeysIndex] for the table and the index the sweeper walks.
//
// # One transaction
//
// A route whose handler writes only to this database, and calls no other
// system before it answers, can set [idempotency.Options.OneTransaction]:
//
//	orders := idempotency.Middleware(store, idempotency.Options{ClientID: clientOf, OneTransaction: true})
//	mux.Handle("POST /orders", orders(http.HandlerFunc(createOrder)))
//
// The claim is then the first statement of the handler's transaction, sent
// with its BEGIN, and inserts the key's row in it: the completion completes
// the row and commits it with the handler's rows, one commit instead of
// two. While the request runs, a transaction-level advisory lock on the key
// (never waited on) answers a duplicate 409 at once, from a route with the
// option or without it; a crash, a panic or a 5xx leaves neither the key
// nor the rows. The price is a connection held from the claim to the
// completion: size the pool for these routes' concurrency (docs/server.md,
// "One transaction", has the details and the isolation levels).
//
// A pool smaller than the requests slows them, never stops them: nothing
// waits for a connection while holding what another waiter needs. Size it
// for the handlers' transactions and, beside them, the claims, renewals
// and completions (docs/operations.md, "Sizing the pool").
//
// # Poolers
//
// The store keeps nothing on a session between two transactions, so it works
// behind PgBouncer in transaction mode in the query modes of pgx that leave
// nothing on the session (exec, simple_protocol, cache_describe), and in pgx's
// default cache_statement when the pooler keeps prepared statements (PgBouncer
// 1.21 and later). Migrate refuses the others with a *QueryModeError
// ([CheckQueryMode]). See docs/operations.md, "Poolers".
package pgstore
