package server

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func BenchmarkFingerprint(b *testing.B) {
	body := []byte(`{"amount": 4200, "currency": "usd", "customer": "cus_123", "metadata": {"order": "o_1", "note": "x"}}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := Fingerprint(FingerprintVersion, "POST", "/v1/payments", "", "application/json", body); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkIdempotencyMemory measures the middleware's own cost on the
// memory store: a first request (claim, handler, complete) and a replay.
func BenchmarkIdempotencyMemory(b *testing.B) {
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	h := Idempotency(NewMemoryStore(), IdempotencyOptions{ClientID: func(*http.Request) (string, bool) { return "c", true }})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			w.Write([]byte(`{"id":"pay_1"}`))
		}))
	request := func(key string) *http.Request {
		r := httptest.NewRequest("POST", "/v1/payments", strings.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		r.Header.Set("Idempotency-Key", key)
		return r
	}
	b.Run("first", func(b *testing.B) {
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i++
			w := httptest.NewRecorder()
			h.ServeHTTP(w, request(fmt.Sprint("k", i)))
			if w.Code != http.StatusCreated {
				b.Fatal(w.Code)
			}
		}
	})
	b.Run("replay", func(b *testing.B) {
		h.ServeHTTP(httptest.NewRecorder(), request("replayed"))
		b.ReportAllocs()
		for b.Loop() {
			w := httptest.NewRecorder()
			h.ServeHTTP(w, request("replayed"))
			if w.Code != http.StatusCreated {
				b.Fatal(w.Code)
			}
		}
	})
}
