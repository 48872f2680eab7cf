package pgstore

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// scanRowSQL returns one row of the key table's column types, its values
// NULL in row 1 and set in row 2 ($1).
const scanRowSQL = `
SELECT 'op'::text, '\x0102'::bytea,
    CASE WHEN $1 = 2 THEN 201 END::integer,
    CASE WHEN $1 = 2 THEN 'application/json' END::text,
    CASE WHEN $1 = 2 THEN '{"Location":"/v1/x"}' END::jsonb,
    CASE WHEN $1 = 2 THEN '\x7b7d' END::bytea,
    '2026-12-06 10:00:00.123456+00'::timestamptz, 5::bigint,
    CASE WHEN $1 = 2 THEN '2026-12-07 10:00:00+00' END::timestamptz, $1 = 2`

// scanRow is one row of scanRowSQL.
type scanRow struct {
	op          string
	hash, body  []byte
	status      *int32
	contentType *string
	header      map[string]string
	at          time.Time
	n           int64
	expires     *time.Time
	set         bool
}

func (r *scanRow) dests() []any {
	return []any{&r.op, &r.hash, &r.status, &r.contentType, &r.header, &r.body, &r.at, &r.n, &r.expires, &r.set}
}

// TestScanPlansScanAsPgxDoes: a row scanned with kept plans is the row
// pgx's own Scan gives, in every query mode (binary and text results, one
// scanPlans across them all), for NULL and set values alike.
func TestScanPlansScanAsPgxDoes(t *testing.T) {
	ctx := context.Background()
	var plans scanPlans
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.DefaultQueryExecMode = mode })
		for _, n := range []int{2, 1, 2} {
			var want, got scanRow
			require.NoError(t, pool.QueryRow(ctx, scanRowSQL, n).Scan(want.dests()...), "%v, row %d", mode, n)
			require.NoError(t, pool.QueryRow(ctx, scanRowSQL, n).Scan(plans.into(got.dests()...)), "%v, row %d", mode, n)
			assert.Equal(t, want, got, "%v, row %d", mode, n)
			assert.Equal(t, n == 2, got.status != nil && got.header["Location"] == "/v1/x", "%v, row %d", mode, n)
		}
	}
}

// TestScanPlansPlanNewDestinations: destinations of another type, or
// another number of them, are planned anew or refused, never scanned with
// plans made for others.
func TestScanPlansPlanNewDestinations(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.PoolWith(t, nil)
	var plans scanPlans
	var s string
	var n int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT 'a'::text, 7::bigint`).Scan(plans.into(&s, &n)))
	assert.Equal(t, "a", s)
	assert.Equal(t, int64(7), n)
	require.NoError(t, pool.QueryRow(ctx, `SELECT 'b'::text, 8::integer`).Scan(plans.into(&s, &n)), "another column type")
	assert.Equal(t, int64(8), n)
	var sp *string
	var f float64
	require.NoError(t, pool.QueryRow(ctx, `SELECT NULL::text, 7::bigint`).Scan(plans.into(&sp, &f)))
	assert.Nil(t, sp)
	assert.Equal(t, float64(7), f)
	assert.Error(t, pool.QueryRow(ctx, `SELECT NULL::text, 7::bigint`).Scan(plans.into(&s, &n)), "NULL into a string")
	assert.Error(t, pool.QueryRow(ctx, `SELECT 'a'::text`).Scan(plans.into(&s, &n)), "one column, two destinations")
}

// TestScanPlansShared: goroutines scanning through one scanPlans, on a
// pool with binary results and one with text results, so that the plans
// are replaced while others scan with them, each get their own rows (run
// with -race).
func TestScanPlansShared(t *testing.T) {
	ctx := context.Background()
	pools := []*pgxpool.Pool{pgtest.PoolWith(t, nil), pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	})}
	var plans scanPlans
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 50 {
				n := 1 + (g+i)%2
				var got scanRow
				if err := pools[i%2].QueryRow(ctx, scanRowSQL, n).Scan(plans.into(got.dests()...)); err != nil {
					t.Error(err)
					return
				}
				if got.set != (n == 2) || (got.status != nil) != (n == 2) || got.n != 5 {
					t.Errorf("row %d scanned as %+v", n, got)
					return
				}
			}
		})
	}
	wg.Wait()
}
