//go:build unix

package server

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/server/storetest"
)

// BenchmarkServerSealed measures a first execution of POST /v1/payments
// through the whole reference server on the in-memory storage, as
// BenchmarkServerMemory's first, with Config.SealKeys off and on: the
// share of a keyed first execution that sealing takes, the database
// aside. Besides ns/op it reports the process's CPU time per op
// (cpu-ns/op), the server's and its fake processor's, which moves less
// than the wall time on a shared machine.
func BenchmarkServerSealed(b *testing.B) {
	for _, seal := range []bool{false, true} {
		b.Run(fmt.Sprintf("seal=%s", map[bool]string{false: "off", true: "on"}[seal]), func(b *testing.B) {
			cfg := Config{Storage: NewMemoryStorage().Storage(), APIKeys: testAPIKeys, Logger: testLogger(b)}
			if seal {
				cfg.SealKeys = storetest.SealKeys(b, "k1")
			}
			srv, err := New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { srv.Close() })
			b.ReportAllocs()
			start := processCPU(b)
			i := 0
			for b.Loop() {
				i++
				r := httptest.NewRequest("POST", "/v1/payments", strings.NewReader(payment))
				r.Header.Set("Authorization", "Bearer "+tokenA)
				r.Header.Set("Content-Type", "application/json")
				r.Header.Set("Idempotency-Key", fmt.Sprint("k", i))
				w := httptest.NewRecorder()
				srv.ServeHTTP(w, r)
				if w.Code != http.StatusCreated {
					b.Fatalf("%d %s", w.Code, w.Body)
				}
			}
			b.ReportMetric(float64(processCPU(b)-start)/float64(b.N), "cpu-ns/op")
		})
	}
}

// processCPU returns the CPU time of the process so far.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
