// Package idempotency is the server side of the Idempotency-Key contract
// for net/http: a middleware any service puts in front of its own POST and
// PATCH handlers, over a [Store] of keys that commits the handler's writes
// together with the key's stored outcome.
//
//	keyed := idempotency.Middleware(store, idempotency.Options{ClientID: clientOf})
//	mux.Handle("POST /orders", keyed(http.HandlerFunc(createOrder)))
//
// The store is a [MemoryStore] for tests and demos, or pgstore.New(pool) on
// PostgreSQL (package github.com/idemkit/idem/server/pgstore), whose
// pgstore.Tx gives the handler the transaction its writes commit
// in. Inside the handler, [ClaimFromContext] carries the
// [Claim.OperationID] to derive downstream idempotency keys from. Package
// storetest is the conformance suite any other Store passes.
//
// The package imports no database driver and no metrics library: events go
// to [Options.OnEvent], logs to [Options.Logger].
//
// # The contract
//
// It follows the IETF draft draft-ietf-httpapi-idempotency-key-header, with
// Stripe's API where the draft is silent. A key is a bare token or an
// RFC 9651 sf-string of 1 to 255 visible ASCII characters, scoped by the
// authenticated client ([Options.ClientID]). A request's [Fingerprint]
// (SHA-256 of its method, path, query and canonical body) is stored with
// the key.
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
// [Options.StoreServerErrors] stores and replays 5xx answers
// instead, as Stripe does. See [Middleware] for the details.
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
// # What a stored response keeps, and how it is protected
//
// A stored response is kept for the retention, for whoever sends its key
// again, so it keeps no more than a replay needs. Its status, content type
// and body are kept, and of its headers those [Options.StoredHeaders] lists
// ([DefaultStoredHeaders]: Location, ETag, Cache-Control and the like);
// headers that carry credentials (Set-Cookie, Authorization,
// WWW-Authenticate, ...) are never kept, whatever the list says.
// [Options.Redact] may store a redacted copy (the first client gets the
// whole response, a replay the copy, marked with [RedactedHeader]), and a
// body over [Options.MaxStoredBodyBytes] (1 MiB) is replaced in the store by
// a [ProblemResponseTooLarge] that keeps the status and Location, so the
// operation is never run again for its size.
//
// [Sealed] seals what is stored at rest with AES-256-GCM under rotating
// [SealKeys], bound to the client, the key and the status, so that the
// store's readers (backups, replicas, support staff) see only the status and
// the request's fingerprint, and a sealed response copied to another row
// does not open. A stored response that cannot be opened is answered 500
// [ProblemResponseSealed], never run again.
//
// # Crashes and slow requests
//
// The key is claimed in its own statement before any work, so a duplicate
// sees it at once. The business writes and the key's completion commit in
// one transaction. While the handler runs, the middleware renews the
// claim's lease every third of the lock timeout (10s by default), so a slow
// request keeps its key however long it takes, and its duplicates get 409.
// A started key whose owner stopped renewing it for a whole lock timeout
// (it crashed, or was cut off from the store) is taken over by the next
// request with the same fingerprint, under a new fencing token and the same
// OperationID: the crashed request's downstream work, keyed by the
// OperationID, is found rather than done again, and a request that was only
// cut off finds its completion fenced ([ErrFenced]) and rolled back, so it
// never commits twice; its context is cancelled with [ErrLeaseLost] as soon
// as a renewal learns of the takeover.
//
// # One transaction
//
// A route whose handler writes only to the key's database can set
// [Options.OneTransaction]: the key is claimed in the handler's own
// transaction and commits with its writes and the stored outcome, one
// commit per first execution. Nothing of a request that fails (a crash,
// a panic, a 5xx) is left, the key included, so its retry runs at once:
// there is no lease to wait out. Its duplicates get 409 at once while it
// runs. The price is a connection held from the claim to the completion;
// a handler that calls a slow or external system (a card processor)
// keeps the default, where the claim commits first and a failed request's
// OperationID survives for its retry. Follow-up work goes to an outbox
// written in the same transaction.
//
// # Retention
//
// Keys are kept for 24 hours by default after their request finished
// (completed or released), a retention stored with each key, so the
// replica that finished a key decides when it expires, whatever the
// settings of the replica that reads it later. An expired key counts as
// absent at once, whatever the purge timing, so reusing it starts a new
// operation. A key whose request is running never expires; one whose owner
// died expires its retention after its lease ran out. [Purger] deletes
// expired keys, released ones included, in bounded batches every minute,
// pausing between batches in proportion to how long each took, so that a
// large backlog does not slow the requests down.
//
// # Abandoned operations and operators
//
// A key whose owner crashed after its downstream work, and whose client
// never came back, would stay unsettled until it expired. A [Sweeper]
// finds such keys (a lease run out, or a release after a failure, that no
// retry took for a grace period), takes each over as a retry would, and
// hands it to an application hook that completes it with its business
// writes and a response, or releases it. [Admin] looks keys up, lists the
// stuck ones, and releases or expires one with a reason. Both need a store
// that implements [Sweepable] and [Inspector], as [MemoryStore] and the
// PostgreSQL store do.
package idempotency
