// Package idemotel traces the operations of an [idem.Transport] with
// OpenTelemetry: one span for each logical call, and under it one otelhttp
// client span for each attempt.
//
//	t := &idem.Transport{Base: idemotel.NewBase(nil)}
//	client := &http.Client{Transport: idemotel.NewTransport(t)}
//
// [NewBase] is otelhttp's client transport over the base, so each attempt
// is a client span as otelhttp makes it, with two attributes added from
// [idem.AttemptFromContext]:
//
//   - http.request.resend_count, the number of attempts sent before this
//     one, on every attempt but the first, as the OpenTelemetry semantic
//     conventions ask ("if and only if the request was retried"). A wait
//     for a 409 Conflict is counted as a resend too: it sends the request
//     again.
//   - idempotency.key, the operation's key, on every attempt of a keyed
//     operation (POST and PATCH). The conventions have no attribute for it;
//     the name holds the key itself, the same whatever header carries it
//     (Transport.KeyHeader) and however it is written (Transport.KeyFormat),
//     unlike http.request.header.idempotency-key, which would hold the
//     header's raw values.
//
// [NewTransport] starts the span of the logical call, named "idem " and the
// method, of kind internal, with the method, the URL (without user info or
// query), the key, the number of attempts (idem.attempts) and the final
// status code or error. It ends when the final response body is read to
// the end or closed, after the attempt span it holds.
//
// This package is a module of its own, so that the idem module does not
// depend on OpenTelemetry.
package idemotel
