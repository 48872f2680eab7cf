package pgstore_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/drivertest"
	"github.com/idemkit/idem/server/pgstore"
)

// The tests below are drivertest's, which sqlstore runs too, on pgx.

func TestSmallPoolAnswersEveryRequest(t *testing.T) {
	drivertest.SmallPoolAnswersEveryRequest(t, smallPoolService)
}

func TestSmallPoolStopsGracefully(t *testing.T) {
	drivertest.SmallPoolStopsGracefully(t, smallPoolService)
}

// smallPoolService is drivertest's NewService on pgstore.
func smallPoolService(t *testing.T, level string, conns int, opts idempotency.Options, hold http.HandlerFunc) (http.Handler, func() int) {
	s := newService(t, opts, func(cfg *pgxpool.Config) { cfg.MaxConns = int32(conns); withIsolation(level)(cfg) },
		func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
			if err := insert(r.Context(), tx, r.Header.Get("Idempotency-Key")); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			hold(w, r)
		})
	return s.h, func() int { return int(s.pool.Stat().AcquiredConns()) }
}

// driverPool is pool as a drivertest.Pool.
type driverPool struct{ *pgxpool.Pool }

func (p driverPool) Exec(ctx context.Context, sql string) error {
	_, err := p.Pool.Exec(ctx, sql)
	return err
}

func (p driverPool) Count(ctx context.Context, sql string) (n int, err error) {
	err = p.QueryRow(ctx, sql).Scan(&n)
	return n, err
}

func (p driverPool) CreateOpenKeysIndex(ctx context.Context) error {
	return pgstore.CreateOpenKeysIndex(ctx, p.Pool)
}

func (p driverPool) Stats(ctx context.Context) error {
	_, err := pgstore.New(p.Pool).Stats(ctx)
	return err
}
