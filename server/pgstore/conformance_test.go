package pgstore_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/pgstore"
	"github.com/idemkit/idem/server/storetest"
)

// TestConformance runs the conformance suite of idempotency.Store on
// pgstore, in every query mode of pgx (the mode a pooler in transaction
// mode needs among them), on a database of the server's defaults and on one whose default_transaction_isolation is serializable,
// where the store's own statements and the handlers' transactions run
// under SERIALIZABLE. A business write is a row inserted through the
// request's transaction (TxFromContext), as a handler's.
func TestConformance(t *testing.T) {
	for _, tt := range []struct {
		name      string
		isolation string // default_transaction_isolation; "": the server's
		mode      pgx.QueryExecMode
	}{
		{"default", "", pgx.QueryExecModeCacheStatement},
		{"serializable", "serializable", pgx.QueryExecModeCacheStatement},
		{"cache_describe", "", pgx.QueryExecModeCacheDescribe},
		{"describe_exec", "", pgx.QueryExecModeDescribeExec},
		{"exec", "", pgx.QueryExecModeExec},
		{"simple_protocol", "", pgx.QueryExecModeSimpleProtocol},
	} {
		t.Run(tt.name, func(t *testing.T) {
			storetest.Exercise(t, func(t *testing.T) storetest.Backend {
				pool := widePool(t, 8, withIsolation(tt.isolation), func(cfg *pgxpool.Config) {
					cfg.ConnConfig.DefaultQueryExecMode = tt.mode
				})
				s := pgstore.New(pool)
				return storetest.Backend{
					Store: s,
					Write: write,
					Written: func(ctx context.Context, name string) (bool, error) {
						return written(ctx, pool, name)
					},
					Elapse: elapseAll(pool),
				}
			})
		})
	}
}
