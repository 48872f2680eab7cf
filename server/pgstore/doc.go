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
// again: it fails closed. A key's times are the database's clock when each
// event happens (statement_timestamp()), so a key completed by a
// transaction that stayed open for a long time is kept its whole retention
// after the completion.
//
// Round trips: a first execution costs the claim (one statement, committed
// on its own so that a duplicate sees the key at once), then the handler's
// own transaction as it would cost without the middleware (BEGIN, which
// reads the transaction's ID in the same round trip, and its statements),
// whose COMMIT carries the key's completion in the same round trip. The claim of a new key is a plain INSERT, the cheapest statement
// that claims it. A retry (its Repeatability-First-Sent a second old or
// more) sends a read of the key's row before the insert, in the same round
// trip, so its replay or duplicate costs one round trip; a first attempt
// does not pay for that read, and a key of its that has a row costs two
// (the insert, then the read). A claim that resumes, replaces or takes
// over a key (a retry after a release or an expiry, a takeover) costs one
// more. See [Store] for what happens
// when a connection breaks, and [Migrate] for the table. A service that
// runs an idempotency.Sweeper, or the inspector's lists and gauges,
// creates their index at start too, with [CreateOpenKeysIndex]; one that
// runs neither leaves it out, and its key completions can be HOT updates.
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
// with its BEGIN, and writes nothing: the completion inserts the key,
// completed, and commits it with the handler's rows. A first execution costs
// one commit instead of two (the claim's own, and the completion's) and
// writes the key row once instead of inserting and updating it. The
// handler's statements run on the transaction as it has begun (no BEGIN to
// pipeline). A replay or a duplicate costs two round trips, the claim and
// its ROLLBACK.
//
// While the request runs the key has no row, committed or not, so nothing
// can wait on one: the claim holds a transaction-level advisory lock on a
// hash of the key (pg_try_advisory_xact_lock, which never waits), and a
// duplicate that finds it held gets 409 at once, however long the first
// request runs. PostgreSQL releases the lock when the transaction ends, by a
// commit, a rollback, or the end of its connection: a panic, a 5xx, a crash
// of the service or a connection cut under the request leave neither the
// key nor the rows, and the retry runs at once. A claim of the key from a
// route without the option (a replica of a rolling deploy that turns it
// on) respects the lock too: it tries it shared, and gets Busy (409) while
// the request holds it, so two handlers never run one key at once. One
// that raced it (its key committed between the claim's snapshot and its
// lock) fences the completion of the request in one transaction, which
// then commits nothing (409, and its retry gets the other request's
// outcome); the purge leaves a key's row alone while a request holds its
// lock, however long it runs. A key that has a row (from such a route,
// released, or expired) is claimed as without the option.
//
// The price is the connection, held from the claim to the completion,
// whatever the handler does meanwhile: size the pool for the concurrency of
// these routes, and keep calls to slow systems off them. The transaction
// begins at [Store.Isolation]; under REPEATABLE READ
// or SERIALIZABLE a SET TRANSACTION after the claim fails, and under
// SERIALIZABLE the claim's read of the key table takes a predicate lock, so
// two requests whose keys fall on one page of the key table's index may fail
// one another's commit (a serialization failure: the request gets 500, and
// its retry runs again). READ COMMITTED suits this mode best.
//
// Size the pool for the handlers' transactions and, beside them, the
// claims, the lease renewals and the completions without a transaction: a
// renewal that waits for a connection longer than the lock timeout may
// lose the lease to a retry that takes the key over (the request's
// completion is then fenced), so a handler that holds its transaction
// across a slow downstream call should not be able to take every
// connection. Nothing waits for a connection while holding what another
// waiter needs: a pool smaller than the requests slows them, never stops
// them (TestSmallPoolAnswersEveryRequest).
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
