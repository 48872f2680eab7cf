package sqlstoretest

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
	"github.com/idemkit/idem/server/pgstore"
	"github.com/idemkit/idem/server/sqlstore"
)

// openBeside returns a pool of driver on a fresh schema, as Open, and a
// pgx pool on the same schema, closed when the test ends.
func openBeside(t *testing.T, driver string) (*sql.DB, *pgxpool.Pool) {
	t.Helper()
	db, url := OpenURL(t, driver)
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return db, pool
}

// testSideBySide: a replica on pgstore and one on sqlstore serve one key
// table, as during a migration from one to the other: each Migrate finds
// the table the other made; the retries of each key alternate between the
// replicas, and every key's rows commit once, its outcome replayed by
// either; a key released by one is claimed again, resuming its operation,
// by the other; a key whose owner on one stopped renewing is taken over by
// the other.
func testSideBySide(t *testing.T, driver string) {
	db, pool := openBeside(t, driver)
	ctx := context.Background()
	require.NoError(t, pgstore.Migrate(ctx, pool), "pgstore.Migrate on sqlstore's table")
	require.NoError(t, sqlstore.Migrate(ctx, db), "sqlstore.Migrate again")

	ops := map[string]string{} // operation ID of each run, by key
	var released []string      // the operation of the first run of key released
	answer := func(w http.ResponseWriter, r *http.Request, exec func(string, ...any) error) {
		key := r.Header.Get("Idempotency-Key")
		c, _ := idempotency.ClaimFromContext(r.Context())
		if prev, ok := ops[key]; ok && prev != c.OperationID {
			t.Errorf("key %s ran as operation %s, then %s", key, prev, c.OperationID)
		}
		ops[key] = c.OperationID
		if err := exec(`INSERT INTO writes (name) VALUES ($1)`, fmt.Sprintf("%s/%s", key, c.OperationID[:8]+time.Now().Format(".000000"))); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if key == "released" && len(released) == 0 {
			released = append(released, c.OperationID)
			w.WriteHeader(503) // released as failed: only the same request resumes it
			return
		}
		w.Header().Set("Location", "/v1/orders/"+key)
		w.WriteHeader(201)
		fmt.Fprintf(w, `{"key":%q}`, key)
	}
	opts := idempotency.Options{LockTimeout: time.Minute, Retention: time.Hour}
	onSQL := idempotency.Middleware(sqlstore.New(db), opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		answer(w, r, func(q string, args ...any) error {
			tx, err := sqlstore.Tx(r.Context())
			if err == nil {
				_, err = tx.ExecContext(r.Context(), q, args...)
			}
			return err
		})
	}))
	onPgx := idempotency.Middleware(pgstore.New(pool), opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		answer(w, r, func(q string, args ...any) error {
			tx, err := pgstore.Tx(r.Context())
			if err == nil {
				_, err = tx.Exec(r.Context(), q, args...)
			}
			return err
		})
	}))
	replicas := []http.Handler{onSQL, onPgx}
	for i := range 6 {
		key := fmt.Sprint("key-", i)
		for retry := range 4 {
			rec, p := send(replicas[(i+retry)%2], key)
			require.Nil(t, p)
			assert.Equal(t, 201, rec.Code, "key %s, attempt %d", key, retry)
			assert.Equal(t, fmt.Sprintf(`{"key":%q}`, key), rec.Body.String(), "key %s, attempt %d", key, retry)
			assert.Equal(t, "/v1/orders/"+key, rec.Header().Get("Location"))
			assert.Equal(t, retry > 0, rec.Header().Get("Idempotent-Replayed") == "true", "key %s, attempt %d replayed", key, retry)
		}
		assert.Equal(t, 1, rows(t, db, key), "rows of %s", key)
	}
	// Released on one (503), resumed by the other with the same operation.
	for i, first := range replicas {
		key := "released"
		_, err := db.ExecContext(ctx, `DELETE FROM idempotency_keys WHERE idempotency_key = $1`, key)
		require.NoError(t, err)
		delete(ops, key)
		released = nil
		rec, _ := send(first, key)
		assert.Equal(t, 503, rec.Code)
		assert.Equal(t, "released", keyStatus(t, db, key))
		other := replicas[1-i]
		rec, _ = send(other, key)
		assert.Equal(t, 201, rec.Code, "the retry on the other replica")
		assert.Equal(t, "completed", keyStatus(t, db, key))
	}
	// Taken over: a key started by a replica that stopped renewing.
	for i, taker := range replicas {
		key := fmt.Sprint("stale-", i)
		var stores = []idempotency.Store{pgstore.New(pool), sqlstore.New(db)}
		_, err := stores[i].Claim(ctx, idempotency.ClaimRequest{ClientID: "cli_a", Key: key, Method: "POST", Path: "/v1/orders",
			Fingerprint: fingerprintOf(t, key), LockTimeout: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		_, err = db.ExecContext(ctx, keysql.ElapseSQL+` WHERE idempotency_key = $2`, (2 * time.Minute).Microseconds(), key)
		require.NoError(t, err) // its lease ran out
		rec, _ := send(taker, key)
		assert.Equal(t, 201, rec.Code, "the takeover of %s", key)
		assert.Equal(t, 1, rows(t, db, key))
	}
}

// fingerprintOf returns the fingerprint of the request send makes.
func fingerprintOf(t *testing.T, key string) []byte {
	t.Helper()
	fp, err := idempotency.Fingerprint("POST", "/v1/orders", "", "", []byte(`{"item":"book"}`))
	require.NoError(t, err)
	return fp
}
