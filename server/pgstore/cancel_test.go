package pgstore_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// TestClientGoneDuringClaimLeavesNoKeyStarted serves requests whose client goes away
// at random points of the claim's round trip. PostgreSQL may commit a
// claim whose answer pgx no longer waits for; the middleware must not
// leave such a key started with no owner (a 409 to every retry until the
// lease runs out, and for good without a lease).
func TestClientGoneDuringClaimLeavesNoKeyStarted(t *testing.T) {
	s, pool := newStore(t, nil)
	opts := idempotency.Options{LockTimeout: -1, Logger: slog.New(slog.DiscardHandler)}
	h := idempotency.Middleware(s, opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	ctx := context.Background()
	for i := range 300 {
		cctx, cancel := context.WithTimeout(idempotency.WithClientID(ctx, "cli_a"), time.Duration(rand.IntN(1500))*time.Microsecond)
		r := httptest.NewRequestWithContext(cctx, "POST", "/v1/orders", strings.NewReader("{}"))
		r.Header.Set("Idempotency-Key", fmt.Sprintf("k%d", i))
		h.ServeHTTP(httptest.NewRecorder(), r)
		cancel()
	}
	var stuck int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE status = 'started'`).Scan(&stuck); err != nil {
		t.Fatal(err)
	}
	if stuck > 0 {
		t.Errorf("%d keys left started by requests that ended: their retries get 409 for good", stuck)
	}
}
