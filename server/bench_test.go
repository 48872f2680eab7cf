package server

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// BenchmarkServerMemory measures POST /v1/payments through the whole
// reference server on the in-memory storage, called in process (no client
// connection; the charge still goes to the fake processor over loopback
// HTTP, as in production): a first execution (claim, charge, payment,
// completion), a replay, and the same payment without the idempotency layer
// (Config.NoIdempotency), the baseline of the first. The middleware's own
// cost, without the payments API, is measured in package idempotency.
func BenchmarkServerMemory(b *testing.B) {
	newServer := func(b *testing.B, cfg Config) *Server {
		cfg.Storage = NewMemoryStorage().Storage()
		cfg.APIKeys = testAPIKeys
		cfg.Logger = testLogger(b)
		srv, err := New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { srv.Close() })
		return srv
	}
	request := func(key string) *http.Request {
		r := httptest.NewRequest("POST", "/v1/payments", strings.NewReader(payment))
		r.Header.Set("Authorization", "Bearer "+tokenA)
		r.Header.Set("Content-Type", "application/json")
		if key != "" {
			r.Header.Set("Idempotency-Key", key)
		}
		return r
	}
	serve := func(b *testing.B, h http.Handler, key string) {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, request(key))
		if w.Code != http.StatusCreated {
			b.Fatalf("%d %s", w.Code, w.Body)
		}
	}
	b.Run("first", func(b *testing.B) {
		srv := newServer(b, Config{})
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i++
			serve(b, srv, fmt.Sprint("k", i))
		}
	})
	b.Run("replay", func(b *testing.B) {
		srv := newServer(b, Config{})
		serve(b, srv, "replayed")
		b.ReportAllocs()
		for b.Loop() {
			serve(b, srv, "replayed")
		}
	})
	b.Run("unkeyed", func(b *testing.B) {
		srv := newServer(b, Config{NoIdempotency: true})
		b.ReportAllocs()
		for b.Loop() {
			serve(b, srv, "")
		}
	})
}
