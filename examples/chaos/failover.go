package main

// The failover test (-failover sync|async): the replicas of idem-server
// share a PostgreSQL primary of the run's own with a streaming standby
// (package pgcluster), through a multi-host URL with
// target_session_attrs=read-write; the card processor runs in this
// process and keeps its charges here, outside the database, as a real
// processor does. Mid-load the primary dies (SIGKILL, every process) and,
// a moment later, the standby is promoted.
//
// With synchronous replication nothing a client was told may be lost.
// With asynchronous replication, held back before the kill, what the
// primary committed meanwhile is gone: the payments its clients were told
// about are counted (the loss window), then sent again with their key and
// first-sent time, as a reconciling client would, and must come back with
// the payment and the charge they were told, the processor finding the
// charge under the same derived operation; and no key may be charged
// twice at the processor, however its retries went.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/server"
)

// The failover modes.
const (
	failoverSync  = "sync"
	failoverAsync = "async"
)

// chaosOnlyFlags are the flags of the chaos test's faults and database,
// which the failover test does not use: it injects no fault but its own
// and runs its own cluster.
var chaosOnlyFlags = []string{
	"database-url", "kills", "restarts", "pg-terminations", "reset", "drop", "stall", "latency",
	"invalid-text", "hold", "cancel", "late", "vanish", "slow-processor-delay", "processor-failure-rate",
	"bug-key-per-attempt",
}

// failoverDefaults turns the chaos faults off for -failover, refusing
// those given explicitly, and sets the failover test's own defaults for
// the flags not given: 20s of load, two replicas, a retention of 10m
// (a payment lost with the primary is sent again well after its first
// sending, and must not be refused as expired).
func failoverDefaults(fs *flag.FlagSet, c *config) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	for _, name := range chaosOnlyFlags {
		if set[name] {
			return fmt.Errorf("-%s is a setting of the chaos test: -failover runs its own PostgreSQL cluster and injects no fault but the failover", name)
		}
	}
	switch {
	case c.failover != failoverSync && c.failover != failoverAsync:
		return fmt.Errorf("-failover %q: want %s or %s", c.failover, failoverSync, failoverAsync)
	case set["replication-lag"] && c.failover != failoverAsync:
		return errors.New("-replication-lag holds back an async standby: it needs -failover async")
	}
	c.databaseURL = ""
	c.kills, c.restarts, c.terminations = 0, 0, 0
	c.mix = faultproxy.Mix{}
	c.invalidRate, c.holdRate, c.cancelRate, c.lateRate, c.vanishRate, c.processorFails = 0, 0, 0, 0, 0, 0
	c.slowDelay = 0
	if !set["duration"] {
		c.duration = 20 * time.Second
	}
	if !set["replicas"] {
		c.replicas = 2
	}
	if !set["retention"] {
		c.retention = 10 * time.Minute
	}
	switch {
	case c.promoteAfter < 0 || c.lag < 0:
		return errors.New("-promote-after and -replication-lag must not be negative")
	case c.killAt()-c.lag < c.duration/10:
		return fmt.Errorf("-replication-lag %v leaves no load before the standby is held back: the kill comes %v into -duration %v", c.lag, c.killAt(), c.duration)
	}
	return nil
}

// killAt is when, into the load, the primary is killed: the rest of the
// load runs against the promoted standby.
func (c config) killAt() time.Duration { return c.duration * 2 / 5 }

// failoverReport is what a failover run found.
type failoverReport struct {
	cfg        config
	schema     string
	syncState  string // the standbys streaming, by sync_state, at the kill: sync, async or none
	walBehind  int64  // bytes of WAL the primary had written and its standby had not flushed (or, held back, received), at the kill
	killAt     time.Duration
	promotedAt time.Duration
	recovery   time.Duration // from the kill to the first 2xx after the promotion began; 0: none came
	stats      *stats
	ops        []*op
	charges    int   // at the processor
	deduped    int64 // charge requests the processor answered with a charge it held
	before     verdict
	recon      reconcileStats
	after      verdict // after the reconciliation; before when there was none
	serverLogs map[string]int64
	logsKeptIn string
	stopErr    error
}

// reconcileStats counts what the reconciliation found and did.
type reconcileStats struct {
	gone     int // payments told, then answered 404
	restored int // sent again: the payment and charge told came back
	other    int // sent again: anything else
}

// doubleCharged returns the operations charged more than once at the
// processor, and the charges of no operation.
func (v *verdict) doubleCharged() int { return v.chargedTwice + v.strayCharges }

// duplicatePayments returns the payments beyond one per operation, and
// those of no operation.
func (v *verdict) duplicatePayments() int { return v.extraPayments + v.strayPayments }

// err returns nil when the failover kept every promise of its mode.
func (r *failoverReport) err() error {
	var errs []error
	switch want := map[string]string{failoverSync: "sync", failoverAsync: "none"}[r.cfg.failover]; {
	case r.syncState != want:
		errs = append(errs, fmt.Errorf("standbys streaming at the kill: %s, want %s", r.syncState, want))
	}
	if n := r.before.duplicatePayments(); n > 0 {
		errs = append(errs, fmt.Errorf("%d duplicate payments", n))
	}
	if n := max(r.before.doubleCharged(), r.after.doubleCharged()); n > 0 {
		errs = append(errs, fmt.Errorf("%d keys charged more than once at the processor", n))
	}
	if r.cfg.failover == failoverSync && r.before.missing > 0 {
		errs = append(errs, fmt.Errorf("%d payments lost with synchronous replication", r.before.missing))
	}
	if r.recon.other > 0 {
		errs = append(errs, fmt.Errorf("%d payments lost with the primary did not come back as told when sent again", r.recon.other))
	}
	if r.recovery == 0 {
		errs = append(errs, errors.New("no payment succeeded after the failover"))
	}
	if err := r.after.err(); err != nil {
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("failover (%s): %w", r.cfg.failover, errors.Join(errs...))
}

// runFailover runs the failover test and prints its report to stdout.
func runFailover(ctx context.Context, cfg config, stdout io.Writer) (rep *failoverReport, err error) {
	out := &syncWriter{w: stdout}
	runID := randomID()
	primary, standby, err := startPair(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer standby.Stop()
	defer primary.Stop()
	want := "async"
	if cfg.failover == failoverSync {
		want = "sync"
	}
	if err := awaitStandby(ctx, primary, standby, want); err != nil {
		return nil, err
	}
	// The replicas follow the primary wherever it is: the first of the
	// hosts that accepts writes.
	multiHost := fmt.Sprintf("host=%s,%s port=%d,%d user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write connect_timeout=2",
		primary.Host(), standby.Host(), primary.Port(), standby.Port())
	schema := "idem_failover_" + runID
	db, err := openDatabase(ctx, multiHost, schema, "idem-failover-"+runID)
	if err != nil {
		return nil, err
	}
	defer func() {
		if cerr := db.close(false); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()

	// The card processor, outside the database: its charges survive the
	// primary, as a real processor's do.
	charges := &countingCharges{MemoryStorage: server.NewMemoryStorage()}
	procURL, stopProcessor, err := serveProcessor(&server.Processor{
		Charges: charges, Delay: cfg.processorDelay, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		return nil, err
	}
	defer stopProcessor()

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
		app := fmt.Sprintf("idem-failover-%s-r%d", runID, i)
		c.fleet.replicas = append(c.fleet.replicas, &replica{
			n:       i,
			appName: app,
			bin:     bin,
			args:    replicaArgs(cfg, db.serverURL(app), accts, "-processor-url", procURL),
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
	// The proxy only spreads the clients' connections over the replicas.
	c.proxy, err = faultproxy.Listen("127.0.0.1:0", faultproxy.Config{Targets: targets, Seed: seedFor(cfg.seed, streamProxy)})
	if err != nil {
		return nil, err
	}
	defer c.proxy.Close()

	printFailoverHeader(out, cfg, schema, primary, standby, want, redactURL(multiHost))
	st := newStats()
	cl, base := newClients(cfg, "http://"+c.proxy.Addr(), st)
	defer base.CloseIdleConnections()

	rep = &failoverReport{cfg: cfg, schema: schema, stats: st}
	c.start = time.Now()
	runCtx, endRun := context.WithCancel(ctx)
	defer endRun()
	newOps, endNewOps := context.WithTimeout(runCtx, cfg.duration)
	defer endNewOps()
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

	killed, err := c.failover(newOps, primary, standby, st, rep)
	if err != nil {
		endRun()
		<-settled
		wd.keep = true
		return nil, fmt.Errorf("%w (logs in %s)", err, wd.logs)
	}
	<-newOps.Done()
	if err := ctx.Err(); err != nil {
		endRun()
		<-settled
		return nil, err
	}
	c.event("no new operations: %d without a definitive answer yet; waiting up to %s for them", cl.pending.Load(), cfg.grace)
	if err := c.settle(ctx, cl, settled, endRun); err != nil {
		return nil, err
	}
	if first := st.firstSuccess(); !first.IsZero() {
		rep.recovery = first.Sub(killed)
	}
	rep.ops = cl.allOps()
	if err := c.verifyFailover(ctx, cl, charges, rep); err != nil {
		return nil, err
	}

	c.proxy.Close()
	rep.stopErr = c.fleet.stopAll(cfg.stopTimeout())
	rep.serverLogs = c.fleet.logCounts()
	if cfg.logsDir != "" || rep.err() != nil || rep.stopErr != nil {
		wd.keep = true
		rep.logsKeptIn = wd.logs
	}
	rep.print(out)
	return rep, nil
}

// verifyFailover checks, once the clients are done, what the promoted
// standby and the processor hold against what the clients were told
// (rep.before); when payments the clients were told are gone, it
// reconciles them and checks again (rep.after).
func (c *chaos) verifyFailover(ctx context.Context, cl *clients, charges *countingCharges, rep *failoverReport) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	state, err := c.db.load(ctx)
	if err != nil {
		return err
	}
	state.charges = charges.rows()
	rep.before = check(rep.ops, state)
	rep.after = rep.before
	if gone := told(rep.ops, state); len(gone) > 0 {
		rep.recon = cl.reconcile(ctx, c, "http://"+c.proxy.Addr(), gone)
		if state, err = c.db.load(ctx); err != nil {
			return err
		}
		state.charges = charges.rows()
		rep.after = check(rep.ops, state)
	}
	rep.charges = len(state.charges)
	rep.deduped = charges.deduped.Load()
	return nil
}

// failover runs the failover while the load runs: with -failover async,
// the standby stops receiving WAL cfg.lag before the kill; then the
// primary is killed, and the standby promoted cfg.promoteAfter later. It
// returns the time of the kill; st watches for the first success from
// the promotion on.
func (c *chaos) failover(ctx context.Context, primary, standby *pgcluster.Cluster, st *stats, rep *failoverReport) (time.Time, error) {
	cfg := c.cfg
	if cfg.failover == failoverAsync {
		if !sleep(ctx, time.Until(c.start.Add(cfg.killAt()-cfg.lag))) {
			return time.Time{}, ctx.Err()
		}
		if err := holdBack(ctx, primary, standby); err != nil {
			return time.Time{}, err
		}
		c.event("the standby stops receiving WAL (primary_conninfo = ''): what the primary commits from now on is lost with it")
	}
	if !sleep(ctx, time.Until(c.start.Add(cfg.killAt()))) {
		return time.Time{}, ctx.Err()
	}
	// Where the primary's WAL is, and how far the standby has it: what it
	// flushed, as the primary last heard (the acknowledgement a
	// synchronous commit waits for), or, once it no longer streams, what
	// it received.
	var current, received string
	var flushed *string
	err := withConn(ctx, primary, func(conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text,
			coalesce(string_agg(sync_state, ','), 'none'), min(flush_lsn)::text FROM pg_stat_replication`).Scan(&current, &rep.syncState, &flushed)
	})
	if err != nil {
		return time.Time{}, fmt.Errorf("primary: %w", err)
	}
	if flushed != nil {
		received = *flushed
	} else if err := queryRow(ctx, standby, "SELECT pg_last_wal_receive_lsn()::text", &received); err != nil {
		return time.Time{}, fmt.Errorf("standby: %w", err)
	}
	rep.walBehind = lsnDiff(current, received)
	killed := time.Now()
	if err := primary.Kill(); err != nil {
		return time.Time{}, err
	}
	rep.killAt = killed.Sub(c.start)
	c.event("kill -9 the primary, every process of it (standbys streaming: %s; WAL written to %s, the standby has it to %s: %d bytes behind)",
		rep.syncState, current, received, rep.walBehind)
	if !sleep(ctx, cfg.promoteAfter) {
		return killed, ctx.Err()
	}
	// Nothing succeeds from the kill to the promotion (no primary, and
	// target_session_attrs=read-write keeps the replicas off the
	// standby), but answers already on their way at the kill: the first
	// success the promoted standby served is the first 2xx after this.
	t0 := st.watch()
	if err := standby.Promote(ctx); err != nil {
		return killed, fmt.Errorf("promoting the standby: %w (see %s)", err, standby.LogPath())
	}
	rep.promotedAt = time.Since(c.start)
	c.event("pg_promote(): the standby is the primary (promoted in %s)", round(time.Since(t0)))
	return killed, nil
}

// serveProcessor serves p on a free port of 127.0.0.1 and returns its
// base URL and a function that stops it.
func serveProcessor(p *server.Processor) (string, func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	hs := &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		hs.Serve(ln)
	}()
	return "http://" + ln.Addr().String(), func() {
		hs.Close()
		<-done
	}, nil
}

// countingCharges is the processor's charge store: in memory, counting
// the charge requests it answered with a charge it held (a retry of a
// charge, or of an operation whose key row was lost).
type countingCharges struct {
	*server.MemoryStorage
	deduped atomic.Int64
}

func (c *countingCharges) CreateCharge(ctx context.Context, ch server.Charge) (server.Charge, bool, error) {
	stored, created, err := c.MemoryStorage.CreateCharge(ctx, ch)
	if err == nil && !created {
		c.deduped.Add(1)
	}
	return stored, created, err
}

// rows returns the charges as the final check reads them.
func (c *countingCharges) rows() []chargeRow {
	var rows []chargeRow
	for _, ch := range c.Charges() {
		rows = append(rows, chargeRow{id: ch.ID, key: ch.IdempotencyKey, amount: ch.Amount})
	}
	return rows
}

func printFailoverHeader(w io.Writer, cfg config, schema string, primary, standby *pgcluster.Cluster, syncState, url string) {
	mode := map[string]string{failoverSync: "synchronous", failoverAsync: "asynchronous"}[cfg.failover]
	fmt.Fprintf(w, "idem failover test: %s replication, seed %d, %s of load; the primary is killed %s in, the standby promoted %s later\n",
		mode, cfg.seed, cfg.duration, cfg.killAt(), cfg.promoteAfter)
	fmt.Fprintf(w, "  primary %s:%d, standby %s:%d (sync_state %s; the standby's own synchronous_standby_names empty)\n",
		primary.Host(), primary.Port(), standby.Host(), standby.Port(), syncState)
	if cfg.failover == failoverAsync {
		fmt.Fprintf(w, "  the standby stops receiving WAL %s before the kill\n", cfg.lag)
	}
	fmt.Fprintf(w, "  %d idem-server replicas on %s (schema %s), lock timeout %s, retention %s\n",
		cfg.replicas, url, schema, cfg.lockTimeout, cfg.retention)
	fmt.Fprintf(w, "  %d clients over %d API keys; attempt timeout %s; an unknown outcome is asked again later with the same key and first-sent time\n",
		cfg.clients, cfg.accounts, cfg.attemptTimeout)
	fmt.Fprintf(w, "  the card processor keeps its charges in this process, outside the database (latency %s)\n", cfg.processorDelay)
	fmt.Fprintln(w)
}

// print writes the figures of the run, ending with the lines operations,
// duplicates, double-charged keys, lost and recovery.
func (r *failoverReport) print(w io.Writer) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }
	p("")
	printClients(w, r.stats, r.ops)
	printTimeToSuccess(w, r.ops)
	p("")
	printServerLogs(w, r.serverLogs)
	p("")
	p("card processor (outside the database)")
	printRow(w, "charges", "%6d", r.charges)
	printRow(w, "  requests answered with a charge it held", "%6d", r.deduped)
	printRow(w, "  operations charged more than once", "%6d", r.after.doubleCharged())
	p("")
	p("database (the promoted standby)")
	printRow(w, "payments lost with the primary (told, then gone)", "%6d", r.before.missing)
	if r.recon != (reconcileStats{}) {
		printRow(w, "  sent again: came back as told", "%6d of %d", r.recon.restored, r.recon.gone)
	}
	printRow(w, "charges without a payment", "%6d", r.after.orphanCharges)
	v := r.after
	if len(v.problems) > 0 {
		p("")
		p("problems")
		for _, s := range v.problems {
			p("  %s", s)
		}
	}
	if r.stopErr != nil {
		p("")
		p("note: %v", r.stopErr)
	}
	if r.logsKeptIn != "" {
		p("server logs kept in %s", r.logsKeptIn)
	}
	p("")
	p("operations: %d", r.before.operations)
	p("duplicates: %d", max(r.before.duplicatePayments(), r.after.duplicatePayments()))
	p("double-charged keys: %d", max(r.before.doubleCharged(), r.after.doubleCharged()))
	if r.cfg.failover == failoverAsync {
		p("lost: %d (the async loss window: told, then gone with the primary; %d came back when sent again)", r.before.missing, r.recon.restored)
	} else {
		p("lost: %d", r.before.missing)
	}
	if r.recovery > 0 {
		p("recovery: %s (kill → first success)", round(r.recovery))
	} else {
		p("recovery: none (no success after the kill)")
	}
}
