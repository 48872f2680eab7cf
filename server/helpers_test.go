package server

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/internal/keysql"
	"github.com/idemkit/idem/server/internal/testhooks"
)

// Test tokens and the clients they map to.
const (
	tokenA  = "sk_test_a"
	tokenB  = "sk_test_b"
	payment = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
)

var testAPIKeys = map[string]string{tokenA: "client_a", tokenB: "client_b"}

// testLogger discards logs unless IDEM_TEST_LOG is set.
func testLogger(t testing.TB) *slog.Logger {
	if os.Getenv("IDEM_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// countingCharges counts the charges a ChargeStore really creates.
type countingCharges struct {
	ChargeStore
	created atomic.Int64
}

func (c *countingCharges) CreateCharge(ctx context.Context, ch Charge) (Charge, bool, error) {
	stored, created, err := c.ChargeStore.CreateCharge(ctx, ch)
	if created {
		c.created.Add(1)
	}
	return stored, created, err
}

// newStorageFunc makes fresh, empty storage for one test: in memory, or on
// PostgreSQL in a schema of its own.
type newStorageFunc func(t *testing.T) Storage

// memoryStorage is a newStorageFunc.
func memoryStorage(t *testing.T) Storage { return NewMemoryStorage().Storage() }

// postgresStorage is a newStorageFunc: the tables of Migrate on a schema of
// the test's own.
func postgresStorage(t *testing.T) Storage {
	return NewPostgresStorage(migratedPool(t)).Storage()
}

// migratedPool returns a pool on a schema of the test's own, migrated.
func migratedPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t)
	if err := Migrate(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

// testServer is a Server behind an httptest.Server.
type testServer struct {
	*Server
	URL     string
	storage Storage // as given to newTestServer, before the charges are counted
	charges *countingCharges
	client  *http.Client
}

// newTestServer starts a server on storage with cfg (Storage, APIKeys and
// Logger filled in when empty), stopped when the test ends. The charges the
// processor creates are counted in ts.charges.
func newTestServer(t *testing.T, storage Storage, cfg Config) *testServer {
	t.Helper()
	if storage.Charges == nil {
		t.Fatal("newTestServer: storage without Charges")
	}
	charges := &countingCharges{ChargeStore: storage.Charges}
	cfg.Storage = storage
	cfg.Storage.Charges = charges
	if cfg.APIKeys == nil {
		cfg.APIKeys = testAPIKeys
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	srv, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(func() {
		client.CloseIdleConnections()
		hs.Close()
		if err := srv.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return &testServer{Server: srv, URL: hs.URL, storage: storage, charges: charges, client: client}
}

// payments returns the number of committed payments in the server's
// storage, a MemoryStorage or a PostgresStorage.
func (ts *testServer) payments(t *testing.T) int {
	t.Helper()
	return committedPayments(t, ts.storage.Payments)
}

// committedPayments counts the committed payments of a MemoryStorage or a
// PostgresStorage.
func committedPayments(t *testing.T, ps PaymentStore) int {
	t.Helper()
	switch s := ps.(type) {
	case *MemoryStorage:
		return len(s.Payments())
	case *PostgresStorage:
		var n int
		if err := s.pool.QueryRow(context.Background(), `SELECT count(*) FROM payments`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	t.Fatalf("cannot count the payments of %T", ps)
	return 0
}

// elapse ages the keys of ts's storage by d, as if d had passed for them:
// their creation, last lock or finish, and expiry move d back.
func (ts *testServer) elapse(t *testing.T, d time.Duration) {
	t.Helper()
	switch s := ts.storage.Payments.(type) {
	case *MemoryStorage:
		testhooks.ElapseMemoryStore(s.keys, d)
	case *PostgresStorage:
		if _, err := s.pool.Exec(context.Background(), keysql.ElapseSQL, d.Microseconds()); err != nil {
			t.Fatal(err)
		}
	default:
		t.Fatalf("cannot age the keys of %T", ts.storage.Payments)
	}
}

// awaitRenewal waits until the lease of client A's key is live: renewed
// by the request still running it, after the test aged the key past its
// lock timeout (see elapse).
func (ts *testServer) awaitRenewal(t *testing.T, key string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		info, err := ts.Admin().Lookup(context.Background(), "client_a", key, false)
		if err != nil {
			t.Fatalf("Lookup(%s): %v", key, err)
		}
		if info.Running() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the lease of %s was not renewed within 10s: %+v", key, info)
		}
	}
}

// call is one raw request; the zero fields mean: POST /v1/payments by
// client A with no key and a JSON body.
type call struct {
	method      string
	path        string
	token       string   // "-" for none
	keys        []string // Idempotency-Key header lines
	contentType string
	body        string
	header      http.Header // more header lines
}

func keyed(key, body string) call { return call{keys: []string{key}, body: body} }

// reply is a response read whole.
type reply struct {
	status int
	header http.Header
	body   []byte
	err    error
}

func (r reply) replayed() bool { return r.header.Get("Idempotent-Replayed") == "true" }

// problem decodes the body as problem details.
func (r reply) problem(t *testing.T) problem {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("Content-Type = %q, want application/problem+json; body %s", ct, r.body)
	}
	var p problem
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("problem body %s: %v", r.body, err)
	}
	if p.Status != r.status || p.Title == "" || p.Detail == "" {
		t.Errorf("incomplete problem %+v for status %d", p, r.status)
	}
	return p
}

// payment decodes the body as a payment.
func (r reply) payment(t *testing.T) paymentResource {
	t.Helper()
	var p paymentResource
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("payment body %s: %v", r.body, err)
	}
	return p
}

// created checks that r is the 201 of the test payment (4200 usd for
// cus_123, charged), with its Location and the echoed key (none when
// key is ""), and returns the payment.
func (r reply) created(t *testing.T, key string) paymentResource {
	t.Helper()
	p := r.payment(t)
	if p.Amount != 4200 || p.Currency != "usd" || p.Customer != "cus_123" || !strings.HasPrefix(p.ID, "pay_") || p.Charge == "" {
		t.Errorf("payment %+v", p)
	}
	if got := r.header.Get("Location"); got != "/v1/payments/"+p.ID {
		t.Errorf("Location = %q", got)
	}
	if got := r.header.Get("Idempotency-Key"); got != key {
		t.Errorf("echoed key %q, want %q", got, key)
	}
	return p
}

// send makes one raw request (no retries) and reads the response.
func (ts *testServer) send(t *testing.T, c call) reply {
	t.Helper()
	method := c.method
	if method == "" {
		method = http.MethodPost
	}
	path := c.path
	if path == "" {
		path = "/v1/payments"
	}
	var body io.Reader
	if c.body != "" {
		body = strings.NewReader(c.body)
	}
	req, err := http.NewRequest(method, ts.URL+path, body)
	if err != nil {
		t.Fatal(err)
	}
	switch c.token {
	case "":
		req.Header.Set("Authorization", "Bearer "+tokenA)
	case "-":
	default:
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	for _, k := range c.keys {
		req.Header.Add("Idempotency-Key", k)
	}
	if c.body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.contentType != "" {
		req.Header.Set("Content-Type", c.contentType)
	}
	for k, vs := range c.header {
		req.Header[k] = vs
	}
	resp, err := ts.client.Do(req)
	if err != nil {
		return reply{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: b, err: err}
}

// mustSend is send for requests that must get an answer.
func (ts *testServer) mustSend(t *testing.T, c call) reply {
	t.Helper()
	r := ts.send(t, c)
	if r.err != nil {
		t.Fatalf("%s %s: %v", c.method, c.path, r.err)
	}
	return r
}

// counter returns the value of a counter of the server's /metrics.
func (ts *testServer) counter(t *testing.T, name string) float64 {
	t.Helper()
	v, ok := ts.Metrics().Counter(name)
	if !ok {
		t.Fatalf("no counter %s", name)
	}
	return v
}
