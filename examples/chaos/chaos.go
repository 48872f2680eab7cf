package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/pgbouncer"
)

// Random streams derived from the seed, one per user, so that each draws
// the same sequence whatever the others do.
const (
	streamProxy = iota + 1
	streamKills
	streamTerminations
	streamRestarts
	streamClients // + client number
	// streamVanish + client number: whether a client vanishes after an
	// unknown outcome, a stream of its own so that the clients' other
	// draws are the same with and without -vanish.
	streamVanish = streamClients + 1<<16
	// streamLate: which operations are sent again after their retention.
	streamLate = streamVanish + 1<<16
)

// chaos is one run in progress.
type chaos struct {
	cfg   config
	out   *syncWriter
	start time.Time
	db    *database
	fleet *fleet
	proxy *faultproxy.Proxy

	mu                 sync.Mutex
	kills              int
	restarts           int
	terminationRounds  int
	backendsTerminated int
	errs               []error // failures of the fault goroutines
}

// report is what a run found.
type report struct {
	cfg         config
	schema      string
	proxy       faultproxy.Stats
	kills       int
	restarts    int
	termRounds  int
	terminated  int
	stats       *stats
	ops         []*op
	db          dbState
	verdict     verdict
	logsKeptIn  string
	stopProblem error
	serverLogs  map[string]int64 // the replicas' log records, by message
	late        lateStats        // what the late retries got
}

// bouncerPoolSize is the most server connections the run's PgBouncer
// opens to the database (-pgbouncer), for replicas of up to 16 client
// connections each.
const bouncerPoolSize = 20

// runChaos runs the test and prints its report to stdout.
func runChaos(ctx context.Context, cfg config, stdout io.Writer) (rep *report, err error) {
	out := &syncWriter{w: stdout}
	runID := randomID()
	schema := "idem_chaos_" + runID
	db, err := openDatabase(ctx, cfg.databaseURL, schema, "idem-chaos-"+runID)
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := db.close(cfg.keepSchema); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	db.mode = cfg.queryExecMode
	if cfg.pgbouncer != "" {
		b, err := pgbouncer.Start(ctx, pgbouncer.Config{Server: cfg.databaseURL, PoolMode: cfg.pgbouncer, SearchPath: schema,
			PoolSize: bouncerPoolSize})
		if err != nil {
			return nil, err
		}
		defer b.Close() // after the replicas stop, before the schema is dropped
		db.bouncer = b.URL()
	}

	wd, err := newWorkdir(cfg)
	if err != nil {
		return nil, err
	}
	defer wd.close()
	bin, err := wd.serverBin(ctx, cfg, out)
	if err != nil {
		return nil, err
	}

	c := &chaos{cfg: cfg, out: out, db: db, fleet: &fleet{logs: map[string]int64{}}}
	accts := accounts(cfg.accounts)
	for i := range cfg.replicas {
		app := fmt.Sprintf("idem-chaos-%s-r%d", runID, i)
		delay := cfg.processorDelay
		if i == 0 && cfg.slowDelay > 0 {
			delay = cfg.slowDelay // slow but alive: leases renewed, never taken over
		}
		c.fleet.replicas = append(c.fleet.replicas, &replica{
			n:       i,
			appName: app,
			bin:     bin,
			args: replicaArgs(cfg, db.serverURL(app), accts,
				"-processor-delay", delay.String(),
				"-processor-failure-rate", strconv.FormatFloat(cfg.processorFails, 'g', -1, 64)),
			logPath: filepath.Join(wd.logs, fmt.Sprintf("replica-%d.log", i)),
			onLog:   c.fleet.countLog,
		})
	}
	defer c.fleet.stopAll(cfg.stopTimeout()) // on the error paths; a no-op after the stop below
	targets, err := c.fleet.startAll(ctx)
	if err != nil {
		wd.keep = true
		return nil, fmt.Errorf("%w (logs in %s)", err, wd.logs)
	}

	c.proxy, err = faultproxy.Listen("127.0.0.1:0", faultproxy.Config{
		Targets:  targets,
		Seed:     seedFor(cfg.seed, streamProxy),
		Mix:      cfg.mix,
		StallFor: 3 * cfg.attemptTimeout,
	})
	if err != nil {
		return nil, err
	}
	defer c.proxy.Close()

	printHeader(out, cfg, schema, redactURL(cfg.databaseURL))
	st := newStats()
	cl, base := newClients(cfg, "http://"+c.proxy.Addr(), st)
	defer base.CloseIdleConnections()

	c.start = time.Now()
	runCtx, endRun := context.WithCancel(ctx)
	defer endRun()
	newOps, endNewOps := context.WithTimeout(runCtx, cfg.duration)
	defer endNewOps()

	var faults sync.WaitGroup
	faults.Go(func() { c.killer(ctx, newOps, rng(cfg.seed, streamKills)) })
	faults.Go(func() { c.terminator(newOps, rng(cfg.seed, streamTerminations)) })
	faults.Go(func() { c.restarter(ctx, newOps, rng(cfg.seed, streamRestarts)) })
	var workers sync.WaitGroup
	for w := range cfg.clients {
		r := rng(cfg.seed, streamClients+uint64(w))
		workers.Go(func() { cl.run(runCtx, newOps, w, r) })
	}
	settled := make(chan struct{})
	go func() {
		workers.Wait()
		close(settled)
	}()

	<-newOps.Done()
	c.proxy.SetMix(faultproxy.Mix{})
	faults.Wait() // a replica being restarted is back
	if err := ctx.Err(); err != nil {
		endRun()
		<-settled
		return nil, err
	}
	c.event("faults off: %d operations without a definitive answer yet; waiting up to %s for them", cl.pending.Load(), cfg.grace)
	if err := c.settle(ctx, cl, settled, endRun); err != nil {
		return nil, err
	}
	c.awaitSweepers(ctx, cl)
	cl.lateRetries(ctx, c, rng(cfg.seed, streamLate))
	if err := errors.Join(c.errs...); err != nil {
		wd.keep = true
		return nil, fmt.Errorf("%w (logs in %s)", err, wd.logs)
	}

	rep = &report{cfg: cfg, schema: schema, stats: st, ops: cl.allOps(), late: cl.late}
	c.proxy.Close()
	rep.proxy = c.proxy.Stats()
	rep.stopProblem = c.fleet.stopAll(cfg.stopTimeout())
	rep.kills, rep.restarts, rep.termRounds, rep.terminated = c.kills, c.restarts, c.terminationRounds, c.backendsTerminated
	rep.serverLogs = c.fleet.logCounts()

	lctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if rep.db, err = db.load(lctx); err != nil {
		return nil, err
	}
	rep.verdict = check(rep.ops, rep.db)
	if cfg.logsDir != "" || rep.verdict.err() != nil || rep.stopProblem != nil {
		wd.keep = true
		rep.logsKeptIn = wd.logs
	}
	rep.print(out)
	return rep, nil
}

// sweepInterval is the replicas' -sweep-interval.
const sweepInterval = 500 * time.Millisecond

// settle waits, once no new operation starts, until every client goroutine
// is done (settled is closed) or the grace period passes; then it ends the
// run (endRun) and waits for them. It returns ctx's error if ctx ended
// first.
func (c *chaos) settle(ctx context.Context, cl *clients, settled <-chan struct{}, endRun func()) error {
	grace := time.NewTimer(c.cfg.grace)
	defer grace.Stop()
	select {
	case <-settled:
		c.event("every client has a definitive answer for every operation")
	case <-grace.C:
		endRun()
		<-settled
		c.event("grace period over: %d operations without a definitive answer", cl.pending.Load())
	case <-ctx.Done():
		<-settled
	}
	return ctx.Err()
}

// replicaArgs are the flags of a replica but -addr: the database, the
// run's settings, and processor, the flags that say which card processor
// it charges through.
func replicaArgs(cfg config, databaseURL string, accts []account, processor ...string) []string {
	args := []string{
		"-database-url", databaseURL,
		"-api-keys", apiKeysFlag(accts),
		"-lock-timeout", cfg.lockTimeout.String(),
		"-retention", cfg.retention.String(),
		"-purge-interval", "1s",
		"-sweep-grace", cfg.sweepGrace.String(),
		"-sweep-interval", sweepInterval.String(),
		"-shutdown-timeout", cfg.shutdownTimeout().String(),
		"-log-format", "json",
		"-log-level", "debug", // the outcomes stored, counted in the report
	}
	args = append(args, processor...)
	args = append(args, holdArgs(cfg)...)
	return append(args, cfg.serverArgs...)
}

// workdir is a run's temporary directory, where idem-server is built, and
// the directory of the replicas' logs: the temporary one unless -logs
// names another.
type workdir struct {
	tmp, logs string
	keep      bool // set when the run fails: the servers' logs explain it
}

func newWorkdir(cfg config) (*workdir, error) {
	tmp, err := os.MkdirTemp("", "idem-chaos-")
	if err != nil {
		return nil, err
	}
	w := &workdir{tmp: tmp, logs: cmp.Or(cfg.logsDir, tmp)}
	if err := os.MkdirAll(w.logs, 0o755); err != nil {
		os.RemoveAll(tmp)
		return nil, err
	}
	return w, nil
}

// serverBin returns the idem-server binary to run: -server-bin, or one
// built into the temporary directory.
func (w *workdir) serverBin(ctx context.Context, cfg config, out io.Writer) (string, error) {
	if cfg.serverBin != "" {
		return cfg.serverBin, nil
	}
	fmt.Fprintln(out, "building idem-server …")
	return buildServer(ctx, w.tmp)
}

// close deletes the temporary directory, or only the binary in it when
// the logs there are kept.
func (w *workdir) close() {
	if w.keep && w.logs == w.tmp {
		os.Remove(filepath.Join(w.tmp, "idem-server")) // the logs are worth keeping, not the binary
		return
	}
	os.RemoveAll(w.tmp)
}

// awaitSweepers waits, after the clients are done, until every downstream
// charge has its payment, or for as long as the sweepers need to settle an
// operation abandoned at the end of the run: its lease runs out, its grace
// passes, a sweep comes. The operations of the clients that vanished are
// settled by the sweepers alone.
func (c *chaos) awaitSweepers(ctx context.Context, cl *clients) {
	bound := c.cfg.lockTimeout + c.cfg.sweepGrace + 4*sweepInterval + 5*time.Second
	deadline := time.Now().Add(bound)
	for {
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		n, err := c.db.orphanCharges(qctx)
		cancel()
		switch {
		case err != nil:
			c.event("counting the charges without a payment failed: %v", err)
			return
		case n == 0:
			c.event("every downstream charge has its payment (%d operations vanished, left to the sweepers)", cl.vanished.Load())
			return
		case time.Now().After(deadline):
			c.event("%d downstream charges still without a payment after %s", n, bound)
			return
		}
		if !sleep(ctx, 200*time.Millisecond) {
			return
		}
	}
}

// holdArgs are the replicas' flags that hold a share of the payments'
// transactions past the retention; none when cfg.holdRate is 0.
func holdArgs(cfg config) []string {
	if cfg.holdRate == 0 {
		return nil
	}
	return []string{"-hold-after-write", cfg.hold().String(), "-hold-rate", strconv.FormatFloat(cfg.holdRate, 'g', -1, 64)}
}

// killer kills a replica with SIGKILL at cfg.kills random times while
// faults runs, and starts it again after a short random downtime. A
// restart is finished even after faults is done; it stops only when ctx is.
func (c *chaos) killer(ctx, faults context.Context, rng *mrand.Rand) {
	for _, at := range schedule(rng, c.cfg.kills, c.cfg.duration) {
		if !sleep(faults, time.Until(c.start.Add(at))) {
			return
		}
		i := rng.IntN(len(c.fleet.replicas))
		down := 200*time.Millisecond + time.Duration(rng.Int64N(int64(time.Second)))
		c.fleet.mu.Lock()
		r := c.fleet.replicas[i]
		pid := r.pid()
		r.kill()
		c.count(func() { c.kills++ })
		c.event("kill -9 replica %d (pid %d); down for %s", i, pid, down.Round(time.Millisecond))
		sleep(ctx, down)
		if !c.startAgain(ctx, i, r) {
			return
		}
	}
}

// startAgain starts replica i, stopped or killed under c.fleet.mu, again
// (three tries), releases c.fleet.mu and points the proxy at it. It
// reports whether the replica is back; when it is not, the run has failed.
func (c *chaos) startAgain(ctx context.Context, i int, r *replica) bool {
	addr, err := r.start(ctx)
	for try := 1; err != nil && try < 3 && ctx.Err() == nil; try++ {
		c.event("replica %d failed to start (%v); trying again", i, err)
		sleep(ctx, time.Second)
		addr, err = r.start(ctx)
	}
	pid := r.pid() // under c.fleet.mu: the killer and the restarter share r
	c.fleet.mu.Unlock()
	if err != nil {
		c.count(func() { c.errs = append(c.errs, fmt.Errorf("restarting replica %d: %w", i, err)) })
		return false
	}
	c.proxy.SetTarget(i, addr)
	c.event("replica %d back (pid %d, %s)", i, pid, addr)
	return true
}

// restarter restarts the replicas gracefully, one at a time in turn, at
// cfg.restarts random times while faults runs, as a rolling deploy does:
// SIGTERM, the replica stops accepting connections (the proxy fails over
// to the others) and drains its requests, each of which completes or
// releases its key, then it starts again.
func (c *chaos) restarter(ctx, faults context.Context, rng *mrand.Rand) {
	for k, at := range schedule(rng, c.cfg.restarts, c.cfg.duration) {
		if !sleep(faults, time.Until(c.start.Add(at))) {
			return
		}
		i := k % len(c.fleet.replicas)
		c.fleet.mu.Lock()
		r := c.fleet.replicas[i]
		c.event("graceful restart of replica %d (pid %d): SIGTERM, draining", i, r.pid())
		stopErr := r.stop(c.cfg.stopTimeout())
		c.count(func() { c.restarts++ })
		if stopErr != nil {
			c.count(func() { c.errs = append(c.errs, fmt.Errorf("graceful stop of replica %d: %w", i, stopErr)) })
		}
		if !c.startAgain(ctx, i, r) {
			return
		}
	}
}

// terminator terminates the PostgreSQL backends of a random replica at
// cfg.terminations random times while ctx runs.
func (c *chaos) terminator(ctx context.Context, rng *mrand.Rand) {
	for _, at := range schedule(rng, c.cfg.terminations, c.cfg.duration) {
		if !sleep(ctx, time.Until(c.start.Add(at))) {
			return
		}
		i := rng.IntN(len(c.fleet.replicas))
		tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		n, err := c.db.terminate(tctx, c.fleet.replicas[i].appName)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				c.event("pg_terminate_backend for replica %d failed: %v", i, err)
			}
			continue
		}
		c.count(func() { c.terminationRounds++; c.backendsTerminated += n })
		c.event("pg_terminate_backend: %d backends of replica %d", n, i)
	}
}

func (c *chaos) count(f func()) {
	c.mu.Lock()
	f()
	c.mu.Unlock()
}

// event prints a line of the run's timeline.
func (c *chaos) event(format string, args ...any) {
	fmt.Fprintf(c.out, "  %6.1fs  %s\n", time.Since(c.start).Seconds(), fmt.Sprintf(format, args...))
}

// schedule returns n sorted random offsets within the middle 80% of d.
func schedule(rng *mrand.Rand, n int, d time.Duration) []time.Duration {
	ts := make([]time.Duration, n)
	for i := range ts {
		ts[i] = d/10 + time.Duration(rng.Int64N(int64(d*8/10)+1))
	}
	slices.Sort(ts)
	return ts
}

// seedFor derives the seed of one random stream from the run's seed.
func seedFor(seed, stream uint64) uint64 {
	return mrand.New(mrand.NewPCG(seed, stream)).Uint64()
}

func rng(seed, stream uint64) *mrand.Rand {
	return mrand.New(mrand.NewPCG(seed, stream))
}

// randomID names a run's schema and connections; it is not derived from
// the seed, so that two runs with one seed on one database do not collide.
func randomID() string {
	var b [4]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// syncWriter serializes the writes of the run's goroutines.
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}
