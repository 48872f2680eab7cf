package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server"
	"github.com/idemkit/idem/server/idempotency"
)

// TestMain fails the package's tests if any goroutine outlives them: every
// scenario must stop its server, its card processor and its connections.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// stored is what each scenario must leave in its store, stated here apart
// from the scenario's own checks.
var stored = map[string]struct{ payments, charges int }{
	"lost-response":    {1, 1},
	"server-errors":    {1, 1},
	"slow-server":      {1, 1},
	"concurrent":       {1, 1},
	"key-reuse":        {1, 1},
	"changed-body":     {1, 1},
	"missing-key":      {0, 0},
	"crash":            {1, 1},
	"deploy":           {1, 1},
	"slow-alive":       {1, 1},
	"invalid-text":     {1, 1},
	"retention-resume": {1, 1},
	"retention":        {2, 2},
	"key-per-attempt":  {3, 3}, // 2 by the naive loop (the bug it shows), 1 by idem
}

func TestScenariosMemory(t *testing.T) {
	testScenarios(t, func(*testing.T) backend { return memoryBackend() })
}

// TestScenariosPostgres runs every scenario on PostgreSQL, each in a schema
// of its own. Without a database it is skipped, except under CI=true, where
// pgtest fails it.
func TestScenariosPostgres(t *testing.T) {
	testScenarios(t, func(t *testing.T) backend {
		pool := pgtest.Pool(t)
		if err := server.Migrate(t.Context(), pool); err != nil {
			t.Fatal(err)
		}
		return backend{
			name: "PostgreSQL",
			open: func(context.Context, string) (*storage, error) {
				return &storage{store: server.NewPostgresStorage(pool).Storage(), ledger: pgLedger{pool}}, nil
			},
		}
	})
}

// testScenarios runs every scenario, in parallel, each on a backend of its
// own, and checks that it passed and what it left in the store.
func testScenarios(t *testing.T, newBackend func(*testing.T) backend) {
	if len(stored) != len(scenarios) {
		t.Fatalf("the test knows %d scenarios, the runner has %d", len(stored), len(scenarios))
	}
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			t.Parallel()
			want, ok := stored[sc.name]
			if !ok {
				t.Fatalf("no expectation for scenario %s", sc.name)
			}
			if sc.want.payments != want.payments || sc.want.charges != want.charges {
				t.Fatalf("the scenario expects %d payments and %d charges, the test %d and %d",
					sc.want.payments, sc.want.charges, want.payments, want.charges)
			}
			res := runScenario(t.Context(), sc, newBackend(t), true)
			var out bytes.Buffer
			writeResult(&out, 1, 1, res, true, false)
			if !res.passed() {
				t.Fatalf("scenario failed:\n%s", &out)
			}
			if res.payments != want.payments || res.charges != want.charges {
				t.Errorf("store holds %d payments and %d charges, want %d and %d\n%s",
					res.payments, res.charges, want.payments, want.charges, &out)
			}
			if !strings.Contains(out.String(), "  PASS  ") {
				t.Errorf("no PASS line:\n%s", &out)
			}
			t.Logf("\n%s", &out)
		})
	}
}

func noEnv(string) string { return "" }

// TestRun runs the command as a user would, without flags, and reads its
// report.
func TestRun(t *testing.T) {
	var out bytes.Buffer
	if err := run(t.Context(), nil, noEnv, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, &out)
	}
	report := out.String()
	if !strings.HasPrefix(report, "idem scenarios: the reference server in process, on the memory store\n") {
		t.Errorf("report does not start with its header:\n%s", report)
	}
	for i, sc := range scenarios {
		if want := fmt.Sprintf("\n%d/%d %s: %s\n", i+1, len(scenarios), sc.name, sc.title); !strings.Contains(report, want) {
			t.Errorf("report lacks the heading %q", want)
		}
		row := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(sc.name) + ` +PASS +\d+ +(\d+) \(expected (\d+)\) +(\d+) \(expected (\d+)\) +\d+\.\d\ds(  (.+))?$`)
		m := row.FindStringSubmatch(report)
		if m == nil {
			t.Errorf("summary lacks a PASS row for %s:\n%s", sc.name, report)
			continue
		}
		want := fmt.Sprintf("%d %d %d %d %q", sc.want.payments, sc.want.charges, sc.want.payments, sc.want.charges, sc.want.why)
		if got := fmt.Sprintf("%s %s %s %s %q", m[1], m[3], m[2], m[4], m[6]); got != want {
			t.Errorf("summary row of %s: found, expected, why = %s, want %s", sc.name, got, want)
		}
	}
	for _, want := range []string{
		// changed-body shows its client's policy, and why it stops.
		"this client's retry policy: MaxAttempts 2, then give up (the default is 4)\n",
		"502 Bad Gateway            stop: attempts exhausted (MaxAttempts 2)\n",
		"422 Unprocessable Content",
	} {
		if !strings.Contains(report, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if strings.Contains(report, "Unprocessable Entity") {
		t.Errorf("report uses a reason phrase older than RFC 9110:\n%s", report)
	}
	if want := fmt.Sprintf("%d of %d scenarios passed (memory store, ", len(scenarios), len(scenarios)); !strings.Contains(report, want) {
		t.Errorf("report lacks %q", want)
	}
	if strings.Contains(report, "\x1b[") {
		t.Error("colour codes written to a writer that is not a terminal")
	}
	if strings.Contains(report, "FAIL") {
		t.Errorf("report has a FAIL:\n%s", report)
	}
}

// TestRunFailure checks that a broken invariant, or a scenario that cannot
// run, is reported and ends the run with an error (exit status 1).
func TestRunFailure(t *testing.T) {
	saved := scenarios
	t.Cleanup(func() { scenarios = saved })
	scenarios = []scenario{
		{name: "broken", title: "an invariant does not hold", run: func(ctx context.Context, e *env) error {
			e.expectCount("payments", 2, 1)
			e.expect(true, "something else holds")
			return nil
		}},
		{name: "erroring", title: "the story cannot be told", run: func(ctx context.Context, e *env) error {
			return errors.New("no luck")
		}},
		{name: "fine", title: "all is well", run: func(ctx context.Context, e *env) error {
			e.expect(true, "all is well")
			return nil
		}},
		{name: "unpaid", title: "the store holds less than expected", want: expected{1, 1, "one purchase"},
			run: func(ctx context.Context, e *env) error {
				e.expect(true, "the client is happy")
				return nil
			}},
	}
	var out bytes.Buffer
	err := run(t.Context(), nil, noEnv, &out)
	if err == nil || errors.Is(err, errUsage) || err.Error() != "3 of 4 scenarios failed" {
		t.Errorf("run = %v, want 3 of 4 scenarios failed", err)
	}
	for _, want := range []string{
		"  FAIL  NOT payments 2, want 1\n",
		"  FAIL  error: no luck\n",
		"  PASS  all is well\n",
		"  FAIL  NOT the store holds 0 payments and 0 charges, expected 1 and 1\n",
		"\nunpaid    FAIL           0  0 (expected 1)  0 (expected 1)  ",
		"s  one purchase\n",
		"3 of 4 scenarios FAILED (memory store, ",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, &out)
		}
	}
}

func TestRunFlags(t *testing.T) {
	tests := []struct {
		args    []string
		wantErr error // nil: success
		want    string
	}{
		{[]string{"-list"}, nil, "key-per-attempt  the classic client bug"},
		{[]string{"-list", "-run", "^crash$"}, nil, "crash            the server crashes"},
		{[]string{"-h"}, flag.ErrHelp, "-database-url URL"},
		{[]string{"-run", "nothing-like-this"}, errUsage, ""},
		{[]string{"-run", "("}, errUsage, ""},
		{[]string{"-bogus"}, errUsage, "flag provided but not defined: -bogus"},
		{[]string{"extra"}, errUsage, "usage: scenarios"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			var out bytes.Buffer
			err := run(t.Context(), tt.args, noEnv, &out)
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Errorf("run(%q) = %v, want %v", tt.args, err, tt.wantErr)
			}
			if !strings.Contains(out.String(), tt.want) {
				t.Errorf("output lacks %q:\n%s", tt.want, &out)
			}
		})
	}
	var out bytes.Buffer
	if err := run(t.Context(), []string{"-list"}, noEnv, &out); err != nil {
		t.Fatal(err)
	}
	if got := strings.Count(out.String(), "\n"); got != len(scenarios) {
		t.Errorf("-list printed %d lines, want %d", got, len(scenarios))
	}
}

// TestRunPostgres runs the command with -database-url and checks that it
// leaves no schema behind.
func TestRunPostgres(t *testing.T) {
	url := pgtest.URL(t)
	var out bytes.Buffer
	err := run(t.Context(), []string{"-database-url", url, "-run", "crash|key-per-attempt", "-v"}, noEnv, &out)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, &out)
	}
	if !strings.Contains(out.String(), "2 of 2 scenarios passed (PostgreSQL ") {
		t.Errorf("report:\n%s", &out)
	}
	if !strings.Contains(out.String(), "idempotency: took over a key whose owner stopped renewing its lease") {
		t.Errorf("-v report lacks the server's takeover warning:\n%s", &out)
	}
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(t.Context()))
	var left []string
	rows, _ := conn.Query(t.Context(), `SELECT nspname FROM pg_namespace WHERE starts_with(nspname, $1)`, schemaPrefix)
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(left) > 0 {
		t.Errorf("schemas left behind: %v", left)
	}
}

func TestRunBadDatabase(t *testing.T) {
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	err := run(ctx, []string{"-database-url", "postgres://nobody@127.0.0.1:1/none?connect_timeout=2"}, noEnv, &out)
	if err == nil || !strings.Contains(err.Error(), "-database-url") {
		t.Errorf("run = %v, want an error naming -database-url", err)
	}
}

// TestMemLedger checks the memory ledger: a payment counts once its unit
// of work completes, and not when it is rolled back or fenced.
func TestMemLedger(t *testing.T) {
	ctx := t.Context()
	s := server.NewMemoryStorage()
	keys := s.Keys()
	l := memLedger{s}
	claim := func(key string) idempotency.Claim {
		t.Helper()
		res, err := keys.Claim(ctx, idempotency.ClaimRequest{ClientID: "c", Key: key, Method: "POST", Path: "/", Fingerprint: []byte{1}})
		if err != nil || res.Outcome != idempotency.Claimed {
			t.Fatalf("Claim(%s) = %v, %v", key, res, err)
		}
		return res.Claim
	}
	// stage writes a payment in the unit of work of c, as the payments
	// API does behind the middleware.
	stage := func(c idempotency.Claim, id string) idempotency.Tx {
		t.Helper()
		tx, err := keys.Begin(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		p := server.Payment{ID: id, ClientID: "c", Customer: "cus_" + id, Amount: 1, Currency: "usd", OperationID: c.OperationID}
		if err := s.CreatePayment(idempotency.NewContext(ctx, c, tx), p); err != nil {
			t.Fatal(err)
		}
		return tx
	}
	done := idempotency.StoredResponse{Status: 201}

	if err := stage(claim("k1"), "p1").Complete(ctx, done); err != nil {
		t.Fatal(err)
	}
	tx := stage(claim("k2"), "p2")
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	c3 := claim("k3")
	tx = stage(c3, "p3")
	if err := keys.Release(ctx, c3, idempotency.ReleaseFailed); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, done); !errors.Is(err, idempotency.ErrFenced) {
		t.Fatalf("Complete after release = %v, want ErrFenced", err)
	}
	for customer, want := range map[string]int{"": 1, "cus_p1": 1, "cus_p2": 0, "cus_p3": 0} {
		if got, _ := l.Payments(ctx, customer); got != want {
			t.Errorf("Payments(%q) = %d, want %d", customer, got, want)
		}
	}
	if n, _ := l.Charges(ctx); n != 0 {
		t.Errorf("Charges = %d, want 0", n)
	}
}

func TestStatusLine(t *testing.T) {
	for code, want := range map[int]string{
		200: "200 OK",
		413: "413 Content Too Large",
		414: "414 URI Too Long",
		416: "416 Range Not Satisfiable",
		422: "422 Unprocessable Content",
		599: "599",
	} {
		if got := statusLine(code); got != want {
			t.Errorf("statusLine(%d) = %q, want %q", code, got, want)
		}
	}
}

// TestTimelineFolding checks that repeats fold unless verbose.
func TestTimelineFolding(t *testing.T) {
	tl := newTimeline()
	for n := 1; n <= 3; n++ {
		tl.add(event{kind: attemptEvent, op: "pay", n: n, key: "0123456789", outcome: "409 Conflict",
			next: fmt.Sprintf("retry in %ds (409: still running)", n), same: "retry (409: still running)"})
	}
	tl.add(event{kind: attemptEvent, op: "pay", n: 4, key: "0123456789", outcome: "201 Created", next: "done", same: "done"})
	var folded, verbose strings.Builder
	tl.write(&folded, false)
	tl.write(&verbose, true)
	if !strings.Contains(folded.String(), "pay  #1-3  01234567  409 Conflict (x3)  retry in 3s (409: still running)\n") {
		t.Errorf("folded:\n%s", folded.String())
	}
	if got := strings.Count(folded.String(), "\n"); got != 2 {
		t.Errorf("folded timeline has %d lines, want 2:\n%s", got, folded.String())
	}
	if got := strings.Count(verbose.String(), "\n"); got != 4 {
		t.Errorf("verbose timeline has %d lines, want 4:\n%s", got, verbose.String())
	}
}
