package main

import (
	"cmp"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/faultproxy"
)

func printHeader(w io.Writer, cfg config, schema, dbURL string) {
	fmt.Fprintf(w, "idem chaos test: seed %d, %s of faults, then up to %s for the clients to settle\n", cfg.seed, cfg.duration, cfg.grace)
	fmt.Fprintf(w, "  %d idem-server replicas sharing %s (schema %s), lock timeout %s\n", cfg.replicas, dbURL, schema, cfg.lockTimeout)
	if cfg.pgbouncer != "" || cfg.queryExecMode != "" {
		fmt.Fprintf(w, "  through PgBouncer: %s (pool_mode); pgx's query mode: %s\n", cmp.Or(cfg.pgbouncer, "none"), cmp.Or(cfg.queryExecMode, "its default"))
	}
	fmt.Fprintf(w, "  %d clients over %d API keys, through a fault proxy; attempt timeout %s; an unknown outcome is asked again later with the same key\n",
		cfg.clients, cfg.accounts, cfg.attemptTimeout)
	fmt.Fprintf(w, "  %d kills, %d graceful restarts, %d rounds of backend terminations; proxy: reset %g, drop %g, stall %g, latency %g of connections\n",
		cfg.kills, cfg.restarts, cfg.terminations, cfg.mix.Reset, cfg.mix.Drop, cfg.mix.Stall, cfg.mix.Latency)
	fmt.Fprintf(w, "  retention %s; %g of operations first sent with invalid text; replica 0 slow but alive (processor %s)\n",
		cfg.retention, cfg.invalidRate, cfg.slowDelay)
	fmt.Fprintf(w, "  %g of unknown outcomes end with the client vanishing for good; the servers sweep abandoned operations after %s\n",
		cfg.vanishRate, cfg.sweepGrace)
	fmt.Fprintln(w)
}

// print writes the figures of the run, ending with the three lines
// operations, duplicates and lost.
func (r *report) print(w io.Writer) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }
	row := func(label string, format string, args ...any) { printRow(w, label, format, args...) }
	ps := r.proxy
	p("")
	p("faults injected")
	row("connections through the proxy", "%6d", ps.Connections)
	row("  reset before the request reached a server", "%6d", ps.Faults[faultproxy.Reset])
	row("  answer dropped after the server sent it", "%6d", ps.Faults[faultproxy.Drop])
	row("  answer held past the attempt timeout", "%6d", ps.Faults[faultproxy.Stall])
	row(fmt.Sprintf("  slowed by up to %s a chunk", faultproxy.DefaultMaxLatency), "%6d", ps.Faults[faultproxy.Latency])
	row("  dial failed over to another replica", "%6d", ps.Failovers)
	if ps.Unreachable > 0 {
		row("  no replica reachable: reset", "%6d", ps.Unreachable)
	}
	row("server processes killed (SIGKILL), restarted", "%6d", r.kills)
	row("graceful restarts (SIGTERM, drain, start)", "%6d", r.restarts)
	row("PostgreSQL backends terminated", "%6d in %d rounds", r.terminated, r.termRounds)
	row("card processor 503s (inside the servers)", "%6.0f%% of charge requests", 100*r.cfg.processorFails)
	if r.cfg.slowDelay > 0 {
		row("slow but alive: replica 0's processor takes", "%6s (lock timeout %s)", r.cfg.slowDelay, r.cfg.lockTimeout)
	}
	row("operations first sent with invalid text", "%6d", r.verdict.invalid)

	p("")
	printClients(w, r.stats, r.ops)
	if l := r.late; l != (lateStats{}) {
		row("sent again after their retention", "%6d (%d refused with 410, %d replayed, %d paid again, %d other)",
			l.refused+l.replayed+l.paid+l.other, l.refused, l.replayed, l.paid, l.other)
	}
	row("operations whose client vanished", "%6d (%d of them paid)", r.verdict.vanished, r.verdict.vanishedPaid)
	printTimeToSuccess(w, r.ops)

	p("")
	printServerLogs(w, r.serverLogs)

	v := r.verdict
	p("")
	p("database")
	row("payments", "%6d", len(r.db.payments))
	row("downstream charges", "%6d", len(r.db.charges))
	row("  without a payment", "%6d", r.verdict.orphanCharges)
	row("keys left started", "%6d", r.db.keysStarted)
	if len(v.problems) > 0 {
		p("")
		p("problems")
		for _, s := range v.problems {
			p("  %s", s)
		}
	}
	if r.stopProblem != nil {
		p("")
		p("note: %v", r.stopProblem)
	}
	if r.logsKeptIn != "" {
		p("server logs kept in %s", r.logsKeptIn)
	}
	p("")
	if v.failed > 0 {
		p("failed: %d", v.failed)
	}
	if n := v.mismatched + v.phantom; n > 0 {
		p("mismatched: %d", n)
	}
	p("operations: %d", v.operations)
	p("duplicates: %d", v.duplicates())
	p("lost: %d", v.lost())
}

// printRow writes one figure of a report, its label aligned.
func printRow(w io.Writer, label string, format string, args ...any) {
	fmt.Fprintf(w, "  %-46s "+format+"\n", append([]any{label}, args...)...)
}

// printClients writes the clients' section of a report: their attempts,
// their calls, and the operations settled by a later call.
func printClients(w io.Writer, st *stats, ops []*op) {
	var unknown int64
	for _, n := range st.unknown {
		unknown += n
	}
	fmt.Fprintln(w, "clients")
	printRow(w, "HTTP attempts", "%6d%s", st.attempts.Load(), breakdown(st.byResult))
	printRow(w, "calls (idem.Client.Post)", "%6d", st.calls)
	printRow(w, "  ended with an unknown outcome", "%6d%s", unknown, breakdown(st.unknown))
	retried := 0
	for _, o := range ops {
		if o.state == succeeded && o.calls > 1 {
			retried++
		}
	}
	printRow(w, "operations settled by a later call", "%6d", retried)
}

// printTimeToSuccess writes the spread of the time from an operation's
// first call to its success.
func printTimeToSuccess(w io.Writer, ops []*op) {
	var times []time.Duration
	for _, o := range ops {
		if o.state == succeeded {
			times = append(times, o.end.Sub(o.start))
		}
	}
	if len(times) == 0 {
		return
	}
	slices.Sort(times)
	printRow(w, "time to success", "p50 %s, p99 %s, max %s",
		round(percentile(times, 0.50)), round(percentile(times, 0.99)), round(times[len(times)-1]))
}

// printServerLogs writes the servers' section of a report: the log
// records worth a figure.
func printServerLogs(w io.Writer, logs map[string]int64) {
	fmt.Fprintln(w, "servers (counted from their logs)")
	for _, e := range serverEvents {
		if n := logs[e.msg]; n > 0 || e.always {
			printRow(w, e.label, "%6d", n)
		}
	}
}

// serverEvents are the log records of idem-server worth a figure: the
// recovery paths the faults drive the servers through.
var serverEvents = []struct {
	msg, label string
	always     bool
}{
	{"idempotency: outcome stored", "outcomes stored (payment committed with its key)", true},
	{"idempotency: took over a key whose owner stopped renewing its lease", "keys taken over (lease ran out)", true},
	{"idempotency: lease lost: the key was taken over while its request ran; cancelling the handler", "leases lost while running", false},
	{"idempotency: completion fenced: the request was taken over; its writes were rolled back", "completions fenced by a takeover", false},
	{"payments: charge outcome unknown", "charge outcomes unknown", false},
	{"idempotency: claim failed", "claims failed (database)", false},
	{"idempotency: completion failed", "completions failed (database)", false},
	{"idempotency: release failed; the key stays started until its lease runs out", "releases failed (database)", false},
	{"idempotency: renewing the lease failed; retrying at the next tick", "lease renewals failed (database)", false},
	{"processor: storing the charge failed", "charges failed (database)", false},
	{"processor: injected failure", "processor 503s injected", false},
	{"payments: processor refused the charge", "charges refused after retries", false},
	{"payments: holding the transaction after the payment's insert (Faults.HoldAfterWrite)", "transactions held past the retention", false},
	{"idempotency: abandoned key completed", "abandoned keys completed by a sweeper", true},
	{"idempotency: abandoned key released: nothing of its operation took effect", "abandoned keys released by a sweeper", false},
	{"idempotency: completing an abandoned key was fenced: a retry took it over; its writes were rolled back", "sweeps fenced by a late retry", false},
}

// breakdown formats counts by name, largest first: " (a 3, b 1)".
func breakdown(m map[string]int64) string {
	if len(m) == 0 {
		return ""
	}
	keys := slices.SortedFunc(maps.Keys(m), func(a, b string) int {
		return cmp.Or(cmp.Compare(m[b], m[a]), strings.Compare(a, b))
	})
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return " (" + strings.Join(parts, ", ") + ")"
}

// percentile returns the nearest-rank q-quantile of sorted ds.
func percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(ds)))) - 1
	return ds[min(max(i, 0), len(ds)-1)]
}

func round(d time.Duration) time.Duration {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond)
	case d >= time.Millisecond:
		return d.Round(100 * time.Microsecond)
	}
	return d
}
