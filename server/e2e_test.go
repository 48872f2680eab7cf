package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// testEndToEnd runs the end-to-end tests of the reference server against
// the storage newStorage makes, through real HTTP. It is storage-agnostic:
// the same tests run in memory and on PostgreSQL.
func testEndToEnd(t *testing.T, newStorage newStorageFunc) {
	testEndToEndResponses(t, newStorage)
	for _, tt := range []struct {
		name string
		fn   func(t *testing.T, newStorage newStorageFunc)
	}{
		{"TakeoverAfterCrash", testTakeoverAfterCrash},
		{"TakeoverThroughSDK", testTakeoverThroughSDK},
		{"RacingTakers", testRacingTakers},
		{"FencedSlowOriginal", testFencedSlowOriginal},
		{"LeaseRenewedWhileSlow", testLeaseRenewedWhileSlow},
		{"TakeoverAfterSlowCrash", testTakeoverAfterSlowCrash},
		{"Retention", testRetention},
		{"PurgeThenReuse", testPurgeThenReuse},
	} {
		t.Run(tt.name, func(t *testing.T) { tt.fn(t, newStorage) })
	}
}

// testEndToEndResponses runs the end-to-end tests of what a client is
// answered and what is stored and replayed, without the leases, takeovers
// and retention of testEndToEnd, which a store's sealing leaves alone (its
// conformance suite runs sealed too).
func testEndToEndResponses(t *testing.T, newStorage newStorageFunc) {
	for _, tt := range []struct {
		name string
		fn   func(t *testing.T, newStorage newStorageFunc)
	}{
		{"ServerTable", testServerTable},
		{"KeyHeader", testKeyHeader},
		{"Unauthorized", testUnauthorized},
		{"ValidationStoresNothing", testValidationStoresNothing},
		{"InvalidTextChargesNothing", testInvalidTextChargesNothing},
		{"GetMalformedID", testGetMalformedID},
		{"ReplayByteForByte", testReplayByteForByte},
		{"TenantIsolation", testTenantIsolation},
		{"FormAndJSON", testFormAndJSON},
		{"ServerErrorsReleased", testServerErrorsReleased},
		{"ServerErrorsStored", testServerErrorsStored},
		{"Storm", testStorm},
		{"LostProcessorAnswer", testLostProcessorAnswer},
		{"RetryAfterChargedFailure", testRetryAfterChargedFailure},
		{"WaitForCompletion", testWaitForCompletion},
		{"NoIdempotency", testNoIdempotency},
	} {
		t.Run(tt.name, func(t *testing.T) { tt.fn(t, newStorage) })
	}
}

// blocker holds the first n calls of AfterCharge until opened. A test that
// may fail while one is held defers open, so that the server's cleanup,
// which waits for its handlers, does not wait for ever.
type blocker struct {
	mu      sync.Mutex
	n       int
	reached chan struct{} // closed when the first call arrives
	release chan struct{}
	once    sync.Once
	opened  sync.Once
}

// open lets the held calls go, and every later one; it may be called
// more than once.
func (b *blocker) open() { b.opened.Do(func() { close(b.release) }) }

func newBlocker(n int) *blocker {
	return &blocker{n: n, reached: make(chan struct{}), release: make(chan struct{})}
}

func (b *blocker) afterCharge(ctx context.Context) error {
	b.mu.Lock()
	hold := b.n > 0
	b.n--
	b.mu.Unlock()
	if hold {
		b.once.Do(func() { close(b.reached) })
		<-b.release
	}
	return nil
}

// testServerTable checks each row of the article's table of server behaviour.
func testServerTable(t *testing.T, newStorage newStorageFunc) {
	block := newBlocker(1)
	ts := newTestServer(t, newStorage(t), Config{AfterCharge: block.afterCharge, RetryAfter: 2 * time.Second})

	// First request with this key: processed, outcome stored.
	first := make(chan reply)
	go func() { first <- ts.send(t, keyed("k-table", payment)) }()
	<-block.reached

	// Retry while the first request is still running: 409 + Retry-After.
	r := ts.mustSend(t, keyed("k-table", payment))
	if r.status != http.StatusConflict || r.header.Get("Retry-After") != "2" {
		t.Errorf("duplicate in flight: %d Retry-After %q, want 409 with Retry-After 2", r.status, r.header.Get("Retry-After"))
	}
	if p := r.problem(t); p.Type != idempotency.ProblemKeyInUse {
		t.Errorf("409 type %s", p.Type)
	}
	// Same key, different payload: 422, also while running.
	r = ts.mustSend(t, keyed("k-table", `{"amount": 1, "currency": "usd", "customer": "cus_123"}`))
	if r.status != http.StatusUnprocessableEntity || r.problem(t).Type != idempotency.ProblemKeyMismatch {
		t.Errorf("other payload: %d %s, want 422 mismatch", r.status, r.body)
	}
	block.open()
	r = <-first
	if r.err != nil || r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("first request: %d %v replayed=%v %s", r.status, r.err, r.replayed(), r.body)
	}
	p := r.created(t, "k-table")
	// Retry after the first finished: the original outcome.
	again := ts.mustSend(t, keyed("k-table", payment))
	if again.status != http.StatusCreated || !again.replayed() || !bytes.Equal(again.body, r.body) {
		t.Errorf("retry: %d replayed=%v %s, want the stored 201", again.status, again.replayed(), again.body)
	}
	// Same key, different payload after completion: 422.
	r = ts.mustSend(t, keyed("k-table", `{"amount": 4200, "currency": "eur", "customer": "cus_123"}`))
	if r.status != http.StatusUnprocessableEntity || r.problem(t).Type != idempotency.ProblemKeyMismatch {
		t.Errorf("other payload after completion: %d, want 422", r.status)
	}
	// Required key missing: 400.
	r = ts.mustSend(t, call{body: payment})
	if r.status != http.StatusBadRequest || r.problem(t).Type != idempotency.ProblemKeyMissing {
		t.Errorf("no key: %d %s", r.status, r.body)
	}
	// Reads need no key and see the payment; another client's is 404.
	r = ts.mustSend(t, call{method: "GET", path: "/v1/payments/" + p.ID})
	if r.status != http.StatusOK || r.payment(t) != p {
		t.Errorf("GET own payment: %d %s", r.status, r.body)
	}
	r = ts.mustSend(t, call{method: "GET", path: "/v1/payments/" + p.ID, token: tokenB})
	if r.status != http.StatusNotFound || r.problem(t).Type != ProblemNotFound {
		t.Errorf("GET another client's payment: %d", r.status)
	}
	r = ts.mustSend(t, call{method: "GET", path: "/v1/payments/pay_nope"})
	if r.status != http.StatusNotFound {
		t.Errorf("GET unknown payment: %d", r.status)
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
	for name, want := range map[string]float64{
		"idem_keys_claimed_total": 1, "idem_keys_completed_total": 1, "idem_replays_total": 1,
		"idem_conflicts_total": 1, "idem_mismatches_total": 2,
	} {
		if got := ts.counter(t, name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
}

// testKeyHeader checks the key header's parsing: invalid keys get 400, and
// a bare token and an sf-string are the same key.
func testKeyHeader(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{})
	for _, tt := range []struct {
		name string
		keys []string
		want string
	}{
		{"missing", nil, idempotency.ProblemKeyMissing},
		{"empty", []string{""}, idempotency.ProblemKeyInvalid},
		{"empty sf-string", []string{`""`}, idempotency.ProblemKeyInvalid},
		{"two lines", []string{"a", "b"}, idempotency.ProblemKeyInvalid},
		{"too long", []string{strings.Repeat("k", 256)}, idempotency.ProblemKeyInvalid},
		{"space inside", []string{"a b"}, idempotency.ProblemKeyInvalid},
		{"non-ASCII", []string{"cl\u00e9"}, idempotency.ProblemKeyInvalid},
		{"bad sf-string", []string{`"abc`}, idempotency.ProblemKeyInvalid},
		{"sf-string with params", []string{`"abc";x=1`}, idempotency.ProblemKeyInvalid},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := ts.mustSend(t, call{keys: tt.keys, body: payment})
			if r.status != http.StatusBadRequest {
				t.Fatalf("status %d, want 400", r.status)
			}
			if p := r.problem(t); p.Type != tt.want {
				t.Errorf("type %s, want %s", p.Type, tt.want)
			}
		})
	}
	if n := ts.charges.created.Load(); n != 0 {
		t.Errorf("%d charges after rejected requests", n)
	}

	key := strings.Repeat("k", 255) // the longest key is accepted
	bare := ts.mustSend(t, keyed(key, payment))
	sf := ts.mustSend(t, keyed(`"`+key+`"`, payment))
	if bare.status != http.StatusCreated || sf.status != http.StatusCreated || bare.replayed() || !sf.replayed() || !bytes.Equal(bare.body, sf.body) {
		t.Errorf("bare then sf-string: %d/%v then %d/%v, want 201 then the replay", bare.status, bare.replayed(), sf.status, sf.replayed())
	}
	if got := sf.header.Get("Idempotency-Key"); got != `"`+key+`"` {
		t.Errorf("sf-string key echoed as %q", got)
	}
	sf2 := ts.mustSend(t, keyed(`"k-sf"`, payment))
	bare2 := ts.mustSend(t, keyed("k-sf", payment))
	if sf2.status != http.StatusCreated || !bare2.replayed() {
		t.Errorf("sf-string then bare: %d then replayed=%v", sf2.status, bare2.replayed())
	}
}

func testUnauthorized(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{})
	for _, tt := range []struct{ name, token string }{{"none", "-"}, {"unknown", "sk_nope"}} {
		for _, c := range []call{keyed("k", payment), {method: "GET", path: "/v1/payments/pay_x"}} {
			c.token = tt.token
			r := ts.mustSend(t, c)
			if r.status != http.StatusUnauthorized || r.problem(t).Type != idempotency.ProblemUnauthorized || r.header.Get("WWW-Authenticate") == "" {
				t.Errorf("%s token, %s: %d, want 401 with a challenge", tt.name, c.method, r.status)
			}
		}
	}
	// The key of a rejected request is still free.
	if r := ts.mustSend(t, keyed("k", payment)); r.status != http.StatusCreated || r.replayed() {
		t.Errorf("after 401s: %d replayed=%v", r.status, r.replayed())
	}
}

// testValidationStoresNothing checks that a 400 leaves the key free, so the
// client can correct the body and retry with the same key.
func testValidationStoresNothing(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{MaxBodyBytes: 1024})
	for _, tt := range []struct {
		name, contentType, body string
		status                  int
		fields                  []string
	}{
		{"zero amount", "", `{"amount": 0, "currency": "usd", "customer": "cus_123"}`, 400, []string{"amount"}},
		{"negative amount", "", `{"amount": -5, "currency": "usd", "customer": "cus_123"}`, 400, []string{"amount"}},
		{"fractional amount", "", `{"amount": 42.5, "currency": "usd", "customer": "cus_123"}`, 400, []string{"amount"}},
		{"amount as string", "", `{"amount": "4200", "currency": "usd", "customer": "cus_123"}`, 400, []string{"amount"}},
		{"uppercase currency", "", `{"amount": 4200, "currency": "USD", "customer": "cus_123"}`, 400, []string{"currency"}},
		{"long currency", "", `{"amount": 4200, "currency": "usdt", "customer": "cus_123"}`, 400, []string{"currency"}},
		{"no customer", "", `{"amount": 4200, "currency": "usd"}`, 400, []string{"customer"}},
		{"everything wrong", "", `{"amount": 0, "currency": "", "customer": "", "extra": "x"}`, 400, []string{"amount", "currency", "customer", "extra"}},
		{"not an object", "", `[1, 2]`, 400, []string{"body"}},
		{"malformed JSON", "", `{"amount": 4200,`, 400, nil},
		{"duplicate JSON key", "", `{"amount": 4200, "amount": 1, "currency": "usd", "customer": "c"}`, 400, nil},
		{"bad form", "application/x-www-form-urlencoded", `amount=%zz`, 400, nil},
		{"repeated form field", "application/x-www-form-urlencoded", `amount=1&amount=2&currency=usd&customer=c`, 400, []string{"amount"}},
		{"unsupported type", "text/plain", `amount 4200`, 415, []string{"Content-Type"}},
		{"too large", "", `{"customer": "` + strings.Repeat("x", 2000) + `"}`, 413, nil},
		// Text the payment could not be stored with is refused before the
		// charge, not after it.
		{"NUL in customer", "", `{"amount": 4200, "currency": "usd", "customer": "a\u0000b"}`, 400, []string{"customer"}},
		{"invalid UTF-8 in customer", "application/x-www-form-urlencoded", `amount=4200&currency=usd&customer=caf%E9`, 400, []string{"customer"}},
	} {
		key := strings.ReplaceAll("k-"+tt.name, " ", "-")
		t.Run(tt.name, func(t *testing.T) {
			c := keyed(key, tt.body)
			c.contentType = tt.contentType
			r := ts.mustSend(t, c)
			if r.status != tt.status {
				t.Fatalf("status %d, want %d: %s", r.status, tt.status, r.body)
			}
			p := r.problem(t)
			want := idempotency.ProblemInvalidRequest
			if tt.status == 413 {
				want = idempotency.ProblemTooLarge
			}
			if p.Type != want {
				t.Errorf("type %s, want %s", p.Type, want)
			}
			if tt.fields != nil {
				var got []string
				for _, e := range p.Errors {
					got = append(got, e.Field)
				}
				if fmt.Sprint(got) != fmt.Sprint(tt.fields) {
					t.Errorf("invalid fields %v, want %v", got, tt.fields)
				}
			}
			// The same key with a valid body now runs, and is the only
			// request charged.
			before := ts.charges.created.Load()
			r = ts.mustSend(t, keyed(key, payment))
			if r.status != http.StatusCreated || r.replayed() {
				t.Errorf("corrected retry: %d replayed=%v %s", r.status, r.replayed(), r.body)
			}
			if n := ts.charges.created.Load() - before; n != 1 {
				t.Errorf("%d charges by the corrected retry, want 1 (the invalid request charged, or the retry did not)", n)
			}
		})
	}
	if charges, payments := ts.charges.created.Load(), ts.payments(t); charges != int64(payments) {
		t.Errorf("%d charges and %d payments: every charge must have its payment", charges, payments)
	}
}

// testReplayByteForByte checks that a replay has the stored status, content
// type, headers and body, byte for byte.
func testReplayByteForByte(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{})
	first := ts.mustSend(t, keyed("k-bytes", payment))
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	for i := range 3 {
		r := ts.mustSend(t, keyed("k-bytes", "{\n\t\"customer\": \"cus_123\", \"currency\": \"usd\",\n\t\"amount\": 4200\n}"))
		if r.status != first.status || !bytes.Equal(r.body, first.body) || !r.replayed() {
			t.Errorf("replay %d: %d %q, want %d %q", i, r.status, r.body, first.status, first.body)
		}
		for _, h := range []string{"Content-Type", "Location", "Content-Length", "Idempotency-Key"} {
			if got, want := r.header.Get(h), first.header.Get(h); got != want {
				t.Errorf("replay %d: %s = %q, want %q", i, h, got, want)
			}
		}
	}
}

// testTenantIsolation checks that keys are scoped by client.
func testTenantIsolation(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{})
	a := ts.mustSend(t, keyed("shared-key", payment))
	b := ts.mustSend(t, call{token: tokenB, keys: []string{"shared-key"}, body: payment})
	if a.status != http.StatusCreated || b.status != http.StatusCreated || b.replayed() {
		t.Fatalf("two clients, one key: %d, %d replayed=%v; want two fresh 201s", a.status, b.status, b.replayed())
	}
	pa, pb := a.payment(t), b.payment(t)
	if pa.ID == pb.ID || pa.Charge == pb.Charge {
		t.Errorf("two clients share payment %s / charge %s", pa.ID, pa.Charge)
	}
	// Client B with another body and A's key: its own key, no 422.
	r := ts.mustSend(t, call{token: tokenB, keys: []string{"only-a"}, body: payment})
	ts.mustSend(t, keyed("only-a", `{"amount": 1, "currency": "usd", "customer": "cus_9"}`))
	if r.status != http.StatusCreated {
		t.Errorf("B: %d", r.status)
	}
	for _, tt := range []struct {
		token, id string
		want      int
	}{{tokenA, pa.ID, 200}, {tokenB, pb.ID, 200}, {tokenA, pb.ID, 404}, {tokenB, pa.ID, 404}} {
		if r := ts.mustSend(t, call{method: "GET", path: "/v1/payments/" + tt.id, token: tt.token}); r.status != tt.want {
			t.Errorf("GET %s as %s: %d, want %d", tt.id, testAPIKeys[tt.token], r.status, tt.want)
		}
	}
	if n := ts.charges.created.Load(); n != 4 {
		t.Errorf("%d charges, want 4", n)
	}
}

// testFormAndJSON checks that the API takes form bodies too, that each
// encoding fingerprints the same whatever the field order, and that the
// two encodings of one payment are two requests.
func testFormAndJSON(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{})
	const form = "application/x-www-form-urlencoded"
	r := ts.mustSend(t, call{keys: []string{"k-form"}, contentType: form, body: "amount=4200&currency=usd&customer=cus_123"})
	if r.status != http.StatusCreated {
		t.Fatalf("form: %d %s", r.status, r.body)
	}
	if p := r.payment(t); p.Amount != 4200 || p.Currency != "usd" || p.Customer != "cus_123" {
		t.Errorf("form payment %+v", p)
	}
	again := ts.mustSend(t, call{keys: []string{"k-form"}, contentType: form + "; charset=utf-8", body: "customer=cus_123&amount=4200&currency=usd"})
	if again.status != http.StatusCreated || !again.replayed() || !bytes.Equal(again.body, r.body) {
		t.Errorf("reordered form: %d replayed=%v", again.status, again.replayed())
	}
	if r := ts.mustSend(t, keyed("k-form", payment)); r.status != http.StatusUnprocessableEntity {
		t.Errorf("the same payment as JSON with the form's key: %d, want 422", r.status)
	}
	// No Content-Type: JSON.
	r = ts.mustSend(t, call{keys: []string{"k-none"}, contentType: " ", body: payment})
	if r.status != http.StatusCreated {
		t.Errorf("no Content-Type: %d %s", r.status, r.body)
	}
}

// testServerErrorsReleased checks the default policy: a 5xx releases the
// key, and the retry runs the operation again.
func testServerErrorsReleased(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{})
	ts.Processor().FailNext(100)
	r := ts.mustSend(t, keyed("k-5xx", payment))
	if r.status != http.StatusBadGateway || r.problem(t).Type != ProblemProcessorUnavailable {
		t.Fatalf("processor down: %d %s, want 502", r.status, r.body)
	}
	r = ts.mustSend(t, keyed("k-5xx", payment))
	if r.status != http.StatusBadGateway || r.replayed() {
		t.Errorf("retry while down: %d replayed=%v, want a fresh 502", r.status, r.replayed())
	}
	ts.Processor().FailNext(0)
	r = ts.mustSend(t, keyed("k-5xx", payment))
	if r.status != http.StatusCreated || r.replayed() {
		t.Errorf("retry after recovery: %d replayed=%v, want a fresh 201", r.status, r.replayed())
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
	if got := ts.counter(t, "idem_keys_released_total"); got != 2 {
		t.Errorf("released %v keys, want 2", got)
	}
}

// testServerErrorsStored checks Stripe's policy: a 5xx is stored and
// replayed.
func testServerErrorsStored(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{StoreServerErrors: true})
	ts.Processor().FailNext(100)
	first := ts.mustSend(t, keyed("k-5xx", payment))
	if first.status != http.StatusBadGateway {
		t.Fatalf("processor down: %d", first.status)
	}
	ts.Processor().FailNext(0)
	r := ts.mustSend(t, keyed("k-5xx", payment))
	if r.status != http.StatusBadGateway || !r.replayed() || !bytes.Equal(r.body, first.body) ||
		r.header.Get("Content-Type") != "application/problem+json" {
		t.Errorf("retry: %d replayed=%v %s, want the stored 502", r.status, r.replayed(), r.body)
	}
	if n := ts.charges.created.Load(); n != 0 {
		t.Errorf("%d charges, want 0", n)
	}
}

// testStorm sends 100 concurrent requests with one key: exactly one payment,
// and only 201, 409 or the replayed 201 as answers.
func testStorm(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{ProcessorDelay: 50 * time.Millisecond})
	const n = 100
	replies := make([]reply, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			replies[i] = ts.send(t, keyed("k-storm", payment))
		})
	}
	close(start)
	wg.Wait()
	fresh, replayed, conflicts := 0, 0, 0
	var body []byte
	for _, r := range replies {
		switch {
		case r.err != nil:
			t.Errorf("request failed: %v", r.err)
		case r.status == http.StatusCreated && !r.replayed():
			fresh++
			body = r.body
		case r.status == http.StatusCreated:
			replayed++
		case r.status == http.StatusConflict:
			conflicts++
		default:
			t.Errorf("unexpected answer %d %s", r.status, r.body)
		}
	}
	if fresh != 1 {
		t.Fatalf("%d fresh 201s, want exactly 1 (%d replayed, %d conflicts)", fresh, replayed, conflicts)
	}
	for _, r := range replies {
		if r.status == http.StatusCreated && !bytes.Equal(r.body, body) {
			t.Errorf("a 201 differs: %s vs %s", r.body, body)
		}
	}
	if got := ts.charges.created.Load(); got != 1 {
		t.Errorf("%d charges, want 1", got)
	}
	if got := ts.counter(t, "idem_keys_completed_total"); got != 1 {
		t.Errorf("%v payments committed, want 1", got)
	}
	t.Logf("storm: 1 fresh 201, %d replayed, %d conflicts", replayed, conflicts)
}

// crashOnce makes the first n AfterCharge calls simulate a crash.
type crashOnce struct {
	mu sync.Mutex
	n  int
}

func (c *crashOnce) afterCharge(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n > 0 {
		c.n--
		return errors.New("injected crash")
	}
	return nil
}

// testTakeoverAfterCrash crashes a request between the charge and the
// commit: the key stays started (409), then after the lock timeout a retry
// takes it over and reuses the charge: exactly one charge downstream.
func testTakeoverAfterCrash(t *testing.T, newStorage newStorageFunc) {
	const lock = time.Minute // the retry comes within it; the test ages the key past it
	crash := &crashOnce{n: 1}
	ts := newTestServer(t, newStorage(t), Config{LockTimeout: lock, AfterCharge: crash.afterCharge})
	r := ts.send(t, keyed("k-crash", payment))
	if r.err == nil {
		t.Fatalf("crashed request answered %d %s", r.status, r.body)
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Fatalf("%d charges before the crash, want 1", n)
	}
	r = ts.mustSend(t, keyed("k-crash", payment))
	if r.status != http.StatusConflict {
		t.Errorf("retry right after the crash: %d, want 409 (the key stays started)", r.status)
	}
	ts.elapse(t, lock+time.Second)
	r = ts.mustSend(t, keyed("k-crash", payment))
	if r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("retry after the lock timeout: %d replayed=%v %s", r.status, r.replayed(), r.body)
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Errorf("%d charges after the takeover, want 1", n)
	}
	if got := ts.counter(t, "idem_keys_taken_over_total"); got != 1 {
		t.Errorf("%v takeovers, want 1", got)
	}
	if r := ts.mustSend(t, keyed("k-crash", payment)); !r.replayed() {
		t.Errorf("after the takeover: %d replayed=%v", r.status, r.replayed())
	}
}

// testTakeoverThroughSDK is the crash seen from the SDK: one Post call
// retries through the cut connection and the 409s until the takeover
// answers, with one charge downstream.
func testTakeoverThroughSDK(t *testing.T, newStorage newStorageFunc) {
	crash := &crashOnce{n: 1}
	ts := newTestServer(t, newStorage(t), Config{LockTimeout: 300 * time.Millisecond, AfterCharge: crash.afterCharge})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &idem.Client{
		BaseURL: ts.URL,
		Token:   tokenA,
		HTTPClient: &http.Client{Transport: &idem.Transport{
			Base:  tr,
			Retry: idem.RetryPolicy{InitialInterval: 50 * time.Millisecond, ConflictTimeout: 10 * time.Second},
		}},
	}
	var p paymentResource
	resp, err := client.Post(context.Background(), "/v1/payments",
		map[string]any{"amount": 4200, "currency": "usd", "customer": "cus_123"}, &p)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusCreated || p.Amount != 4200 {
		t.Errorf("Post: %d %+v", resp.StatusCode, p)
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
	// A key reused for another payment is a KeyReuseError.
	ctx := idem.WithKey(context.Background(), "k-reuse")
	if _, err := client.Post(ctx, "/v1/payments", map[string]any{"amount": 1, "currency": "usd", "customer": "c"}, nil); err != nil {
		t.Fatal(err)
	}
	_, err = client.Post(ctx, "/v1/payments", map[string]any{"amount": 2, "currency": "usd", "customer": "c"}, nil)
	var reuse *idem.KeyReuseError
	if !errors.As(err, &reuse) || reuse.Key != "k-reuse" || reuse.Problem.Type != idempotency.ProblemKeyMismatch {
		t.Errorf("reused key: %v, want a KeyReuseError with the mismatch problem", err)
	}
}

// testRacingTakers lets ten retries race for one stale key: one takes it
// over, the others see it started or completed.
func testRacingTakers(t *testing.T, newStorage newStorageFunc) {
	const lock = time.Minute // the winner completes within it while nine others queue for connections
	crash := &crashOnce{n: 1}
	ts := newTestServer(t, newStorage(t), Config{LockTimeout: lock, AfterCharge: crash.afterCharge, ProcessorDelay: 20 * time.Millisecond})
	if r := ts.send(t, keyed("k-race", payment)); r.err == nil {
		t.Fatalf("crashed request answered %d", r.status)
	}
	ts.elapse(t, lock+time.Second)
	replies := make([]reply, 10)
	var wg sync.WaitGroup
	for i := range replies {
		wg.Go(func() { replies[i] = ts.send(t, keyed("k-race", payment)) })
	}
	wg.Wait()
	fresh := 0
	for _, r := range replies {
		switch {
		case r.err != nil:
			t.Errorf("request failed: %v", r.err)
		case r.status == http.StatusCreated && !r.replayed():
			fresh++
		case r.status == http.StatusCreated || r.status == http.StatusConflict:
		default:
			t.Errorf("unexpected %d %s", r.status, r.body)
		}
	}
	if fresh != 1 || ts.counter(t, "idem_keys_taken_over_total") != 1 {
		t.Errorf("%d fresh 201s, %v takeovers; want 1 and 1", fresh, ts.counter(t, "idem_keys_taken_over_total"))
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
}

// cutOffRenewals is a key store whose renewals fail while cut is set, as
// when the process serving a request is cut off from the store: the lease
// of a request still running then runs out.
type cutOffRenewals struct {
	idempotency.Store
	cut atomic.Bool
}

func (s *cutOffRenewals) Renew(ctx context.Context, c idempotency.Claim) error {
	if s.cut.Load() {
		return errors.New("injected: the store is unreachable")
	}
	return s.Store.Renew(ctx, c)
}

// testFencedSlowOriginal holds the original request after its charge while
// its renewals cannot reach the store, past the lock timeout; a retry takes
// over and completes; the original's next renewal finds the key taken over
// (lease lost) and cancels its context, so when it resumes it stops before
// writing its payment and answers 409 (its completion would be fenced):
// one payment, one charge.
func testFencedSlowOriginal(t *testing.T, newStorage newStorageFunc) {
	// The taker, whose renewals are cut off too, completes within the
	// lock timeout; the original's renewals, on the middleware's real
	// timer, come a third of it apart.
	const lock = time.Second
	block := newBlocker(1)
	storage := newStorage(t)
	keys := &cutOffRenewals{Store: storage.Keys}
	keys.cut.Store(true)
	storage.Keys = keys
	ts := newTestServer(t, storage, Config{LockTimeout: lock, AfterCharge: block.afterCharge})
	original := make(chan reply)
	go func() { original <- ts.send(t, keyed("k-slow", payment)) }()
	<-block.reached
	ts.elapse(t, lock+time.Second) // its lease ran out, unrenewed
	taker := ts.mustSend(t, keyed("k-slow", payment))
	if taker.status != http.StatusCreated || taker.replayed() {
		t.Fatalf("takeover: %d %s", taker.status, taker.body)
	}
	// The original's renewals reach the store again, and find the key
	// taken over.
	keys.cut.Store(false)
	for deadline := time.Now().Add(10 * time.Second); ts.counter(t, "idem_leases_lost_total") < 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the original's renewals never noticed the takeover")
		}
	}
	block.open()
	r := <-original
	if r.err != nil || r.status != http.StatusConflict || r.problem(t).Type != idempotency.ProblemKeyInUse {
		t.Fatalf("fenced original: %d %v %s, want 409", r.status, r.err, r.body)
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
	if n := ts.payments(t); n != 1 {
		t.Errorf("%d payments, want 1", n)
	}
	for name, want := range map[string]float64{
		"idem_completions_fenced_total": 0, "idem_keys_completed_total": 1,
		"idem_keys_taken_over_total": 1, "idem_leases_lost_total": 1,
	} {
		if got := ts.counter(t, name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	p := taker.payment(t)
	if r := ts.mustSend(t, call{method: "GET", path: "/v1/payments/" + p.ID}); r.status != http.StatusOK || r.payment(t) != p {
		t.Errorf("the taker's payment: %d %s", r.status, r.body)
	}
	if r := ts.mustSend(t, keyed("k-slow", payment)); !r.replayed() || !bytes.Equal(r.body, taker.body) {
		t.Errorf("retry replays %d %s, want the taker's outcome", r.status, r.body)
	}
}

// testLeaseRenewedWhileSlow holds a request after its charge for several
// lock timeouts (the test ages its key past one, again and again): its
// lease is renewed meanwhile, so every duplicate sent past the lock
// timeout gets 409, never a takeover, and there is one payment and one
// charge.
func testLeaseRenewedWhileSlow(t *testing.T, newStorage newStorageFunc) {
	// Renewals come on the middleware's real timer, a third of the lock
	// timeout apart: a renewal delayed by a busy machine stays within it.
	const lock = time.Second
	block := newBlocker(1)
	ts := newTestServer(t, newStorage(t), Config{LockTimeout: lock, AfterCharge: block.afterCharge})
	defer block.open()
	first := make(chan reply, 1)
	go func() { first <- ts.send(t, keyed("k-live", payment)) }()
	<-block.reached
	for i := range 3 {
		ts.elapse(t, lock+lock/2)
		ts.awaitRenewal(t, "k-live")
		r := ts.mustSend(t, keyed("k-live", payment))
		if r.status != http.StatusConflict || r.problem(t).Type != idempotency.ProblemKeyInUse {
			t.Errorf("duplicate %d lock timeouts and a half in: %d %s, want 409 (the first request is alive)", i+1, r.status, r.body)
		}
	}
	block.open()
	r := <-first
	if r.err != nil || r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("slow request: %d %v %s, want a fresh 201", r.status, r.err, r.body)
	}
	if again := ts.mustSend(t, keyed("k-live", payment)); !again.replayed() || !bytes.Equal(again.body, r.body) {
		t.Errorf("retry: %d replayed=%v, want the stored 201", again.status, again.replayed())
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
	if n := ts.payments(t); n != 1 {
		t.Errorf("%d payments, want 1", n)
	}
	for name, want := range map[string]float64{
		"idem_keys_taken_over_total": 0, "idem_completions_fenced_total": 0, "idem_leases_lost_total": 0,
		"idem_conflicts_total": 3, "idem_keys_completed_total": 1,
	} {
		if got := ts.counter(t, name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	if got := ts.counter(t, "idem_leases_renewed_total"); got < 3 {
		t.Errorf("%v renewals, want at least 3, one after each aging", got)
	}
}

// testTakeoverAfterSlowCrash crashes a request that ran past the lock
// timeout (held after its charge, its lease renewed) after its charge: its
// key stays started, the retries get 409 while the renewed lease is live,
// and once it ran out one of them takes the key over and finds the
// charge: one payment, one charge.
func testTakeoverAfterSlowCrash(t *testing.T, newStorage newStorageFunc) {
	// Renewals come on the middleware's real timer, a third of the lock
	// timeout apart; the first retry, sent as soon as the crash cuts the
	// connection, arrives within the lease renewed just before.
	const lock = 1500 * time.Millisecond
	block := newBlocker(1)
	crash := &crashOnce{n: 1}
	ts := newTestServer(t, newStorage(t), Config{LockTimeout: lock,
		AfterCharge: func(ctx context.Context) error {
			if err := block.afterCharge(ctx); err != nil {
				return err
			}
			return crash.afterCharge(ctx)
		}})
	defer block.open()
	first := make(chan reply, 1)
	go func() { first <- ts.send(t, keyed("k-slow-crash", payment)) }()
	<-block.reached
	// The request runs past the lock timeout, and its lease is renewed.
	ts.elapse(t, 2*lock)
	ts.awaitRenewal(t, "k-slow-crash")
	block.open()
	if r := <-first; r.err == nil {
		t.Fatalf("crashed request answered %d %s", r.status, r.body)
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Fatalf("%d charges before the crash, want 1", n)
	}
	if r := ts.mustSend(t, keyed("k-slow-crash", payment)); r.status != http.StatusConflict {
		t.Errorf("the first retry after the crash: %d, want 409 while the crashed request's renewed lease is live", r.status)
	}
	ts.elapse(t, lock+time.Second)
	r := ts.mustSend(t, keyed("k-slow-crash", payment))
	if r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("retry after the lease ran out: %d replayed=%v %s, want a fresh 201", r.status, r.replayed(), r.body)
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
	if n := ts.payments(t); n != 1 {
		t.Errorf("%d payments, want 1", n)
	}
	if got := ts.counter(t, "idem_keys_taken_over_total"); got != 1 {
		t.Errorf("%v takeovers, want 1", got)
	}
	if again := ts.mustSend(t, keyed("k-slow-crash", payment)); !again.replayed() || !bytes.Equal(again.body, r.body) {
		t.Errorf("after the takeover: %d replayed=%v, want the stored 201", again.status, again.replayed())
	}
}

// testLostProcessorAnswer cuts the processor's answer after it charged: the
// payments API's Transport retries with the same key and gets the charge
// back, so one charge and one payment.
func testLostProcessorAnswer(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{})
	ts.Processor().LoseNext(2)
	r := ts.mustSend(t, keyed("k-lost", payment))
	if r.status != http.StatusCreated {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if n := ts.charges.created.Load(); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
}

// failFirstCompletion makes the completion of the first payment's unit of
// work fail, after the handler has done its work (the charge and the
// payment's write included): nothing of the unit of work is committed, and
// the middleware releases the key. It cannot wrap the key store's Tx,
// since the stores' accessors (MemoryStore.Stage, pgstore.Tx)
// find their own unit of work in the request's context; it makes the unit
// of work itself fail to commit, as a handler's write can.
type failFirstCompletion struct {
	PaymentStore
	failed atomic.Bool
}

var errInjectedCommit = errors.New("injected: the commit failed")

func (s *failFirstCompletion) CreatePayment(ctx context.Context, p Payment) error {
	if !s.failed.Swap(true) {
		switch ps := s.PaymentStore.(type) {
		case *MemoryStorage:
			// Staged before the payment, so it runs first and nothing is
			// applied.
			if !ps.Keys().Stage(ctx, func() error { return errInjectedCommit }) {
				return errors.New("failFirstCompletion: no unit of work in the context")
			}
		case *PostgresStorage:
			// A deferred foreign key that no row satisfies: checked, and
			// failed, at COMMIT, after the key's completion statement.
			tx, err := pgstore.Tx(ctx)
			if err != nil {
				return fmt.Errorf("failFirstCompletion: %w", err)
			}
			for _, sql := range []string{
				`CREATE TEMP TABLE fail_commit_parent (id int PRIMARY KEY) ON COMMIT DROP`,
				`CREATE TEMP TABLE fail_commit_child (id int REFERENCES fail_commit_parent DEFERRABLE INITIALLY DEFERRED) ON COMMIT DROP`,
				`INSERT INTO fail_commit_child VALUES (1)`,
			} {
				if _, err := tx.Exec(ctx, sql); err != nil {
					return err
				}
			}
		default:
			return fmt.Errorf("failFirstCompletion: cannot fail the commit of %T", ps)
		}
	}
	return s.PaymentStore.CreatePayment(ctx, p)
}

// testRetryAfterChargedFailure fails a request with a 5xx after the
// processor charged: the key is released with its operation, so the
// immediate retry with the same key gets a fresh 201 (no 409, no wait for
// the lock timeout), the processor's existing charge, and one payment.
func testRetryAfterChargedFailure(t *testing.T, newStorage newStorageFunc) {
	for _, tt := range []struct {
		name    string
		storage func(Storage) Storage
		inject  func(ts *testServer)
		recover func(ts *testServer)
		status  int
		problem string
	}{
		{
			// Every answer of the processor is lost after it charged: the
			// payments API cannot tell whether it was charged and answers 502.
			name:    "processor answers lost",
			storage: func(s Storage) Storage { return s },
			inject:  func(ts *testServer) { ts.Processor().LoseNext(100) },
			recover: func(ts *testServer) { ts.Processor().LoseNext(0) },
			status:  http.StatusBadGateway,
			problem: ProblemProcessorUnavailable,
		},
		{
			// The charge went through and the payment was written; the
			// commit of the key's completion with it fails: 500.
			name: "completion failed",
			storage: func(s Storage) Storage {
				s.Payments = &failFirstCompletion{PaymentStore: s.Payments}
				return s
			},
			inject:  func(*testServer) {},
			recover: func(*testServer) {},
			status:  http.StatusInternalServerError,
			problem: idempotency.ProblemInternal,
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// The default lock timeout (10s): a key left started would
			// answer the retry 409 for that long.
			storage := newStorage(t)
			ts := newTestServer(t, tt.storage(storage), Config{})
			tt.inject(ts)
			r := ts.mustSend(t, keyed("k-charged", payment))
			if r.status != tt.status || r.problem(t).Type != tt.problem {
				t.Fatalf("failing request: %d %s, want %d %s", r.status, r.body, tt.status, tt.problem)
			}
			if n := ts.charges.created.Load(); n != 1 {
				t.Fatalf("%d charges before the retry, want 1 (the failure must come after the charge)", n)
			}
			tt.recover(ts)
			// Another request with the key would leave the charge behind
			// (or charge again): refused, and nothing changes.
			other := strings.Replace(payment, "4200", "4300", 1)
			if r := ts.mustSend(t, keyed("k-charged", other)); r.status != http.StatusUnprocessableEntity ||
				r.problem(t).Type != idempotency.ProblemKeyMismatch || !strings.Contains(r.problem(t).Detail, "failed after it may have taken effect") {
				t.Fatalf("another request with the key: %d %s, want 422 %s saying the first may have taken effect", r.status, r.body, idempotency.ProblemKeyMismatch)
			}
			r = ts.mustSend(t, keyed("k-charged", payment))
			if r.status != http.StatusCreated || r.replayed() {
				t.Fatalf("immediate retry: %d replayed=%v %s, want a fresh 201", r.status, r.replayed(), r.body)
			}
			p := r.payment(t)
			if n := ts.charges.created.Load(); n != 1 {
				t.Errorf("%d charges after the retry, want 1", n)
			}
			if n := committedPayments(t, storage.Payments); n != 1 {
				t.Errorf("%d payments after the retry, want 1", n)
			}
			for name, want := range map[string]float64{
				"idem_keys_claimed_total": 2, "idem_keys_released_total": 1, "idem_keys_completed_total": 1,
				"idem_keys_taken_over_total": 0, "idem_conflicts_total": 0,
			} {
				if got := ts.counter(t, name); got != want {
					t.Errorf("%s = %v, want %v", name, got, want)
				}
			}
			if g := ts.mustSend(t, call{method: "GET", path: "/v1/payments/" + p.ID}); g.status != http.StatusOK || g.payment(t) != p {
				t.Errorf("GET the payment: %d %s", g.status, g.body)
			}
			if again := ts.mustSend(t, keyed("k-charged", payment)); !again.replayed() || !bytes.Equal(again.body, r.body) {
				t.Errorf("third request: %d replayed=%v, want the stored 201", again.status, again.replayed())
			}
		})
	}
}

// countedClaims is a key store that counts the claims asked of it.
type countedClaims struct {
	idempotency.Store
	n atomic.Int64
}

func (s *countedClaims) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	s.n.Add(1)
	return s.Store.Claim(ctx, req)
}

// testWaitForCompletion checks the option that holds a duplicate until the
// first request finishes: the first request, held, is let go once the
// duplicate waits for it, and the duplicate gets its outcome; held until
// the duplicate's wait ran out, the duplicate gets 409.
func testWaitForCompletion(t *testing.T, newStorage newStorageFunc) {
	for _, tt := range []struct {
		name string
		wait time.Duration
		want int
	}{
		{"replay", 10 * time.Second, http.StatusCreated},
		{"timeout", 100 * time.Millisecond, http.StatusConflict},
	} {
		t.Run(tt.name, func(t *testing.T) {
			block := newBlocker(1)
			storage := newStorage(t)
			keys := &countedClaims{Store: storage.Keys}
			storage.Keys = keys
			ts := newTestServer(t, storage, Config{WaitForCompletion: tt.wait, AfterCharge: block.afterCharge})
			defer block.open()
			first := make(chan reply, 1)
			go func() { first <- ts.send(t, keyed("k-wait", payment)) }()
			<-block.reached
			dups := make(chan reply, 1)
			go func() { dups <- ts.send(t, keyed("k-wait", payment)) }()
			var dup reply
			if tt.want == http.StatusCreated {
				// The duplicate waits once it claimed again after its
				// first wait: the first request's claim, then two of its.
				for deadline := time.Now().Add(10 * time.Second); keys.n.Load() < 3; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Error("the duplicate did not wait for the first request")
						break
					}
				}
				block.open()
				dup = <-dups
			} else {
				dup = <-dups
				block.open()
			}
			f := <-first
			if dup.err != nil || dup.status != tt.want {
				t.Fatalf("duplicate: %d %v, want %d", dup.status, dup.err, tt.want)
			}
			if tt.want == http.StatusCreated && (!dup.replayed() || !bytes.Equal(dup.body, f.body)) {
				t.Errorf("duplicate: replayed=%v %s, want the first's outcome %s", dup.replayed(), dup.body, f.body)
			}
		})
	}
}

// testRetention checks that retention is exact at lookup: an expired key is
// a new operation before any purge.
func testRetention(t *testing.T, newStorage newStorageFunc) {
	const retention = time.Minute // the replay comes within it; the test ages the key past it
	ts := newTestServer(t, newStorage(t), Config{Retention: retention, PurgeInterval: time.Hour})
	first := ts.mustSend(t, keyed("k-ret", payment))
	if r := ts.mustSend(t, keyed("k-ret", payment)); !r.replayed() {
		t.Fatalf("within retention: %d replayed=%v", r.status, r.replayed())
	}
	ts.elapse(t, retention+time.Second)
	// Another body would be a 422 within retention; now it is new.
	r := ts.mustSend(t, keyed("k-ret", `{"amount": 99, "currency": "eur", "customer": "cus_9"}`))
	if r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("after retention: %d replayed=%v %s", r.status, r.replayed(), r.body)
	}
	if r.payment(t).ID == first.payment(t).ID || r.payment(t).Charge == first.payment(t).Charge {
		t.Error("an expired key's new operation reused the old payment or charge")
	}
	if n := ts.charges.created.Load(); n != 2 {
		t.Errorf("%d charges, want 2", n)
	}
}

// testPurgeThenReuse purges expired keys in bounded batches, then reuses a
// purged key as a new operation.
func testPurgeThenReuse(t *testing.T, newStorage newStorageFunc) {
	const retention = time.Minute // five payments and a purge within it; the test ages the keys past it
	ts := newTestServer(t, newStorage(t), Config{Retention: retention, PurgeBatch: 2})
	for i := range 5 {
		if r := ts.mustSend(t, keyed(fmt.Sprintf("k-purge-%d", i), payment)); r.status != http.StatusCreated {
			t.Fatalf("%d %s", r.status, r.body)
		}
	}
	if n, err := ts.Purge(context.Background()); err != nil || n != 0 {
		t.Fatalf("Purge within retention = %d, %v; want 0", n, err)
	}
	ts.elapse(t, retention+time.Second)
	n, err := ts.Purge(context.Background())
	if err != nil || n != 5 {
		t.Fatalf("Purge = %d, %v; want 5", n, err)
	}
	if got := ts.counter(t, "idem_keys_purged_total"); got != 5 {
		t.Errorf("purged counter %v, want 5", got)
	}
	// The same request under the purged key derives the same operation:
	// the processor finds its charge, and the payment stands.
	r := ts.mustSend(t, keyed("k-purge-0", payment))
	if r.status != http.StatusCreated || r.replayed() {
		t.Errorf("purged key reused: %d replayed=%v", r.status, r.replayed())
	}
	if n := ts.charges.created.Load(); n != 5 {
		t.Errorf("%d charges after the same request under a purged key, want 5", n)
	}
	if n := ts.payments(t); n != 5 {
		t.Errorf("%d payments after the same request under a purged key, want 5", n)
	}
}

// testNoIdempotency checks the benchmark-only route of
// Config.NoIdempotency: no key is needed, none is stored, and every request
// is a new payment with a charge of its own.
func testNoIdempotency(t *testing.T, newStorage newStorageFunc) {
	storage := newStorage(t)
	ts := newTestServer(t, storage, Config{NoIdempotency: true})

	var ids []string
	for _, c := range []call{
		{body: payment}, // no key
		{body: payment, keys: []string{"k-ignored"}}, // a key is ignored...
		{body: payment, keys: []string{"k-ignored"}}, // ...so its retry pays again
	} {
		r := ts.mustSend(t, c)
		if r.status != http.StatusCreated || r.replayed() {
			t.Fatalf("POST %v: %d replayed=%v %s, want a new 201", c.keys, r.status, r.replayed(), r.body)
		}
		p := r.created(t, "")
		got := ts.mustSend(t, call{method: http.MethodGet, path: "/v1/payments/" + p.ID})
		if got.status != http.StatusOK || got.payment(t) != p {
			t.Errorf("GET %s: %d %s, want %+v", p.ID, got.status, got.body, p)
		}
		stored, err := storage.Payments.GetPayment(context.Background(), "client_a", p.ID)
		if err != nil || stored.IdempotencyKey != "" || stored.OperationID == "" {
			t.Errorf("stored payment %+v, %v; want no key and an operation", stored, err)
		}
		ids = append(ids, p.ID)
	}
	if ids[0] == ids[1] || ids[1] == ids[2] || ids[0] == ids[2] {
		t.Errorf("payment ids %v, want three distinct", ids)
	}
	if n := ts.charges.created.Load(); n != 3 {
		t.Errorf("%d charges, want 3", n)
	}

	// Nothing was stored under the key: claiming it finds it absent.
	res, err := storage.Keys.Claim(context.Background(), idempotency.ClaimRequest{ClientID: "client_a", Key: "k-ignored",
		Method: "POST", Path: "/v1/payments", Fingerprint: []byte("fp")})
	if err != nil || res.Outcome != idempotency.Claimed {
		t.Errorf("claim of the key sent to the unkeyed route: %v, %v; want Claimed (no row)", res.Outcome, err)
	}
	if got := ts.counter(t, "idem_keys_claimed_total"); got != 0 {
		t.Errorf("%v keys claimed by the server, want 0", got)
	}

	// An invalid body stores nothing and says so, without talk of keys.
	r := ts.mustSend(t, call{body: `{"amount": -1, "currency": "usd", "customer": "cus_123"}`})
	if r.status != http.StatusBadRequest || strings.Contains(r.problem(t).Detail, "Idempotency-Key") {
		t.Errorf("invalid body: %d %s", r.status, r.body)
	}
	// A processor outage is a 502 that says a retry is a new payment.
	ts.Processor().FailNext(100)
	r = ts.mustSend(t, call{body: payment})
	if r.status != http.StatusBadGateway || !strings.Contains(r.problem(t).Detail, "new payment") {
		t.Errorf("processor down: %d %s", r.status, r.body)
	}
	ts.Processor().FailNext(0)
}
