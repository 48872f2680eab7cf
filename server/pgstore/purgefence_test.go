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

// TestPurgeSparesKeyOfOneTxRequest (found by a review): the fence of a
// claim in one transaction is the key row another claim left (the completion's INSERT
// ... ON CONFLICT DO NOTHING). Nothing bounds how long a one-transaction
// request runs (it has no lease), so that row can expire and be purged
// while it runs, and then the completion inserts the key and commits: two
// operations committed for one key, both clients told 201.
//
// Sequence: A (route with OneTransaction) claims key k, writes its row, and
// is held. B (a route without the option, Retention 50 ms) claims k in its
// own commit, writes its row, and completes 201. 50 ms later the key has
// expired and Purge deletes it. A is let go: its completion finds no row,
// inserts k completed, commits: 201. That was two rows for k; the purge
// now passes over a key whose one-transaction lock is held (PurgeSQL), so
// A's completion still finds B's row and commits nothing.
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
	require.Equal(t, 201, send(b), "B, in a commit of its own, while A holds k in one transaction")
	time.Sleep(200 * time.Millisecond) // B's key expires (Retention 50 ms)
	n, err := store.Purge(context.Background(), 100)
	require.NoError(t, err)
	t.Logf("purged %d", n)
	close(release)
	statusA := <-first
	var rows int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM writes WHERE name LIKE 'k/%'`).Scan(&rows))
	t.Logf("A got %d; rows committed for k: %d", statusA, rows)
	if rows > 1 {
		t.Errorf("%d operations committed for one key (A got %d, B got 201)", rows, statusA)
	}
}
