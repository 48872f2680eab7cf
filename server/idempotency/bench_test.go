package idempotency

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

func BenchmarkFingerprint(b *testing.B) {
	benchmarkFingerprintBody(b, []byte(`{"amount": 4200, "currency": "usd", "customer": "cus_123", "metadata": {"order": "o_1", "note": "x"}}`))
}

// nestedBody returns a JSON document of depth nested objects, each
// {"b":<the next level>,"a":1}, or {"a":1,"b":<the next level>} if sorted,
// around a string that pads the document to size bytes (when the levels
// alone are shorter). The canonical form of either shape is the sorted one.
func nestedBody(depth, size int, sorted bool) []byte {
	open, close := `{"b":`, `,"a":1}`
	if sorted {
		open, close = `{"a":1,"b":`, `}`
	}
	pad := max(size-depth*(len(open)+len(close))-2, 0)
	body := make([]byte, 0, depth*(len(open)+len(close))+pad+2)
	for range depth {
		body = append(body, open...)
	}
	body = append(body, '"')
	body = append(body, strings.Repeat("x", pad)...)
	body = append(body, '"')
	for range depth {
		body = append(body, close...)
	}
	return body
}

// benchmarkFingerprintBody fingerprints body as a JSON request.
func benchmarkFingerprintBody(b *testing.B, body []byte) {
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := Fingerprint("POST", "/v1/payments", "", "application/json", body); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFingerprintNestedUnsorted fingerprints a 1 MiB body of 999
// nested objects whose members are out of order at every level
// ({"b":{"b":…,"a":1},"a":1}): the shape that once cost O(depth × size).
func BenchmarkFingerprintNestedUnsorted(b *testing.B) {
	benchmarkFingerprintBody(b, nestedBody(999, 1<<20, false))
}

// BenchmarkFingerprintNestedSorted fingerprints the same document with its
// members already in order at every level ({"a":1,"b":{"a":1,"b":…}}).
func BenchmarkFingerprintNestedSorted(b *testing.B) {
	benchmarkFingerprintBody(b, nestedBody(999, 1<<20, true))
}

// discardWriter is a ResponseWriter that keeps the status and drops the
// body, its header map cleared for each request: the cheapest writer, so
// that what BenchmarkKeyedRequest measures is the handler's and the
// middleware's.
type discardWriter struct {
	header http.Header
	status int
}

func (w *discardWriter) Header() http.Header         { return w.header }
func (w *discardWriter) WriteHeader(status int)      { w.status = status }
func (w *discardWriter) Write(p []byte) (int, error) { return len(p), nil }

// BenchmarkKeyedRequest measures the middleware's own work on a keyed
// POST served in process, on the memory store, against the handler alone
// (op=alone): a first execution (claim, handler, completion) and a
// replay. The handler reads the body and answers as the reference server
// does: 201, a Location and a payment of about 250 bytes. The logger is a
// text handler at Warn, as a service runs it, so that what the middleware
// prepares for logs it never writes is counted. First executions go to a
// new store every 4096 keys, so that the store's size does not depend on
// b.N. The difference of op=first and op=alone is the middleware's cost
// (the memory store's included); the HTTP server's and the database's
// come on top in a service.
func BenchmarkKeyedRequest(b *testing.B) {
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			b.Fatal(err)
		}
		id := "0d9c6a52-1f0e-5a4e-9b7c-2f1d3e4a5b6c"
		if c, ok := ClaimFromContext(r.Context()); ok {
			id = c.OperationID
		}
		w.Header().Set("Location", "/v1/payments/pay_"+id)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":"pay_`+id+`","amount":4200,"currency":"usd","customer":"cus_123","charge":"ch_`+id+
			`","created":"2026-12-03T10:00:00Z"}`+"\n")
	})
	ctx := WithClientID(context.Background(), "c")
	base := httptest.NewRequestWithContext(ctx, "POST", "/v1/payments", nil)
	base.Header.Set("Content-Type", "application/json")
	base.Header.Set("Idempotency-Key", "k")
	base.Header.Set("Repeatability-First-Sent", time.Now().UTC().Format(http.TimeFormat))
	base.ContentLength = int64(len(body))
	var rd strings.Reader
	w := &discardWriter{header: make(http.Header)}
	serve := func(b *testing.B, h http.Handler, key string) {
		base.Header["Idempotency-Key"][0] = key
		rd.Reset(body)
		r := *base
		r.Body = io.NopCloser(&rd)
		clear(w.header)
		h.ServeHTTP(w, &r)
		if w.status != http.StatusCreated {
			b.Fatalf("status %d", w.status)
		}
	}
	newHandler := func() http.Handler {
		log := slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelWarn}))
		return Middleware(NewMemoryStore(), Options{Logger: log})(handler)
	}
	b.Run("op=alone", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			serve(b, handler, "k")
		}
	})
	b.Run("op=first", func(b *testing.B) {
		h := newHandler()
		keys := make([]string, 4096)
		for i := range keys {
			keys[i] = "k" + strconv.Itoa(i)
		}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if i++; i == len(keys) {
				i, h = 0, newHandler()
			}
			serve(b, h, keys[i])
		}
	})
	b.Run("op=replay", func(b *testing.B) {
		h := newHandler()
		serve(b, h, "replayed")
		b.ReportAllocs()
		for b.Loop() {
			serve(b, h, "replayed")
		}
	})
}
