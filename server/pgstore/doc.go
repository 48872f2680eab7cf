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
//	tx, _ := pgstore.TxFromContext(r.Context())
//	_, err := tx.Exec(r.Context(), `INSERT INTO orders (id, item) VALUES ($1, $2)`, id, item)
//
// The order row and the key's outcome then commit together, in one commit
// sent with the key's completion: a retry gets the stored response and finds
// the row, and a request whose outcome is not stored (a 400, a 5xx, a panic,
// a request taken over while it ran) leaves no row. The transaction begins on
// its first statement, so a handler that calls a slow downstream system first
// holds no connection meanwhile.
//
// The transaction takes what a pgx.Tx takes, and is the middleware's to end:
// its Commit and Rollback, and a COMMIT or ROLLBACK the handler sends as SQL,
// are refused with [ErrTxOwned], and everything handed out from it
// (savepoints, rows, batches, its Conn) stops working when the request ends,
// so a goroutine that outlives the handler cannot write into another
// request's transaction. [TxFromContext] lists what holds, and the one way
// around it (SQL sent on the transaction's Conn). A key's times are the
// database's clock when each event happens (statement_timestamp()), so a
// key completed by a transaction that stayed open for a long time is kept
// its whole retention after the completion.
//
// Round trips: a first execution costs the claim (one statement, committed
// on its own so that a duplicate sees the key at once), then the handler's
// own transaction as it would cost without the middleware (BEGIN, its
// statements; the BEGIN travels with the first statement of Exec or
// QueryRow), whose COMMIT carries the key's completion in the same round
// trip; a replay costs one, the claim. A claim that resumes, replaces or
// takes over a key (a retry after a release or an expiry, a takeover)
// costs two. See [Store] for what happens
// when a connection breaks, and [Migrate] for the table.
//
// Size the pool for the handlers' transactions and, beside them, the
// claims, the lease renewals and the completions without a transaction: a
// renewal that waits for a connection longer than the lock timeout loses
// the lease (the request's completion is then fenced, and its client's
// retry runs it again), so a handler that holds its transaction across a
// slow downstream call should not be able to take every connection.
package pgstore
