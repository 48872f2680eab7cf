// Package server is the reference payments API of idem, built on the
// server-side library exactly as any service would be: POST /v1/payments
// behind [idempotency.Middleware], its payments written through
// [pgstore.Tx] on PostgreSQL (or staged with
// [idempotency.MemoryStore.Stage] in memory), its own tables (payments, and
// the fake card processor's charges), its own authentication ([BearerAuth])
// and its own metrics ([Metrics], fed by [idempotency.Options.OnEvent]). It
// serves cmd/idem-server, the end-to-end tests, the benchmarks, the
// scenarios and the chaos test. It is a demo, not a library: a service
// imports [idempotency] and a store (pgstore or sqlstore), never this
// package, whose API follows the demo's needs (ARCHITECTURE.md lists
// what each package owns).
//
//	srv, err := server.New(server.Config{Storage: server.NewMemoryStorage().Storage()})
//	http.ListenAndServe("127.0.0.1:8080", srv)
//
// A payment charges a fake card processor ([Processor], on its own loopback
// listener) through the SDK's idem.Transport, with a key derived from the
// client and the [idempotency.Claim.OperationID], and stores the payment in
// the key's unit of work, so it commits with the key's outcome; GET
// /v1/payments/{id} reads it back. For benchmarks only,
// [Config.NoIdempotency] serves the same payment without the idempotency
// layer, to measure what the layer costs. What the contract does for the
// client (replays, 409, 422, releases, leases, retention) is the library's:
// see package idempotency.
package server
