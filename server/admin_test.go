package server

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// The operators' view itself is idempotency.Admin's, on the stores'
// Inspector, tested in their conformance suites; these tests check the
// admin API of the reference server on both storages: its token, its
// routes and answers, and the gauges of /metrics.

func TestAdminMemory(t *testing.T) { testAdmin(t, memoryStorage) }

func TestAdminPostgres(t *testing.T) { testAdmin(t, postgresStorage) }

const adminToken = "admin-secret"

// adminCall makes one request to the admin API h and decodes its JSON
// answer into out, if not nil.
func adminCall(t *testing.T, h *httptest.Server, method, path, token, body string, out any) int {
	t.Helper()
	req, err := http.NewRequest(method, h.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := h.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if out != nil && resp.StatusCode < 300 {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("%s %s: %s: %v", method, path, b, err)
		}
	}
	return resp.StatusCode
}

func testAdmin(t *testing.T, newStorage newStorageFunc) {
	ctx := context.Background()
	ts := newTestServer(t, newStorage(t), Config{LockTimeout: time.Hour, AfterCharge: (&crashOnce{n: 1}).afterCharge})
	h, err := ts.AdminHandler(adminToken)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(h)
	defer hs.Close()

	// A completed payment, a crashed one (started, its lease an hour), and
	// one released after the processor refused it.
	if r := ts.send(t, keyed("k/crash", payment)); r.err == nil {
		t.Fatalf("crashed request answered %d", r.status)
	}
	done := ts.mustSend(t, keyed("k-done", payment))
	if done.status != http.StatusCreated {
		t.Fatalf("payment: %d %s", done.status, done.body)
	}
	ts.Processor().FailNext(100)
	if r := ts.mustSend(t, keyed("k-down", payment)); r.status != http.StatusBadGateway {
		t.Fatalf("payment with the processor down: %d", r.status)
	}
	ts.Processor().FailNext(0)

	for _, token := range []string{"", "wrong"} {
		if st := adminCall(t, hs, "GET", "/admin/keys/client_a/k-done", token, "", nil); st != http.StatusUnauthorized {
			t.Errorf("lookup with token %q: %d, want 401", token, st)
		}
	}

	var k keyView
	if st := adminCall(t, hs, "GET", "/admin/keys/client_a/k-done", adminToken, "", &k); st != http.StatusOK {
		t.Fatalf("lookup: %d", st)
	}
	if k.Status != "completed" || k.Response == nil || k.Response.Status != 201 || k.Response.Body != nil ||
		k.Response.Header["Location"] == "" || k.OperationID == "" || k.FinishedAt == nil || k.Running {
		t.Errorf("lookup of a completed key: %+v (response %+v)", k, k.Response)
	}
	if adminCall(t, hs, "GET", "/admin/keys/client_a/k-done?body=1", adminToken, "", &k); k.Response == nil ||
		k.Response.Body == nil || *k.Response.Body != string(done.body) {
		t.Errorf("lookup with the body: %+v, want the stored body %s", k.Response, done.body)
	}
	if st := adminCall(t, hs, "GET", "/admin/keys/client_b/k-done", adminToken, "", nil); st != http.StatusNotFound {
		t.Errorf("lookup of another client's key: %d, want 404", st)
	}
	crashPath := "/admin/keys/client_a/" + url.PathEscape("k/crash")
	if adminCall(t, hs, "GET", crashPath, adminToken, "", &k); k.Key != "k/crash" || k.Status != "started" || !k.Running || k.Lease != "1h0m0s" {
		t.Errorf("lookup of a key with a slash: %+v", k)
	}

	var list struct{ Keys []keyView }
	keysOf := func(path string) []string {
		t.Helper()
		list.Keys = nil
		if st := adminCall(t, hs, "GET", path, adminToken, "", &list); st != http.StatusOK {
			t.Fatalf("%s: %d", path, st)
		}
		var keys []string
		for _, k := range list.Keys {
			keys = append(keys, k.Key)
		}
		return keys
	}
	for path, want := range map[string]string{
		"/admin/keys?stuck=0s":                   "k/crash",
		"/admin/keys?stuck=1h":                   "",
		"/admin/keys?released=1":                 "k-down",
		"/admin/keys?released=1&client=client_b": "",
		"/admin/keys?released=1h":                "",
	} {
		if got := strings.Join(keysOf(path), ","); got != want {
			t.Errorf("%s: %q, want %q", path, got, want)
		}
	}
	for _, path := range []string{"/admin/keys", "/admin/keys?stuck=1&released=1", "/admin/keys?stuck=soon", "/admin/keys?released=1&limit=0"} {
		if st := adminCall(t, hs, "GET", path, adminToken, "", nil); st != http.StatusBadRequest {
			t.Errorf("%s: %d, want 400", path, st)
		}
	}
	var stats struct {
		Running        int64 `json:"running"`
		Lapsed         int64 `json:"lapsed"`
		ReleasedFailed int64 `json:"released_failed"`
	}
	if adminCall(t, hs, "GET", "/admin/stats", adminToken, "", &stats); stats.Running != 1 || stats.ReleasedFailed != 1 {
		t.Errorf("stats %+v, want 1 running, 1 released after a failure", stats)
	}
	metrics := ts.mustSend(t, call{method: "GET", path: "/metrics"})
	for _, line := range []string{"idem_keys_running 1\n", "idem_keys_lapsed 0\n", "idem_keys_released_failed 1\n", "# TYPE idem_keys_running_oldest_age_seconds gauge\n"} {
		if !strings.Contains(string(metrics.body), line) {
			t.Errorf("/metrics lacks %q", line)
		}
	}

	// Releasing the running key needs a reason and "running": true.
	for body, want := range map[string]int{
		``:                            http.StatusBadRequest,
		`{"reason": ""}`:              http.StatusBadRequest,
		`{"reason": "x", "other": 1}`: http.StatusBadRequest,
		`{"reason": "INC-7"}`:         http.StatusConflict,
	} {
		if st := adminCall(t, hs, "POST", crashPath+"/release", adminToken, body, nil); st != want {
			t.Errorf("release with %s: %d, want %d", body, st, want)
		}
	}
	var acted struct {
		Done string
		Was  keyView
	}
	if st := adminCall(t, hs, "POST", crashPath+"/release", adminToken, `{"reason": "INC-7: crashed", "running": true}`, &acted); st != http.StatusOK ||
		acted.Done != "released" || acted.Was.Status != "started" {
		t.Fatalf("release of the running key: %d %+v", st, acted)
	}
	if info, err := ts.Admin().Lookup(ctx, "client_a", "k/crash", false); err != nil ||
		info.Status != idempotency.StatusReleased || info.ReleaseKind != idempotency.ReleaseFailed {
		t.Errorf("after the release: %+v, %v", info, err)
	}
	if r := ts.mustSend(t, keyed("k/crash", payment)); r.status != http.StatusCreated {
		t.Errorf("the retry after the release: %d %s, want 201", r.status, r.body)
	}
	if st := adminCall(t, hs, "POST", "/admin/keys/client_a/k-done/release", adminToken, `{"reason": "r"}`, nil); st != http.StatusConflict {
		t.Errorf("release of a completed key: %d, want 409", st)
	}
	if st := adminCall(t, hs, "POST", "/admin/keys/client_a/k-done/expire", adminToken, `{"reason": "INC-8: new order"}`, &acted); st != http.StatusOK ||
		acted.Done != "expired" || acted.Was.Status != "completed" {
		t.Fatalf("expiry: %d %+v", st, acted)
	}
	if st := adminCall(t, hs, "POST", "/admin/keys/client_a/k-done/expire", adminToken, `{"reason": "again"}`, nil); st != http.StatusNotFound {
		t.Errorf("expiry of an expired key: %d, want 404", st)
	}
	if r := ts.mustSend(t, keyed("k-done", payment)); r.status != http.StatusCreated || r.replayed() {
		t.Errorf("the request after the expiry: %d replayed=%v, want a new payment", r.status, r.replayed())
	}
	if got := ts.counter(t, "idem_keys_force_released_total") + ts.counter(t, "idem_keys_expired_by_operator_total"); got != 2 {
		t.Errorf("operators' actions counted: %v, want 2", got)
	}
}

func TestExpiredKeyRefusesRetryAfterPurgeMemory(t *testing.T) {
	testExpiredKeyRefusesRetryAfterPurge(t, memoryStorage)
}

func TestExpiredKeyRefusesRetryAfterPurgePostgres(t *testing.T) {
	testExpiredKeyRefusesRetryAfterPurge(t, postgresStorage)
}

// testExpiredKeyRefusesRetryAfterPurge: an operator expires a payment's
// key through the admin API, the purge runs, and the client's retry of the
// payment comes, first sent before the payment began. It is refused with
// 410, the processor asked once: the purge keeps the expired key until the
// payment's retention has run out, and the first-sent rule refuses the
// retry by it. The rest of the story (a new
// request claims the key at once; the purge deletes the key after the
// retention, and the retry is refused as too old) is the stores'
// conformance suite's and TestExpiredByOperatorRefusedAfterPurge's in
// package idempotency, which move time.
func testExpiredKeyRefusesRetryAfterPurge(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{})
	h, err := ts.AdminHandler(adminToken)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(h)
	defer hs.Close()

	sent := http.Header{"Repeatability-First-Sent": {time.Now().UTC().Format(http.TimeFormat)}}
	first := call{keys: []string{"k-expired"}, body: payment, header: sent}
	if r := ts.mustSend(t, first); r.status != http.StatusCreated {
		t.Fatalf("payment: %d %s", r.status, r.body)
	}
	if st := adminCall(t, hs, "POST", "/admin/keys/client_a/k-expired/expire", adminToken, `{"reason": "INC-9: reused keys"}`, nil); st != http.StatusOK {
		t.Fatalf("expiry: %d", st)
	}
	if n, err := ts.Purge(context.Background()); err != nil || n != 0 {
		t.Errorf("Purge = %d, %v; want 0: the expired key is kept for its operation's retries", n, err)
	}
	r := ts.mustSend(t, first)
	if r.status != http.StatusGone || r.problem(t).Type != idempotency.ProblemKeyExpired {
		t.Errorf("the retry after the expiry and a purge: %d %s, want 410", r.status, r.body)
	}
	if charges, asked := ts.charges.created.Load(), ts.counter(t, "idem_processor_charges_total"); charges != 1 || asked != 1 {
		t.Errorf("%d charges, the processor asked %v times; want 1, 1", charges, asked)
	}

}

// TestAdminHandlerRefuses: no admin API without a token, or on a key store
// without Inspector.
func TestAdminHandlerRefuses(t *testing.T) {
	ts := newTestServer(t, memoryStorage(t), Config{})
	if _, err := ts.AdminHandler(""); err == nil {
		t.Error("AdminHandler without a token succeeded")
	}
	storage := memoryStorage(t)
	storage.Keys = &scriptedPurges{Store: storage.Keys}
	if _, err := newTestServer(t, storage, Config{}).AdminHandler("t"); err == nil {
		t.Error("AdminHandler on a store without Inspector succeeded")
	}
}

// TestMigrateCreatesOpenKeysIndex: the reference server's Migrate creates
// the open keys' index, which its sweeper, admin lists and key gauges
// need; on a key table without it (dropped, say), /metrics says why it has
// no key gauges, naming the function that creates it, and the next
// Migrate (the next start) creates it again.
func TestMigrateCreatesOpenKeysIndex(t *testing.T) {
	ctx := context.Background()
	pool := migratedPool(t)
	indexValid := func() bool {
		t.Helper()
		var valid bool
		err := pool.QueryRow(ctx, `SELECT coalesce((SELECT indisvalid FROM pg_index
			WHERE indexrelid = to_regclass('idempotency_keys_open_idx')), false)`).Scan(&valid)
		if err != nil {
			t.Fatal(err)
		}
		return valid
	}
	if !indexValid() {
		t.Fatal("no valid idempotency_keys_open_idx after Migrate")
	}
	if _, err := pool.Exec(ctx, `DROP INDEX idempotency_keys_open_idx`); err != nil {
		t.Fatal(err)
	}
	ts := newTestServer(t, NewPostgresStorage(pool).Storage(), Config{})
	metrics := string(ts.mustSend(t, call{method: "GET", path: "/metrics"}).body)
	if !strings.Contains(metrics, "# idem_keys_* gauges unavailable: ") || !strings.Contains(metrics, "pgstore.CreateOpenKeysIndex") ||
		strings.Contains(metrics, "idem_keys_running ") {
		t.Errorf("/metrics without the index: want no key gauges and a comment naming pgstore.CreateOpenKeysIndex:\n%s", metrics)
	}
	if err := Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if !indexValid() {
		t.Fatal("no valid idempotency_keys_open_idx after Migrate again")
	}
	if metrics := string(ts.mustSend(t, call{method: "GET", path: "/metrics"}).body); !strings.Contains(metrics, "idem_keys_running 0\n") {
		t.Errorf("/metrics after Migrate again lacks idem_keys_running 0:\n%s", metrics)
	}
}
