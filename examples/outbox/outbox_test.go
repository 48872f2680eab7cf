package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/pgtest"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		main() // a service or a worker of the chaos test
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

// The chaos test's settings. Its run time is about chaosFor, plus a few
// seconds.
const (
	chaosFor    = 10 * time.Second
	senders     = 6                      // clients placing orders at once
	jobTimeout  = 2 * time.Second        // River's JobTimeout for the workers
	rescueAfter = 3 * time.Second        // River's RescueStuckJobsAfter: a killed worker's jobs run again after this
	testTimeout = 55 * time.Second       // the whole test
	tenant      = "shop"                 // the client every order is placed by
	orderDelay  = 40 * time.Millisecond  // a service's wait between its writes and its answer
	shipLatency = 40 * time.Millisecond  // the shipping API's wait between a shipment and its answer
	loseEvery   = 3                      // the shipping API loses the first answer of every third shipment
	minKillGap  = 200 * time.Millisecond // a process runs between minKillGap and maxKillGap before it is killed
	maxKillGap  = 1500 * time.Millisecond
)

// TestOutboxSurvivesKills places orders through idem.Transport while the
// service and the worker, separate processes, are killed with SIGKILL at
// random points and started again, and checks the outbox's promise for
// every key a client was answered for: one order, one job run to
// completion, one shipment made by the shipping API, recorded on the order.
// The clients reach the service through a proxy that also resets
// connections and loses answers; the shipping API loses the first answer of
// every third shipment, so a worker must ask again with the same key.
func TestOutboxSurvivesKills(t *testing.T) {
	for _, store := range []string{"pgx", "sql"} {
		t.Run(store, func(t *testing.T) { testOutboxSurvivesKills(t, store) })
	}
}

// testOutboxSurvivesKills is TestOutboxSurvivesKills with the service on
// store: pgx (pgstore, River's riverpgxv5) or sql (sqlstore on a *sql.Tx,
// River's riverdatabasesql).
func testOutboxSurvivesKills(t *testing.T, store string) {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	dbURL := pgtest.SchemaURL(t)
	pool, err := pgxpool.New(ctx, dbURL)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrate(ctx, pool))

	ship := &shippingAPI{latency: shipLatency, loseEvery: loseEvery}
	shipping := httptest.NewServer(ship)
	defer shipping.Close()

	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	dir := t.TempDir()
	service := &proc{name: "service", ready: "listening", logPath: filepath.Join(dir, "service.log"), args: []string{
		"-role", "service", "-addr", "127.0.0.1:0", "-database-url", dbURL,
		"-order-delay", orderDelay.String(), "-store", store,
	}}
	worker := &proc{name: "worker", ready: "working", logPath: filepath.Join(dir, "worker.log"), args: []string{
		"-role", "worker", "-database-url", dbURL, "-shipping-url", shipping.URL,
		"-job-timeout", jobTimeout.String(), "-rescue-after", rescueAfter.String(), "-max-retry-wait", "500ms",
	}}
	defer service.kill()
	defer worker.kill()
	defer func() {
		if t.Failed() {
			t.Logf("service log, last lines:\n%s", service.logTail(30))
			t.Logf("worker log, last lines:\n%s", worker.logTail(30))
		}
	}()
	require.NoError(t, service.start())
	require.NoError(t, worker.start())

	proxy, err := faultproxy.Listen("127.0.0.1:0", faultproxy.Config{
		Targets: []string{service.addr},
		Seed:    seed,
		Mix:     faultproxy.Mix{Reset: 0.05, Drop: 0.05},
	})
	require.NoError(t, err)
	defer proxy.Close()

	// The clients: each places orders one after another until the chaos
	// ends, each order with a key of its own, sent again until answered.
	client := &http.Client{Transport: &idem.Transport{
		Base:  &http.Transport{DisableKeepAlives: true}, // a fault of the proxy per attempt
		Retry: idem.RetryPolicy{AttemptTimeout: 5 * time.Second},
	}}
	var (
		mu       sync.Mutex
		answered = make(map[string]order) // by key
		sending  sync.WaitGroup
		stop     = make(chan struct{})
	)
	stopSending := sync.OnceFunc(func() { close(stop) })
	defer func() { // a test that fails early stops the senders before it ends
		stopSending()
		cancel()
		sending.Wait()
	}()
	for i := range senders {
		sending.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				key, want := idem.NewKey(), order{Item: fmt.Sprintf("item-%d-%d", i, n), Qty: n%5 + 1}
				got, err := placeOrder(ctx, client, "http://"+proxy.Addr(), key, want)
				if err != nil {
					t.Errorf("order %s: %v", key, err)
					return
				}
				mu.Lock()
				answered[key] = got
				mu.Unlock()
			}
		})
	}

	// The chaos: each process killed after a random time, and started again
	// after another, until chaosFor has passed.
	rng := rand.New(rand.NewPCG(seed, 1))
	var rngMu sync.Mutex
	gap := func(lo, hi time.Duration) time.Duration {
		rngMu.Lock()
		defer rngMu.Unlock()
		return lo + time.Duration(rng.Int64N(int64(hi-lo)+1))
	}
	begin := time.Now()
	var chaos sync.WaitGroup
	errs := make(chan error, 2)
	for _, p := range []*proc{service, worker} {
		chaos.Go(func() {
			for time.Since(begin) < chaosFor {
				time.Sleep(gap(minKillGap, maxKillGap))
				p.kill()
				time.Sleep(gap(0, 300*time.Millisecond))
				if err := p.start(); err != nil {
					errs <- err
					return
				}
				if p == service {
					proxy.SetTarget(0, service.addr)
				}
			}
		})
	}
	chaos.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	stopSending()
	sending.Wait() // the service is up: every order sent gets its answer
	t.Logf("chaos over after %s: %d service starts, %d worker starts, %d orders answered, %d orders rolled back by a kill",
		time.Since(begin).Round(time.Millisecond), service.starts, worker.starts, len(answered), rolledBack(ctx, t, pool))

	// The worker is killed once more, and the last one started once the
	// jobs it was running count as stuck and the dead leader's term is
	// over, both moved in SQL: River elects the new worker leader at once,
	// and its first rescue finds them.
	worker.kill()
	_, err = pool.Exec(ctx, `UPDATE river_job SET attempted_at = attempted_at - $1::interval WHERE state = 'running'`, rescueAfter)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `DELETE FROM river_leader`)
	require.NoError(t, err)
	require.NoError(t, worker.start())
	waitJobsFinished(ctx, t, pool)
	t.Logf("jobs finished after %s", time.Since(begin).Round(time.Millisecond))

	checkOutbox(t, pool, answered, ship)
	shipments, replays, lost := ship.snapshot()
	stats := proxy.Stats()
	t.Logf("%d shipments; the shipping API lost %d answers and replayed %d; the proxy reset %d client connections and lost %d answers",
		len(shipments), lost, replays, stats.Faults[faultproxy.Reset], stats.Faults[faultproxy.Drop])
}

// rolledBack counts the orders whose insert ran and never committed (a
// kill, a lost connection): the ids the identity handed out that no row
// has, since a sequence is not rolled back.
func rolledBack(ctx context.Context, t *testing.T, pool *pgxpool.Pool) int64 {
	var n int64
	err := pool.QueryRow(ctx, `SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('orders', 'id')::regclass), 0)
		- (SELECT count(*) FROM orders)`).Scan(&n)
	require.NoError(t, err)
	return n
}

// placeOrder places want with key through client, sending it again with
// the same key until the service answers 201, and returns the order.
func placeOrder(ctx context.Context, client *http.Client, base, key string, want order) (order, error) {
	body, err := json.Marshal(want)
	if err != nil {
		return order{}, err
	}
	ctx = idem.WithKey(ctx, key)
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/orders", bytes.NewReader(body))
		if err != nil {
			return order{}, err
		}
		req.SetBasicAuth(tenant, "secret")
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			if ctx.Err() != nil {
				return order{}, err
			}
			time.Sleep(100 * time.Millisecond) // the Transport gave up on this call; the next one sends the same key
			continue
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		switch {
		case err != nil:
			continue
		case resp.StatusCode == http.StatusCreated:
			var got order
			if err := json.Unmarshal(b, &got); err != nil {
				return order{}, fmt.Errorf("201 with %q: %v", b, err)
			}
			return got, nil
		case resp.StatusCode >= 500 || resp.StatusCode == http.StatusConflict:
			continue // the Transport's retries ran out: send again
		default:
			return order{}, fmt.Errorf("%s: %s", resp.Status, b)
		}
	}
}

// waitJobsFinished waits until no job is left to run.
func waitJobsFinished(ctx context.Context, t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	for {
		var left int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM river_job WHERE state NOT IN ('completed', 'cancelled', 'discarded')`).Scan(&left)
		if err == nil && left == 0 {
			return
		}
		if ctx.Err() != nil {
			states := collect(t, pool, pgx.RowTo[string], `SELECT state || ': ' || count(*) FROM river_job GROUP BY state`)
			t.Fatalf("jobs still to run when the test ran out of time: %v (%v)", states, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// collect runs a query and returns its rows, each read by scan.
func collect[T any](t *testing.T, pool *pgxpool.Pool, scan pgx.RowToFunc[T], sql string, args ...any) []T {
	t.Helper()
	rows, err := pool.Query(context.Background(), sql, args...)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, scan)
	require.NoError(t, err)
	return got
}

// checkOutbox checks, for every key a client was answered for, one order
// (the one answered), one job completed, and one shipment, recorded on the
// order; and nothing else: no order, job or shipment without its key.
func checkOutbox(t *testing.T, pool *pgxpool.Pool, answered map[string]order, ship *shippingAPI) {
	t.Helper()
	require.NotEmpty(t, answered)

	type keyRow struct {
		Key, Status, Operation string
	}
	keys := collect(t, pool, pgx.RowToStructByPos[keyRow],
		`SELECT idempotency_key, status, operation_id FROM idempotency_keys WHERE client_id = $1`, tenant)
	opOf := make(map[string]string) // operation by key
	for _, k := range keys {
		if _, ok := answered[k.Key]; ok {
			assert.Equal(t, "completed", k.Status, "key %s", k.Key)
			opOf[k.Key] = k.Operation
		}
	}

	type orderRow struct {
		ID              int64
		Operation, Item string
		Qty             int
		Shipment        *string
	}
	orders := collect(t, pool, pgx.RowToStructByPos[orderRow], `SELECT id, operation_id, item, qty, shipment_id FROM orders`)
	ordersOf := make(map[string][]orderRow) // by operation
	for _, o := range orders {
		ordersOf[o.Operation] = append(ordersOf[o.Operation], o)
	}

	type jobRow struct {
		Operation, State string
		Attempt          int
		Rescued          bool
	}
	jobs := collect(t, pool, pgx.RowToStructByPos[jobRow],
		`SELECT args->>'operation_id', state::text, attempt, metadata ? 'river:rescue_count' FROM river_job`)
	jobsOf := make(map[string][]jobRow) // by operation
	reruns, rescued := 0, 0
	for _, j := range jobs {
		jobsOf[j.Operation] = append(jobsOf[j.Operation], j)
		if j.Attempt > 1 {
			reruns++
		}
		if j.Rescued {
			rescued++
		}
	}

	shipments, replays, lost := ship.snapshot()
	for key, got := range answered {
		op, ok := opOf[key]
		if !assert.True(t, ok, "key %s: answered, but not in the key table", key) {
			continue
		}
		if mine := ordersOf[op]; assert.Len(t, mine, 1, "key %s: orders", key) {
			o := mine[0]
			assert.Equal(t, got.ID, o.ID, "key %s: the order answered is the order stored", key)
			assert.Equal(t, [2]any{got.Item, got.Qty}, [2]any{o.Item, o.Qty}, "key %s", key)
			s, shippedOK := shipments[shipmentKey(tenant, op)]
			if assert.True(t, shippedOK, "key %s: no shipment under the key derived from its operation", key) &&
				assert.NotNil(t, o.Shipment, "key %s: the order does not record its shipment", key) {
				assert.Equal(t, s.ID, *o.Shipment, "key %s: the order records another shipment", key)
			}
		}
		if js := jobsOf[op]; assert.Len(t, js, 1, "key %s: jobs", key) {
			assert.Equal(t, "completed", js[0].State, "key %s: job", key)
		}
	}
	// Nothing more than one per key: every order, job and shipment belongs
	// to a key a client was answered for.
	assert.Len(t, orders, len(answered), "orders")
	assert.Len(t, jobs, len(answered), "jobs")
	assert.Len(t, shipments, len(answered), "shipments")
	// The lost answers were asked for again, under the same keys.
	assert.Positive(t, lost, "the shipping API lost no answer")
	assert.GreaterOrEqual(t, replays, lost, "answers lost by the shipping API were not asked for again")
	t.Logf("%d keys: %d orders, %d jobs (%d run more than once, %d rescued from a killed worker)",
		len(answered), len(orders), len(jobs), reruns, rescued)
}

// A shipment key is the same for the same operation, and another for
// another operation or another tenant.
func TestShipmentKey(t *testing.T) {
	k := shipmentKey("shop", "op-1")
	assert.Equal(t, k, shipmentKey("shop", "op-1"))
	assert.NotEqual(t, k, shipmentKey("shop", "op-2"))
	assert.NotEqual(t, k, shipmentKey("other", "op-1"))
	assert.NotEqual(t, shipmentKey("a\x00b", "c"), shipmentKey("a", "b\x00c"), "an unambiguous encoding, whatever the tenant holds")
	assert.Len(t, k, 36)
}

// The fake shipping API makes one shipment per key, replays it for the
// same request, refuses the key with another body, and loses the first
// answer of every loseEvery-th shipment once the shipment is made.
func TestShippingAPI(t *testing.T) {
	ship := &shippingAPI{loseEvery: 2}
	srv := httptest.NewServer(ship)
	defer srv.Close()
	// No connection is reused: net/http sends a request with an
	// Idempotency-Key again by itself when a reused connection breaks.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	post := func(key, body string) (*http.Response, string, error) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/shipments", bytes.NewBufferString(body))
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		if err != nil {
			return nil, "", err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b), nil
	}

	resp, first, err := post("k1", `{"n":1}`)
	require.NoError(t, err)
	assert.Equal(t, http.StatusCreated, resp.StatusCode)
	resp, again, err := post("k1", `{"n":1}`)
	require.NoError(t, err)
	assert.Equal(t, http.StatusCreated, resp.StatusCode)
	assert.Equal(t, "true", resp.Header.Get("Idempotent-Replayed"))
	assert.Equal(t, first, again)
	resp, _, err = post("k1", `{"n":2}`)
	require.NoError(t, err)
	assert.Equal(t, http.StatusUnprocessableEntity, resp.StatusCode)

	_, _, err = post("k2", `{"n":1}`) // the second shipment: its answer is lost
	require.Error(t, err)
	resp, _, err = post("k2", `{"n":1}`)
	require.NoError(t, err)
	assert.Equal(t, "true", resp.Header.Get("Idempotent-Replayed"))

	shipments, replays, lost := ship.snapshot()
	assert.Len(t, shipments, 2)
	assert.Equal(t, 2, replays)
	assert.Equal(t, 1, lost)
}

// The command refuses a command line it cannot run, before it connects to
// anything.
func TestParseFlags(t *testing.T) {
	noEnv := func(string) string { return "" }
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{}, "DATABASE_URL is required"},
		{[]string{"-database-url", "postgres://x", "-role", "both"}, `-role "both"`},
		{[]string{"-database-url", "postgres://x", "extra"}, "unexpected arguments"},
		{[]string{"-database-url", "postgres://x", "-store", "gorm"}, `-store "gorm": want pgx or sql`},
	} {
		_, err := parseFlags(tc.args, noEnv, io.Discard)
		if assert.Error(t, err, "%q", tc.args) {
			assert.Contains(t, err.Error(), tc.want)
		}
	}
	c, err := parseFlags(nil, func(k string) string { return map[string]string{"DATABASE_URL": "postgres://db"}[k] }, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "postgres://db", c.databaseURL)
	assert.Equal(t, "all", c.role)
	assert.Equal(t, "pgx", c.store)
}
