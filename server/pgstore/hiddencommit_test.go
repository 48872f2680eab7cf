package pgstore_test

import (
	"context"
	"fmt"
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/server/idempotency"
)

// Review (found by a review): pgstore's side of sqlstore's
// TestHiddenCommitRefused (found by a review): keysql.Scan missed a COMMIT after
// standard_conforming_strings is turned off with set_config (Scan reads
// the literal a, backslash, two quotes, as two strings, PostgreSQL as one); pgstore's TxStatus check
// notices afterwards, too late: the rows written before it are committed
// without the key, the handler answers 503, and the retry commits a second
// row. pgstore's docs concede this for a transaction "the handler ended
// itself" (its Conn()), but the guard's documentation says such a text is
// refused before it is sent.
func TestHiddenCommitRefused(t *testing.T) {
	for _, oneTx := range []bool{true, false} {
		t.Run(fmt.Sprintf("onetx=%v", oneTx), func(t *testing.T) {
			var s *service
			s = newService(t, idempotency.Options{OneTransaction: oneTx}, nil,
				func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
					if err := insert(r.Context(), tx, s.row(r, "a")); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
					if s.attempt.Load() == 1 {
						for _, q := range []string{`SELECT set_config('standard_conforming_strings', 'off', true)`,
							`SELECT 'a\''; COMMIT; --'`} {
							if _, err := tx.Exec(r.Context(), q); err != nil {
								t.Logf("sneak %q: %v", q, err)
								break
							}
						}
						w.WriteHeader(503)
						return
					}
					w.WriteHeader(201)
				})
			status, _ := s.send("k")
			if status != 503 {
				t.Logf("first status %d", status)
			}
			status, _ = s.send("k")
			if !(status >= 200 && status < 300) {
				t.Logf("retry status %d", status)
			}
			var n int
			if err := s.pool.QueryRow(context.Background(), `SELECT count(*) FROM writes WHERE name LIKE 'k/%'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n > 1 {
				t.Errorf("%d rows committed for one key", n)
			}
		})
	}
}
