package gormtest

import (
	"context"
	"database/sql"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" driver
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
)

// Order is the service's own row, as GORM maps it.
type Order struct {
	ID     int64 `gorm:"primaryKey"`
	Tenant string
	Item   string
}

// Line is a row GORM writes in a nested db.Transaction.
type Line struct {
	ID      int64 `gorm:"primaryKey"`
	OrderID int64
	Note    string
}

// TestGORMOnTheKeysTransaction serves orders written with GORM on the
// *sql.Tx of sqlstore.Tx, as a repository would: the order and its lines
// commit once with the key's outcome, the retry is a replay, a nested
// db.Transaction that fails rolls back to its savepoint only, and a
// request whose outcome is not stored commits nothing.
func TestGORMOnTheKeysTransaction(t *testing.T) {
	ctx := context.Background()
	db, err := sql.Open("pgx", pgtest.SchemaURL(t))
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	require.NoError(t, sqlstore.Migrate(ctx, db))
	setup, err := gorm.Open(postgres.New(postgres.Config{Conn: db}), &gorm.Config{})
	require.NoError(t, err)
	require.NoError(t, setup.AutoMigrate(&Order{}, &Line{}))

	runs := 0
	h := idempotency.Middleware(sqlstore.New(db), idempotency.Options{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		tx, err := sqlstore.Tx(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		gdb, err := gorm.Open(postgres.New(postgres.Config{Conn: tx}), &gorm.Config{SkipDefaultTransaction: true})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		gdb = gdb.WithContext(r.Context())
		tenant, _ := idempotency.ClientIDFromContext(r.Context())
		order := Order{Tenant: tenant, Item: r.Header.Get("Item")}
		if err := gdb.Create(&order).Error; err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		// A nested transaction that commits, and one that fails: savepoints.
		if err := gdb.Transaction(func(t2 *gorm.DB) error {
			return t2.Create(&Line{OrderID: order.ID, Note: "kept"}).Error
		}); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		_ = gdb.Transaction(func(t2 *gorm.DB) error {
			if err := t2.Create(&Line{OrderID: order.ID, Note: "dropped"}).Error; err != nil {
				return err
			}
			return errors.New("changed its mind")
		})
		if r.Header.Get("Fail") != "" {
			http.Error(w, "the downstream failed", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	send := func(key, item, fail string) *httptest.ResponseRecorder {
		r := httptest.NewRequestWithContext(idempotency.WithClientID(ctx, "cli_a"), "POST", "/orders", strings.NewReader(`{}`))
		r.Header.Set("Idempotency-Key", key)
		r.Header.Set("Item", item)
		if fail != "" {
			r.Header.Set("Fail", fail)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		return rec
	}
	count := func(query string, args ...any) int64 {
		var n int64
		require.NoError(t, setup.Raw(query, args...).Scan(&n).Error)
		return n
	}

	require.Equal(t, http.StatusCreated, send("k1", "book", "").Code)
	again := send("k1", "book", "")
	assert.Equal(t, http.StatusCreated, again.Code)
	assert.Equal(t, "true", again.Header().Get("Idempotent-Replayed"))
	assert.Equal(t, 1, runs, "the retry ran the handler again")
	assert.Equal(t, int64(1), count(`SELECT count(*) FROM orders WHERE item = ?`, "book"))
	assert.Equal(t, int64(1), count(`SELECT count(*) FROM lines WHERE note = ?`, "kept"))
	assert.Equal(t, int64(0), count(`SELECT count(*) FROM lines WHERE note = ?`, "dropped"))

	assert.Equal(t, http.StatusServiceUnavailable, send("k2", "lamp", "yes").Code)
	assert.Equal(t, int64(0), count(`SELECT count(*) FROM orders WHERE item = ?`, "lamp"), "a 503's order committed")
	assert.Equal(t, http.StatusCreated, send("k2", "lamp", "").Code, "the retry of the 503")
	assert.Equal(t, int64(1), count(`SELECT count(*) FROM orders WHERE item = ?`, "lamp"))
}
