package main

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server"
)

// slowAmount is the amount the tests' targets take slowBodyDelay to pay:
// the slow body the in-flight row needs.
const (
	slowAmount    = 4242
	slowBodyDelay = 1500 * time.Millisecond
	slowBodyFlag  = `{"amount": 4242, "currency": "usd", "customer": "cus_slow"}`
)

// counting counts the POST requests that reach h.
func counting(h http.Handler, n *atomic.Int32) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			n.Add(1)
		}
		h.ServeHTTP(w, r)
	})
}

// verdictsOf returns the verdict of each row of a report's table.
func verdictsOf(t *testing.T, report string) map[string]string {
	t.Helper()
	i := strings.Index(report, "\nrow ")
	if i < 0 {
		t.Fatalf("no table of verdicts:\n%s", report)
	}
	got := map[string]string{}
	re := regexp.MustCompile(`^(.+?)  +((conforms|differs|not checkable).*)$`)
	for line := range strings.SplitSeq(report[i+1:], "\n") {
		if m := re.FindStringSubmatch(line); m != nil {
			got[m[1]] = m[2]
		}
	}
	return got
}

var rowNames = []string{"key required", "replay", "advertised retention", "late retry", "another body", "sf-string key", "per client", "key length", "in flight", "retention"}

// sentFigure returns the "N requests sent" of a report.
func sentFigure(t *testing.T, report string) int {
	t.Helper()
	m := regexp.MustCompile(`; (\d+) requests sent, at most (\d+) (payments|operations) made`).FindStringSubmatch(report)
	if m == nil {
		t.Fatalf("report lacks its last line:\n%s", report)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// TestConformanceReference runs the check against the reference server,
// with a card processor that is slow for one amount (the slow body), two
// clients and a three-second retention, waited out: every row conforms.
func TestConformanceReference(t *testing.T) {
	storage := server.NewMemoryStorage()
	proc := &server.Processor{Charges: storage}
	slowProc := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var in struct{ Amount int64 }
		if json.Unmarshal(body, &in) == nil && in.Amount == slowAmount {
			time.Sleep(slowBodyDelay)
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		proc.ServeHTTP(w, r)
	}))
	defer slowProc.Close()
	srv, err := server.New(server.Config{
		Storage:      storage.Storage(),
		APIKeys:      map[string]string{"sk_one": "one", "sk_two": "two"},
		Retention:    3 * time.Second, // the first-sent policy's shortest (the late retry row)
		LockTimeout:  300 * time.Millisecond,
		ProcessorURL: slowProc.URL,
		Logger:       slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	var posts atomic.Int32
	ts := httptest.NewServer(counting(srv, &posts))
	defer ts.Close()

	var out bytes.Buffer
	err = run(t.Context(), []string{"-target", ts.URL + "/v1/payments", "-token", "sk_one", "-token2", "sk_two",
		"-slow-body", slowBodyFlag, "-retention", "3s", "-wait"}, noEnv, &out)
	report := out.String()
	if err != nil {
		t.Fatalf("run: %v\n%s", err, report)
	}
	got := verdictsOf(t, report)
	for _, name := range rowNames {
		if !strings.HasPrefix(got[name], "conforms") {
			t.Errorf("row %s: %q, want conforms", name, got[name])
		}
	}
	if len(got) != len(rowNames) {
		t.Errorf("rows %v, want %v", got, rowNames)
	}
	if !strings.Contains(report, "10 conform, 0 differ, 0 not checkable; ") {
		t.Errorf("report:\n%s", report)
	}
	if sent := sentFigure(t, report); int(posts.Load()) != sent {
		t.Errorf("the server got %d requests, the report says %d were sent", posts.Load(), sent)
	}
	// K1, K3 (another body, accepted with a new key), K4 (the slow body),
	// client 2's K1, the 255-character key and K5; K5 after its retention
	// is the same operation (its operation ID is derived from the request),
	// answered with K5's payment.
	if n := len(storage.Payments()); n != 6 {
		t.Errorf("the check made %d payments, want 6", n)
	}
	t.Logf("\n%s", report)
}

// brokenAPI is a payments API that gets the contract wrong on purpose:
// it takes payments without a key, compares no body, shares keys between
// clients, takes an sf-string's quotes as part of the key, has no key
// length limit, does not see a request in flight (a duplicate runs too),
// and sends no replay marker. It keeps its keys for ever, and replays the
// stored answer faithfully.
type brokenAPI struct {
	mu       sync.Mutex
	answers  map[string][]byte // by key, for every client
	payments int
}

func (b *brokenAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var in struct {
		Amount   int64  `json:"amount"`
		Currency string `json:"currency"`
		Customer string `json:"customer"`
	}
	if r.Header.Get("Authorization") == "" || json.Unmarshal(body, &in) != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	b.mu.Lock()
	stored, ok := b.answers[key]
	b.mu.Unlock()
	if ok && key != "" {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write(stored)
		return
	}
	if in.Amount == slowAmount {
		time.Sleep(slowBodyDelay)
	}
	var id [8]byte
	rand.Read(id[:])
	answer, _ := json.Marshal(map[string]any{"id": "pay_" + hex.EncodeToString(id[:]), "amount": in.Amount})
	b.mu.Lock()
	b.payments++
	if key != "" {
		b.answers[key] = answer
	}
	b.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	w.Write(answer)
}

func (b *brokenAPI) made() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.payments
}

// TestConformanceBroken runs the check against brokenAPI: each row it gets
// wrong differs, and says what the server did. Its budget is above the
// default: client 2's replay of client 1's answer counts as a payment
// (the check cannot tell it from one), which leaves the default no room
// for the retention row.
func TestConformanceBroken(t *testing.T) {
	api := &brokenAPI{answers: map[string][]byte{}}
	var posts atomic.Int32
	ts := httptest.NewServer(counting(api, &posts))
	defer ts.Close()

	var out bytes.Buffer
	err := run(t.Context(), []string{"-target", ts.URL + "/v1/payments", "-token", "sk_one", "-token2", "sk_two",
		"-slow-body", slowBodyFlag, "-retention", "1s", "-wait", "-max-payments", "13"}, noEnv, &out)
	report := out.String()
	if err == nil || errors.Is(err, errUsage) || err.Error() != "8 of 10 rows differ from the contract" {
		t.Errorf("run = %v, want 8 of 10 rows differ\n%s", err, report)
	}
	want := map[string]string{
		"key required":         "differs (accepted without a key, a payment no retry can find: 201 Created, application/json)",
		"replay":               "conforms (same status and body; no replay marker, and a new key got another answer)",
		"another body":         "differs (replayed the first answer: the body is not compared)",
		"in flight":            "differs (ran the duplicate as well: two answers, two payments)",
		"per client":           "differs (replayed client 1's answer to client 2: keys are shared by all clients)",
		"sf-string key":        "differs (a new payment: the quotes were taken as part of another key)",
		"key length":           "differs (256 not refused with 400: 201 Created, application/json)",
		"advertised retention": "differs (K1's answer has no Idempotency-TTL: a client cannot tell how long it may retry)",
		"late retry":           "differs (ran it, 201 Created, application/json: a retry that arrives after its key was purged would run again)",
		"retention":            "conforms (replayed 900ms after K5 was sent; still replayed after the retention)",
	}
	got := verdictsOf(t, report)
	for _, name := range rowNames {
		if got[name] != want[name] {
			t.Errorf("row %s:\n got %q\nwant %q", name, got[name], want[name])
		}
	}
	if sent := sentFigure(t, report); int(posts.Load()) != sent {
		t.Errorf("the server got %d requests, the report says %d were sent", posts.Load(), sent)
	}
	// K1, no key, K2 (a new key: the replay has no marker), K6 first sent
	// long ago, K4 twice, the sf-string, both long keys, K5.
	if n := api.made(); n != 10 {
		t.Errorf("the check made %d payments, want 10", n)
	}
	if !strings.Contains(report, "at most 11 payments made (-max-payments 13)") { // the 10 and client 2's K1
		t.Errorf("report:\n%s", report)
	}
	t.Logf("\n%s", report)
}

// TestConformanceMaxPayments checks that the check stops before it could
// make more payments than -max-payments, on a server that makes one for
// nearly every request.
func TestConformanceMaxPayments(t *testing.T) {
	api := &brokenAPI{answers: map[string][]byte{}}
	ts := httptest.NewServer(api)
	defer ts.Close()
	var out bytes.Buffer
	err := run(t.Context(), []string{"-target", ts.URL + "/v1/payments", "-token", "sk_one", "-token2", "sk_two",
		"-max-payments", "3"}, noEnv, &out)
	report := out.String()
	if err == nil {
		t.Errorf("run = nil, want rows that differ\n%s", report)
	}
	if n := api.made(); n > 3 {
		t.Errorf("the check made %d payments with -max-payments 3", n)
	}
	got := verdictsOf(t, report)
	for _, name := range []string{"per client", "key length"} {
		if got[name] != "not checkable (-max-payments 3 reached: its requests could make more payments)" {
			t.Errorf("row %s: %q, want not checkable for the budget", name, got[name])
		}
	}
	if !strings.Contains(report, "at most 3 payments made (-max-payments 3)") {
		t.Errorf("report:\n%s", report)
	}
}

// TestConformanceDryRun checks that -dry-run lists the requests and sends
// none.
func TestConformanceDryRun(t *testing.T) {
	var posts atomic.Int32
	ts := httptest.NewServer(counting(http.NotFoundHandler(), &posts))
	defer ts.Close()
	var out bytes.Buffer
	err := run(t.Context(), []string{"-target", ts.URL + "/v1/payments", "-token", "sk_one", "-dry-run",
		"-retention", "24h"}, noEnv, &out)
	if err != nil {
		t.Fatal(err)
	}
	report := out.String()
	if posts.Load() != 0 {
		t.Errorf("-dry-run sent %d requests", posts.Load())
	}
	for _, want := range []string{
		"-dry-run: nothing is sent",
		"all POST " + ts.URL + "/v1/payments with Content-Type: application/json;\n  client 1's credentials: Authorization; client 2's: none\n",
		"no key, the body: client 1's credentials, no Idempotency-Key, body {\"amount\": 4200,",
		"K1 again, the same body: client 1's credentials, Idempotency-Key: ",
		"K2, the body: client 1's credentials, Idempotency-Key: ",
		"; sent only if K1's replay has no Idempotent-Replayed: true; a new key must get another answer",
		`"K1" (sf-string), the body: client 1's credentials, Idempotency-Key: "`,
		"a key of 256 characters: client 1's credentials, Idempotency-Key: ",
		"none: not checkable (needs -slow-body",
		"none: not checkable (needs -token2 or -header2",
		"none: not checkable (the published retention is 24h0m0s; -wait waits it out (about 24h0m10s))",
	} {
		if !strings.Contains(report, want) {
			t.Errorf("plan lacks %q:\n%s", want, report)
		}
	}
}

// TestConformanceDryRunHeaders checks the plan of a PATCH check whose
// clients send X-Api-Key: it names the method and the headers, never
// their values, and speaks of operations.
func TestConformanceDryRunHeaders(t *testing.T) {
	var out bytes.Buffer
	err := run(t.Context(), []string{"-target", "http://127.0.0.1:1/v1/orders/42?expand=items", "-method", "patch", "-dry-run",
		"-header", "X-Api-Key: secret-one", "-header", "X-Tenant: t1", "-header2", "X-Api-Key: secret-two", "-body", `{"qty": 2}`}, noEnv, &out)
	require.NoError(t, err)
	report := out.String()
	for _, want := range []string{
		"idem conformance check of PATCH http://127.0.0.1:1/v1/orders/42?expand=items\n",
		"at most 10 operations (-max-operations)",
		"all PATCH http://127.0.0.1:1/v1/orders/42?expand=items with Content-Type: application/json;\n  client 1's credentials: X-Api-Key, X-Tenant; client 2's: X-Api-Key\n",
		"1. key required: a PATCH without a key gets 400",
		"K1 from client 2, the body: client 2's credentials, Idempotency-Key: ",
	} {
		assert.Contains(t, report, want)
	}
	assert.NotContains(t, report, "secret")
	assert.NotContains(t, strings.ToLower(report), "payment")
}

func TestConformanceFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-token", "T"},
		{"-target", "https://api.example.com/v1/payments"},
		{"-target", "ftp://api.example.com/", "-token", "T"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-run", "crash"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-token2", "T"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-body", "[1]"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-slow-body", "slow"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-max-payments", "0"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-wait"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-method", "GET"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-method", "PUT"},
		{"-target", "https://api.example.com/v1/payments", "-header", "X-Api-Key"},
		{"-target", "https://api.example.com/v1/payments", "-header", ": K1"},
		{"-target", "https://api.example.com/v1/payments", "-header", "X Api Key: K1"},
		{"-target", "https://api.example.com/v1/payments", "-header", "X-Api-Key: K\x001"},
		{"-target", "https://api.example.com/v1/payments", "-header", "X-Api-Key: K1\r\nX-Admin: 1"},
		{"-target", "https://api.example.com/v1/payments", "-header", "Idempotency-Key: K"},
		{"-target", "https://api.example.com/v1/payments", "-header", "content-type: text/plain"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-header", "Authorization: Basic dTpw"},
		{"-target", "https://api.example.com/v1/payments", "-header", "X-Api-Key: K1", "-header2", "X-Api-Key:  K1"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-header2", "Authorization: Bearer T"},
		{"-target", "https://api.example.com/v1/payments", "-header2", "X-Api-Key: K2"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-max-payments", "3", "-max-operations", "4"},
		{"-target", "https://api.example.com/v1/payments", "-token", "T", "-max-operations", "0"},
		{"-header", "X-Api-Key: K1"},
		{"-method", "PATCH"},
		{"-max-operations", "3"},
	} {
		var out bytes.Buffer
		if err := run(t.Context(), args, noEnv, &out); !errors.Is(err, errUsage) {
			t.Errorf("run(%q) = %v, want a usage error", args, err)
		}
	}
}

func TestOtherBody(t *testing.T) {
	for in, want := range map[string]string{
		`{"amount": 4200, "currency": "usd"}`: `{"amount":4201,"currency":"usd"}`,
		`{"b": 1.5, "a": 2}`:                  `{"a":3,"b":1.5}`,
		`{"customer": "cus_1"}`:               `{"customer":"cus_1-2"}`,
		`{"ok": true}`:                        `{"idem_conformance":"another body","ok":true}`,
	} {
		if got := string(otherBody([]byte(in))); got != want {
			t.Errorf("otherBody(%s) = %s, want %s", in, got, want)
		}
	}
}
