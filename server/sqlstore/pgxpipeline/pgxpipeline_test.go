package pgxpipeline_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
	_ "github.com/idemkit/idem/server/sqlstore/pgxpipeline"
)

// The tests of sqlstore run piped in server/sqlstore (TestPgxPiped), which
// imports this package: the two runs share no database connections.

// TestRoundTrips pins the round trips of a keyed first execution whose
// handler writes one row, on one connection whose statements are
// prepared: pgstore's, where database/sql alone sends two more in one
// transaction (BEGIN, COMMIT) and one more in two commits (COMMIT).
func TestRoundTrips(t *testing.T) {
	for _, tt := range []struct {
		oneTx bool
		want  int64
	}{
		{false, 4}, // the claim; BEGIN; the INSERT; the completion with the COMMIT
		{true, 3},  // BEGIN with the claim; the INSERT; the completion with the COMMIT
	} {
		t.Run(fmt.Sprintf("OneTransaction=%v", tt.oneTx), func(t *testing.T) {
			counter := new(server.DBRoundTrips) // each query, batch, prepare and connection is one
			cfg, err := pgx.ParseConfig(pgtest.SchemaURL(t))
			require.NoError(t, err)
			cfg.Tracer = counter
			db := stdlib.OpenDB(*cfg)
			t.Cleanup(func() { db.Close() })
			db.SetMaxOpenConns(1)
			ctx := context.Background()
			require.NoError(t, sqlstore.Migrate(ctx, db))
			_, err = db.ExecContext(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, key text NOT NULL)`)
			require.NoError(t, err)
			h := idempotency.Middleware(sqlstore.New(db), idempotency.Options{OneTransaction: tt.oneTx})(http.HandlerFunc(
				func(w http.ResponseWriter, r *http.Request) {
					tx, _ := sqlstore.TxFromContext(r.Context())
					if _, err := tx.ExecContext(r.Context(), `INSERT INTO orders (key) VALUES ($1)`, r.Header.Get("Idempotency-Key")); err != nil {
						http.Error(w, err.Error(), http.StatusInternalServerError)
						return
					}
					w.WriteHeader(http.StatusCreated)
				}))
			send := func(key string) int {
				r := httptest.NewRequestWithContext(idempotency.WithClientID(ctx, "cli_a"), "POST", "/orders", strings.NewReader(`{}`))
				r.Header.Set("Idempotency-Key", key)
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, r)
				return rec.Code
			}
			require.Equal(t, http.StatusCreated, send("warm-up")) // prepares the statements
			for i := range 3 {
				before := counter.Total()
				require.Equal(t, http.StatusCreated, send(fmt.Sprint("key-", i)))
				require.Equal(t, tt.want, counter.Total()-before, "round trips of first execution %d", i)
			}
			var n int
			require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n))
			require.Equal(t, 4, n)
		})
	}
}
