package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server"
	"github.com/idemkit/idem/server/idempotency"
)

// The tests of this file check the conformance check against targets that
// are not the reference server: an orders API whose clients authenticate
// with X-Api-Key (on POST and on PATCH), one that refuses every
// credential, and one that ignores keys entirely.

// orderBody and slowOrderBody are the -body and -slow-body of the orders
// API: quantity 99 takes slowBodyDelay.
const (
	orderBody     = `{"item": "wool", "qty": 1}`
	slowOrderBody = `{"item": "wool", "qty": 99}`
	slowQty       = 99
)

// ordersAPI is an orders service built on package idempotency as a user
// would build it: its clients send X-Api-Key (k1 is client a, k2 client
// b), POST /v1/orders creates an order, PATCH /v1/orders/{id} changes
// one (each change a new version). It counts the requests of each method.
type ordersAPI struct {
	http.Handler
	mu      sync.Mutex
	methods map[string]int
	next    int
}

func newOrdersAPI(t *testing.T) *ordersAPI {
	api := &ordersAPI{methods: map[string]int{}}
	keyed := idempotency.Middleware(idempotency.NewMemoryStore(), idempotency.Options{
		ClientID: func(r *http.Request) (string, bool) {
			c, ok := map[string]string{"k1": "a", "k2": "b"}[r.Header.Get("X-Api-Key")]
			return c, ok
		},
		Logger: slog.New(slog.DiscardHandler),
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/orders", keyed(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		api.change(w, r, "", http.StatusCreated)
	})))
	mux.Handle("PATCH /v1/orders/{id}", keyed(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		api.change(w, r, r.PathValue("id"), http.StatusOK)
	})))
	api.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		api.mu.Lock()
		api.methods[r.Method]++
		api.mu.Unlock()
		mux.ServeHTTP(w, r)
	})
	return api
}

// change creates order id (a new one if "") or makes a new version of it.
func (api *ordersAPI) change(w http.ResponseWriter, r *http.Request, id string, status int) {
	var in struct {
		Item string `json:"item"`
		Qty  int    `json:"qty"`
	}
	if json.NewDecoder(r.Body).Decode(&in) != nil || in.Item == "" || in.Qty < 1 {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprintf(w, `{"type":%q,"status":400,"detail":"want item and qty"}`+"\n", idempotency.ProblemInvalidRequest)
		return
	}
	if in.Qty == slowQty {
		time.Sleep(slowBodyDelay)
	}
	api.mu.Lock()
	api.next++
	n := api.next
	api.mu.Unlock()
	if id == "" {
		id = fmt.Sprint("ord_", n)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(map[string]any{"id": id, "item": in.Item, "qty": in.Qty, "version": n})
}

func (api *ordersAPI) count(method string) int {
	api.mu.Lock()
	defer api.mu.Unlock()
	return api.methods[method]
}

// checkTarget runs the check with args and returns its report, its table
// of verdicts and its error.
func checkTarget(t *testing.T, args ...string) (string, map[string]string, error) {
	t.Helper()
	var out bytes.Buffer
	err := run(t.Context(), args, noEnv, &out)
	report := out.String()
	t.Logf("\n%s", report)
	return report, verdictsOf(t, report), err
}

// TestConformanceAPIKeyHeaders checks an API whose clients authenticate
// with X-Api-Key, given with -header and -header2: every row conforms
// (the retention is not asked for), and the report speaks of operations,
// not payments, since the body is not the default payment.
func TestConformanceAPIKeyHeaders(t *testing.T) {
	api := newOrdersAPI(t)
	ts := httptest.NewServer(api)
	defer ts.Close()
	report, got, err := checkTarget(t, "-target", ts.URL+"/v1/orders", "-header", "X-Api-Key: k1", "-header2", "X-Api-Key: k2",
		"-body", orderBody, "-slow-body", slowOrderBody)
	require.NoError(t, err)
	for _, name := range rowNames {
		if name == "retention" {
			assert.Equal(t, "not checkable (pass -retention with the retention the API publishes (Stripe: 24h), and -wait to wait it out)", got[name])
			continue
		}
		assert.True(t, strings.HasPrefix(got[name], "conforms"), "row %s: %q, want conforms", name, got[name])
	}
	assert.Contains(t, got["per client"], "an operation of client 2's own")
	assert.Contains(t, report, "idem conformance check of POST "+ts.URL+"/v1/orders")
	assert.Contains(t, report, "9 conform, 0 differ, 1 not checkable; ")
	assert.Contains(t, report, "operations made (-max-operations 10)")
	assert.NotContains(t, strings.ToLower(report), "payment")
	assert.Equal(t, sentFigure(t, report), api.count(http.MethodPost))
}

// TestConformancePATCH checks a PATCH endpoint, picked with -method and
// -target: the check sends PATCH requests only, to that URL, and every
// row it can check conforms.
func TestConformancePATCH(t *testing.T) {
	api := newOrdersAPI(t)
	ts := httptest.NewServer(api)
	defer ts.Close()
	target := ts.URL + "/v1/orders/ord_42"
	report, got, err := checkTarget(t, "-target", target, "-method", "PATCH", "-header", "X-Api-Key: k1", "-header2", "X-Api-Key: k2",
		"-body", orderBody, "-max-operations", "8")
	require.NoError(t, err)
	for _, name := range []string{"key required", "replay", "another body", "sf-string key", "per client", "key length"} {
		assert.True(t, strings.HasPrefix(got[name], "conforms"), "row %s: %q, want conforms", name, got[name])
	}
	assert.Equal(t, "conforms (400 Bad Request, application/problem+json)", got["key required"])
	assert.Contains(t, report, "idem conformance check of PATCH "+target)
	assert.Contains(t, report, "1. key required: a PATCH without a key gets 400")
	assert.Contains(t, report, "(-max-operations 8)")
	assert.Zero(t, api.count(http.MethodPost), "POST requests sent to a PATCH endpoint")
	assert.Equal(t, sentFigure(t, report), api.count(http.MethodPatch))
}

// TestConformanceCredentialsRefused checks a run whose every request is
// refused: the X-Api-Key API checked with a bearer token, as the check
// sent before -header existed, and an API that answers 403 to everything.
// No row differs; each that sent a request is not checkable, credentials
// refused, and the run fails saying so, after a single request.
func TestConformanceCredentialsRefused(t *testing.T) {
	forbidden := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "forbidden", http.StatusForbidden)
	})
	for name, tc := range map[string]struct {
		api   http.Handler
		creds []string
		want  string
	}{
		"X-Api-Key API given a token": {newOrdersAPI(t), []string{"-token", "k1", "-token2", "k2"}, "401 Unauthorized, application/problem+json"},
		"403 to everything":           {forbidden, []string{"-header", "X-Api-Key: k1", "-header2", "X-Api-Key: k2"}, "403 Forbidden, text/plain"},
	} {
		t.Run(name, func(t *testing.T) {
			var posts atomic.Int32
			ts := httptest.NewServer(counting(tc.api, &posts))
			defer ts.Close()
			args := append([]string{"-target", ts.URL + "/v1/orders", "-body", orderBody, "-slow-body", slowOrderBody}, tc.creds...)
			report, got, err := checkTarget(t, args...)
			require.Error(t, err)
			assert.Equal(t, "the target refused the credentials of every request (401 or 403): nothing was checked", err.Error())
			for _, row := range rowNames {
				if row == "retention" {
					continue // not asked for: it says so
				}
				assert.True(t, strings.HasPrefix(got[row], "not checkable (credentials refused"), "row %s: %q", row, got[row])
				assert.Contains(t, got[row], tc.want)
			}
			assert.Contains(t, report, "0 conform, 0 differ, 10 not checkable; 1 requests sent")
			assert.EqualValues(t, 1, posts.Load())
		})
	}
}

// keylessAPI ignores Idempotency-Key entirely: every POST makes a new
// payment with an id of its own, or, with sameAnswer, answers every one
// alike (no id); with marker, every answer says Idempotent-Replayed: true.
// Like many APIs it validates the amount: over 4200 is refused with 422,
// whatever the key.
type keylessAPI struct {
	sameAnswer, marker bool
	made               atomic.Int32
}

func (api *keylessAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var in struct{ Amount int64 }
	if json.NewDecoder(r.Body).Decode(&in) != nil || in.Amount < 1 {
		http.Error(w, "bad amount", http.StatusBadRequest)
		return
	}
	if in.Amount > 4200 {
		http.Error(w, "amount over the limit", http.StatusUnprocessableEntity)
		return
	}
	n := api.made.Add(1)
	if api.marker {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	if api.sameAnswer {
		fmt.Fprintf(w, `{"status":"accepted","amount":%d}`, in.Amount)
		return
	}
	fmt.Fprintf(w, `{"id":"pay_%d","amount":%d}`, n, in.Amount)
}

// TestConformanceIgnoresKeys checks an API that ignores keys: no row
// conforms. The rows whose premise is a replay (per client, sf-string,
// retention) are not checkable and say why, rather than conform (client
// 2's new payment is not proof of scoping when client 1 gets a new one
// too) or differ; the 422 to another body is not taken for a key check
// when another body is refused on its own; and answers that do not tell
// one operation from another make the replay not checkable, also when
// every one of them carries a replay marker.
func TestConformanceIgnoresKeys(t *testing.T) {
	for _, api := range []*keylessAPI{{}, {sameAnswer: true}, {sameAnswer: true, marker: true}} {
		t.Run(fmt.Sprintf("sameAnswer=%v,marker=%v", api.sameAnswer, api.marker), func(t *testing.T) {
			ts := httptest.NewServer(api)
			defer ts.Close()
			report, got, err := checkTarget(t, "-target", ts.URL+"/v1/payments", "-token", "sk_one", "-token2", "sk_two",
				"-retention", "1s", "-wait")
			require.Error(t, err)
			notReplayed := "K1 was not seen replayed (see replay)"
			want := map[string]string{
				"key required":         "differs (accepted without a key, a payment no retry can find: 201 Created, application/json)",
				"replay":               "differs (another answer, 201 Created, application/json: the request ran twice)",
				"another body":         "not checkable (another body is not accepted with a new key either: 422 Unprocessable Content, text/plain: the 422 may not be about the key)",
				"sf-string key":        "not checkable (" + notReplayed + ": no replay to expect)",
				"per client":           "not checkable (" + notReplayed + ": client 2's answer shows nothing of scoping)",
				"key length":           "differs (256 not refused with 400: 201 Created, application/json)",
				"advertised retention": "differs (K1's answer has no Idempotency-TTL: a client cannot tell how long it may retry)",
				"late retry":           "differs (ran it, 201 Created, application/json: a retry that arrives after its key was purged would run again)",
				"in flight":            "not checkable (needs -slow-body: a body the target takes over a second to process (see docs/conformance.md))",
				"retention":            "not checkable (" + notReplayed + ": no key kept to time)",
			}
			if api.marker {
				for _, row := range []string{"key required", "replay", "key length", "late retry"} {
					want[row] = strings.Replace(want[row], "application/json", "application/json, Idempotent-Replayed: true", 1)
				}
			}
			if api.sameAnswer {
				want["replay"] = "not checkable (a new key with the body got the same answer, and no replay marker: a replay cannot be told from a second execution)"
			}
			for _, name := range rowNames {
				assert.Equal(t, want[name], got[name], "row %s", name)
			}
			assert.NotContains(t, report, "conforms (")
			assert.Equal(t, sentFigure(t, report), int(api.made.Load())+2) // the two 422s to another body made nothing
		})
	}
}

// TestConformanceMaxPaymentsSameAnswers checks -max-payments against an
// API that ignores keys and answers every payment alike: an answer that
// repeats an earlier one is no proof that nothing was made, so the check
// still stops at the limit.
func TestConformanceMaxPaymentsSameAnswers(t *testing.T) {
	api := &keylessAPI{sameAnswer: true}
	ts := httptest.NewServer(api)
	defer ts.Close()
	report, _, err := checkTarget(t, "-target", ts.URL+"/v1/payments", "-token", "sk_one", "-token2", "sk_two", "-max-payments", "3")
	require.Error(t, err)
	assert.LessOrEqual(t, int(api.made.Load()), 3, "payments made with -max-payments 3")
	assert.Contains(t, report, fmt.Sprintf("at most %d payments made (-max-payments 3)", api.made.Load()))
}

// lateKeys delays by lateBy every request whose key it first saw over
// lateAfter ago: the probe of the retention row within the retention
// reaches the server only after the retention. Each request without a
// first-sent time gets the time it arrives, as a client that reuses a key
// for a new operation sends: the server that forgot the key runs it anew.
func lateKeys(h http.Handler, lateAfter, lateBy time.Duration) http.Handler {
	var mu sync.Mutex
	seen := map[string]time.Time{}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		first, ok := seen[key]
		if !ok {
			seen[key] = time.Now()
		}
		mu.Unlock()
		if ok && key != "" && time.Since(first) > lateAfter {
			time.Sleep(lateBy)
		}
		if r.Header.Get("Repeatability-First-Sent") == "" {
			r.Header.Set("Repeatability-First-Sent", time.Now().UTC().Format(http.TimeFormat))
		}
		h.ServeHTTP(w, r)
	})
}

// TestConformanceRetentionLate checks the retention row when its request
// within the retention is answered only after the retention (a slow
// answer, a busy machine): the server forgot the key in time, and the row
// is not checkable, never "differs".
func TestConformanceRetentionLate(t *testing.T) {
	srv, err := server.New(server.Config{
		Storage:   server.NewMemoryStorage().Storage(),
		APIKeys:   map[string]string{"sk_one": "one"},
		Retention: 3 * time.Second, // the first-sent policy's shortest (the late retry row)
		Logger:    slog.New(slog.DiscardHandler),
	})
	require.NoError(t, err)
	defer srv.Close()
	ts := httptest.NewServer(lateKeys(srv, 2100*time.Millisecond, 1200*time.Millisecond))
	defer ts.Close()
	_, got, err := checkTarget(t, "-target", ts.URL+"/v1/payments", "-token", "sk_one", "-retention", "3s", "-wait")
	require.NoError(t, err)
	assert.Regexp(t, `^not checkable \(K5 again was answered [0-9]+\.[0-9]+s after K5 was sent, past the 3s retention: it may have come too late\)$`, got["retention"])
}

// TestConformanceInFlightDuplicateFirst checks the in-flight row when the
// duplicate reaches the API before the first request (a slow network
// under the first): the API runs the duplicate and answers the first 409
// with Retry-After, which conforms: the request that came while the other
// ran got the 409.
func TestConformanceInFlightDuplicateFirst(t *testing.T) {
	api := newOrdersAPI(t)
	var mu sync.Mutex
	delayed := false
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		mu.Lock()
		first := string(body) == slowOrderBody && !delayed
		delayed = delayed || first
		mu.Unlock()
		if first {
			time.Sleep(3 * inFlightAfter) // the duplicate, due inFlightAfter later, gets there first
		}
		api.ServeHTTP(w, r)
	}))
	defer ts.Close()
	_, got, err := checkTarget(t, "-target", ts.URL+"/v1/orders", "-header", "X-Api-Key: k1", "-header2", "X-Api-Key: k2",
		"-body", orderBody, "-slow-body", slowOrderBody)
	require.NoError(t, err)
	assert.Regexp(t, `^conforms \(409 Conflict, .*Retry-After: .*, to the first request, which arrived second\)$`, got["in flight"])
}
