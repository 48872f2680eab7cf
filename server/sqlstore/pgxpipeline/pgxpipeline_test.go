package pgxpipeline_test

import (
	"context"
	"database/sql"
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
// prepared: pgstore's three, where database/sql alone sends two more
// (BEGIN, COMMIT). In two commits the BEGIN travels with the handler's
// first statement when that is an ExecContext with arguments, as pgstore's
// does; with an INSERT of literals (no arguments: pgx's stdlib sends it in
// the simple protocol, alone), the BEGIN goes before it, alone.
func TestRoundTrips(t *testing.T) {
	for _, tt := range []struct {
		oneTx    bool
		literals bool
		want     int64
	}{
		{false, false, 3}, // the claim; BEGIN with the INSERT; the completion with the COMMIT
		{true, false, 3},  // BEGIN with the claim; the INSERT; the completion with the COMMIT
		{false, true, 4},  // the claim; BEGIN; the INSERT; the completion with the COMMIT
	} {
		t.Run(fmt.Sprintf("OneTransaction=%v,literals=%v", tt.oneTx, tt.literals), func(t *testing.T) {
			counter := new(server.DBRoundTrips) // each query, batch, prepare and connection is one
			cfg := mustConfig(t)
			cfg.Tracer = counter
			db := stdlib.OpenDB(*cfg)
			t.Cleanup(func() { db.Close() })
			db.SetMaxOpenConns(1)
			ctx := context.Background()
			require.NoError(t, sqlstore.Migrate(ctx, db))
			_, err := db.ExecContext(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, key text NOT NULL)`)
			require.NoError(t, err)
			h := idempotency.Middleware(sqlstore.New(db), idempotency.Options{OneTransaction: tt.oneTx})(http.HandlerFunc(
				func(w http.ResponseWriter, r *http.Request) {
					tx, _ := sqlstore.TxFromContext(r.Context())
					query, args := `INSERT INTO orders (key) VALUES ($1)`, []any{r.Header.Get("Idempotency-Key")}
					if tt.literals {
						query, args = `INSERT INTO orders (key) VALUES ('`+r.Header.Get("Idempotency-Key")+`')`, nil
					}
					if _, err := tx.ExecContext(r.Context(), query, args...); err != nil {
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

// TestFirstExecArguments: a first ExecContext, which a piped transaction
// sends with its BEGIN, takes the arguments it takes alone on pgx's
// stdlib: sql.Named values (pgx's stdlib goes by position), pgx's query
// options (a QueryExecMode, pgx.NamedArgs), and values of types pgx
// encodes itself.
func TestFirstExecArguments(t *testing.T) {
	db := stdlib.OpenDB(*mustConfig(t))
	t.Cleanup(func() { db.Close() })
	ctx := context.Background()
	require.NoError(t, sqlstore.Migrate(ctx, db))
	_, err := db.ExecContext(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, key text NOT NULL, n int)`)
	require.NoError(t, err)
	for _, tt := range []struct {
		name  string
		query string
		args  func(key string) []any
	}{
		{"sql.Named", `INSERT INTO orders (key, n) VALUES ($1, $2)`, func(key string) []any {
			return []any{sql.Named("key", key), sql.Named("n", 7)}
		}},
		{"simple protocol", `INSERT INTO orders (key, n) VALUES ($1, $2)`, func(key string) []any {
			return []any{pgx.QueryExecModeSimpleProtocol, key, 7}
		}},
		{"pgx.NamedArgs", `INSERT INTO orders (key, n) VALUES (@key, @n)`, func(key string) []any {
			return []any{pgx.NamedArgs{"key": key, "n": 7}}
		}},
		{"a pointer and an int64", `INSERT INTO orders (key, n) VALUES ($1, $2)`, func(key string) []any {
			return []any{&key, int64(7)}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			key := "args-" + strings.ReplaceAll(tt.name, " ", "-")
			h := idempotency.Middleware(sqlstore.New(db), idempotency.Options{})(http.HandlerFunc(
				func(w http.ResponseWriter, r *http.Request) {
					tx, _ := sqlstore.TxFromContext(r.Context())
					res, err := tx.ExecContext(r.Context(), tt.query, tt.args(key)...)
					if err != nil {
						http.Error(w, err.Error(), http.StatusInternalServerError)
						return
					}
					if n, _ := res.RowsAffected(); n != 1 {
						http.Error(w, fmt.Sprint("rows affected: ", n), http.StatusInternalServerError)
						return
					}
					w.WriteHeader(http.StatusCreated)
				}))
			r := httptest.NewRequestWithContext(idempotency.WithClientID(ctx, "cli_a"), "POST", "/orders", strings.NewReader(`{}`))
			r.Header.Set("Idempotency-Key", key)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, r)
			require.Equal(t, http.StatusCreated, rec.Code, rec.Body.String())
			var n int
			require.NoError(t, db.QueryRowContext(ctx, `SELECT n FROM orders WHERE key = $1`, key).Scan(&n))
			require.Equal(t, 7, n)
		})
	}
}

func mustConfig(t *testing.T) *pgx.ConnConfig {
	cfg, err := pgx.ParseConfig(pgtest.SchemaURL(t))
	require.NoError(t, err)
	return cfg
}
