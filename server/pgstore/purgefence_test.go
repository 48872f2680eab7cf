package pgstore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// TestPurgeSparesKeyOfOneTxRequest: a request in one transaction (A)
// holds key k, with no row, for as long as it runs (it has no lease). A
// request with k from a route without the option (B, Retention 50 ms)
// respects the hold: 409, nothing written. The purge that runs meanwhile
// passes over the key A holds (PurgeSQL). A completes alone: one row for
// k. (Before claims in commits of their own respected the hold, B claimed
// k and completed 201, its key expired and was purged while A ran, and A
// then committed k again: two operations for one key, both told 201.)
func TestPurgeSparesKeyOfOneTxRequest(t *testing.T) {
	store, pool := newStore(t, nil)
	var attempt atomic.Int64
	entered, release := make(chan struct{}), make(chan struct{})
	handler := func(hold bool) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tx, err := pgstore.Tx(r.Context())
			if err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			if err := insert(r.Context(), tx, fmt.Sprintf("k/%d", attempt.Add(1))); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
			if hold {
				close(entered)
				<-release
			}
			w.WriteHeader(201)
		})
	}
	a := idempotency.Middleware(store, idempotency.Options{OneTransaction: true})(handler(true))
	b := idempotency.Middleware(store, idempotency.Options{Retention: 50 * time.Millisecond})(handler(false))
	send := func(h http.Handler) int {
		r := httptest.NewRequestWithContext(idempotency.WithClientID(context.Background(), "cli_a"),
			"POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
		r.Header.Set("Idempotency-Key", "k")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		return rec.Code
	}
	first := make(chan int, 1)
	go func() { first <- send(a) }()
	<-entered
	statusB := send(b)
	if statusB != http.StatusConflict {
		close(release)
		<-first
		t.Fatalf("B, in a commit of its own, while A holds k in one transaction: %d, want 409", statusB)
	}
	n, err := store.Purge(context.Background(), 100)
	require.NoError(t, err)
	t.Logf("purged %d", n)
	close(release)
	statusA := <-first
	var rows int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM writes WHERE name LIKE 'k/%'`).Scan(&rows))
	t.Logf("A got %d; rows committed for k: %d", statusA, rows)
	if rows != 1 || statusA != http.StatusCreated {
		t.Errorf("%d operations committed for one key, A got %d; want 1, 201", rows, statusA)
	}
}
