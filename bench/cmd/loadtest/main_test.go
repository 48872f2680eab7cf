package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestCheckLoopback(t *testing.T) {
	for _, tc := range []struct {
		url string
		ok  bool
	}{
		{"http://127.0.0.1:8080", true},
		{"http://localhost:8080", true},
		{"http://[::1]:8080", true},
		{"http://10.0.0.1:8080", false},
		{"http://example.com", false},
	} {
		if err := checkLoopback(tc.url); (err == nil) != tc.ok {
			t.Errorf("checkLoopback(%q) = %v, want ok %t", tc.url, err, tc.ok)
		}
	}
}

func TestParseFlags(t *testing.T) {
	getenv := func(string) string { return "" }
	c, err := parseFlags([]string{"-scenario", "first, conflict", "-concurrency", "3"}, getenv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.scenarios; len(got) != 2 || got[0] != "first" || got[1] != "conflict" || c.concurrency != 3 {
		t.Errorf("scenarios %q, concurrency %d", got, c.concurrency)
	}
	for _, args := range [][]string{
		{"-scenario", "nope"},
		{"-concurrency", "0"},
		{"-duration", "0s"},
		{"-server-url", "http://192.0.2.1:80"},
		{"-rounds", "0"},
		{"extra"},
	} {
		if _, err := parseFlags(args, getenv, io.Discard); err == nil {
			t.Errorf("parseFlags(%q): no error", args)
		}
	}
}

func TestQuantile(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 1000; i++ {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	for _, tc := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Millisecond}, {0.99, 990 * time.Millisecond}, {0.999, 999 * time.Millisecond}, {1, time.Second}} {
		if got := quantile(d, tc.q); got != tc.want {
			t.Errorf("quantile(%v) = %v, want %v", tc.q, got, tc.want)
		}
	}
	if got := quantile(nil, 0.5); got != 0 {
		t.Errorf("quantile(nil) = %v", got)
	}
}

func TestHasFlag(t *testing.T) {
	help := "Usage of idem-server:\n  -addr address\n    \tlisten address\n  -no-idempotency\n    \tserve without the layer\n"
	if !hasFlag(help, "no-idempotency") || !hasFlag(help, "addr") || hasFlag(help, "async-claims") {
		t.Error("hasFlag misreads the -h text")
	}
}

func TestPaymentBodyIsStable(t *testing.T) {
	if a, b := paymentBody(7), paymentBody(7); string(a) != string(b) || string(a) == string(paymentBody(8)) {
		t.Error("paymentBody must give the same bytes for the same n and others for another")
	}
	if got, want := string(paymentBody(7)), `{"amount":107,"currency":"usd","customer":"cus_7"}`; got != want {
		t.Errorf("paymentBody(7) = %s, want %s", got, want)
	}
}

func TestMetric(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		io.WriteString(w, `# HELP idem_db_round_trips_total Round trips.
# TYPE idem_db_round_trips_total counter
idem_db_round_trips_total{kind="batch"} 2
idem_db_round_trips_total{kind="query"} 1.5e+06
idem_db_round_trips_totalx 100
idem_keys_purged_total 42
`)
	}))
	defer srv.Close()
	ctx := context.Background()
	if v, err := metric(ctx, srv.URL, "idem_db_round_trips_total"); err != nil || v != 1500002 {
		t.Errorf("idem_db_round_trips_total = %v, %v; want the sum of its labelled samples, 1500002", v, err)
	}
	if v, err := purged(ctx, srv.URL); err != nil || v != 42 {
		t.Errorf("purged = %v, %v; want 42", v, err)
	}
	if _, err := metric(ctx, srv.URL, "idem_missing_total"); err == nil {
		t.Error("a missing counter: no error")
	}
}

func TestRatioLine(t *testing.T) {
	round := func(first, unkeyed float64) map[string]result {
		return map[string]result{"first": {ReqPerS: first}, "unkeyed": {ReqPerS: unkeyed}}
	}
	for _, tc := range []struct {
		rounds []map[string]result
		want   string
	}{
		{[]map[string]result{round(600, 1000)}, "first/unkeyed req/s = 0.60 (target >= 0.75: MISSED)"},
		{[]map[string]result{round(900, 1000)}, "first/unkeyed req/s = 0.90 (target >= 0.75: met)"},
		{[]map[string]result{round(740, 1000)}, "first/unkeyed req/s = 0.74 (target >= 0.75: MISSED)"},
		{[]map[string]result{round(750, 1000)}, "first/unkeyed req/s = 0.75 (target >= 0.75: met)"},
		// The median, not the best round, is judged; the rounds keep their order.
		{[]map[string]result{round(900, 1000), round(500, 1000), round(700, 1000)},
			"first/unkeyed req/s = 0.70, median of 3 rounds [0.90 0.50 0.70] (target >= 0.75: MISSED)"},
		{[]map[string]result{round(900, 1000), round(700, 1000)},
			"first/unkeyed req/s = 0.80, median of 2 rounds [0.90 0.70] (target >= 0.75: met)"},
		// A round without one of the two, or with nothing measured, is left out.
		{[]map[string]result{round(900, 1000), {"first": {ReqPerS: 800}}, round(800, 0)},
			"first/unkeyed req/s = 0.90 (target >= 0.75: met)"},
		{[]map[string]result{{"first": {ReqPerS: 800}}},
			"first/unkeyed: not measured (first and unkeyed must both run)"},
	} {
		if got := ratioLine(tc.rounds, "first", "unkeyed", firstOverUnkeyed); got != tc.want {
			t.Errorf("ratioLine = %q\n                want %q", got, tc.want)
		}
	}
}

// TestPrintRatiosConcurrency checks that a run at another concurrency than
// issue 11's says so next to the verdict.
func TestPrintRatiosConcurrency(t *testing.T) {
	rounds := []map[string]result{{"first": {ReqPerS: 700}, "unkeyed": {ReqPerS: 1000}}}
	for _, tc := range []struct {
		concurrency int
		want        string
	}{
		{16, "ratio (a)/(c): first/unkeyed req/s = 0.70 (target >= 0.75: MISSED)\n"},
		{32, "ratio (a)/(c): first/unkeyed req/s = 0.70 (target >= 0.75: MISSED); issue 11 sets this target at concurrency 16, not 32\n"},
	} {
		var out strings.Builder
		r := &runner{cfg: config{concurrency: tc.concurrency, scenarios: []string{"first", "unkeyed"}}, stdout: &out}
		r.printRatios(rounds)
		if got, _, _ := strings.Cut(out.String(), "ratio (b)"); got != tc.want {
			t.Errorf("c%d: printRatios printed %q, want %q first", tc.concurrency, out.String(), tc.want)
		}
	}
}

func TestParseFlagsHandler(t *testing.T) {
	getenv := func(string) string { return "" }
	c, err := parseFlags([]string{"-handler", "orders", "-one-transaction", "-database-url", "postgres://postgres@127.0.0.1/idem_bench",
		"-scenario", "first,article,unkeyed,replay"}, getenv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.handler != "orders" || !c.oneTx || len(c.scenarios) != 4 || c.scenarios[1] != "article" {
		t.Errorf("parsed %+v", c)
	}
	if !strings.Contains(c.databaseURL, "sslmode=disable") {
		t.Errorf("database URL %q: want TLS off on loopback", c.databaseURL)
	}
	for _, args := range [][]string{
		{"-handler", "nope", "-database-url", "postgres://127.0.0.1/x"},
		{"-handler", "orders"}, // no database
		{"-handler", "orders", "-database-url", "postgres://127.0.0.1/x", "-server-url", "http://127.0.0.1:1"},
		{"-one-transaction"}, // without -handler
	} {
		if _, err := parseFlags(args, getenv, io.Discard); err == nil {
			t.Errorf("parseFlags(%q): no error", args)
		}
	}
}

func TestNoTLSOnLoopback(t *testing.T) {
	t.Setenv("PGSSLMODE", "")
	for in, want := range map[string]string{
		"postgres://postgres@127.0.0.1:5432/b":               "postgres://postgres@127.0.0.1:5432/b?sslmode=disable",
		"postgres://postgres@localhost/b?application_name=x": "postgres://postgres@localhost/b?application_name=x&sslmode=disable",
		"postgres://postgres@127.0.0.1/b?sslmode=require":    "postgres://postgres@127.0.0.1/b?sslmode=require",
		"host=127.0.0.1 user=postgres dbname=b":              "host=127.0.0.1 user=postgres dbname=b sslmode=disable",
		"postgres://postgres@db.example.com/b":               "postgres://postgres@db.example.com/b",
		"":                                                   "",
	} {
		if got := noTLSOnLoopback(in); got != want {
			t.Errorf("noTLSOnLoopback(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestPrintRatiosBench checks the bench server's verdicts: issue 35's
// replay over read in CPU, idem over the article by mode, and no verdict on
// replay/first (issue 21's 4, since restated) or on first less unkeyed.
func TestPrintRatiosBench(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	rounds := []map[string]result{
		{"first": {ReqPerS: 1200, CPU: f(0.8)}, "article": {ReqPerS: 1000, CPU: f(0.9)}, "unkeyed": {ReqPerS: 1800, CPU: f(0.5)},
			"replay": {ReqPerS: 5000, CPU: f(0.24)}, "read": {ReqPerS: 6000, CPU: f(0.2)}},
		{"first": {ReqPerS: 1100, CPU: f(0.8)}, "article": {ReqPerS: 1000, CPU: f(0.9)}, "unkeyed": {ReqPerS: 1800, CPU: f(0.5)},
			"replay": {ReqPerS: 5000, CPU: f(0.22)}, "read": {ReqPerS: 6000, CPU: f(0.2)}},
	}
	for _, tc := range []struct {
		oneTx bool
		want  []string
	}{
		{false, []string{
			"ratio idem/article: first/article req/s = 1.15, median of 2 rounds [1.20 1.10] (target >= 1: met)\n",
			"CPU replay/read: 1.15x, median of 2 rounds [1.20 1.10] (target <= 1.2: met)\n",
			"CPU first - unkeyed: 0.300 ms per request, median of 2 rounds [0.300 0.300]\n",
		}},
		{true, []string{"(target >= 1.2: MISSED)"}},
	} {
		var out strings.Builder
		r := &runner{cfg: config{handler: "orders", oneTx: tc.oneTx, scenarios: []string{"first", "article", "unkeyed", "replay", "read"}}, stdout: &out}
		r.printRatios(rounds)
		for _, w := range tc.want {
			if !strings.Contains(out.String(), w) {
				t.Errorf("one transaction %v: printRatios printed\n%s\nwant %q in it", tc.oneTx, out.String(), w)
			}
		}
		if strings.Count(out.String(), "(target ") != 2 {
			t.Errorf("one transaction %v: printRatios printed\n%s\nwant two verdicts, idem/article and replay/read", tc.oneTx, out.String())
		}
	}
	rounds[1]["replay"] = result{CPU: f(0.3)}
	if got := cpuRatioLine(rounds, "replay", "read", replayOverRead); !strings.HasSuffix(got, "(target <= 1.2: MISSED)") {
		t.Errorf("cpuRatioLine = %q, want it MISSED (median 1.35)", got)
	}
}

func TestCPUDeltaLine(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	rounds := []map[string]result{
		{"first": {CPU: f(0.9)}, "unkeyed": {CPU: f(0.5)}},
		{"first": {CPU: f(0.8)}, "unkeyed": {CPU: f(0.6)}},
		{"first": {CPU: f(1.0)}, "unkeyed": {CPU: f(0.5)}},
	}
	got := cpuDeltaLine(rounds, "first", "unkeyed", 0.3)
	if !strings.HasPrefix(got, "0.400 ms per request, median of 3 rounds") || !strings.Contains(got, "MISSED") {
		t.Errorf("cpuDeltaLine = %q", got)
	}
	if got := cpuDeltaLine(rounds, "first", "unkeyed", 0.5); !strings.Contains(got, "met") {
		t.Errorf("cpuDeltaLine = %q", got)
	}
}
