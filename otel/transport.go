package idemotel

import (
	"context"
	"io"
	"net/http"
	"sync/atomic"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem"
)

// KeyAttribute is the attribute that carries an operation's idempotency
// key, on the span of each attempt and on the span of the logical call.
const KeyAttribute = attribute.Key("idempotency.key")

// attemptsAttribute is the number of attempts an operation sent, on the
// span of the logical call.
const attemptsAttribute = attribute.Key("idem.attempts")

// scope is the instrumentation scope of the spans of logical calls.
const scope = "github.com/idemkit/idem/otel"

// NewBase returns the RoundTripper to use as [idem.Transport.Base]:
// otelhttp's client transport (otelhttp.NewTransport, with opts) over base,
// whose span for each attempt also carries http.request.resend_count and
// [KeyAttribute]. If base is nil, http.DefaultTransport is used. Its
// CloseIdleConnections reaches base, which otelhttp's transport alone does
// not forward.
func NewBase(base http.RoundTripper, opts ...otelhttp.Option) http.RoundTripper {
	if base == nil {
		base = http.DefaultTransport
	}
	return &baseTransport{Transport: otelhttp.NewTransport(&annotate{base: base}, opts...), base: base}
}

type baseTransport struct {
	*otelhttp.Transport
	base http.RoundTripper
}

// CloseIdleConnections closes the idle connections of the base transport,
// if it has such a method.
func (b *baseTransport) CloseIdleConnections() { closeIdle(b.base) }

// annotate adds the attempt's attributes to the span otelhttp started for
// it, which is in the request's context, and the key and attempt count to
// the span of the logical call, if NewTransport started one.
type annotate struct{ base http.RoundTripper }

func (a *annotate) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	if at, ok := idem.AttemptFromContext(ctx); ok {
		span := trace.SpanFromContext(ctx)
		if at.Number > 1 {
			span.SetAttributes(semconv.HTTPRequestResendCount(at.Number - 1))
		}
		if at.Key != "" {
			span.SetAttributes(KeyAttribute.String(at.Key))
		}
		if op, ok := ctx.Value(opKey{}).(*opState); ok {
			op.attempts.Store(int64(at.Number))
			if at.Number == 1 && at.Key != "" {
				op.span.SetAttributes(KeyAttribute.String(at.Key))
			}
		}
	}
	return a.base.RoundTrip(req)
}

// opKey is the context key of the opState of a logical call.
type opKey struct{}

// opState is what the attempts of a logical call tell its span.
type opState struct {
	span     trace.Span
	attempts atomic.Int64 // the number of the last attempt
}

// Option configures a [Transport].
type Option func(*Transport)

// WithTracerProvider sets the provider of the tracer that starts the spans
// of logical calls. If none is given, the provider of the span in the
// request's context is used if there is one, else the global provider
// (otel.GetTracerProvider), as otelhttp does. The attempt spans under it
// then come from the same provider unless NewBase was given another.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(t *Transport) { t.tracer = tp.Tracer(scope) }
}

// Transport is an [http.RoundTripper] that starts a span for each logical
// call and sends the request through next, an [idem.Transport] whose Base
// comes from [NewBase], so that the spans of the attempts sit under it.
// It is safe for concurrent use.
type Transport struct {
	next   http.RoundTripper
	tracer trace.Tracer // nil: from the context, or the global provider
}

// NewTransport returns a Transport that traces the operations sent through
// next, usually an *[idem.Transport] whose Base comes from [NewBase].
func NewTransport(next http.RoundTripper, opts ...Option) *Transport {
	t := &Transport{next: next}
	for _, o := range opts {
		o(t)
	}
	return t
}

// RoundTrip starts the span of the logical call, sends req through the
// next RoundTripper with the span in its context, and ends the span when
// the response body is read to the end or closed, or at once on an error.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	tracer := t.tracer
	if tracer == nil {
		tp := otel.GetTracerProvider()
		if span := trace.SpanFromContext(ctx); span.SpanContext().IsValid() {
			tp = span.TracerProvider()
		}
		tracer = tp.Tracer(scope)
	}
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	ctx, span := tracer.Start(ctx, "idem "+method,
		trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(
			semconv.HTTPRequestMethodKey.String(method),
			semconv.URLFull(redact(req)),
		))
	op := &opState{span: span}
	ctx = context.WithValue(ctx, opKey{}, op)

	resp, err := t.next.RoundTrip(req.WithContext(ctx))
	if n := op.attempts.Load(); n > 0 {
		span.SetAttributes(attemptsAttribute.Int64(n))
	}
	if err != nil {
		span.SetAttributes(semconv.ErrorType(err))
		span.SetStatus(codes.Error, err.Error())
		span.End()
		return resp, err
	}
	span.SetAttributes(semconv.HTTPResponseStatusCode(resp.StatusCode))
	if resp.StatusCode >= 400 {
		span.SetStatus(codes.Error, "")
	}
	if resp.Body == nil {
		span.End() // nothing to read: the call is over
		return resp, nil
	}
	resp.Body = endOnClose(resp.Body, span)
	return resp, nil
}

// CloseIdleConnections closes the idle connections of the next
// RoundTripper, if it has such a method.
func (t *Transport) CloseIdleConnections() { closeIdle(t.next) }

func closeIdle(rt http.RoundTripper) {
	type closeIdler interface{ CloseIdleConnections() }
	if ci, ok := rt.(closeIdler); ok {
		ci.CloseIdleConnections()
	}
}

// redact returns the request URL without user info and query, which may
// hold secrets.
func redact(req *http.Request) string {
	if req.URL == nil {
		return ""
	}
	u := *req.URL
	u.User, u.RawQuery, u.ForceQuery, u.Fragment = nil, "", false, ""
	return u.String()
}

// endOnClose wraps body so that span ends when body is read to the end or
// closed, whichever comes first. The body of a 101 Switching Protocols
// response stays an io.ReadWriteCloser.
func endOnClose(body io.ReadCloser, span trace.Span) io.ReadCloser {
	b := &spanBody{ReadCloser: body, span: span}
	if rw, ok := body.(io.ReadWriteCloser); ok {
		return &spanBodyRW{spanBody: b, w: rw}
	}
	return b
}

type spanBody struct {
	io.ReadCloser
	span  trace.Span
	ended atomic.Bool
}

func (b *spanBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.end()
	}
	return n, err
}

func (b *spanBody) Close() error {
	err := b.ReadCloser.Close()
	b.end()
	return err
}

func (b *spanBody) end() {
	if b.ended.CompareAndSwap(false, true) {
		b.span.End()
	}
}

type spanBodyRW struct {
	*spanBody
	w io.Writer
}

func (b *spanBodyRW) Write(p []byte) (int, error) { return b.w.Write(p) }
