package server

import (
	"log/slog"
	"math/rand/v2"
	"net/http"
	"time"
)

// Faults make the payments API's own answers fail, vanish or lag, as a
// real service's sometimes do, so that a client author can watch idem's
// retries against the real server (idem-server's -fail-after-write,
// -drop-answer and -hold-after-write flags) and the chaos test can attack
// the library's edges. The zero value injects nothing. Faults act on keyed
// payments only.
type Faults struct {
	// HoldAfterWrite holds a payment's transaction open this long after
	// its insert, before the handler answers: the key's retention must
	// still count from the completion, however long the transaction was
	// open. HoldRate is the share of payments held; zero with a
	// HoldAfterWrite: all of them.
	HoldAfterWrite time.Duration
	HoldRate       float64
	// FailAfterWriteRate is the share of payments answered 500 after the
	// card was charged and the payment inserted: the insert rolls back
	// with the key's release, and the client's retry with the key runs
	// again under the same operation, charged once.
	FailAfterWriteRate float64
	// DropAnswerRate is the share of payments whose answer is lost after
	// it was stored: the connection is closed without it, and the client's
	// retry with the key gets the replay.
	DropAnswerRate float64
}

// hit draws whether a fault of the given rate strikes.
func hit(rate float64) bool {
	return rate > 0 && rand.Float64() < rate
}

// afterWrite runs the faults of a payment just inserted in the key's unit
// of work; it reports whether the payment must fail with a 500. A hold
// does not end with the client, as a slow handler's work would not.
func (f Faults) afterWrite(log *slog.Logger) (fail bool) {
	if f.HoldAfterWrite > 0 && (f.HoldRate == 0 || hit(f.HoldRate)) {
		log.Info("payments: holding the transaction after the payment's insert (Faults.HoldAfterWrite)", "hold", f.HoldAfterWrite)
		time.Sleep(f.HoldAfterWrite)
	}
	return hit(f.FailAfterWriteRate)
}

// dropAnswers wraps the keyed payments route: the answers of a share of
// its requests are stored as usual but never sent, the connection closed
// instead.
func (f Faults) dropAnswers(next http.Handler) http.Handler {
	if f.DropAnswerRate <= 0 {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !hit(f.DropAnswerRate) {
			next.ServeHTTP(w, r)
			return
		}
		next.ServeHTTP(discard{make(http.Header)}, r)
		panic(http.ErrAbortHandler) // net/http closes the connection, unanswered
	})
}

// discard is a ResponseWriter that sends nothing.
type discard struct{ h http.Header }

func (d discard) Header() http.Header         { return d.h }
func (d discard) Write(p []byte) (int, error) { return len(p), nil }
func (d discard) WriteHeader(int)             {}
