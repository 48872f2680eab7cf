// Package server implements the server side of the Idempotency-Key contract
// for net/http, and a reference payments API built on it.
//
// Wrap the POST and PATCH routes that must be safe to retry, behind the
// authentication that says who the client is:
//
//	store := server.NewMemoryStore() // or server.NewPostgresStore(pool) after server.Migrate
//	keyed := server.Idempotency(store, server.IdempotencyOptions{})
//	mux.Handle("POST /v1/orders", server.BearerAuth(tokens)(keyed(createOrder)))
//
// Inside the handler, [TxFromContext] is the unit of work whose writes
// commit together with the key's stored outcome, and [ClaimFromContext]
// carries the [Claim.OperationID] to derive downstream idempotency keys from.
//
// # The contract
//
// It follows the IETF draft draft-ietf-httpapi-idempotency-key-header, with
// Stripe's API where the draft is silent. A key is a bare token or an
// RFC 9651 sf-string of 1 to 255 visible ASCII characters, scoped by the
// authenticated client. A request's [Fingerprint] (SHA-256 of its method,
// path, query and canonical body) is stored with the key.
//
//	first request with the key         runs; its outcome is stored
//	retry after it finished            the stored status, headers and body, with Idempotent-Replayed: true
//	retry while it runs                409 with Retry-After (or a bounded wait, then the replay)
//	same key, another request          422
//	no key, or an invalid one          400
//	body over the limit                413
//
// Error bodies are RFC 9457 problem details with a stable type URI per case
// (the Problem… constants).
//
// # What is stored
//
// 2xx, 3xx and definitive 4xx answers are stored and replayed. 400 and the
// other 4xx that mean "nothing was done" (401, 403, 404, 405, 408, 409, 413,
// 415, 425, 429) release the key, so the client can correct the request and
// retry with the same key. 5xx answers, panics and failed completions
// release the key too by default, so the retry runs again at once;
// [IdempotencyOptions.StoreServerErrors] stores and replays 5xx answers
// instead, as Stripe does. See [Idempotency] for the details.
//
// A released key is not deleted: it keeps its [Claim.OperationID]
// ([Store.Release]). The retry of the same request resumes the operation
// under it, so a request that failed after an irreversible downstream call
// keyed by the OperationID (a card charge) is not charged twice. After a
// 4xx that means "nothing was done", a different request with the key,
// such as the corrected one after a 400, is a new operation; after a 5xx,
// a panic or a failed completion, it gets 422, since the failed request
// may have taken effect and only its own retry finishes it
// ([ReleaseKind]).
//
// # Crashes and slow requests
//
// The key is claimed in its own statement before any work, so a duplicate
// sees it at once. The business writes and the key's completion commit in
// one transaction. A started key older than the lock timeout (30s by
// default) is taken over by the next request with the same fingerprint,
// under a new fencing token and the same OperationID: the crashed request's
// downstream work, keyed by the OperationID, is found rather than done again,
// and a request that was only slow finds its completion fenced
// ([ErrFenced]) and rolled back, so it never commits a second payment.
//
// # Retention
//
// Keys are kept for 24 hours by default, counted from the first claim of
// their operation. A key older than that counts as absent at once, whatever
// its state and the purge timing, so reusing it starts a new operation;
// [Server.Run] deletes expired keys, released ones included, in bounded
// batches every minute, pausing between batches in proportion to how long
// each took ([Config.PurgeDutyCycle]), so that a large backlog does not
// slow the requests down; the pace only bounds how large the table grows.
//
// # The reference server
//
// [Server] is the payments API of cmd/idem-server: POST /v1/payments (JSON
// or form-encoded) charges a fake card processor ([Processor], on its own
// loopback listener) through the SDK's idem.Transport, with a key derived
// from the client and the OperationID, and stores the payment with the key's
// outcome; GET /v1/payments/{id} reads it back. For benchmarks only,
// [Config.NoIdempotency] serves the same payment without the idempotency
// layer, to measure what the layer costs. The stores are the
// [MemoryStore], the default of idem-server without a database, and the
// PostgreSQL store; both pass the conformance suite in package storetest.
package server
