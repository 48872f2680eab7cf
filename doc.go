// Package idem makes payment-style HTTP calls safe to retry.
//
// Wrap an http.Client's transport with a [Transport] and every POST or PATCH
// becomes one logical operation with one Idempotency-Key (a UUIDv4), reused
// on every retry, so a server that honours the key performs it once however
// often the network makes the client try:
//
//	client := &http.Client{Transport: &idem.Transport{}}
//	resp, err := client.Post(url, "application/json", body) // keyed, retried
//
// The Transport retries connection errors, attempt timeouts, 408, 429 and
// 5xx with bounded exponential backoff and jitter, honours Retry-After,
// waits out 409 Conflict (the first attempt with the key is still running)
// and turns 422 (the key was reused for another request) into a
// [*KeyReuseError], a bug to fix rather than a failure to retry. Operations
// that cannot finish end with a typed error: [*RetryError] when attempts,
// time or the [RetryBudget] run out, [*InProgressError] when the outcome is
// still unknown and the same key must be retried later.
//
// After any call, [OutcomeOf] says whether the operation may have taken
// effect, in one switch:
//
//	switch idem.OutcomeOf(resp, err) {
//	case idem.OutcomeNotSent: // nothing reached the server: it may go elsewhere, under a new key
//	case idem.OutcomeDone:    // the server's final answer: read it
//	case idem.OutcomeUnknown: // it may have happened: retry with the same key, here only
//	}
//
// To retry one operation across calls, or across a process restart, pin its
// key with [WithKey]. [Client] is a small JSON client built on the
// Transport, and [Replayed] tells a replayed answer from a first one.
//
// The server side of the same contract is a library for your own service:
// package github.com/idemkit/idem/server/idempotency is the middleware
// (any net/http handler, any store), and github.com/idemkit/idem/server/pgstore
// keeps the keys in PostgreSQL and hands your handler the pgx.Tx its writes
// commit in. Package github.com/idemkit/idem/server is the reference
// payments API built on them, for tests and demos.
package idem
