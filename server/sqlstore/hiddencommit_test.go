package sqlstore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
	"github.com/idemkit/idem/server/sqlstore/internal/sqlstoretest"
)

// Review (found by a review): a COMMIT that the handler's Tx lets through. keysql.Scan
// is the only guard sqlstore has (database/sql shows no transaction status,
// so nothing catches the COMMIT after it ran, unlike pgstore's TxStatus
// checks). Two texts get past it:
//
//   - "CREATE ...; COMMIT": Scan stops reading at CREATE (documented in
//     keysql.Scan, but sqlstore's "caught after it ran" does not exist);
//   - standard_conforming_strings turned off by the handler with
//     set_config (not a SET, so Facts.Set is not raised either): Scan reads
//     the literal a, backslash, two quotes, as two strings, PostgreSQL as one, and the COMMIT after it,
//     which Scan believes inside a string, runs.
//
// Either way the handler's writes are committed while the key is not: the
// handler then answers 503, the middleware "rolls back" (a no-op), the
// retry ran again and committed a second row. Scan now reads past a
// CREATE and refuses text that names standard_conforming_strings: one row.
func TestHiddenCommitRefused(t *testing.T) { forBoth(t, testHiddenCommitRefused) }

func testHiddenCommitRefused(t *testing.T) {
	for _, driver := range []string{"pgx"} {
		for _, oneTx := range []bool{true, false} {
			for name, sneak := range map[string][]string{
				"create then commit": {`CREATE TEMP TABLE IF NOT EXISTS review_t (x int); COMMIT`},
				"scs off": {`SELECT set_config('standard_conforming_strings', 'off', true)`,
					`SELECT 'a\''; COMMIT; --'`},
			} {
				t.Run(fmt.Sprintf("%s/onetx=%v/%s", driver, oneTx, name), func(t *testing.T) {
					db := sqlstoretest.Open(t, driver)
					store := sqlstore.New(db)
					var attempt atomic.Int64
					h := idempotency.Middleware(store, idempotency.Options{OneTransaction: oneTx})(http.HandlerFunc(
						func(w http.ResponseWriter, r *http.Request) {
							tx, ok := sqlstore.TxFromContext(r.Context())
							if !ok {
								http.Error(w, "no tx", 500)
								return
							}
							n := attempt.Add(1)
							if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, fmt.Sprintf("k/%d", n)); err != nil {
								http.Error(w, err.Error(), 500)
								return
							}
							if n == 1 {
								for _, q := range sneak {
									if _, err := tx.ExecContext(r.Context(), q); err != nil {
										t.Logf("sneak %q refused: %v", q, err)
										http.Error(w, err.Error(), http.StatusServiceUnavailable)
										return
									}
								}
								w.WriteHeader(503) // not stored: "nothing commits"
								return
							}
							w.WriteHeader(201)
						}))
					send := func() int {
						r := httptest.NewRequestWithContext(idempotency.WithClientID(context.Background(), "cli_a"),
							"POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
						r.Header.Set("Idempotency-Key", "k")
						rec := httptest.NewRecorder()
						h.ServeHTTP(rec, r)
						return rec.Code
					}
					assert.Equal(t, 503, send())
					assert.Equal(t, 201, send())
					var n int
					require.NoError(t, db.QueryRowContext(context.Background(),
						`SELECT count(*) FROM writes WHERE name LIKE 'k/%'`).Scan(&n))
					assert.Equal(t, 1, n, "rows committed for one key (a 503 then a 201)")
				})
			}
		}
	}
}
