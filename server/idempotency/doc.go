// Package idempotency is the server side of the Idempotency-Key contract
// for net/http: a middleware any service puts in front of its own POST and
// PATCH handlers, over a [Store] of keys that commits the handler's writes
// together with the key's stored outcome.
//
//	keyed := idempotency.Middleware(store, idempotency.Options{ClientID: clientOf})
//	mux.Handle("POST /orders", keyed(http.HandlerFunc(createOrder)))
//
// The store is a [MemoryStore] for tests and demos, or pgstore.New(pool) on
// PostgreSQL, whose pgstore.Tx gives the handler the transaction its writes
// commit in. Inside the handler, [ClaimFromContext] carries the
// [Claim.OperationID] to derive downstream idempotency keys from. Options
// read from configuration go through [New], which returns an error where
// Middleware panics. The package imports no database driver and no metrics
// library: events go to [Options.OnEvent], logs to [Options.Logger].
//
// It follows the IETF draft draft-ietf-httpapi-idempotency-key-header, with
// Stripe's API where the draft is silent. A key is scoped by the
// authenticated client; a request's [Fingerprint] is stored with it.
//
//	first request with the key         runs; its outcome is stored
//	retry after it finished            the stored response, with Idempotent-Replayed: true
//	retry while it runs                409 with Retry-After (or a bounded wait, then the replay)
//	same key, another request          422
//	no key, or an invalid one          400
//
// Error bodies are RFC 9457 problem details with a stable type URI per case
// (the Problem… constants). A 5xx, a panic or a failed completion releases
// the key, keeping its operation for the retry ([Store.Release]). A lease
// renewed while the handler runs lets a retry take over the key of a
// request that crashed, and fences the crashed request's completion.
//
// Beyond requests: [Sealed] seals stored responses at rest, [Purger]
// deletes expired keys, a [Sweeper] settles abandoned operations, and
// [Admin] looks keys up and releases them. docs/server.md and
// docs/operations.md in the repository give the details.
package idempotency
