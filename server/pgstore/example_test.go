package pgstore_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// examplePool is the database of the runnable examples, which have no
// testing.T to get one from: a schema of its own, made by TestMain.
var examplePool *pgxpool.Pool

func TestMain(m *testing.M) {
	pool, cleanup, err := pgtest.MainPool("pgstore_examples")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		if pgtest.CI() {
			os.Exit(1) // CI=true: database tests must run, not skip
		}
		os.Exit(0)
	}
	examplePool = pool
	code := m.Run()
	cleanup()
	os.Exit(code)
}

// newOrderService is a service of one's own: its table (orders), its
// authentication (Basic, user = client), its handler. Idempotency is the
// middleware around the route and the transaction the handler writes in.
func newOrderService(pool *pgxpool.Pool, reserve func(ctx context.Context, item string, qty int) error) http.Handler {
	keyed := idempotency.Middleware(pgstore.New(pool), idempotency.Options{
		ClientID: func(r *http.Request) (string, bool) { // keys are scoped by the service's own clients
			user, password, ok := r.BasicAuth()
			return user, ok && password == "secret"
		},
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", keyed(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Item string `json:"item"`
			Qty  int    `json:"qty"`
		}
		if json.NewDecoder(r.Body).Decode(&in) != nil || in.Item == "" || in.Qty < 1 {
			http.Error(w, `want {"item": "...", "qty": 1 or more}`, http.StatusBadRequest) // the key stays free
			return
		}
		tenant, _ := idempotency.ClientIDFromContext(r.Context()) // the client the key is scoped by
		tx, err := pgstore.Tx(r.Context())                        // commits with the key's stored outcome
		var id int64
		if err == nil {
			err = tx.QueryRow(r.Context(), `INSERT INTO orders (tenant, item, qty) VALUES ($1, $2, $3) RETURNING id`,
				tenant, in.Item, in.Qty).Scan(&id)
		}
		if err == nil {
			err = reserve(r.Context(), in.Item, in.Qty) // a downstream call after the insert
		}
		if err != nil {
			http.Error(w, "try again with the same key", http.StatusServiceUnavailable) // the insert rolls back
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"item":%q,"qty":%d}`+"\n", id, in.Item, in.Qty)
	})))
	return mux
}

// migrateOrders creates the key table and the service's own table.
func migrateOrders(ctx context.Context, pool *pgxpool.Pool) error {
	if err := pgstore.Migrate(ctx, pool); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (
		id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		tenant text    NOT NULL,
		item   text    NOT NULL,
		qty    integer NOT NULL)`)
	return err
}

// postOrder sends one order with a key, as client "shop".
func postOrder(url, key, body string) (*http.Response, string, error) {
	req, err := http.NewRequest("POST", url+"/orders", strings.NewReader(body))
	if err != nil {
		return nil, "", err
	}
	req.SetBasicAuth("shop", "secret")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, string(b), err
}

// A service protects its own POST /orders: the order row and the key's
// outcome commit together, and a retry with the key gets the stored answer
// instead of a second order.
func Example() {
	ctx := context.Background()
	if err := migrateOrders(ctx, examplePool); err != nil {
		panic(err)
	}
	noReservation := func(context.Context, string, int) error { return nil }
	srv := httptest.NewServer(newOrderService(examplePool, noReservation))
	defer srv.Close()

	for range 2 { // the first call and its retry, with the same key
		resp, body, err := postOrder(srv.URL, "order-7f3a", `{"item": "book", "qty": 2}`)
		if err != nil {
			panic(err)
		}
		fmt.Println(resp.StatusCode, "replayed:", resp.Header.Get("Idempotent-Replayed") == "true", body)
	}
	var orders int
	if err := examplePool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		panic(err)
	}
	fmt.Println("orders:", orders)
	// Output:
	// 201 replayed: false {"id":1,"item":"book","qty":2}
	//
	// 201 replayed: true {"id":1,"item":"book","qty":2}
	//
	// orders: 1
}

// TestOrderService checks what Example claims of a service built the same
// way, on a schema of its own.
func TestOrderService(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if err := migrateOrders(ctx, pool); err != nil {
		t.Fatal(err)
	}
	var failReserve atomic.Bool
	reserve := func(context.Context, string, int) error {
		if failReserve.Load() {
			return errors.New("warehouse unavailable")
		}
		return nil
	}
	srv := httptest.NewServer(newOrderService(pool, reserve))
	t.Cleanup(srv.Close)
	orders := func(t *testing.T, item string) int {
		t.Helper()
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM orders WHERE item = $1`, item).Scan(&n))
		return n
	}

	t.Run("one key sent concurrently makes one row", func(t *testing.T) {
		const n = 8
		statuses := make(chan int, n)
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() {
				resp, _, err := postOrder(srv.URL, "concurrent-1", `{"item": "lamp", "qty": 1}`)
				if assert.NoError(t, err) {
					statuses <- resp.StatusCode
				}
			})
		}
		wg.Wait()
		close(statuses)
		for s := range statuses {
			assert.Contains(t, []int{http.StatusCreated, http.StatusConflict}, s)
		}
		assert.Equal(t, 1, orders(t, "lamp"))
		resp, _, err := postOrder(srv.URL, "concurrent-1", `{"item": "lamp", "qty": 1}`)
		require.NoError(t, err)
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, 1, orders(t, "lamp"))
	})

	t.Run("a 5xx after the insert leaves no row", func(t *testing.T) {
		failReserve.Store(true)
		resp, _, err := postOrder(srv.URL, "failing-1", `{"item": "desk", "qty": 1}`)
		failReserve.Store(false)
		require.NoError(t, err)
		assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
		assert.Equal(t, 0, orders(t, "desk"))
		// The retry of the same request runs again, and makes the one row.
		resp, _, err = postOrder(srv.URL, "failing-1", `{"item": "desk", "qty": 1}`)
		require.NoError(t, err)
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, 1, orders(t, "desk"))
	})

	t.Run("a 400 leaves the key free for the corrected body", func(t *testing.T) {
		resp, _, err := postOrder(srv.URL, "corrected-1", `{"item": "chair", "qty": 0}`)
		require.NoError(t, err)
		assert.Equal(t, http.StatusBadRequest, resp.StatusCode)
		resp, _, err = postOrder(srv.URL, "corrected-1", `{"item": "chair", "qty": 4}`)
		require.NoError(t, err)
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		assert.Equal(t, 1, orders(t, "chair"))
	})

	t.Run("the order belongs to the client the key is scoped by", func(t *testing.T) {
		resp, _, err := postOrder(srv.URL, "tenant-1", `{"item": "mug", "qty": 1}`)
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, resp.StatusCode)
		var tenant string
		require.NoError(t, pool.QueryRow(ctx, `SELECT tenant FROM orders WHERE item = 'mug'`).Scan(&tenant))
		assert.Equal(t, "shop", tenant)
	})

	t.Run("the replay is byte for byte", func(t *testing.T) {
		first, firstBody, err := postOrder(srv.URL, "replay-1", `{"item": "pen", "qty": 3}`)
		require.NoError(t, err)
		// The same request, with its members in another order and other
		// whitespace: the same canonical body.
		again, againBody, err := postOrder(srv.URL, "replay-1", `{ "qty":3, "item":"pen" }`)
		require.NoError(t, err)
		assert.Equal(t, first.StatusCode, again.StatusCode)
		assert.Equal(t, firstBody, againBody)
		for _, h := range []string{"Content-Type", "Content-Length", "Idempotency-Key"} {
			assert.Equal(t, first.Header.Values(h), again.Header.Values(h), h)
		}
		assert.Equal(t, "true", again.Header.Get("Idempotent-Replayed"))
		assert.Equal(t, 1, orders(t, "pen"))
	})
}

// TestImports checks the import graph a service pays for: the library
// packages pull in neither the metrics library nor the reference server,
// and the middleware no database driver.
func TestImports(t *testing.T) {
	goBin, err := exec.LookPath("go")
	require.NoError(t, err, "the go command is needed to list the imports")
	for _, tc := range []struct {
		pkg       string
		forbidden []string
	}{
		{"github.com/idemkit/idem/server/idempotency", []string{"github.com/jackc/pgx", "github.com/prometheus/", "github.com/idemkit/idem/server\n"}},
		{"github.com/idemkit/idem/server/pgstore", []string{"github.com/prometheus/", "github.com/idemkit/idem/server\n"}},
	} {
		out, err := exec.Command(goBin, "list", "-deps", tc.pkg).CombinedOutput()
		require.NoError(t, err, "go list -deps %s: %s", tc.pkg, out)
		for _, f := range tc.forbidden {
			assert.NotContains(t, string(out), f, "%s imports %s", tc.pkg, strings.TrimSpace(f))
		}
	}
}
