package idemotel_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/idemkit/idem"
	idemotel "github.com/idemkit/idem/otel"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// setup returns a client traced into a span recorder, through an
// idem.Transport on a pooled transport of its own that is closed when the
// test ends.
func setup(t *testing.T) (*http.Client, *tracetest.SpanRecorder) {
	t.Helper()
	sr := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sr))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	pool := &http.Transport{}
	it := &idem.Transport{Base: idemotel.NewBase(pool), DisableBudget: true}
	rt := idemotel.NewTransport(it, idemotel.WithTracerProvider(tp))
	t.Cleanup(rt.CloseIdleConnections)
	return &http.Client{Transport: rt}, sr
}

// attr returns the value of the attribute k of s, and whether s has it.
func attr(s sdktrace.ReadOnlySpan, k attribute.Key) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

// A keyed POST answered 503, 503, then 201 is one span for the call with
// three client spans under it, one per attempt, each with its resend count
// and the key.
func TestRetriedPost(t *testing.T) {
	var mu sync.Mutex
	var keys []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		n := len(keys)
		mu.Unlock()
		if n <= 2 {
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"pay_1"}`)
	}))
	defer srv.Close()
	client, sr := setup(t)

	resp, err := client.Post(srv.URL+"/v1/payments?secret=x", "application/json", strings.NewReader(`{"amount":4200}`))
	if err != nil {
		t.Fatal(err)
	}
	// The retried attempts' spans have ended, and the last attempt's
	// too: idem read its small answer inside the attempt
	// (Transport.MaxBufferedResponse). The call's span ends when the
	// caller closes the body.
	if len(sr.Ended()) != 3 {
		t.Errorf("before the body is read, %d spans ended, want 3 (the attempts)", len(sr.Ended()))
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()

	spans := sr.Ended()
	if len(spans) != 4 {
		t.Fatalf("%d spans ended, want 4", len(spans))
	}
	if len(keys) != 3 || keys[0] == "" || keys[1] != keys[0] || keys[2] != keys[0] {
		t.Fatalf("server saw keys %q, want one key three times", keys)
	}
	key := keys[0]

	op := spans[3] // the call's span ends last, after the attempt it holds
	if op.Name() != "idem POST" || op.SpanKind() != trace.SpanKindInternal {
		t.Errorf("call span %q of kind %v, want \"idem POST\" of kind internal", op.Name(), op.SpanKind())
	}
	for k, want := range map[attribute.Key]attribute.Value{
		idemotel.KeyAttribute:       attribute.StringValue(key),
		"idem.attempts":             attribute.Int64Value(3),
		"http.request.method":       attribute.StringValue("POST"),
		"http.response.status_code": attribute.IntValue(201),
		"url.full":                  attribute.StringValue(srv.URL + "/v1/payments"),
	} {
		if got, ok := attr(op, k); !ok || got != want {
			t.Errorf("call span: %s = %v (present %v), want %v", k, got.String(), ok, want.String())
		}
	}
	if op.Status().Code == codes.Error {
		t.Errorf("call span status %v, want unset", op.Status())
	}

	for i, s := range spans[:3] {
		if s.SpanKind() != trace.SpanKindClient {
			t.Errorf("attempt %d: kind %v, want client", i+1, s.SpanKind())
		}
		if s.SpanContext().TraceID() != op.SpanContext().TraceID() {
			t.Errorf("attempt %d: trace %s, want the call's %s", i+1, s.SpanContext().TraceID(), op.SpanContext().TraceID())
		}
		if s.Parent().SpanID() != op.SpanContext().SpanID() {
			t.Errorf("attempt %d: parent %s, want the call span %s", i+1, s.Parent().SpanID(), op.SpanContext().SpanID())
		}
		got, ok := attr(s, "http.request.resend_count")
		switch {
		case i == 0 && ok:
			t.Errorf("attempt 1: http.request.resend_count = %v, want none", got.String())
		case i > 0 && (!ok || got.AsInt64() != int64(i)):
			t.Errorf("attempt %d: http.request.resend_count = %v (present %v), want %d", i+1, got.String(), ok, i)
		}
		if got, _ := attr(s, idemotel.KeyAttribute); got.AsString() != key {
			t.Errorf("attempt %d: %s = %q, want %q", i+1, idemotel.KeyAttribute, got.AsString(), key)
		}
		wantStatus := int64(503)
		if i == 2 {
			wantStatus = 201
		}
		if got, _ := attr(s, "http.response.status_code"); got.AsInt64() != wantStatus {
			t.Errorf("attempt %d: status %v, want %d", i+1, got.String(), wantStatus)
		}
	}
}

// An unkeyed GET has no key on its spans, and its single attempt no resend
// count.
func TestGet(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer srv.Close()
	client, sr := setup(t)

	resp, err := client.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	spans := sr.Ended()
	if len(spans) != 2 {
		t.Fatalf("%d spans ended, want 2", len(spans))
	}
	for _, s := range spans {
		for _, k := range []attribute.Key{idemotel.KeyAttribute, "http.request.resend_count"} {
			if v, ok := attr(s, k); ok {
				t.Errorf("span %q: %s = %v, want none", s.Name(), k, v.String())
			}
		}
	}
	if got, _ := attr(spans[1], "idem.attempts"); got.AsInt64() != 1 {
		t.Errorf("idem.attempts = %v, want 1", got.String())
	}
}

// An operation that ends in an error ends the call's span at once, with
// the error's type and an error status.
func TestKeyReuse(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusUnprocessableEntity)
	}))
	defer srv.Close()
	client, sr := setup(t)

	_, err := client.Post(srv.URL, "application/json", strings.NewReader(`{}`))
	if kr := (*idem.KeyReuseError)(nil); !errors.As(err, &kr) {
		t.Fatalf("err = %v, want a *idem.KeyReuseError", err)
	}
	spans := sr.Ended()
	if len(spans) != 2 {
		t.Fatalf("%d spans ended, want 2", len(spans))
	}
	op := spans[1]
	if op.Status().Code != codes.Error {
		t.Errorf("call span status %v, want Error", op.Status())
	}
	if got, _ := attr(op, "error.type"); got.AsString() != "*idem.KeyReuseError" {
		t.Errorf("error.type = %q, want *idem.KeyReuseError", got.AsString())
	}
	if got, ok := attr(op, idemotel.KeyAttribute); !ok || got.AsString() == "" {
		t.Errorf("call span has no key")
	}
}
