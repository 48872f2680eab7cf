// Command chaos is idem's exactly-once test under real faults: it runs many
// logical payments from concurrent clients against several replicas of the
// reference server (the real idem-server binary) sharing one PostgreSQL
// database, while a fault-injecting proxy between them resets connections,
// drops and stalls answers the servers already sent, and adds latency;
// while server processes are killed with SIGKILL and restarted; and while
// the servers' PostgreSQL backends are terminated. Then it checks against
// the database that every operation has exactly one payment and at most one
// downstream charge, and that every client learned the outcome of every
// operation:
//
//	go run ./examples/chaos -duration 30s -seed 1
//
// A client whose call ends with an unknown outcome (an idem.RetryError or
// idem.InProgressError, a 5xx, a cut connection) retries the same operation
// later with the same key (idem.WithKey), as the SDK's documentation tells
// users to, until it gets a definitive answer or the grace period after the
// faults ends; except a share of them (-vanish), whose client vanishes for
// good after an unknown outcome: the servers' sweepers must settle those
// operations, so that every downstream charge still has its payment. The
// run prints the faults it injected, the clients' figures and, last, three
// lines:
//
//	operations: 4711
//	duplicates: 0
//	lost: 0
//
// and exits with status 1 if an invariant failed. It needs PostgreSQL (by
// default the local server, postgres://postgres@127.0.0.1:5432/postgres; see
// -database-url), creates a schema of its own there, and drops it at the
// end. Everything listens on loopback only, and the run stops by itself.
//
// With -failover sync or -failover async it runs the failover test
// instead (failover.go): a PostgreSQL primary and a streaming standby of
// its own, started from the PostgreSQL binaries on the machine, the
// primary killed mid-load and the standby promoted; it ends with the lines
//
//	operations: 5764
//	duplicates: 0
//	double-charged keys: 0
//	lost: 0
//	recovery: 1.11s (kill → first success)
//
// With -pgbouncer, the replicas reach the database through a PgBouncer of
// the run's own (its server connections on the run's schema), which the
// run starts and stops; with -pgbouncer transaction, give them a query
// mode that works there:
//
//	go run ./examples/chaos -duration 30s -pgbouncer transaction -query-exec-mode exec
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/pgbouncer"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout)
	switch {
	case errors.Is(err, flag.ErrHelp):
	case err != nil:
		fmt.Fprintln(os.Stderr, "chaos:", err)
		stop()
		os.Exit(1)
	}
}

// defaultDatabaseURL is the local PostgreSQL server used without
// -database-url.
const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// config is a run's settings, from the flags.
type config struct {
	duration       time.Duration // faults and new operations
	grace          time.Duration // the longest wait for unresolved operations afterwards
	seed           uint64
	databaseURL    string
	serverBin      string // a built idem-server; empty: go build it
	replicas       int
	clients        int // concurrent client goroutines
	accounts       int // API keys (clients of the API) the goroutines share
	kills          int
	terminations   int
	lockTimeout    time.Duration
	attemptTimeout time.Duration
	processorDelay time.Duration
	slowDelay      time.Duration // the processor delay of replica 0; 0: as the others
	processorFails float64
	retention      time.Duration // the servers' -retention
	invalidRate    float64       // share of operations whose first request holds invalid text
	holdRate       float64       // share of payments whose transaction a replica holds past the retention
	cancelRate     float64       // share of calls whose context the client cancels mid-flight
	lateRate       float64       // share of succeeded operations sent again after their retention
	vanishRate     float64       // share of unknown outcomes after which the client never asks again
	sweepGrace     time.Duration // the servers' -sweep-grace
	restarts       int           // rolling graceful restarts (SIGTERM, drain, start)
	mix            faultproxy.Mix
	keepSchema     bool
	logsDir        string   // where the replicas' logs are kept; empty: a temporary directory
	keyPerAttempt  bool     // the classic client bug, a new key on every attempt: a negative control
	serverArgs     []string // extra idem-server flags for every replica
	// failover: "" for the chaos test; "sync" or "async" for the failover
	// test (failover.go), whose own settings follow.
	failover      string
	promoteAfter  time.Duration // from the primary's death to the standby's promotion
	lag           time.Duration // async: the standby stops receiving WAL this long before the kill
	pgbouncer     string        // pool mode of a PgBouncer between the replicas and the database; empty: none
	queryExecMode string        // the replicas' default_query_exec_mode; empty: pgx's default
}

func parseFlags(args []string, out io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.DurationVar(&c.duration, "duration", 30*time.Second, "how long faults are injected and new operations started")
	fs.DurationVar(&c.grace, "grace", time.Minute,
		"after -duration, the longest wait for clients to learn the outcome of their unresolved operations (faults off)")
	fs.Uint64Var(&c.seed, "seed", 1, "seed of every random choice: faults, their times and targets, client waits")
	fs.StringVar(&c.databaseURL, "database-url", defaultDatabaseURL,
		"PostgreSQL (pgx `DSN`); the run works in a schema of its own there and drops it at the end")
	fs.StringVar(&c.serverBin, "server-bin", "", "idem-server `binary` to run; empty: go build ./server/cmd/idem-server into a temporary directory")
	fs.IntVar(&c.replicas, "replicas", 3, "server replicas sharing the database")
	serverArgs := fs.String("server-args", "", "extra idem-server flags for every replica, space-separated (e.g. \"-batch-claims -async-claims\")")
	fs.IntVar(&c.clients, "clients", 8, "concurrent clients")
	fs.IntVar(&c.accounts, "accounts", 2, "API keys the clients are spread over (keys are scoped by API client)")
	fs.IntVar(&c.kills, "kills", -1, "server processes killed with SIGKILL and restarted; -1: one per 5s of -duration")
	fs.IntVar(&c.restarts, "restarts", -1,
		"rolling graceful restarts, as in a deploy: one replica at a time gets SIGTERM, drains its requests, stops and starts again; -1: one per 10s of -duration")
	fs.IntVar(&c.terminations, "pg-terminations", -1,
		"rounds of pg_terminate_backend on one replica's PostgreSQL backends; -1: one per 3s of -duration")
	fs.DurationVar(&c.lockTimeout, "lock-timeout", 2*time.Second, "the servers' -lock-timeout: when a started key may be taken over")
	fs.DurationVar(&c.attemptTimeout, "attempt-timeout", time.Second, "the clients' per-attempt timeout (idem.RetryPolicy.AttemptTimeout)")
	fs.DurationVar(&c.processorDelay, "processor-delay", 20*time.Millisecond, "the servers' -processor-delay: latency of the fake card processor")
	fs.DurationVar(&c.slowDelay, "slow-processor-delay", 4*time.Second,
		"the -processor-delay of replica 0, longer than -lock-timeout: its requests are slow but alive, renew their lease, and must not be taken over; 0: as the others")
	fs.DurationVar(&c.retention, "retention", 10*time.Second,
		"the servers' -retention (with -purge-interval 1s): operations outlive it while their keys are released and resumed, and must still be charged once; "+
			"it must exceed the longest gap between two calls of one operation")
	fs.Float64Var(&c.invalidRate, "invalid-text", 0.05,
		"share of operations whose first request carries a NUL in a text field: it must get 400 before any charge, and the corrected request with the same key must succeed")
	fs.Float64Var(&c.processorFails, "processor-failure-rate", 0.02, "the servers' -processor-failure-rate: share of charges answered 503")
	fs.Float64Var(&c.holdRate, "hold", 0.02,
		"share of payments whose transaction a replica holds open for -retention plus 1s after its insert (the servers' -hold-after-write): "+
			"the retry after it must get the replay, since retention counts from the answer")
	fs.Float64Var(&c.lateRate, "late", 0.05,
		"share of the operations that succeeded that are sent again once their key's retention has passed, with their key and first-sent time pinned "+
			"(Repeatability-First-Sent): each must be refused with 410, never paid again")
	fs.Float64Var(&c.cancelRate, "cancel", 0.03,
		"share of calls whose context the client cancels at a random moment within the time a call takes (four processor delays): the operation is asked about again later, with the same key")
	fs.Float64Var(&c.vanishRate, "vanish", 0.05,
		"share of unknown outcomes after which the client vanishes for good, never asking about its operation again: "+
			"the servers' sweepers settle it (a charge becomes its payment), and it is left out of the lost operations")
	fs.DurationVar(&c.sweepGrace, "sweep-grace", 6*time.Second,
		"the servers' -sweep-grace (and so their processor timeout): how long an abandoned operation is left to its client before a sweeper settles it; "+
			"it must exceed -slow-processor-delay and stay below -retention")
	fs.Float64Var(&c.mix.Reset, "reset", 0.04, "share of proxied connections reset before the request reaches a server")
	fs.Float64Var(&c.mix.Drop, "drop", 0.04, "share of proxied connections whose answer is dropped after the server sent it")
	fs.Float64Var(&c.mix.Stall, "stall", 0.02, "share of proxied connections whose answer is held past the attempt timeout")
	fs.Float64Var(&c.mix.Latency, "latency", 0.10, "share of proxied connections slowed by up to 50ms a chunk")
	fs.BoolVar(&c.keepSchema, "keep-schema", false, "keep the run's schema (for inspection) instead of dropping it")
	fs.StringVar(&c.logsDir, "logs", "", "keep the servers' logs in this `directory`; by default they are kept only when the run fails")
	fs.StringVar(&c.pgbouncer, "pgbouncer", "",
		"run the replicas through a PgBouncer of the run's own, in front of -database-url, in this pool `mode` (session or transaction), "+
			"with the run's schema as its server connections' search_path; it needs pgbouncer (on PATH or at /usr/sbin/pgbouncer); empty: none")
	fs.StringVar(&c.queryExecMode, "query-exec-mode", "",
		"pgx's query `mode` for the replicas' connections (default_query_exec_mode: cache_statement, cache_describe, describe_exec, exec, simple_protocol); "+
			"behind -pgbouncer transaction only exec, simple_protocol and cache_describe work; empty: pgx's default, cache_statement")
	fs.BoolVar(&c.keyPerAttempt, "bug-key-per-attempt", false,
		"negative control: send a new Idempotency-Key on every attempt (the classic client bug), which must show duplicates")
	fs.StringVar(&c.failover, "failover", "",
		"run the failover test instead of the chaos test: `sync` or async replication to a standby, whose primary is killed mid-load and the standby promoted "+
			"(its own throwaway PostgreSQL cluster; none of the chaos faults)")
	fs.DurationVar(&c.promoteAfter, "promote-after", time.Second, "with -failover: how long after the primary's death the standby is promoted (failure detection)")
	fs.DurationVar(&c.lag, "replication-lag", 3*time.Second,
		"with -failover async: how long before the kill the standby stops receiving WAL; what the primary commits meanwhile is lost with it")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	c.serverArgs = strings.Fields(*serverArgs)
	if c.failover != "" {
		if err := failoverDefaults(fs, &c); err != nil {
			return c, err
		}
	}
	if c.kills < 0 {
		c.kills = max(1, int(c.duration/(5*time.Second)))
	}
	if c.terminations < 0 {
		c.terminations = max(1, int(c.duration/(3*time.Second)))
	}
	if c.restarts < 0 {
		c.restarts = max(1, int(c.duration/(10*time.Second)))
	}
	switch {
	case fs.NArg() > 0:
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	case c.duration <= 0 || c.grace <= 0:
		return c, errors.New("-duration and -grace must be positive")
	case c.duration > time.Hour:
		return c, errors.New("-duration is capped at 1h")
	case c.replicas < 1 || c.replicas > 16:
		return c, errors.New("-replicas must be in [1, 16]")
	case c.clients < 1 || c.clients > 256:
		return c, errors.New("-clients must be in [1, 256]")
	case c.accounts < 1 || c.accounts > c.clients:
		return c, errors.New("-accounts must be in [1, -clients]")
	case c.lockTimeout <= 0 || c.attemptTimeout <= 0:
		return c, errors.New("-lock-timeout and -attempt-timeout must be positive")
	case c.processorDelay < 0 || c.slowDelay < 0 || c.processorFails < 0 || c.processorFails > 1:
		return c, errors.New("-processor-delay and -slow-processor-delay must not be negative, -processor-failure-rate must be in [0, 1]")
	case c.retention <= 0:
		return c, errors.New("-retention must be positive")
	case c.invalidRate < 0 || c.invalidRate > 1:
		return c, errors.New("-invalid-text must be in [0, 1]")
	case !(c.holdRate >= 0 && c.holdRate <= 1) || !(c.cancelRate >= 0 && c.cancelRate <= 1) || !(c.vanishRate >= 0 && c.vanishRate <= 1) ||
		!(c.lateRate >= 0 && c.lateRate <= 1):
		return c, errors.New("-hold, -cancel, -vanish and -late must be in [0, 1]")
	case c.pgbouncer != "" && c.pgbouncer != pgbouncer.Session && c.pgbouncer != pgbouncer.Transaction:
		return c, fmt.Errorf("-pgbouncer %q: want %s or %s", c.pgbouncer, pgbouncer.Session, pgbouncer.Transaction)
	case c.queryExecMode != "" && !slices.Contains([]string{"cache_statement", "cache_describe", "describe_exec", "exec", "simple_protocol"}, c.queryExecMode):
		return c, fmt.Errorf("-query-exec-mode %q: want cache_statement, cache_describe, describe_exec, exec or simple_protocol", c.queryExecMode)
	case c.sweepGrace <= max(c.processorDelay, c.slowDelay) || c.sweepGrace >= c.retention:
		return c, fmt.Errorf("-sweep-grace %v must exceed the processor delays (%v, %v: it is also the servers' processor timeout) and stay below -retention %v, "+
			"or abandoned keys expire before a sweeper settles them", c.sweepGrace, c.processorDelay, c.slowDelay, c.retention)
	}
	if err := c.mix.Valid(); err != nil {
		return c, err
	}
	return c, nil
}

// run runs the chaos test as the flags in args say, writes its report to
// stdout, and returns an error if the run failed or an invariant was
// violated.
func run(ctx context.Context, args []string, stdout io.Writer) error {
	cfg, err := parseFlags(args, stdout)
	if err != nil {
		return err
	}
	if cfg.failover != "" {
		rep, err := runFailover(ctx, cfg, stdout)
		if err != nil {
			return err
		}
		return rep.err()
	}
	rep, err := runChaos(ctx, cfg, stdout)
	if err != nil {
		return err
	}
	return rep.verdict.err()
}

// hold is how long a held payment's transaction stays open after its
// insert: past the retention, so that a retention counted from anything
// but the answer would expire the key before the retry asks.
func (c config) hold() time.Duration { return c.retention + time.Second }

// shutdownTimeout is the replicas' -shutdown-timeout: time for the
// slowest request in flight at a graceful stop (a slow replica's charge,
// then a held transaction) to finish.
func (c config) shutdownTimeout() time.Duration {
	d := 10 * time.Second
	if c.holdRate > 0 {
		d = max(d, c.slowDelay+c.hold()+3*time.Second)
	}
	return d
}

// stopTimeout bounds the graceful stop of a replica.
func (c config) stopTimeout() time.Duration { return c.shutdownTimeout() + 5*time.Second }
