//go:build unix

package idempotency

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"
)

// cpuTime returns the CPU time of the process so far, user and system.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportCPU reports the process's CPU time per op since start, as
// cpu-ns/op: on a shared machine it moves less than the wall time, which
// counts the waits for a CPU too.
func reportCPU(b *testing.B, start time.Duration) {
	b.ReportMetric(float64(cpuTime(b)-start)/float64(b.N), "cpu-ns/op")
}

// BenchmarkMiddleware measures a keyed request through Middleware on the
// memory store, served in process, with sealing off and on (Sealed): a
// first execution (claim, handler, completion: Seal) and a replay (claim:
// Open). The handler answers as the reference server does: 201, a
// Location and a payment of about 250 bytes. Sealing's cost is the
// difference; the store and the HTTP stack of a real server come on top of
// both. First executions go to a new store every 4096 keys, so that the
// store's size does not depend on b.N. Besides ns/op, each reports the
// process's CPU time per op (cpu-ns/op).
func BenchmarkMiddleware(b *testing.B) {
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, _ := ClaimFromContext(r.Context())
		w.Header().Set("Location", "/v1/payments/pay_"+c.OperationID)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"pay_%s","amount":4200,"currency":"usd","customer":"cus_123","charge":"ch_%s","created":"2026-12-03T10:00:00Z"}`+"\n",
			c.OperationID, c.OperationID)
	})
	serve := func(b *testing.B, h http.Handler, key string, want int) {
		r := httptest.NewRequest("POST", "/v1/payments", strings.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		r.Header.Set("Idempotency-Key", key)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r.WithContext(WithClientID(r.Context(), "c")))
		if w.Code != want {
			b.Fatalf("%d %s", w.Code, w.Body)
		}
		io.Copy(io.Discard, w.Body)
	}
	for _, sealed := range []bool{false, true} {
		newHandler := func(b *testing.B) http.Handler {
			var store Store = NewMemoryStore()
			if sealed {
				store = Sealed(store, testSealKeys(b, "k1"))
			}
			return Middleware(store, Options{Logger: slog.New(slog.DiscardHandler), Retention: -1})(handler)
		}
		name := "seal=off"
		if sealed {
			name = "seal=on"
		}
		b.Run("op=first/"+name, func(b *testing.B) {
			h := newHandler(b)
			b.ReportAllocs()
			i := 0
			start := cpuTime(b)
			for b.Loop() {
				i++
				if i%4096 == 0 {
					h = newHandler(b)
				}
				serve(b, h, fmt.Sprint("k", i), http.StatusCreated)
			}
			reportCPU(b, start)
		})
		b.Run("op=replay/"+name, func(b *testing.B) {
			h := newHandler(b)
			serve(b, h, "replayed", http.StatusCreated)
			b.ReportAllocs()
			start := cpuTime(b)
			for b.Loop() {
				serve(b, h, "replayed", http.StatusCreated)
			}
			reportCPU(b, start)
		})
	}
}

// BenchmarkSeal measures Seal and Open of the benchmark's 250-byte payment.
func BenchmarkSeal(b *testing.B) {
	ks := testSealKeys(b, "k1")
	resp := StoredResponse{Status: 201, ContentType: "application/json", Header: map[string]string{"Location": "/v1/payments/pay_1"},
		Body: []byte(strings.Repeat("x", 250))}
	b.Run("seal", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := ks.Seal("c", "k", "op-1", resp); err != nil {
				b.Fatal(err)
			}
		}
	})
	sealed, _ := ks.Seal("c", "k", "op-1", resp)
	b.Run("open", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := ks.Open("c", "k", "op-1", sealed); err != nil {
				b.Fatal(err)
			}
		}
	})
}
