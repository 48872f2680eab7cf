package pgstore_test

import (
	"context"
	"testing"

	"github.com/idemkit/idem/server/pgstore"
	"github.com/idemkit/idem/server/storetest"
)

// TestConformance runs the conformance suite of idempotency.Store on
// pgstore: durable, with AsyncClaims, with BatchClaims, and with both; and
// on a database whose default_transaction_isolation is serializable,
// where the store's own statements and the handlers' transactions run
// under SERIALIZABLE. A business write is a row inserted through the
// request's transaction (TxFromContext), as a handler's.
func TestConformance(t *testing.T) {
	for _, tt := range []struct {
		name         string
		async, batch bool
		isolation    string // default_transaction_isolation; "": the server's
	}{
		{"durable", false, false, ""},
		{"async claims", true, false, ""},
		{"batch claims", false, true, ""},
		{"batch async claims", true, true, ""},
		{"serializable", false, false, "serializable"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			storetest.Exercise(t, func(t *testing.T) storetest.Backend {
				pool := widePool(t, 8, withIsolation(tt.isolation))
				s := pgstore.New(pool)
				s.AsyncClaims, s.BatchClaims = tt.async, tt.batch
				return storetest.Backend{
					Store: s,
					Write: write,
					Written: func(ctx context.Context, name string) (bool, error) {
						return written(ctx, pool, name)
					},
				}
			})
		})
	}
}
