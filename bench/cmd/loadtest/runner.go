package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// runner holds what the scenarios share: the server under test and the
// database the load test reads its counters from.
type runner struct {
	cfg    config
	stdout io.Writer
	stderr io.Writer

	dir  string // temporary directory of the binary and logs
	bin  string // the built server; "" with -server-url
	help string // its -h text
	srv  *proc  // the started server; nil with -server-url
	url  string // base URL of the server under test (with -handler, of idem's routes)
	root string // with -handler: the bench server's URL, whose three ways are under it
	path string // the route: /v1/payments, or /v1/orders with -handler orders
	db   *pgxpool.Pool
	logs int // server logs written, to name the next

	// before holds results a scenario measured on the way, to be
	// reported ahead of its own (retention's "before" run).
	before []result
}

func (r *runner) logf(format string, args ...any) {
	fmt.Fprintf(r.stderr, "loadtest: "+format+"\n", args...)
}

// setup builds and starts the server (or checks -server-url) and connects
// to the database for its counters.
func (r *runner) setup(ctx context.Context) error {
	if r.cfg.databaseURL != "" {
		pool, err := pgxpool.New(ctx, r.cfg.databaseURL)
		if err != nil {
			return fmt.Errorf("database: %w", err)
		}
		if err := pool.Ping(ctx); err != nil {
			pool.Close()
			return fmt.Errorf("database: %w", err)
		}
		r.db = pool
	} else {
		r.logf("no -database-url: the server uses its in-memory store, and commits per request are not counted")
	}
	if r.cfg.serverURL != "" {
		r.url = strings.TrimRight(r.cfg.serverURL, "/")
		p := &proc{url: r.url, exited: make(chan struct{})}
		return waitHealthy(ctx, p, 10*time.Second)
	}
	dir, err := os.MkdirTemp("", "idem-loadtest-")
	if err != nil {
		return err
	}
	r.dir = dir
	if r.cfg.handler != "" {
		return r.setupBench(ctx)
	}
	r.logf("building the server into %s", dir)
	if r.bin, r.help, err = buildServer(ctx, dir); err != nil {
		return err
	}
	r.srv, err = r.start(ctx, nil)
	if err != nil {
		return err
	}
	r.url = r.srv.url
	r.logf("server %s started (log %s)", r.url, r.srv.logPath)
	return nil
}

// setupBench builds and starts the bench server (bench/cmd/benchserver),
// which serves -handler three ways on one pool: behind idem, as the seed
// article by hand, and unkeyed.
func (r *runner) setupBench(ctx context.Context) error {
	r.logf("building the bench server into %s", r.dir)
	bin, err := buildBenchServer(ctx, r.dir)
	if err != nil {
		return err
	}
	args := []string{"-database-url", r.cfg.databaseURL, "-handler", r.cfg.handler, "-reset"}
	if r.cfg.oneTx {
		args = append(args, "-one-transaction")
	}
	args = append(args, r.cfg.serverArgs...)
	r.logs++
	r.srv, err = startServer(ctx, bin, args, filepath.Join(r.dir, fmt.Sprintf("server-%d.log", r.logs)))
	if err != nil {
		return err
	}
	r.root, r.url, r.path = r.srv.url, r.srv.url+"/idem", "/v1/"+r.cfg.handler
	r.logf("bench server %s started, handler %s, one transaction %t (log %s)", r.root, r.cfg.handler, r.cfg.oneTx, r.srv.logPath)
	return nil
}

// client returns a client of the scenario's route at base.
func (r *runner) client(base string) *client {
	c := newClient(base, r.cfg.apiKey, r.cfg.concurrency)
	if r.path != "" {
		c.path = r.path
	}
	return c
}

// start starts the built server with the common flags and extra.
func (r *runner) start(ctx context.Context, extra []string) (*proc, error) {
	args := []string{"-log-level", "warn"} // a log line per payment would be measured too
	if r.cfg.databaseURL != "" {
		args = append(args, "-database-url", r.cfg.databaseURL)
	}
	args = append(args, r.cfg.serverArgs...)
	args = append(args, extra...)
	r.logs++
	return startServer(ctx, r.bin, args, filepath.Join(r.dir, fmt.Sprintf("server-%d.log", r.logs)))
}

func (r *runner) close() {
	if r.srv != nil {
		if err := r.srv.stop(); err != nil {
			r.logf("%v", err)
		}
	}
	if r.db != nil {
		r.db.Close()
	}
	if r.dir != "" {
		if r.cfg.keepServer {
			r.logf("kept %s", r.dir)
		} else {
			os.RemoveAll(r.dir)
		}
	}
}

// result is the outcome of one scenario.
type result struct {
	Scenario string  `json:"scenario"`
	Round    int     `json:"round,omitempty"` // with -rounds above 1: which one, from 1
	Requests int     `json:"requests"`
	ReqPerS  float64 `json:"req_per_s"`
	P50      float64 `json:"p50_ms"`
	P99      float64 `json:"p99_ms"`
	P999     float64 `json:"p999_ms"`
	Errors   int     `json:"errors"`

	Concurrency int            `json:"concurrency"`
	Statuses    map[string]int `json:"statuses"`                         // by HTTP status; "0" for transport errors
	Replayed    int            `json:"replayed"`                         // answers with Idempotent-Replayed: true
	Commits     *float64       `json:"commits_per_req"`                  // database transactions per request; null when not counted
	RoundTrips  *float64       `json:"db_round_trips_per_req,omitempty"` // the server's database round trips per request (its idem_db_round_trips_total)
	ServerCPU   *float64       `json:"server_cpu_ms_per_req,omitempty"`  // CPU time of the server process per request
	DBCPU       *float64       `json:"db_cpu_ms_per_req,omitempty"`      // CPU time of the database's backends per request (local PostgreSQL only)
	MachineBusy *float64       `json:"machine_cpu_busy,omitempty"`       // share of the machine's CPU time not idle, in [0, 1]
	MachineCPU  *float64       `json:"machine_cpu_ms_per_req,omitempty"` // the whole machine's busy CPU time per request, the load test's and any other process's included
	CPU         *float64       `json:"cpu_ms_per_req,omitempty"`         // the CPU time per request of the server, the database's backends and the load test: the whole system under test, whatever else runs on the machine
	Purge       *purgeResult   `json:"purge,omitempty"`                  // retention only
	Note        string         `json:"note,omitempty"`                   // what the figures mean, when it is not obvious
	FirstError  string         `json:"first_error,omitempty"`
}

// purgeResult is what the retention scenario adds.
type purgeResult struct {
	Keys        int     `json:"keys"`
	Seconds     float64 `json:"seconds"`
	RowsPerS    float64 `json:"rows_per_s"`
	P99Before   float64 `json:"p99_before_ms"`
	P99During   float64 `json:"p99_during_ms"`
	ReqPerSPrev float64 `json:"req_per_s_before"`
	Finished    bool    `json:"finished"`
}

func (r *runner) scenario(ctx context.Context, name string) (result, error) {
	switch name {
	case "first":
		return r.first(ctx, r.url, "first")
	case "article":
		if r.root == "" {
			return result{}, fmt.Errorf("%w: article needs -handler (the bench server serves the seed article by hand)", errSkipped)
		}
		return r.first(ctx, r.root+"/article", "article")
	case "replay":
		return r.replay(ctx)
	case "unkeyed":
		return r.unkeyed(ctx)
	case "read":
		if r.root == "" {
			return result{}, fmt.Errorf("%w: read needs -handler (the bench server serves GET by primary key)", errSkipped)
		}
		return r.read(ctx)
	case "conflict":
		return r.conflict(ctx)
	case "retention":
		return r.retention(ctx)
	}
	return result{}, fmt.Errorf("unknown scenario %q", name)
}

func (r *runner) measure() window {
	from := time.Now().Add(r.cfg.warmup)
	return window{from: from, to: from.Add(r.cfg.duration)}
}

// first measures first executions: every request has a new key.
func (r *runner) first(ctx context.Context, base, name string) (result, error) {
	c := r.client(base)
	defer c.close()
	w := r.measure()
	var t *tally
	commits, err := r.countCommits(ctx, w, pidOf(r.srv), base, func() {
		t = drive(ctx, r.cfg.concurrency, w, int64(r.cfg.maxRequests), func(ctx context.Context, _ int, seq int64) outcome {
			return c.post(ctx, uuid.NewString(), paymentBody(seq))
		}, isStatus(http.StatusCreated, false))
	})
	if err != nil {
		return result{}, err
	}
	return r.summarize(name, t, w, commits), nil
}

// replay creates replayKeys payments, then measures retries of them. Each
// key is sent with the first-sent time of its creation, and retried with
// it, as idem's Transport does.
func (r *runner) replay(ctx context.Context) (result, error) {
	c := r.client(r.url)
	defer c.close()
	n := r.cfg.replayKeys
	keys := make([]string, n)
	for i := range keys {
		keys[i] = uuid.NewString()
	}
	sent := time.Now().UTC().Format(http.TimeFormat)
	// Create them, untimed, with the same concurrency.
	errs := make(chan error, r.cfg.concurrency)
	var next sync.Mutex
	i := 0
	var wg sync.WaitGroup
	for range r.cfg.concurrency {
		wg.Go(func() {
			for {
				next.Lock()
				k := i
				i++
				next.Unlock()
				if k >= n || ctx.Err() != nil {
					return
				}
				if o := c.postSent(ctx, keys[k], sent, paymentBody(int64(k))); o.status != http.StatusCreated {
					errs <- fmt.Errorf("creating the keys to replay: %s", describe(o))
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return result{}, err
	}
	w := r.measure()
	var t *tally
	commits, err := r.countCommits(ctx, w, pidOf(r.srv), r.url, func() {
		t = drive(ctx, r.cfg.concurrency, w, int64(r.cfg.maxRequests), func(ctx context.Context, _ int, seq int64) outcome {
			k := int(seq % int64(n))
			return c.postSent(ctx, keys[k], sent, paymentBody(int64(k)))
		}, isStatus(http.StatusCreated, true))
	})
	if err != nil {
		return result{}, err
	}
	return r.summarize("replay", t, w, commits), nil
}

// read measures GETs of stored rows by primary key, unkeyed, on the
// bench server: a replay's yardstick, one indexed read and an answer. It
// creates replayKeys rows first, untimed, through the unkeyed route.
func (r *runner) read(ctx context.Context) (result, error) {
	post := r.client(r.root + "/unkeyed")
	defer post.close()
	ids := make([]string, r.cfg.replayKeys)
	for i := range ids {
		id, err := post.create(ctx, paymentBody(int64(i)))
		if err != nil {
			return result{}, fmt.Errorf("creating the rows to read: %w", err)
		}
		ids[i] = id
	}
	c := r.client(r.root + "/read")
	defer c.close()
	w := r.measure()
	var t *tally
	commits, err := r.countCommits(ctx, w, pidOf(r.srv), r.root, func() {
		t = drive(ctx, r.cfg.concurrency, w, int64(r.cfg.maxRequests), func(ctx context.Context, _ int, seq int64) outcome {
			return c.get(ctx, ids[seq%int64(len(ids))])
		}, isStatus(http.StatusOK, false))
	})
	if err != nil {
		return result{}, err
	}
	return r.summarize("read", t, w, commits), nil
}

// unkeyed measures the same payment without the idempotency layer: on a
// second server started with -no-idempotency, or at -unkeyed-url.
func (r *runner) unkeyed(ctx context.Context) (result, error) {
	base := r.cfg.unkeyedURL
	var driven *proc // the server measured, when the load test started it
	if r.root != "" {
		base, driven = r.root+"/unkeyed", r.srv
	}
	if base == "" {
		if r.bin == "" {
			return result{}, fmt.Errorf("%w: with -server-url, pass -unkeyed-url: the URL of a server started with -no-idempotency", errSkipped)
		}
		if !hasFlag(r.help, "no-idempotency") {
			return result{}, fmt.Errorf("%w: idem-server has no -no-idempotency flag, so there is no payment route without the idempotency layer to compare with", errSkipped)
		}
		// Only one server runs at a time, so that they do not share the
		// machine's two cores.
		if err := r.srv.stop(); err != nil {
			return result{}, err
		}
		p, err := r.start(ctx, []string{"-no-idempotency"})
		if err != nil {
			return result{}, err
		}
		defer func() {
			p.stop()
			if p, err := r.start(ctx, nil); err == nil {
				r.srv, r.url = p, p.url
			} else {
				r.logf("restarting the server: %v", err)
			}
		}()
		base, driven = p.url, p
	}
	c := r.client(base)
	defer c.close()
	w := r.measure()
	var t *tally
	commits, err := r.countCommits(ctx, w, pidOf(driven), base, func() {
		t = drive(ctx, r.cfg.concurrency, w, int64(r.cfg.maxRequests), func(ctx context.Context, _ int, seq int64) outcome {
			return c.post(ctx, "", paymentBody(seq))
		}, isStatus(http.StatusCreated, false))
	})
	if err != nil {
		return result{}, err
	}
	return r.summarize("unkeyed", t, w, commits), nil
}

// conflict runs rounds in which every worker sends the same new key at
// once: one request executes (201), the others find it started (409) or
// completed (a replayed 201). A round starts when the last one has ended.
func (r *runner) conflict(ctx context.Context) (result, error) {
	c := r.client(r.url)
	defer c.close()
	w := r.measure()
	n := r.cfg.concurrency
	ok := func(o outcome) bool {
		return o.err == nil && (o.status == http.StatusCreated || o.status == http.StatusConflict)
	}
	tallies := make([]*tally, n)
	for i := range tallies {
		tallies[i] = newTally()
	}
	measured := 0
	commits, err := r.countCommits(ctx, w, pidOf(r.srv), r.url, func() {
		for round := int64(0); ctx.Err() == nil && measured < r.cfg.maxRequests; round++ {
			start := time.Now()
			if !start.Before(w.to) {
				break
			}
			key, body := uuid.NewString(), paymentBody(round)
			var wg sync.WaitGroup
			gate := make(chan struct{})
			for i := range n {
				wg.Go(func() {
					<-gate
					s := time.Now()
					o := c.post(ctx, key, body)
					if !start.Before(w.from) {
						tallies[i].add(s, time.Since(s), o, ok)
					}
				})
			}
			close(gate)
			wg.Wait()
			if !start.Before(w.from) {
				measured += n
			}
		}
	})
	if err != nil {
		return result{}, err
	}
	total := newTally()
	for _, t := range tallies {
		total.merge(t)
	}
	res := r.summarize("conflict", total, w, commits)
	res.Note = fmt.Sprintf("rounds of %d concurrent requests with one key: 201 executed or replayed, 409 in progress", n)
	return res, nil
}

// retention measures the first scenario on a freshly started server, then
// again on a fresh server whose table holds expiredKeys expired keys, which
// its purge job deletes from its start on.
func (r *runner) retention(ctx context.Context) (result, error) {
	if r.bin == "" || r.db == nil {
		return result{}, fmt.Errorf("%w: retention needs -database-url and a reference server the load test starts (no -server-url, no -handler)", errSkipped)
	}
	restart := func() error {
		if err := r.srv.stop(); err != nil {
			return err
		}
		p, err := r.start(ctx, nil)
		if err != nil {
			return err
		}
		r.srv, r.url = p, p.url
		return nil
	}
	// Before: a fresh server, no expired keys.
	if _, err := r.db.Exec(ctx, `DELETE FROM idempotency_keys WHERE client_id = 'loadtest_expired'`); err != nil {
		return result{}, err
	}
	if err := restart(); err != nil {
		return result{}, err
	}
	before, err := r.first(ctx, r.url, "retention-before")
	if err != nil {
		return result{}, err
	}
	before.Note = "first executions on a fresh server, before the expired keys are inserted"
	r.before = append(r.before, before)

	// Stop the server, so that its purge job runs only once the keys are in.
	if err := r.srv.stop(); err != nil {
		return result{}, err
	}
	t0 := time.Now()
	n := r.cfg.expiredKeys
	_, err = r.db.Exec(ctx, `
		INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
			request_hash, status, operation_id, lock_token,
			response_status, response_content_type, response_body, created_at, locked_at)
		SELECT 'loadtest_expired', 'expired-' || g, 'POST', '/v1/payments',
			sha256(g::text::bytea), 'completed', gen_random_uuid(), nextval('idempotency_lock_tokens'),
			201, 'application/json', convert_to('{"id":"pay_expired_' || g || '"}', 'UTF8'),
			now() - interval '48 hours' - g * interval '1 millisecond', now() - interval '48 hours'
		FROM generate_series(1, $1::int) g`, n)
	if err != nil {
		return result{}, fmt.Errorf("inserting %d expired keys: %w", n, err)
	}
	if _, err := r.db.Exec(ctx, `VACUUM ANALYZE idempotency_keys`); err != nil {
		return result{}, err
	}
	r.logf("retention: inserted %d expired keys in %s", n, time.Since(t0).Round(time.Millisecond))

	// During: a fresh server purges at once while the load runs.
	p, err := r.start(ctx, nil)
	if err != nil {
		return result{}, err
	}
	r.srv, r.url = p, p.url
	purgeStart := p.started
	done := make(chan time.Time, 1)
	pollCtx, stopPoll := context.WithCancel(ctx)
	defer stopPoll()
	go func() {
		for pollCtx.Err() == nil {
			if v, err := purged(pollCtx, r.url); err == nil && v >= float64(n) {
				done <- time.Now()
				return
			}
			select {
			case <-pollCtx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	// Run until the purge is done, within 10 minutes; the load goes on
	// for the usual duration at least.
	c := r.client(r.url)
	defer c.close()
	w := r.measure()
	w.to = w.from.Add(10 * time.Minute)
	var purgeEnd time.Time
	finished := false
	loadCtx, stopLoad := context.WithCancel(ctx)
	go func() {
		select {
		case purgeEnd = <-done:
			finished = true
			// Let the load go on to the usual duration when the purge was quick.
			if min := w.from.Add(r.cfg.duration); purgeEnd.Before(min) {
				time.Sleep(time.Until(min))
			}
		case <-time.After(time.Until(w.to)):
		case <-ctx.Done():
		}
		stopLoad()
	}()
	t := drive(loadCtx, r.cfg.concurrency, w, int64(r.cfg.maxRequests), func(ctx context.Context, _ int, seq int64) outcome {
		return c.post(ctx, uuid.NewString(), paymentBody(seq))
	}, isStatus(http.StatusCreated, false))
	stopPoll()
	if !finished {
		purgeEnd = time.Now()
	}
	// "During" is the requests that started while the purge ran.
	during := newTally()
	during.statuses = t.statuses
	during.errors, during.firstErr = t.errors, t.firstErr
	for _, s := range t.samples {
		if s.start.Before(purgeEnd) {
			during.samples = append(during.samples, s)
		}
	}
	span := window{from: w.from, to: purgeEnd}
	if purgeEnd.Before(w.from) {
		span.to = w.from.Add(time.Millisecond)
	}
	res := r.summarize("retention", during, span, nil)
	secs := purgeEnd.Sub(purgeStart).Seconds()
	res.Purge = &purgeResult{
		Keys: n, Seconds: secs, RowsPerS: float64(n) / secs,
		P99Before: before.P99, P99During: res.P99, ReqPerSPrev: before.ReqPerS, Finished: finished,
	}
	res.Note = "first executions while the purge job deletes the expired keys; purge timed from the server's start"
	return res, nil
}

// pidOf returns the process ID of p, or 0 for none.
func pidOf(p *proc) int {
	if p == nil || p.cmd == nil || p.cmd.Process == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// purged reads idem_keys_purged_total from the server's /metrics.
func purged(ctx context.Context, base string) (float64, error) {
	return metric(ctx, base, "idem_keys_purged_total")
}

// metric reads a counter from the server's /metrics: the sum of its samples
// over all label values.
func metric(ctx context.Context, base, name string) (float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sum, found := 0.0, false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), name)
		if !ok || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue
		}
		if rest[0] == '{' {
			_, rest, _ = strings.Cut(rest, "}")
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
		if err != nil {
			return 0, fmt.Errorf("%s in /metrics: %w", name, err)
		}
		sum, found = sum+v, true
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	if !found {
		return 0, fmt.Errorf("no %s in /metrics", name)
	}
	return sum, nil
}

// countCommits runs load and returns what the counters say about the
// window w: the database transactions committed (nil without a database),
// the database round trips the server at base made (from its /metrics;
// absent for a server without the counter or without a database), the CPU
// time of the server process pid (0: not known, with -server-url), and how
// busy the machine's CPUs were. The counters are read at the start
// and the end of the window while the load runs; PostgreSQL backends
// publish their counts at most a second late, which under steady load
// shifts both ends alike.
func (r *runner) countCommits(ctx context.Context, w window, pid int, base string, load func()) (*commitCount, error) {
	cc := &commitCount{pid: pid}
	var wg sync.WaitGroup
	var errFrom, errTo error
	wg.Go(func() {
		time.Sleep(time.Until(w.from))
		cc.from, errFrom = r.counters(ctx, pid, base)
		time.Sleep(time.Until(w.to))
		cc.to, errTo = r.counters(ctx, pid, base)
	})
	load()
	wg.Wait()
	return cc, errors.Join(errFrom, errTo)
}

type commitCount struct {
	pid      int
	from, to counters
}

type counters struct {
	commits    int64
	roundTrips float64 // idem_db_round_trips_total of the server
	hasRT      bool
	srvTicks   int64         // utime+stime of the server, in clock ticks
	selfTicks  int64         // utime+stime of the load test itself
	dbTicks    map[int]int64 // utime+stime of each backend on the database, by PID
	busy, all  int64         // the machine's busy and total CPU ticks
	hasSrv     bool
	hasMachine bool
}

// clockTicksPerSecond is USER_HZ, 100 on Linux on every common
// architecture; /proc reports CPU times in it.
const clockTicksPerSecond = 100

func (r *runner) counters(ctx context.Context, pid int, base string) (counters, error) {
	var c counters
	if v, err := metric(ctx, base, "idem_db_round_trips_total"); err == nil {
		c.roundTrips, c.hasRT = v, true
	}
	if r.db != nil {
		err := r.db.QueryRow(ctx, `
			SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&c.commits)
		if err != nil {
			return c, err
		}
	}
	if pid > 0 {
		c.srvTicks, c.hasSrv = cpuTicks(pid)
	}
	c.selfTicks, _ = cpuTicks(os.Getpid())
	if r.db != nil {
		// The backends of the database under test (the server's pool, and
		// this one connection of the load test's), when PostgreSQL runs on
		// this machine and its processes can be read: their CPU is the
		// database's share of a request.
		rows, err := r.db.Query(ctx, `
			SELECT pid FROM pg_stat_activity
			WHERE datname = current_database() AND backend_type = 'client backend'`)
		if err != nil {
			return c, err
		}
		pids, err := pgx.CollectRows(rows, pgx.RowTo[int])
		if err != nil {
			return c, err
		}
		for _, p := range pids {
			if t, ok := cpuTicks(p); ok {
				if c.dbTicks == nil {
					c.dbTicks = make(map[int]int64)
				}
				c.dbTicks[p] = t
			}
		}
	}
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		if f := strings.Fields(line); len(f) > 5 && f[0] == "cpu" {
			var all int64
			for i, v := range f[1:] {
				n, _ := strconv.ParseInt(v, 10, 64)
				if i < 8 { // user nice system idle iowait irq softirq steal; guest is in user
					all += n
				}
				if i == 3 || i == 4 { // idle, iowait
					c.busy -= n
				}
			}
			c.busy += all
			c.all, c.hasMachine = all, true
		}
	}
	return c, nil
}

// cpuTicks returns the CPU time of process pid, user and system, in clock
// ticks, from /proc/PID/stat.
func cpuTicks(pid int) (int64, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	// The fields after the command name, which is in parentheses and may
	// hold spaces: state is the first, utime the 12th.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(b)[i+1:])
	if len(f) <= 12 {
		return 0, false
	}
	u, err1 := strconv.ParseInt(f[11], 10, 64)
	s, err2 := strconv.ParseInt(f[12], 10, 64)
	return u + s, err1 == nil && err2 == nil
}

// summarize turns a tally into a result.
func (r *runner) summarize(name string, t *tally, w window, cc *commitCount) result {
	lat := make([]time.Duration, len(t.samples))
	for i, s := range t.samples {
		lat[i] = s.latency
	}
	slices.Sort(lat)
	res := result{
		Scenario:    name,
		Requests:    len(lat),
		ReqPerS:     float64(len(lat)) / w.to.Sub(w.from).Seconds(),
		P50:         ms(quantile(lat, 0.50)),
		P99:         ms(quantile(lat, 0.99)),
		P999:        ms(quantile(lat, 0.999)),
		Errors:      t.errors,
		Concurrency: r.cfg.concurrency,
		Statuses:    make(map[string]int),
		Replayed:    t.replayed,
	}
	for k, v := range t.statuses {
		res.Statuses[strconv.Itoa(k)] = v
	}
	if cc != nil && len(lat) > 0 {
		if r.db != nil {
			v := float64(cc.to.commits-cc.from.commits) / float64(len(lat))
			res.Commits = &v
		}
		if cc.from.hasRT && cc.to.hasRT {
			v := (cc.to.roundTrips - cc.from.roundTrips) / float64(len(lat))
			res.RoundTrips = &v
		}
		if cc.from.hasSrv && cc.to.hasSrv {
			v := float64(cc.to.srvTicks-cc.from.srvTicks) * 1000 / clockTicksPerSecond / float64(len(lat))
			res.ServerCPU = &v
		}
		// Backends that lived through the whole window; a pool that
		// replaced connections meanwhile is undercounted.
		if len(cc.from.dbTicks) > 0 && len(cc.to.dbTicks) > 0 {
			var ticks int64
			for p, t := range cc.to.dbTicks {
				if t0, ok := cc.from.dbTicks[p]; ok {
					ticks += t - t0
				}
			}
			v := float64(ticks) * 1000 / clockTicksPerSecond / float64(len(lat))
			res.DBCPU = &v
			if res.ServerCPU != nil {
				all := *res.ServerCPU + v + float64(cc.to.selfTicks-cc.from.selfTicks)*1000/clockTicksPerSecond/float64(len(lat))
				res.CPU = &all
			}
		}
		if cc.from.hasMachine && cc.to.hasMachine && cc.to.all > cc.from.all {
			v := float64(cc.to.busy-cc.from.busy) / float64(cc.to.all-cc.from.all)
			res.MachineBusy = &v
			m := float64(cc.to.busy-cc.from.busy) * 1000 / clockTicksPerSecond / float64(len(lat))
			res.MachineCPU = &m
		}
	}
	if t.firstErr != nil {
		res.FirstError = t.firstErr.Error()
	}
	return res
}

// quantile returns the q-quantile of sorted (nearest rank).
func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q*float64(len(sorted))+0.999999) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// isStatus returns the success test of a scenario: the status wanted, and
// whether the answer must be a replay.
func isStatus(status int, replayed bool) func(outcome) bool {
	return func(o outcome) bool {
		return o.err == nil && o.status == status && (!replayed || o.replayed)
	}
}

func describe(o outcome) string {
	if o.err != nil {
		return o.err.Error()
	}
	return fmt.Sprintf("status %d", o.status)
}

func (r *runner) printJSON(res result) {
	b, _ := json.Marshal(res)
	fmt.Fprintf(r.stdout, "%s\n", b)
}

func printTable(w io.Writer, results []result) {
	fmt.Fprintf(w, "%-16s %5s %9s %10s %9s %9s %9s %7s %8s %6s %8s %7s %7s %5s  %s\n",
		"scenario", "conc", "requests", "req/s", "p50 ms", "p99 ms", "p999 ms", "errors", "commits", "db rt", "srv ms", "db ms", "cpu ms", "busy", "statuses")
	for _, r := range results {
		commits, rt := "-", "-"
		if r.Commits != nil {
			commits = fmt.Sprintf("%.2f", *r.Commits)
		}
		if r.RoundTrips != nil {
			rt = fmt.Sprintf("%.2f", *r.RoundTrips)
		}
		srv, db, mach, busy := "-", "-", "-", "-"
		if r.CPU != nil {
			mach = fmt.Sprintf("%.3f", *r.CPU)
		}
		if r.ServerCPU != nil {
			srv = fmt.Sprintf("%.3f", *r.ServerCPU)
		}
		if r.DBCPU != nil {
			db = fmt.Sprintf("%.3f", *r.DBCPU)
		}
		if r.MachineBusy != nil {
			busy = fmt.Sprintf("%.0f%%", 100**r.MachineBusy)
		}
		name := r.Scenario
		if r.Round > 0 {
			name = fmt.Sprintf("%s #%d", name, r.Round)
		}
		fmt.Fprintf(w, "%-16s %5d %9d %10.1f %9.2f %9.2f %9.2f %7d %8s %6s %8s %7s %7s %5s  %s\n",
			name, r.Concurrency, r.Requests, r.ReqPerS, r.P50, r.P99, r.P999, r.Errors, commits, rt, srv, db, mach, busy, statusText(r))
		if r.Purge != nil {
			p := r.Purge
			fmt.Fprintf(w, "%-16s purged %d keys in %.1fs (%.0f rows/s, finished %t); p99 before %.2f ms, during %.2f ms (%.2fx)\n",
				"", p.Keys, p.Seconds, p.RowsPerS, p.Finished, p.P99Before, p.P99During, p.P99During/p.P99Before)
		}
	}
}

func statusText(r result) string {
	keys := make([]string, 0, len(r.Statuses))
	for k := range r.Statuses {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	for i, k := range keys {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%s:%d", k, r.Statuses[k])
	}
	if r.Replayed > 0 {
		fmt.Fprintf(&b, " (replayed %d)", r.Replayed)
	}
	return b.String()
}

// firstOverUnkeyed is the target of first/unkeyed: issue 11's, on the
// server's default flags at concurrency targetConcurrency. Runs at other
// concurrencies are judged against it too, with a note, for comparison.
const (
	firstOverUnkeyed  = 0.75
	targetConcurrency = 16
)

// replayOverRead is issue 35's bound on a replay's CPU per request over a
// read's, on the bench server.
const replayOverRead = 1.2

// printRatios prints the target ratios of the scenarios that ran, from
// each round's results by scenario.
func (r *runner) printRatios(rounds []map[string]result) {
	out := r.stdout
	if r.cfg.json {
		out = r.stderr
	}
	ratio := func(name, num, den string, target float64, note string) {
		if !slices.Contains(r.cfg.scenarios, num) && !slices.Contains(r.cfg.scenarios, den) {
			return
		}
		fmt.Fprintf(out, "ratio %s: %s%s\n", name, ratioLine(rounds, num, den, target), note)
	}
	if r.cfg.handler != "" {
		// The targets of issues 30 and 35: against the seed article by
		// hand, 1.0 for payments in two commits and 1.2 for orders in one
		// transaction; a replay's CPU at most 1.2 times a read's.
		target := 1.0
		if r.cfg.oneTx {
			target = 1.2
		}
		ratio("idem/article", "first", "article", target, "")
		ratio("first/unkeyed", "first", "unkeyed", 0, " (no target: issue 35 aims at 0.7 in one transaction)")
		ratio("replay/first", "replay", "first", 0, "")
		if slices.Contains(r.cfg.scenarios, "replay") && slices.Contains(r.cfg.scenarios, "read") {
			fmt.Fprintf(out, "CPU replay/read: %s\n", cpuRatioLine(rounds, "replay", "read", replayOverRead))
		}
		if slices.Contains(r.cfg.scenarios, "first") && slices.Contains(r.cfg.scenarios, "unkeyed") {
			fmt.Fprintf(out, "CPU first - unkeyed: %s\n", cpuDeltaLine(rounds, "first", "unkeyed", 0))
		}
		if slices.Contains(r.cfg.scenarios, "first") && slices.Contains(r.cfg.scenarios, "article") {
			fmt.Fprintf(out, "CPU article - first: %s\n", cpuDeltaLine(rounds, "article", "first", 0))
		}
		return
	}
	note := ""
	if r.cfg.concurrency != targetConcurrency {
		note = fmt.Sprintf("; issue 11 sets this target at concurrency %d, not %d", targetConcurrency, r.cfg.concurrency)
	}
	ratio("(a)/(c)", "first", "unkeyed", firstOverUnkeyed, note)
	ratio("(b)/(a)", "replay", "first", 1.5, "")
}

// ratioLine tells num's req/s over den's, per round, against target: the
// value itself from one round, the median (judged against target) and
// every round's value from several.
func ratioLine(rounds []map[string]result, num, den string, target float64) string {
	var vs []float64
	for _, res := range rounds {
		a, okA := res[num]
		b, okB := res[den]
		if okA && okB && b.ReqPerS > 0 {
			vs = append(vs, a.ReqPerS/b.ReqPerS)
		}
	}
	if len(vs) == 0 {
		return fmt.Sprintf("%s/%s: not measured (%s and %s must both run)", num, den, num, den)
	}
	each := make([]string, len(vs))
	for i, v := range vs {
		each[i] = fmt.Sprintf("%.2f", v)
	}
	med := median(vs)
	verdict := ""
	switch {
	case target == 0:
	case med < target:
		verdict = fmt.Sprintf(" (target >= %g: MISSED)", target)
	default:
		verdict = fmt.Sprintf(" (target >= %g: met)", target)
	}
	if len(vs) == 1 {
		return fmt.Sprintf("%s/%s req/s = %.2f%s", num, den, med, verdict)
	}
	return fmt.Sprintf("%s/%s req/s = %.2f, median of %d rounds [%s]%s",
		num, den, med, len(vs), strings.Join(each, " "), verdict)
}

// cpuDeltaLine tells num's CPU per request less den's (the server's, the
// database's and the load test's: the whole machine's on a machine that
// runs nothing else, and measurable on one that does), in ms, per round,
// against limit (0: none): the median and each round's.
func cpuDeltaLine(rounds []map[string]result, num, den string, limit float64) string {
	return cpuLine(rounds, num, den, func(a, b float64) float64 { return a - b }, "%.3f", " ms", " ms per request", limit)
}

// cpuRatioLine tells num's CPU per request over den's, per round, against
// limit (0: none), as cpuDeltaLine does.
func cpuRatioLine(rounds []map[string]result, num, den string, limit float64) string {
	return cpuLine(rounds, num, den, func(a, b float64) float64 { return a / b }, "%.2f", "", "x", limit)
}

// cpuLine is cpuDeltaLine and cpuRatioLine: of each round's CPU per
// request of num and den, combined by f, the median and every round's
// value in format, judged against limit (0: none) in unit.
func cpuLine(rounds []map[string]result, num, den string, f func(a, b float64) float64, format, unit, what string, limit float64) string {
	var vs []float64
	for _, res := range rounds {
		a, okA := res[num]
		b, okB := res[den]
		if okA && okB && a.CPU != nil && b.CPU != nil && *b.CPU > 0 {
			vs = append(vs, f(*a.CPU, *b.CPU))
		}
	}
	if len(vs) == 0 {
		return "not measured"
	}
	each := make([]string, len(vs))
	for i, v := range vs {
		each[i] = fmt.Sprintf(format, v)
	}
	med := median(vs)
	verdict := ""
	switch {
	case limit == 0:
	case med > limit:
		verdict = fmt.Sprintf(" (target <= %g%s: MISSED)", limit, unit)
	default:
		verdict = fmt.Sprintf(" (target <= %g%s: met)", limit, unit)
	}
	return fmt.Sprintf(format+"%s, median of %d rounds [%s]%s", med, what, len(vs), strings.Join(each, " "), verdict)
}

// median returns the median of vs, which it sorts.
func median(vs []float64) float64 {
	slices.Sort(vs)
	if len(vs)%2 == 0 {
		return (vs[len(vs)/2-1] + vs[len(vs)/2]) / 2
	}
	return vs[len(vs)/2]
}
