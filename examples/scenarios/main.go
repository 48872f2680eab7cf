// Command scenarios tells the stories of the article behind idem, each
// against the reference payments server, and checks that no retry loses a
// payment or makes a second one:
//
//	go run ./examples/scenarios                      # every scenario, in-memory store
//	go run ./examples/scenarios -run 'crash|retention' -v
//	go run ./examples/scenarios -database-url postgres://postgres@127.0.0.1:5432/postgres
//
// Each scenario starts a server of its own, in process, on an empty store,
// with a fault injector in front of it (lost responses, 503s) and the
// client's attempts recorded through [idem.Transport.OnAttempt]. It prints
// the timeline of the attempts, then PASS or FAIL with the invariants it
// checked against the store: payments made, charges made downstream. A
// summary table ends the run. The exit status is 1 when any scenario fails.
//
// With -database-url every scenario runs on PostgreSQL in a schema of its
// own (idem_scenarios_<run>_<scenario>), created, migrated and dropped by
// the run; the role needs CREATE on the database.
//
// With -target, it runs no scenario: it checks the client-observable part
// of the contract against any POST or PATCH endpoint, one verdict per row
// (conformance.go):
//
//	go run ./examples/scenarios -target https://api.example.com/v1/payments -token T [-token2 T2] [-body JSON] [-dry-run]
//	go run ./examples/scenarios -target https://api.example.com/v1/orders/42 -method PATCH \
//	    -header 'X-Api-Key: K1' -header2 'X-Api-Key: K2' -body '{"qty": 2}'
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout)
	stop()
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
	case errors.Is(err, errUsage):
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "scenarios:", err)
		os.Exit(1)
	}
}

// errUsage is in the chain of the errors run returns for bad flags, which
// the flag package has already printed.
var errUsage = errors.New("usage")

// run parses args, runs the selected scenarios and prints their report to
// stdout. It returns an error when a scenario fails or cannot run.
func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	fs := flag.NewFlagSet("scenarios", flag.ContinueOnError)
	fs.SetOutput(stdout)
	dbURL := fs.String("database-url", "", "run on PostgreSQL at this `URL` (pgx connection string) instead of the in-memory store")
	pattern := fs.String("run", "", "run only the scenarios whose name matches this `regexp`")
	verbose := fs.Bool("v", false, "show every attempt, and the server's warnings, on the timelines")
	list := fs.Bool("list", false, "list the scenarios and exit")

	var tf targetFlags
	fs.StringVar(&tf.target, "target", "", "check the endpoint at this `URL` (any path and query) against the contract instead of running the scenarios")
	fs.StringVar(&tf.method, "method", http.MethodPost, "with -target: the `method` of the operation, POST or PATCH")
	fs.StringVar(&tf.token, "token", "", "with -target: the bearer `token` of the API client the check uses (short for -header 'Authorization: Bearer T')")
	fs.StringVar(&tf.token2, "token2", "", "with -target: the bearer `token` of a second client, to check that keys are scoped per client (short for -header2 'Authorization: Bearer T2')")
	fs.Func("header", "with -target: a `header` the client sends with every request, such as 'X-Api-Key: K1' (repeatable)", func(v string) error {
		tf.headers[0] = append(tf.headers[0], v)
		return nil
	})
	fs.Func("header2", "with -target: a `header` the second client sends, such as 'X-Api-Key: K2' (repeatable), to check that keys are scoped per client", func(v string) error {
		tf.headers[1] = append(tf.headers[1], v)
		return nil
	})
	fs.StringVar(&tf.body, "body", defaultConformanceBody, "with -target: the `JSON` body of a request the target accepts; the report speaks of payments with the default body, of operations with another")
	fs.StringVar(&tf.slowBody, "slow-body", "", "with -target: a `JSON` body the target takes over a second to process, to check the answer to a duplicate in flight")
	fs.IntVar(&tf.maxPayments, "max-payments", 10, "with -target: never make more than `N` payments (operations)")
	fs.IntVar(&tf.maxOps, "max-operations", 10, "with -target: never make more than `N` operations (the same as -max-payments)")
	fs.DurationVar(&tf.retention, "retention", 0, "with -target: the `duration` the API publishes it keeps keys for")
	fs.BoolVar(&tf.wait, "wait", false, "with -target and -retention: wait the retention out to check it")
	fs.BoolVar(&tf.dryRun, "dry-run", false, "with -target: print the requests the check would send, and send none")
	fs.DurationVar(&tf.timeout, "timeout", 30*time.Second, "with -target: the longest wait for one answer")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: scenarios [-run regexp] [-v] [-database-url URL] [-list]\n")
		fmt.Fprintf(fs.Output(), "       scenarios -target URL [-method POST|PATCH] -token T | -header 'Name: value'... [-token2 T2 | -header2 'Name: value'...]\n")
		fmt.Fprintf(fs.Output(), "                 [-body JSON] [-slow-body JSON] [-max-operations N] [-retention D [-wait]] [-dry-run]\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %w", errUsage, err)
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return fmt.Errorf("%w: unexpected arguments %q", errUsage, fs.Args())
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	conformanceFlags := []string{"method", "token", "token2", "header", "header2", "body", "slow-body", "max-payments", "max-operations",
		"retention", "wait", "dry-run", "timeout"}
	if tf.target != "" {
		for _, name := range []string{"run", "v", "database-url", "list"} {
			if set[name] {
				return fmt.Errorf("%w: -%s runs scenarios; it does not go with -target", errUsage, name)
			}
		}
		cfg, err := tf.config(set)
		if err != nil {
			return err
		}
		return runConformance(ctx, cfg, stdout)
	}
	for _, name := range conformanceFlags {
		if set[name] {
			return fmt.Errorf("%w: -%s goes with -target", errUsage, name)
		}
	}
	selected, err := selectScenarios(*pattern)
	if err != nil {
		return err
	}
	if *list {
		for _, sc := range selected {
			fmt.Fprintf(stdout, "%-16s %s\n", sc.name, sc.title)
		}
		return nil
	}

	b := memoryBackend()
	if *dbURL != "" {
		pb, admin, err := postgresBackend(ctx, *dbURL)
		if err != nil {
			return err
		}
		defer admin.Close()
		b = pb
	}
	color := getenv("NO_COLOR") == "" && getenv("TERM") != "dumb" && isTerminal(stdout)
	fmt.Fprintf(stdout, "idem scenarios: the reference server in process, on the %s\n", b.name)

	start := time.Now()
	results := make([]*result, 0, len(selected))
	for i, sc := range selected {
		if ctx.Err() != nil {
			break
		}
		res := runScenario(ctx, sc, b, *verbose)
		results = append(results, res)
		writeResult(stdout, i+1, len(selected), res, *verbose, color)
	}
	failed := writeSummary(stdout, results, b.name, time.Since(start), color)
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("interrupted after %d of %d scenarios", len(results), len(selected))
	case failed > 0:
		return fmt.Errorf("%d of %d scenarios failed", failed, len(results))
	}
	return nil
}

// selectScenarios returns the scenarios whose name matches pattern.
func selectScenarios(pattern string) ([]scenario, error) {
	re, err := regexp.Compile(pattern)
	if err != nil {
		return nil, fmt.Errorf("%w: -run: %w", errUsage, err)
	}
	var out []scenario
	var names []string
	for _, sc := range scenarios {
		names = append(names, sc.name)
		if re.MatchString(sc.name) {
			out = append(out, sc)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: -run %q matches no scenario; they are: %s", errUsage, pattern, strings.Join(names, ", "))
	}
	return out, nil
}

// isTerminal reports whether w is a terminal, so that colour is used only
// where a person reads it.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// verdict returns PASS or FAIL, in colour when asked.
func verdict(pass, color bool) string {
	switch {
	case pass && color:
		return "\x1b[32mPASS\x1b[0m"
	case pass:
		return "PASS"
	case color:
		return "\x1b[1;31mFAIL\x1b[0m"
	}
	return "FAIL"
}

// writeResult prints one scenario: its title, its timeline, what the
// developer sees, and the PASS or FAIL line with its invariants.
func writeResult(w io.Writer, i, n int, r *result, verbose, color bool) {
	var b strings.Builder
	fmt.Fprintf(&b, "\n%d/%d %s: %s\n", i, n, r.name, r.title)
	r.tl.write(&b, verbose)
	for _, line := range r.notes {
		fmt.Fprintf(&b, "      | %s\n", line)
	}
	var shown []string
	for _, c := range r.checks {
		if !c.ok {
			shown = append(shown, "NOT "+c.text)
		} else if r.passed() {
			shown = append(shown, c.text)
		}
	}
	if r.err != nil {
		shown = append(shown, "error: "+r.err.Error())
	}
	if len(shown) == 0 {
		shown = append(shown, "no invariant was checked")
	}
	fmt.Fprintf(&b, "  %s  %s\n", verdict(r.passed(), color), strings.Join(shown, "; "))
	io.WriteString(w, b.String())
}

// writeSummary prints the table of results and returns the number of
// scenarios that failed. Each figure found in the store stands beside the
// one the scenario expects, and the last column says why a scenario expects
// other figures than one payment and one charge, so that a 3 where one
// might expect a 1 reads as intended at a glance.
func writeSummary(w io.Writer, results []*result, backend string, elapsed time.Duration, color bool) int {
	var b strings.Builder
	rows := [][]string{{"scenario", "result", "attempts", "payments", "charges", "time", ""}}
	failed := 0
	for _, r := range results {
		res := "PASS"
		if !r.passed() {
			res = "FAIL"
			failed++
		}
		rows = append(rows, []string{r.name, res, fmt.Sprint(r.attempts),
			fmt.Sprintf("%d (expected %d)", r.payments, r.want.payments),
			fmt.Sprintf("%d (expected %d)", r.charges, r.want.charges),
			fmt.Sprintf("%.2fs", r.elapsed.Seconds()), r.want.why})
	}
	b.WriteString("\n")
	writeSummaryTable(&b, rows, color)
	if failed == 0 {
		fmt.Fprintf(&b, "%d of %d scenarios passed (%s, %.1fs)\n", len(results), len(results), backend, elapsed.Seconds())
	} else {
		fmt.Fprintf(&b, "%d of %d scenarios FAILED (%s, %.1fs)\n", failed, len(results), backend, elapsed.Seconds())
	}
	io.WriteString(w, b.String())
	return failed
}

// writeSummaryTable aligns the summary: names left, figures right, the
// result coloured after alignment so escape codes do not count as width.
// The last cell, the reason, is neither padded nor counted.
func writeSummaryTable(b *strings.Builder, rows [][]string, color bool) {
	widths := make([]int, len(rows[0]))
	for _, row := range rows {
		for i, cell := range row {
			widths[i] = max(widths[i], len(cell))
		}
	}
	for ri, row := range rows {
		var line strings.Builder
		last := len(row) - 1
		for i, cell := range row[:last] {
			pad := strings.Repeat(" ", widths[i]-len(cell))
			switch {
			case i == 1 && ri > 0:
				line.WriteString(verdict(cell == "PASS", color) + pad)
			case i >= 2 && ri > 0:
				line.WriteString(pad + cell)
			default:
				line.WriteString(cell + pad)
			}
			line.WriteString("  ")
		}
		line.WriteString(row[last])
		b.WriteString(strings.TrimRight(line.String(), " "))
		b.WriteByte('\n')
	}
}
