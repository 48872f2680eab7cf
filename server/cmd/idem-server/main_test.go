package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
	"github.com/idemkit/idem/server/pgstore"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// syncBuffer is a bytes.Buffer safe for the server's and the test's
// goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

var listeningRE = regexp.MustCompile(`msg=listening addr=(\S+)`)

// start runs the server with args and env and returns its base URL and a
// stop function that cancels it and returns run's error.
func start(t *testing.T, args []string, env map[string]string) (string, *syncBuffer, func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append([]string{"-addr", "127.0.0.1:0"}, args...), func(k string) string { return env[k] }, out)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if m := listeningRE.FindStringSubmatch(out.String()); m != nil {
			stopped := false
			var err error
			stop := func() error {
				if !stopped {
					stopped = true
					cancel()
					err = <-done
				}
				return err
			}
			t.Cleanup(func() { stop() })
			return "http://" + m[1], out, stop
		}
		select {
		case err := <-done:
			cancel()
			t.Fatalf("run ended before listening: %v\n%s", err, out)
		default:
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("server did not start:\n%s", out)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func post(t *testing.T, client *http.Client, url, token, key, body string) (*http.Response, string) {
	t.Helper()
	resp, b, err := tryPost(client, url, token, key, body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func tryPost(client *http.Client, url, token, key, body string) (*http.Response, string, error) {
	req, _ := http.NewRequest("POST", url+"/v1/payments", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+token)
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, string(b), err
}

func TestRunInMemory(t *testing.T) {
	url, out, stop := start(t, nil, nil)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}

	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	resp, b := post(t, client, url, "sk_test_demo", "k1", body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST: %d %s", resp.StatusCode, b)
	}
	resp, b2 := post(t, client, url, "sk_test_demo", "k1", body)
	if resp.Header.Get("Idempotent-Replayed") != "true" || b2 != b {
		t.Errorf("retry: %d %s, want the replay", resp.StatusCode, b2)
	}
	for path, want := range map[string]string{"/healthz": "ok", "/metrics": "idem_keys_claimed_total 1"} {
		resp, err := client.Get(url + path)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(got), want) {
			t.Errorf("GET %s: %d, want %q in the body", path, resp.StatusCode, want)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	logs := out.String()
	for _, want := range []string{"in-memory store", "sk_test_demo:demo", "msg=stopped"} {
		if !strings.Contains(logs, want) {
			t.Errorf("log lacks %q:\n%s", want, logs)
		}
	}
	if strings.Contains(logs, "cus_123") {
		t.Error("the log holds a request body")
	}
}

// heldProcessor serves a fake card processor that holds its charges until
// release is called: reached is closed when the first one arrives.
// release is idempotent, and called when the test ends.
func heldProcessor(t *testing.T) (url string, reached <-chan struct{}, release func()) {
	t.Helper()
	arrived, let := make(chan struct{}), make(chan struct{})
	var first, once sync.Once
	release = func() { once.Do(func() { close(let) }) }
	proc := &server.Processor{Charges: server.NewMemoryStorage(), Logger: slog.New(slog.DiscardHandler)}
	ps := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			first.Do(func() { close(arrived) })
			<-let
		}
		proc.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		release()
		ps.Close()
	})
	return ps.URL, arrived, release
}

// TestRunGracefulStop stops the server while a payment is in flight, at
// the processor: the payment finishes and is answered, and its key is
// completed, not left started.
func TestRunGracefulStop(t *testing.T) {
	procURL, reached, release := heldProcessor(t)
	url, _, stop := start(t, []string{"-processor-url", procURL, "-api-keys", "tok_1:acme"}, nil)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	type result struct {
		status int
		body   string
		err    error
	}
	done := make(chan result, 1)
	go func() {
		resp, b, err := tryPost(client, url, "tok_1", "k-inflight", `{"amount": 1, "currency": "usd", "customer": "c"}`)
		if err != nil {
			done <- result{err: err}
			return
		}
		done <- result{resp.StatusCode, b, nil}
	}()
	<-reached
	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	// The processor answers once the server has stopped listening: its
	// graceful stop is under way.
	addr := strings.TrimPrefix(url, "http://")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			break
		}
		conn.Close()
		if time.Now().After(deadline) {
			t.Fatal("the server still listens 10s after it was told to stop")
		}
	}
	release()
	r := <-done
	if r.err != nil || r.status != http.StatusCreated {
		t.Errorf("in-flight payment during shutdown: %d %s %v", r.status, r.body, r.err)
	}
	if err := <-stopped; err != nil {
		t.Errorf("run: %v", err)
	}
}

// TestRunSlowProcessor starts the server with a processor that answers
// only after the key of the payment waiting on it was aged past the lock
// timeout (in SQL), which the lease renewal allows: once the lease is
// renewed, a duplicate gets 409, not a takeover, and the first request
// completes.
func TestRunSlowProcessor(t *testing.T) {
	ctx := context.Background()
	const lock = time.Second // renewed every third of it, on the server's real clock
	dsn := pgtest.SchemaURL(t)
	procURL, reached, release := heldProcessor(t)
	url, _, stop := start(t, []string{"-database-url", dsn, "-lock-timeout", lock.String(), "-processor-url", procURL}, nil)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	type result struct {
		status int
		body   string
		err    error
	}
	first := make(chan result, 1)
	go func() {
		resp, b, err := tryPost(client, url, "sk_test_demo", "k-slow", body)
		if err != nil {
			first <- result{err: err}
			return
		}
		first <- result{resp.StatusCode, b, nil}
	}()
	<-reached
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var aged time.Time
	if err := conn.QueryRow(ctx, keysql.ElapseSQL+` RETURNING locked_at`, (2 * lock).Microseconds()).Scan(&aged); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var locked time.Time
		if err := conn.QueryRow(ctx, `SELECT locked_at FROM idempotency_keys`).Scan(&locked); err != nil {
			t.Fatal(err)
		}
		if locked.After(aged) {
			break // renewed since
		}
		if time.Now().After(deadline) {
			t.Fatal("the lease of the payment waiting on the processor was not renewed within 10s")
		}
	}
	resp, b := post(t, client, url, "sk_test_demo", "k-slow", body)
	if resp.StatusCode != http.StatusConflict {
		t.Errorf("duplicate past the lock timeout: %d %s, want 409", resp.StatusCode, b)
	}
	release()
	r := <-first
	if r.err != nil || r.status != http.StatusCreated {
		t.Fatalf("slow request: %d %s %v, want 201", r.status, r.body, r.err)
	}
	resp, err = client.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"idem_keys_taken_over_total 0", "idem_keys_completed_total 1", "idem_conflicts_total 1"} {
		if !strings.Contains(string(metrics), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if regexp.MustCompile(`(?m)^idem_leases_renewed_total 0$`).Match(metrics) {
		t.Error("no lease renewed while the request waited past the lock timeout")
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
}

func TestRunFlags(t *testing.T) {
	for _, tt := range []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"bad api keys", []string{"-api-keys", "nocolon"}, nil, "not token:client_id"},
		{"bad api keys from env", nil, map[string]string{"IDEM_API_KEYS": ":x"}, "not token:client_id"},
		{"unknown flag", []string{"-nope"}, nil, "flag provided but not defined"},
		{"extra argument", []string{"serve"}, nil, "unexpected arguments"},
		{"failure rate", []string{"-processor-failure-rate", "2"}, nil, "[0, 1]"},
		{"log format", []string{"-log-format", "xml"}, nil, "text or json"},
		{"purge batch", []string{"-purge-batch", "0"}, nil, "-purge-batch 0"},
		{"purge duty cycle zero", []string{"-purge-duty-cycle", "0"}, nil, "(0, 1]"},
		{"purge duty cycle over 1", []string{"-purge-duty-cycle", "1.5"}, nil, "(0, 1]"},
		{"purge duty cycle NaN", []string{"-purge-duty-cycle", "NaN"}, nil, "(0, 1]"},
		{"db max conns", []string{"-database-url", "postgres://127.0.0.1/x", "-db-max-conns", "0"}, nil, "-db-max-conns 0"},
		{"db max conns without a database", []string{"-db-max-conns", "8"}, nil, "needs -database-url"},
		{"batch completions are gone", []string{"-batch-completions"}, nil, "flag provided but not defined: -batch-completions"},
		{"pool size twice", []string{"-database-url", "postgres://127.0.0.1/x?pool_max_conns=4", "-db-max-conns", "8"}, nil, "keep one"},
		{"metrics on the API's address", []string{"-addr", "127.0.0.1:8080", "-metrics-addr", "127.0.0.1:8080"}, nil, "-metrics-addr 127.0.0.1:8080 is -addr"},
		{"metrics address taken", []string{"-metrics-addr", "256.0.0.1:1"}, nil, "-metrics-addr"},
		{"negative read timeout", []string{"-read-timeout", "-1s"}, nil, "-read-timeout -1s"},
		{"fail after write over 1", []string{"-fail-after-write", "1.5"}, nil, "want shares in [0, 1]"},
		{"drop answer NaN", []string{"-drop-answer", "NaN"}, nil, "want shares in [0, 1]"},
		{"hold rate negative", []string{"-hold-rate", "-0.1"}, nil, "want shares in [0, 1]"},
		{"negative hold", []string{"-hold-after-write", "-1s"}, nil, "-hold-after-write -1s"},
		{"first-sent skew over half the retention", []string{"-retention", "1h", "-first-sent-skew", "30m"}, nil, "-first-sent-skew 30m0s"},
		{"negative first-sent skew", []string{"-first-sent-skew", "-1s"}, nil, "-first-sent-skew -1s"},
		{"bad database URL", []string{"-database-url", "postgres://%zz"}, nil, "database"},
		{"database from env", nil, map[string]string{"DATABASE_URL": "postgres://%zz"}, "database"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			err := run(context.Background(), tt.args, func(k string) string { return tt.env[k] }, &out)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("run(%q) = %v, want an error with %q", tt.args, err, tt.want)
			}
		})
	}
}

// TestRunPostgres runs the binary's code on PostgreSQL: it migrates the
// schema at start and serves payments from it.
func TestRunPostgres(t *testing.T) {
	dsn := pgtest.SchemaURL(t)
	url, out, stop := start(t, nil, map[string]string{"DATABASE_URL": dsn})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	resp, b := post(t, client, url, "sk_test_demo", "k-pg", body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST: %d %s", resp.StatusCode, b)
	}
	resp, b2 := post(t, client, url, "sk_test_demo", "k-pg", body)
	if resp.Header.Get("Idempotent-Replayed") != "true" || b2 != b {
		t.Errorf("retry: %d %s, want the replay", resp.StatusCode, b2)
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	if logs := out.String(); !strings.Contains(logs, "using PostgreSQL") || strings.Contains(logs, "in-memory") {
		t.Errorf("log does not say PostgreSQL:\n%s", logs)
	}
	// A second start on the same schema migrates nothing and still serves
	// the stored outcome.
	url, _, stop = start(t, []string{"-database-url", dsn}, nil)
	resp, b3 := post(t, client, url, "sk_test_demo", "k-pg", body)
	if resp.Header.Get("Idempotent-Replayed") != "true" || b3 != b {
		t.Errorf("after a restart: %d %s, want the replay", resp.StatusCode, b3)
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
}

// TestRunNoIdempotency runs the benchmark-only mode: a payment needs no key,
// and the log warns that the idempotency layer is off.
func TestRunNoIdempotency(t *testing.T) {
	url, out, stop := start(t, []string{"-no-idempotency"}, nil)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	r1, b1 := post(t, client, url, "sk_test_demo", "", body)
	r2, b2 := post(t, client, url, "sk_test_demo", "", body)
	if r1.StatusCode != http.StatusCreated || r2.StatusCode != http.StatusCreated || b1 == b2 {
		t.Errorf("two unkeyed POSTs: %d %s, %d %s; want two different payments", r1.StatusCode, b1, r2.StatusCode, b2)
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	if logs := out.String(); !strings.Contains(logs, "level=WARN") || !strings.Contains(logs, "WITHOUT the idempotency layer") {
		t.Errorf("no warning that the idempotency layer is off:\n%s", logs)
	}
}

// TestRunNoIdempotencyPostgres checks what the benchmark-only mode writes
// to PostgreSQL: the charge and the payment, no idempotency key.
func TestRunNoIdempotencyPostgres(t *testing.T) {
	dsn := pgtest.SchemaURL(t)
	url, _, stop := start(t, []string{"-no-idempotency", "-database-url", dsn}, nil)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	for range 2 {
		resp, b := post(t, client, url, "sk_test_demo", "k-ignored", `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`)
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("POST: %d %s", resp.StatusCode, b)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var keys, payments, unkeyed, charges int
	if err := conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM idempotency_keys),
		(SELECT count(*) FROM payments), (SELECT count(*) FROM payments WHERE idempotency_key = ''),
		(SELECT count(*) FROM charges)`).Scan(&keys, &payments, &unkeyed, &charges); err != nil {
		t.Fatal(err)
	}
	if keys != 0 || payments != 2 || unkeyed != 2 || charges != 2 {
		t.Errorf("%d keys, %d payments (%d without a key), %d charges; want 0, 2 (2), 2", keys, payments, unkeyed, charges)
	}
}

// TestOpenStore checks that the database flags reach the key store and its
// pool: -db-max-conns sizes the pool, unless the DSN does; and that
// the storage keeps payments and charges in the same database.
func TestOpenStore(t *testing.T) {
	dsn := pgtest.SchemaURL(t)
	for _, tt := range []struct {
		name      string
		args      []string
		dsn       string
		wantConns int32
	}{
		{"defaults", nil, dsn, defaultDBMaxConns},
		{"db max conns", []string{"-db-max-conns", "7"}, dsn, 7},
		{"pool size in the DSN", nil, withParam(dsn, "pool_max_conns", "3"), 3},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			o, err := parseFlags(append([]string{"-database-url", tt.dsn}, tt.args...), func(string) string { return "" }, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			storage, pool, err := openStore(ctx, o, slog.New(slog.DiscardHandler), nil)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			keys, ok := storage.Keys.(*pgstore.Store)
			if !ok {
				t.Fatalf("key store %T, want *pgstore.Store", storage.Keys)
			}
			if _, ok := storage.Payments.(*server.PostgresStorage); !ok {
				t.Errorf("payment store %T, want *server.PostgresStorage", storage.Payments)
			}
			if _, ok := storage.Charges.(*server.PostgresStorage); !ok {
				t.Errorf("charge store %T, want *server.PostgresStorage", storage.Charges)
			}
			if got := pool.Config().MaxConns; got != tt.wantConns {
				t.Errorf("pool MaxConns = %d, want %d", got, tt.wantConns)
			}
			// The claim works either way.
			res, err := keys.Claim(ctx, idempotency.ClaimRequest{ClientID: "c", Key: "k-" + tt.name, Method: "POST",
				Path: "/v1/payments", Fingerprint: []byte("fp")})
			if err != nil || res.Outcome != idempotency.Claimed {
				t.Errorf("Claim = %v, %v", res.Outcome, err)
			}
		})
	}
}

// TestPoolConfig checks who sizes the pool, in both DSN forms, without a
// database: the flag, or the DSN's pool_max_conns when it has one.
func TestPoolConfig(t *testing.T) {
	for _, tt := range []struct {
		dsn  string
		args []string
		want int32
		err  string
	}{
		{"postgres://u@127.0.0.1:1/db", nil, defaultDBMaxConns, ""},
		{"postgres://u@127.0.0.1:1/db", []string{"-db-max-conns", "40"}, 40, ""},
		{"postgres://u@127.0.0.1:1/db?pool_max_conns=5", nil, 5, ""},
		{"host=127.0.0.1 port=1 user=u dbname=db", []string{"-db-max-conns", "9"}, 9, ""},
		{"host=127.0.0.1 port=1 user=u dbname=db pool_max_conns=6", nil, 6, ""},
		{"host=127.0.0.1 port=1 user=u dbname=db pool_max_conns=6", []string{"-db-max-conns", "6"}, 0, "keep one"},
		{"postgres://u@127.0.0.1:1/db?pool_max_conns=0", nil, 0, "pool_max_conns"},
	} {
		o, err := parseFlags(append([]string{"-database-url", tt.dsn}, tt.args...), func(string) string { return "" }, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := poolConfig(o)
		switch {
		case tt.err != "":
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("poolConfig(%q, %q) = %v, want an error with %q", tt.dsn, tt.args, err, tt.err)
			}
		case err != nil:
			t.Errorf("poolConfig(%q, %q): %v", tt.dsn, tt.args, err)
		case cfg.MaxConns != tt.want:
			t.Errorf("poolConfig(%q, %q).MaxConns = %d, want %d", tt.dsn, tt.args, cfg.MaxConns, tt.want)
		}
	}
}

// withParam adds a setting to a connection string in either form.
func withParam(dsn, name, value string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Set(name, value)
		u.RawQuery = q.Encode()
		return u.String()
	}
	return dsn + " " + name + "=" + value
}

// TestRunCPUProfile checks that -cpuprofile leaves a profile once the
// server stops (gzip-compressed protobuf, as pprof writes them), and that a
// file that cannot be created stops the start.
func TestRunCPUProfile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cpu.prof")
	url, _, stop := start(t, []string{"-cpuprofile", path}, nil)
	resp, err := http.Get(url + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) < 20 || b[0] != 0x1f || b[1] != 0x8b {
		t.Errorf("the CPU profile is not a gzip stream: %d bytes, % x...", len(b), b[:min(len(b), 4)])
	}

	bad := filepath.Join(t.TempDir(), "missing", "cpu.prof")
	err = run(context.Background(), []string{"-addr", "127.0.0.1:0", "-cpuprofile", bad}, func(string) string { return "" }, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("run with an uncreatable -cpuprofile: %v, want the file's error", err)
	}
}

// TestTimeoutFlags checks that the timeouts a user gives never block the
// start against each other: a lock timeout is a lease renewed while the
// request runs, so it needs to be neither longer than the processor's
// delay nor shorter than the retention, which counts from when a request
// finished. Only negative values are refused, naming the flag.
func TestTimeoutFlags(t *testing.T) {
	for _, tt := range []struct {
		name       string
		args       []string
		lock, keep time.Duration
		err        string // a substring of the error
	}{
		{"defaults", nil, idempotency.DefaultLockTimeout, idempotency.DefaultRetention, ""},
		{"short retention alone", []string{"-retention", "2s"}, idempotency.DefaultLockTimeout, 2 * time.Second, ""},
		{"lock over retention", []string{"-lock-timeout", "2h", "-retention", "1h"}, 2 * time.Hour, time.Hour, ""},
		{"processor slower than the lock", []string{"-processor-delay", "5s", "-lock-timeout", "2s"}, 2 * time.Second, idempotency.DefaultRetention, ""},
		{"huge lock", []string{"-lock-timeout", "2562047h"}, 2562047 * time.Hour, idempotency.DefaultRetention, ""},
		{"zero retention", []string{"-retention", "0"}, 0, 0, "-retention, -lock-timeout and -purge-interval must be positive"},
		{"negative shutdown timeout", []string{"-shutdown-timeout", "-1s"}, 0, 0, "-shutdown-timeout -1s"},
		{"negative wait for completion", []string{"-wait-for-completion", "-1ms"}, 0, 0, "-wait-for-completion -1ms"},
		{"negative processor delay", []string{"-processor-delay", "-1s"}, 0, 0, "-processor-delay -1s"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			o, err := parseFlags(tt.args, func(string) string { return "" }, io.Discard)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("parseFlags(%q) = %v, want an error naming %q", tt.args, err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("parseFlags(%q): %v", tt.args, err)
			}
			if o.lockTimeout != tt.lock || o.retention != tt.keep {
				t.Errorf("lock timeout %v, retention %v; want %v, %v", o.lockTimeout, o.retention, tt.lock, tt.keep)
			}
		})
	}
}

// TestRunShortRetention starts the server with -retention 2s alone, which
// the default lock timeout used to refuse: it starts, with the default lock
// timeout.
func TestRunShortRetention(t *testing.T) {
	_, out, stop := start(t, []string{"-retention", "2s"}, nil)
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	if logs, want := out.String(), "lock_timeout="+idempotency.DefaultLockTimeout.String(); !strings.Contains(logs, want) {
		t.Errorf("log lacks %q:\n%s", want, logs)
	}
}

// TestRunFaults injects each fault of the API's own answers at rate 1:
// a payment failed after its write is released, and its retry runs again;
// a dropped answer is stored and lost on the way; a payment held past the
// retention is still replayed, since retention counts from the answer.
func TestRunFaults(t *testing.T) {
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_1"}`
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()

	url, _, _ := start(t, []string{"-fail-after-write", "1"}, nil)
	for range 2 {
		resp, b := post(t, client, url, "sk_test_demo", "k1", body)
		if resp.StatusCode != http.StatusInternalServerError || resp.Header.Get("Idempotent-Replayed") != "" {
			t.Errorf("-fail-after-write 1: %d %s, want a 500 every time, never replayed", resp.StatusCode, b)
		}
	}

	url, _, _ = start(t, []string{"-drop-answer", "1"}, nil)
	if resp, b, err := tryPost(client, url, "sk_test_demo", "k1", body); err == nil {
		t.Errorf("-drop-answer 1: %d %s, want no answer", resp.StatusCode, b)
	}
	if got := metric(t, client, url, "idem_keys_completed_total"); got != 1 {
		t.Errorf("-drop-answer 1: %d keys completed, want 1 (the answer is stored, then lost)", got)
	}

	// The retry comes within the retention counted from the completion
	// (one second, on a busy machine too), not from the claim.
	url, _, _ = start(t, []string{"-hold-after-write", "1500ms", "-retention", "1s"}, nil)
	post(t, client, url, "sk_test_demo", "k1", body)
	if resp, b := post(t, client, url, "sk_test_demo", "k1", body); resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("retry of a payment held past the retention: %d %s, want the replay", resp.StatusCode, b)
	}
}

// metric reads one counter from the server's /metrics.
func metric(t *testing.T, client *http.Client, url, name string) int64 {
	t.Helper()
	resp, err := client.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return n
		}
	}
	t.Fatalf("no %s in /metrics:\n%s", name, b)
	return 0
}

// rawConn dials the server at base URL u with a generous deadline, which
// only keeps a regression from hanging the test.
func rawConn(t *testing.T, u string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(u, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	return conn
}

// readToClose reads conn until the server closes it and returns what came;
// it fails the test if the generous deadline passes first.
func readToClose(t *testing.T, conn net.Conn) string {
	t.Helper()
	b, err := io.ReadAll(conn)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("the server did not close the connection; read so far: %q", b)
	}
	return string(b) // EOF, or a reset: closed either way
}

// TestRunStalledBodyCutOff sends an authenticated payment whose body stalls
// after a few bytes: -read-timeout cuts it off, and nothing is paid.
// Before, only the headers had a timeout and such a client held its
// connection for ever.
func TestRunStalledBodyCutOff(t *testing.T) {
	url, _, _ := start(t, []string{"-read-timeout", "300ms"}, nil)
	conn := rawConn(t, url)
	io.WriteString(conn, "POST /v1/payments HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer sk_test_demo\r\n"+
		"Idempotency-Key: k-stall\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"amount\"")
	if got := readToClose(t, conn); strings.Contains(got, " 201 ") {
		t.Errorf("a stalled body was paid:\n%s", got)
	}
}

// TestRunIdleTimeout checks that -idle-timeout closes a keep-alive
// connection that sends no next request.
func TestRunIdleTimeout(t *testing.T) {
	url, _, _ := start(t, []string{"-idle-timeout", "200ms"}, nil)
	conn := rawConn(t, url)
	io.WriteString(conn, "GET /healthz HTTP/1.1\r\nHost: idem\r\n\r\n")
	if got := readToClose(t, conn); !strings.HasPrefix(got, "HTTP/1.1 200 ") || strings.Contains(got, "Connection: close") {
		t.Errorf("want a keep-alive 200 before the idle close, got:\n%s", got)
	}
}

// TestRunWriteTimeoutSparesSlowPayments checks that -write-timeout counts
// from the response's first write, not from the request: a payment whose
// processor takes longer than the write timeout is still answered.
func TestRunWriteTimeoutSparesSlowPayments(t *testing.T) {
	url, _, _ := start(t, []string{"-write-timeout", "100ms", "-processor-delay", "400ms"}, nil)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, b := post(t, &http.Client{Transport: tr}, url, "sk_test_demo", "k-slow", `{"amount": 1, "currency": "usd", "customer": "c"}`)
	if resp.StatusCode != http.StatusCreated {
		t.Errorf("slow payment: %d %s, want 201", resp.StatusCode, b)
	}
}

// TestBoundWrites checks that a client that does not read its response is
// cut off once the write timeout has passed since the first write: the
// handler's Write fails instead of blocking for ever.
func TestBoundWrites(t *testing.T) {
	wrote := make(chan error, 1)
	ts := httptest.NewServer(boundWrites(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		chunk := make([]byte, 1<<20)
		for range 1 << 10 { // 1 GiB: more than any socket buffers
			if _, err := w.Write(chunk); err != nil {
				wrote <- err
				return
			}
		}
		wrote <- nil
	}), 200*time.Millisecond))
	defer ts.Close()
	conn := rawConn(t, ts.URL)
	io.WriteString(conn, "GET / HTTP/1.1\r\nHost: idem\r\n\r\n") // and never read
	select {
	case err := <-wrote:
		if err == nil {
			t.Fatal("1 GiB written to a client that reads nothing")
		}
	case <-time.After(10 * time.Second):
		conn.Close() // lets the handler end
		<-wrote
		t.Fatal("the write to a client that reads nothing did not time out")
	}
}

var metricsListeningRE = regexp.MustCompile(`msg="metrics listening" addr=(\S+)`)

// TestRunMetricsAddr checks that with -metrics-addr, /metrics, which needs
// no API key, is served there and only there; the API stays on -addr.
func TestRunMetricsAddr(t *testing.T) {
	url, out, stop := start(t, []string{"-metrics-addr", "127.0.0.1:0"}, nil)
	m := metricsListeningRE.FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("no metrics listener in the log:\n%s", out)
	}
	metricsURL := "http://" + m[1]
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	if resp, b := post(t, client, url, "sk_test_demo", "k-m", `{"amount": 1, "currency": "usd", "customer": "c"}`); resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST: %d %s", resp.StatusCode, b)
	}
	for _, tt := range []struct {
		url, path string
		want      int
		body      string
	}{
		{metricsURL, "/metrics", 200, "idem_keys_claimed_total 1"},
		{url, "/metrics", 404, ""},
		{url, "/healthz", 200, "ok"},
		{metricsURL, "/v1/payments/pay_x", 404, ""},
	} {
		resp, err := client.Get(tt.url + tt.path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tt.want || !strings.Contains(string(b), tt.body) {
			t.Errorf("GET %s%s: %d, want %d with %q", tt.url, tt.path, resp.StatusCode, tt.want, tt.body)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
}
