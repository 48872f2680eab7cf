package idemotel_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/idem"
	idemotel "github.com/idemkit/idem/otel"
)

// Trace a payment whose first attempt meets a 503: one span for the call,
// one client span per attempt under it, the second with its resend count.
func Example() {
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(http.StatusServiceUnavailable) // a flaky first attempt
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	spans := tracetest.NewSpanRecorder() // in production, an exporter
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(context.Background())

	t := &idem.Transport{Base: idemotel.NewBase(nil)}
	client := &http.Client{Transport: idemotel.NewTransport(t, idemotel.WithTracerProvider(tp))}
	resp, err := client.Post(srv.URL+"/v1/payments", "application/json",
		strings.NewReader(`{"amount": 4200, "currency": "usd", "customer": "cus_123"}`))
	if err != nil {
		log.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()

	for _, s := range spans.Ended() {
		fmt.Printf("%s (%s)", s.Name(), s.SpanKind())
		for _, kv := range s.Attributes() {
			switch kv.Key {
			case "http.request.resend_count", "http.response.status_code", "idem.attempts":
				fmt.Printf(" %s=%s", kv.Key, kv.Value.String())
			case idemotel.KeyAttribute:
				fmt.Printf(" %s=…", kv.Key)
			}
		}
		fmt.Println()
	}
	// Output:
	// HTTP POST (client) idempotency.key=… http.response.status_code=503
	// HTTP POST (client) http.request.resend_count=1 idempotency.key=… http.response.status_code=201
	// idem POST (internal) idempotency.key=… idem.attempts=2 http.response.status_code=201
}
