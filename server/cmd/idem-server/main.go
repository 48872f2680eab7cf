// Command idem-server runs the reference payments API of idem: POST
// /v1/payments behind the Idempotency-Key contract, on PostgreSQL or, without
// a database URL, on an in-memory store.
//
//	go run ./server/cmd/idem-server -addr 127.0.0.1:8080
//	curl -X POST localhost:8080/v1/payments \
//	  -H 'Authorization: Bearer sk_test_demo' -H "Idempotency-Key: $(uuidgen)" \
//	  -d amount=4200 -d currency=usd -d customer=cus_123
//
// Flags (see -h): -addr, -database-url (or DATABASE_URL), -db-max-conns,
// -api-keys (or IDEM_API_KEYS), -retention, -lock-timeout,
// -purge-interval, -purge-batch, -purge-duty-cycle, -processor-delay,
// -processor-failure-rate, -processor-url, -fail-after-write, -drop-answer,
// -hold-after-write, -hold-rate, -first-sent-skew, -ignore-first-sent,
// -store-server-errors,
// -wait-for-completion, -max-body-bytes, -read-timeout, -write-timeout,
// -idle-timeout, -metrics-addr, -shutdown-timeout, -log-level, -log-format,
// -no-idempotency, -cpuprofile, -processor-timeout, -sweep-grace,
// -sweep-interval, -no-sweep, -admin-addr, -admin-token (or
// IDEM_ADMIN_TOKEN), -seal-key-file, -seal-key-file-insecure, -seal-require.
//
// The sweeper settles the payments whose key was abandoned (its request's
// server crashed, or it failed after the charge) and whose client did not
// retry within -sweep-grace: every -sweep-interval it asks the processor
// for each one's charge, records the payment and completes the key with its
// 201 when there is one, and releases the key when there is none. The grace
// is at least -processor-timeout (the longer of 1m and it by default; a
// shorter one given with both flags is refused), so that a charge still in
// flight is never missed. -admin-addr serves the operators' JSON API (see
// server.Server.AdminHandler: look a key up, list stuck and released keys,
// release or expire one with a reason) on a listener of its own, behind
// -admin-token, without which it refuses to start; an address without a
// host (:9090) listens on loopback only, and the log line at start says
// where it listens (at Warn when that is not loopback).
//
// With a database, it migrates at start (server.Migrate): the key table,
// its own tables, and the open keys' index (pgstore.CreateOpenKeysIndex)
// that the sweeper, the admin lists and the key gauges of /metrics walk.
// It creates the index always, -no-sweep or not: it costs each claim and
// renewal an index entry, and keeps every key completion from being a HOT
// update, which a service that runs no sweeper and no gauges need not pay
// (see docs/operations.md).
//
// -seal-key-file names a file of the keys that seal stored responses at
// rest, one a line, "id base64-key" (32 bytes: openssl rand -base64 32);
// the first line seals, every line opens (see server.ParseSealKeys). A
// file that cannot be read or parsed stops the server at start, naming the
// line and the column, never what is written there; so does a file that
// its group or others may read (mode 0600 or 0400 is wanted), unless
// -seal-key-file-insecure. -seal-require refuses (500, nothing run) to
// replay a response stored in the clear; it is off by default, for the
// migration window (see docs/operations.md).
//
// Slow clients are bounded: a request's headers and body must arrive within
// -read-timeout (10s: the default 1 MiB body at 100 KB/s), its response must
// be written within -write-timeout (10s) of the handler's first write, and
// an idle keep-alive connection is closed after -idle-timeout (2m, above
// the 60-90s idle timeouts of common load balancers and HTTP clients, so
// that they, not the server, close first). The write timeout counts from
// the first write, not from the request, so a payment that is slow to
// process (a slow processor, a duplicate held by -wait-for-completion) is
// never cut: cutting it would make the client retry a payment that was
// done. A request that fails authentication is answered without reading
// its body, and its connection is closed.
//
// The database pool holds at most -db-max-conns connections (16), unless
// the DSN sets pool_max_conns, which then decides; setting both is an
// error. pgxpool's own default, max(4, NumCPU), starves the server: every
// first execution takes a connection three times (the claim, the fake
// processor's charge, which goes through the same pool, and the
// completion), and each of them mostly waits on a WAL flush, which
// PostgreSQL shares among the commits that wait together (group commit),
// so more concurrent committers help until the disk is saturated. No
// connection is held across a request, so a small pool cannot deadlock,
// it only queues; 16 per process leaves room for several replicas under
// PostgreSQL's default max_connections of 100.
//
// -no-idempotency serves POST /v1/payments without the idempotency layer:
// no key is needed or stored and every request is a new payment (a retry
// pays twice). It exists only so that the load test (bench/cmd/loadtest,
// scenario unkeyed) can measure what the layer costs against the same
// charge and payment insert without it. Never run it for anything else.
//
// The fake card processor the payments are charged through listens on its
// own loopback port (logged at start) unless -processor-url names another.
// SIGINT or SIGTERM stops the server gracefully: it stops accepting
// connections, lets in-flight requests finish (each completes or releases
// its key, so a clean stop leaves no key started), stops the purge job and
// exits.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server"
	"github.com/idemkit/idem/server/idempotency"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout)
	switch {
	case errors.Is(err, flag.ErrHelp):
	case err != nil:
		fmt.Fprintln(os.Stderr, "idem-server:", err)
		stop()
		os.Exit(1)
	}
}

// defaultDBMaxConns is the default of -db-max-conns; see the package doc.
const defaultDBMaxConns = 16

// Defaults of the HTTP server's timeouts; see the package doc.
const (
	defaultReadTimeout   = 10 * time.Second
	defaultWriteTimeout  = 10 * time.Second
	defaultIdleTimeout   = 2 * time.Minute
	maxReadHeaderTimeout = 10 * time.Second
)

// options are the parsed flags.
type options struct {
	addr                 string
	databaseURL          string
	dbMaxConns           int
	dbMaxConnsSet        bool // -db-max-conns was given
	apiKeys              string
	retention            time.Duration
	lockTimeout          time.Duration
	purgeInterval        time.Duration
	purgeBatch           int
	purgeDutyCycle       float64
	processorDelay       time.Duration
	processorFailureRate float64
	faults               server.Faults
	firstSentSkew        time.Duration
	ignoreFirstSent      bool
	processorURL         string
	storeServerErrors    bool
	waitForCompletion    time.Duration
	maxBodyBytes         int64
	metricsAddr          string
	adminAddr            string
	adminToken           string
	processorTimeout     time.Duration
	sweepGrace           time.Duration
	sweepInterval        time.Duration
	noSweep              bool
	readTimeout          time.Duration
	writeTimeout         time.Duration
	idleTimeout          time.Duration
	shutdownTimeout      time.Duration
	logLevel             slog.Level
	logFormat            string
	noIdempotency        bool
	cpuProfile           string
	sealKeyFile          string
	sealKeyFileInsecure  bool
	sealRequire          bool
}

func parseFlags(args []string, getenv func(string) string, out io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("idem-server", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.StringVar(&o.addr, "addr", "127.0.0.1:8080", "listen `address`")
	fs.StringVar(&o.databaseURL, "database-url", getenv("DATABASE_URL"),
		"PostgreSQL connection string (pgx `DSN`); empty: in-memory store (env DATABASE_URL)")
	fs.IntVar(&o.dbMaxConns, "db-max-conns", defaultDBMaxConns,
		"most PostgreSQL connections in the pool, shared by the claims, completions and the fake processor's charges; "+
			"above pgxpool's max(4, NumCPU), which leaves requests queueing for a connection while the database waits on WAL flushes. "+
			"A pool_max_conns in the DSN takes precedence (giving both is an error)")
	fs.StringVar(&o.apiKeys, "api-keys", cmp.Or(getenv("IDEM_API_KEYS"), server.DefaultAPIKeys),
		"comma-separated token:client_id `pairs` (env IDEM_API_KEYS)")
	fs.DurationVar(&o.retention, "retention", idempotency.DefaultRetention,
		"how long a key is kept after its request finished; older keys count as absent and the purge job deletes them. "+
			"Stored with each key, so a replica's -retention applies to the keys it finishes")
	fs.DurationVar(&o.lockTimeout, "lock-timeout", idempotency.DefaultLockTimeout,
		"the lease of a running request, renewed every third of it while the request runs (so a slow request keeps its key); "+
			"a key whose owner stopped renewing it for this long (crashed, or cut off from the database) may be taken over by a retry")
	fs.DurationVar(&o.purgeInterval, "purge-interval", idempotency.DefaultPurgeInterval, "how often the purge job runs")
	fs.IntVar(&o.purgeBatch, "purge-batch", idempotency.DefaultPurgeBatch,
		"most expired keys deleted by one purge statement; smaller batches are shorter bursts of work for the requests running meanwhile")
	fs.Float64Var(&o.purgeDutyCycle, "purge-duty-cycle", idempotency.DefaultPurgeDutyCycle,
		"share of its time, in (0, 1], the purge job spends deleting while it works through a backlog: "+
			"after a batch that took d it pauses d×(1-share)/share; 1: no pause. Retention stays exact: an expired key counts as absent before it is deleted")
	fs.DurationVar(&o.processorDelay, "processor-delay", 0, "latency of the fake card processor; 0: none")
	fs.Float64Var(&o.processorFailureRate, "processor-failure-rate", 0,
		"share of charge requests the fake processor fails with 503, in [0, 1]. The server retries its processor itself (5 attempts), "+
			"so an API client rarely sees these: to watch a client's retries, use -fail-after-write and -drop-answer")
	fs.Float64Var(&o.faults.FailAfterWriteRate, "fail-after-write", 0,
		"share of keyed payments answered 500 after the card was charged and the payment written, in [0, 1]: the write rolls back, "+
			"the key is released, and the client's retry with it runs again, charged once")
	fs.Float64Var(&o.faults.DropAnswerRate, "drop-answer", 0,
		"share of keyed payments whose answer is stored but never sent (the connection is closed), in [0, 1]: the client's retry with the key gets the replay")
	fs.DurationVar(&o.faults.HoldAfterWrite, "hold-after-write", 0,
		"hold a keyed payment's transaction open this long after its insert, before answering (see -hold-rate); the key's retention counts from the answer")
	fs.Float64Var(&o.faults.HoldRate, "hold-rate", 0,
		"share of keyed payments -hold-after-write holds, in [0, 1]; 0: all of them")
	fs.StringVar(&o.processorURL, "processor-url", "",
		"base `URL` of the card processor; empty: the fake one, on its own loopback port")
	fs.BoolVar(&o.storeServerErrors, "store-server-errors", false,
		"store and replay 5xx answers (Stripe's behaviour); default: a 5xx releases the key so a retry runs again")
	fs.DurationVar(&o.waitForCompletion, "wait-for-completion", 0,
		"hold a duplicate request up to this long for the first to finish and replay its outcome; 0: answer 409 at once; negative values are refused")
	fs.Int64Var(&o.maxBodyBytes, "max-body-bytes", idempotency.DefaultMaxBodyBytes,
		"largest request body in bytes, buffered in memory to be fingerprinted; larger ones get 413. "+
			"0: the default, 1 MiB; negative: no limit (only -read-timeout bounds the body then)")
	fs.DurationVar(&o.firstSentSkew, "first-sent-skew", 0,
		"allowance for a client clock that runs ahead, taken off -retention by the first-sent policy: a retry first sent longer ago than "+
			"-retention less this, whose key is gone or expired, gets 410 and is not run; 0: a tenth of -retention, at least 1s, at most 5m; it must be under half of -retention "+
			"(a -retention under 3s turns the policy off)")
	fs.BoolVar(&o.ignoreFirstSent, "ignore-first-sent", false,
		"serve keyed requests whatever their Repeatability-First-Sent: a retry that arrives after its key was purged runs its operation again")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "",
		"listen `address` of GET /metrics, which then is not served on -addr; empty: /metrics is served on -addr. "+
			"/metrics needs no API key, so anyone who reaches it reads the counters: give it a private address")
	fs.StringVar(&o.adminAddr, "admin-addr", "",
		"listen `address` of the operators' JSON API on the keys (GET /admin/keys/{client}/{key}, GET /admin/keys?stuck=30s or ?released=1, "+
			"POST /admin/keys/{client}/{key}/release and /expire with a reason); empty: off. It needs -admin-token. "+
			"Without a host (:9090) it listens on loopback only (127.0.0.1); name the host to listen elsewhere (0.0.0.0:9090: every interface)")
	fs.StringVar(&o.adminToken, "admin-token", getenv("IDEM_ADMIN_TOKEN"),
		"bearer `token` of the admin API, required with -admin-addr (env IDEM_ADMIN_TOKEN)")
	fs.DurationVar(&o.processorTimeout, "processor-timeout", 0,
		"longest time for one payment's calls to the card processor, retries included; 0: 30s, or -sweep-grace when that is shorter")
	fs.DurationVar(&o.sweepGrace, "sweep-grace", 0,
		"how long an abandoned payment (its key lapsed, or released after a failure) is left to its client's retries before the sweeper settles it "+
			"from the processor's charge; at least -processor-timeout. 0: the longer of 1m and -processor-timeout")
	fs.DurationVar(&o.sweepInterval, "sweep-interval", idempotency.DefaultSweepInterval, "how often the sweeper looks for abandoned payments")
	fs.BoolVar(&o.noSweep, "no-sweep", false, "run no sweeper: abandoned payments wait for their clients' retries, and expire with their keys")
	fs.DurationVar(&o.readTimeout, "read-timeout", defaultReadTimeout,
		"longest time to read a request, headers and body; a client that sends slower is cut off. "+
			"The headers alone get at most 10s. 0: no limit on the body")
	fs.DurationVar(&o.writeTimeout, "write-timeout", defaultWriteTimeout,
		"longest time to write a response, counted from the handler's first write, so a slow payment is never cut; "+
			"a client that reads slower is cut off. 0: no limit")
	fs.DurationVar(&o.idleTimeout, "idle-timeout", defaultIdleTimeout,
		"how long a keep-alive connection may wait for its next request. 0: -read-timeout, or no limit if that is 0")
	fs.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 30*time.Second,
		"how long a graceful stop waits for in-flight requests before cutting them; 0: it does not wait; negative values are refused")
	fs.TextVar(&o.logLevel, "log-level", slog.LevelInfo, "log `level`: debug, info, warn or error")
	fs.StringVar(&o.logFormat, "log-format", "text", "log `format`: text or json")
	fs.BoolVar(&o.noIdempotency, "no-idempotency", false,
		"FOR BENCHMARKS ONLY: serve POST /v1/payments without the idempotency layer (no key needed or stored, a retry pays twice), "+
			"to measure what the layer costs against the same charge and payment insert (the load test's unkeyed scenario)")
	fs.StringVar(&o.cpuProfile, "cpuprofile", "",
		"write a CPU profile of the whole run to `file` when the server stops (for go tool pprof; the load test takes -server-args \"-cpuprofile f\")")
	fs.StringVar(&o.sealKeyFile, "seal-key-file", "",
		"`file` of the keys that seal stored responses at rest (AES-256-GCM, bound to the client, the key and the status): one key a line, "+
			"\"id base64-key\" (32 bytes: openssl rand -base64 32), # comments; the first line seals, every line opens. "+
			"To rotate, put the new key first and keep the old one until -retention has passed; \"id base64-key open-only\" on the first line stops sealing. "+
			"Turn it on once every replica sharing the database runs this release (an older one replays sealed responses as they are stored); empty: off")
	fs.BoolVar(&o.sealKeyFileInsecure, "seal-key-file-insecure", false,
		"start although -seal-key-file may be read by its group or others (a warning is logged); default: such a file stops the server, which wants mode 0600 or 0400")
	fs.BoolVar(&o.sealRequire, "seal-require", false,
		"refuse (500, nothing run) to replay a stored response that is not sealed, rather than serve it in the clear; needs -seal-key-file, whose first key seals. "+
			"Off by default for the migration window: turn it on once every replica seals and -retention has passed since the last one started sealing")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	given := make(map[string]bool)
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	if o.adminAddr != "" {
		addr, err := loopbackUnlessNamed(o.adminAddr)
		if err != nil {
			return o, fmt.Errorf("-admin-addr: %w", err)
		}
		o.adminAddr = addr
	}
	o.dbMaxConnsSet = given["db-max-conns"]
	switch {
	case fs.NArg() > 0:
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	case o.logFormat != "text" && o.logFormat != "json":
		return o, fmt.Errorf("-log-format %q: want text or json", o.logFormat)
	case o.processorFailureRate < 0 || o.processorFailureRate > 1:
		return o, fmt.Errorf("-processor-failure-rate %v: want a value in [0, 1]", o.processorFailureRate)
	case !validShare(o.faults.FailAfterWriteRate) || !validShare(o.faults.DropAnswerRate) || !validShare(o.faults.HoldRate):
		return o, fmt.Errorf("-fail-after-write %v, -drop-answer %v, -hold-rate %v: want shares in [0, 1]",
			o.faults.FailAfterWriteRate, o.faults.DropAnswerRate, o.faults.HoldRate)
	case o.firstSentSkew < 0 || (o.firstSentSkew > 0 && o.retention >= idempotency.MinFirstSentRetention && o.firstSentSkew >= o.retention/2):
		return o, fmt.Errorf("-first-sent-skew %v: want 0 (the default) or a duration under half of -retention %v", o.firstSentSkew, o.retention)
	case o.faults.HoldAfterWrite < 0:
		return o, fmt.Errorf("-hold-after-write %v: want 0 (no hold) or more", o.faults.HoldAfterWrite)
	case o.retention <= 0 || o.lockTimeout <= 0 || o.purgeInterval <= 0:
		return o, errors.New("-retention, -lock-timeout and -purge-interval must be positive")
	case o.processorTimeout < 0 || o.sweepGrace < 0 || o.sweepInterval <= 0:
		return o, fmt.Errorf("-processor-timeout %v and -sweep-grace %v must not be negative, -sweep-interval %v must be positive",
			o.processorTimeout, o.sweepGrace, o.sweepInterval)
	case o.noSweep && (given["sweep-grace"] || given["sweep-interval"]):
		return o, errors.New("-no-sweep and -sweep-grace or -sweep-interval: the sweeper is off, or paced; keep one")
	case o.sweepGrace > 0 && o.processorTimeout > o.sweepGrace:
		return o, fmt.Errorf("-sweep-grace %v is shorter than -processor-timeout %v: the sweeper could find no charge for a payment whose charge call is still running, and release its key",
			o.sweepGrace, o.processorTimeout)
	case o.sealKeyFileInsecure && o.sealKeyFile == "":
		return o, errors.New("-seal-key-file-insecure without -seal-key-file: there is no file to be lenient about")
	case o.sealRequire && o.sealKeyFile == "":
		return o, errors.New("-seal-require without -seal-key-file: nothing is sealed, so every stored response would be refused")
	case o.adminAddr != "" && o.adminToken == "":
		return o, errors.New("-admin-addr needs -admin-token (or IDEM_ADMIN_TOKEN): the admin API releases and expires keys, and must not be open")
	case o.adminAddr != "" && (o.adminAddr == o.addr || o.adminAddr == o.metricsAddr) && !strings.HasSuffix(o.adminAddr, ":0"):
		return o, fmt.Errorf("-admin-addr %s is the address of the API or the metrics: give the admin API its own", o.adminAddr)
	case o.processorDelay < 0:
		return o, fmt.Errorf("-processor-delay %v: want 0 or more", o.processorDelay)
	case o.waitForCompletion < 0:
		return o, fmt.Errorf("-wait-for-completion %v: want 0 (answer 409 at once) or more", o.waitForCompletion)
	case o.shutdownTimeout < 0:
		return o, fmt.Errorf("-shutdown-timeout %v: want 0 (do not wait) or more", o.shutdownTimeout)
	case o.metricsAddr != "" && o.metricsAddr == o.addr && !strings.HasSuffix(o.addr, ":0"): // :0 is two free ports
		return o, fmt.Errorf("-metrics-addr %s is -addr %s: give the metrics their own address, or leave -metrics-addr empty to serve them on -addr", o.metricsAddr, o.addr)
	case o.readTimeout < 0 || o.writeTimeout < 0 || o.idleTimeout < 0:
		return o, fmt.Errorf("-read-timeout %v, -write-timeout %v, -idle-timeout %v: want 0 (no limit) or more", o.readTimeout, o.writeTimeout, o.idleTimeout)
	case o.purgeBatch < 1:
		return o, fmt.Errorf("-purge-batch %d: want at least 1", o.purgeBatch)
	case !(o.purgeDutyCycle > 0 && o.purgeDutyCycle <= 1):
		return o, fmt.Errorf("-purge-duty-cycle %v: want a share in (0, 1]", o.purgeDutyCycle)
	case o.dbMaxConns < 1 || o.dbMaxConns > math.MaxInt32:
		return o, fmt.Errorf("-db-max-conns %d: want at least 1", o.dbMaxConns)
	case o.databaseURL == "" && o.dbMaxConnsSet:
		return o, errors.New("-db-max-conns needs -database-url: the in-memory store has no connection pool")
	}
	return o, nil
}

// openStore returns the store the options ask for: in memory without a
// database URL, else a PostgresStore on a new pool, migrated, which the
// caller closes. The pool's connections report to trips, if not nil.
func openStore(ctx context.Context, o options, log *slog.Logger, trips *server.DBRoundTrips) (server.Storage, *pgxpool.Pool, error) {
	if o.databaseURL == "" {
		log.Warn("no database URL: using the in-memory store; keys and payments are lost on exit (set -database-url or DATABASE_URL for PostgreSQL)")
		return server.NewMemoryStorage().Storage(), nil, nil
	}
	cfg, err := poolConfig(o)
	if err != nil {
		return server.Storage{}, nil, fmt.Errorf("database: %w", err)
	}
	if trips != nil {
		cfg.ConnConfig.Tracer = trips
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return server.Storage{}, nil, fmt.Errorf("database: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return server.Storage{}, nil, fmt.Errorf("database: %w", err)
	}
	if err := server.Migrate(ctx, pool); err != nil {
		pool.Close()
		return server.Storage{}, nil, fmt.Errorf("database: migrating: %w", err)
	}
	storage := server.NewPostgresStorage(pool)
	cc := cfg.ConnConfig
	log.Info("using PostgreSQL", "host", cc.Host, "port", cc.Port, "database", cc.Database, "user", cc.User,
		"max_conns", cfg.MaxConns)
	return storage.Storage(), pool, nil
}

// poolConfig parses the DSN and sizes the pool: -db-max-conns, unless the
// DSN sets pool_max_conns itself. Both at once is an error, since one of
// them would be silently ignored.
func poolConfig(o options) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(o.databaseURL)
	if err != nil {
		return nil, err
	}
	// pgxpool.ParseConfig consumes pool_max_conns; pgconn leaves it among
	// the parameters it does not know.
	cc, err := pgconn.ParseConfig(o.databaseURL)
	if err != nil {
		return nil, err
	}
	if _, inDSN := cc.RuntimeParams["pool_max_conns"]; inDSN {
		if o.dbMaxConnsSet {
			return nil, fmt.Errorf("-db-max-conns %d and the DSN's pool_max_conns=%d both set the pool size; keep one",
				o.dbMaxConns, cfg.MaxConns)
		}
		return cfg, nil
	}
	cfg.MaxConns = int32(o.dbMaxConns)
	return cfg, nil
}

// run runs the server until ctx is done, then stops it gracefully. Logs go
// to stdout.
func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	o, err := parseFlags(args, getenv, stdout)
	if err != nil {
		return err
	}
	hopts := &slog.HandlerOptions{Level: o.logLevel}
	var log *slog.Logger
	if o.logFormat == "json" {
		log = slog.New(slog.NewJSONHandler(stdout, hopts))
	} else {
		log = slog.New(slog.NewTextHandler(stdout, hopts))
	}

	keys, err := server.ParseAPIKeys(o.apiKeys)
	if err != nil {
		return err
	}
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return err
		}
		defer func() {
			pprof.StopCPUProfile()
			if err := f.Close(); err != nil {
				log.Error("writing the CPU profile", "file", o.cpuProfile, "err", err)
			}
		}()
	}
	if o.apiKeys == server.DefaultAPIKeys {
		log.Warn("using the demo API key; set -api-keys or IDEM_API_KEYS for real tokens", "api_keys", server.DefaultAPIKeys)
	} else {
		clients := slices.Compact(slices.Sorted(maps.Values(keys)))
		log.Info("API keys loaded", "clients", strings.Join(clients, ","))
	}

	var sealKeys *idempotency.SealKeys
	if o.sealKeyFile != "" {
		if sealKeys, err = readSealKeys(o, log); err != nil {
			return fmt.Errorf("-seal-key-file %s: %w", o.sealKeyFile, err)
		}
	} else if !o.noIdempotency {
		log.Info("stored responses are kept in the clear; set -seal-key-file to seal them at rest")
	}

	trips := new(server.DBRoundTrips)
	storage, pool, err := openStore(ctx, o, log, trips)
	if err != nil {
		return err
	}
	if pool != nil {
		defer pool.Close()
	} else {
		trips = nil // no database: no idem_db_round_trips_total
	}

	srv, err := server.New(server.Config{
		Storage:              storage,
		APIKeys:              keys,
		Retention:            o.retention,
		LockTimeout:          o.lockTimeout,
		StoreServerErrors:    o.storeServerErrors,
		WaitForCompletion:    o.waitForCompletion,
		MaxBodyBytes:         o.maxBodyBytes,
		PurgeInterval:        o.purgeInterval,
		PurgeBatch:           o.purgeBatch,
		PurgeDutyCycle:       o.purgeDutyCycle,
		NoIdempotency:        o.noIdempotency,
		NoMetricsRoute:       o.metricsAddr != "",
		DBRoundTrips:         trips,
		ProcessorURL:         o.processorURL,
		ProcessorDelay:       o.processorDelay,
		ProcessorFailureRate: o.processorFailureRate,
		ProcessorTimeout:     o.processorTimeout,
		SweepGrace:           o.sweepGrace,
		SweepInterval:        o.sweepInterval,
		NoSweep:              o.noSweep,
		Faults:               o.faults,
		FirstSentSkew:        o.firstSentSkew,
		IgnoreFirstSent:      o.ignoreFirstSent,
		SealKeys:             sealKeys,
		Logger:               log,
	})
	if err != nil {
		return err
	}
	defer srv.Close()

	ln, err := net.Listen("tcp", o.addr)
	if err != nil {
		return err
	}
	hs := httpServer(srv, o, log)
	served := make(chan error, 1)
	metricsServed := make(chan error, 1) // stays empty without -metrics-addr
	if o.metricsAddr != "" {
		mln, err := net.Listen("tcp", o.metricsAddr)
		if err != nil {
			ln.Close()
			return fmt.Errorf("-metrics-addr: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", srv.Metrics().Handler())
		ms := httpServer(mux, o, log)
		go func() { metricsServed <- ms.Serve(mln) }()
		// Nothing on it is worth waiting for at shutdown.
		defer func() {
			ms.Close()
			<-metricsServed
		}()
		log.Info("metrics listening", "addr", mln.Addr().String())
	}
	if o.adminAddr != "" {
		stopAdmin, err := serveAdmin(srv, o, log)
		if err != nil {
			ln.Close()
			return err
		}
		defer stopAdmin()
	}
	log.Info("listening", "addr", ln.Addr().String(),
		"retention", o.retention, "lock_timeout", o.lockTimeout, "purge_interval", o.purgeInterval,
		"purge_batch", o.purgeBatch, "purge_duty_cycle", o.purgeDutyCycle,
		"store_server_errors", o.storeServerErrors, "processor_url", srv.ProcessorURL(),
		"read_timeout", o.readTimeout, "write_timeout", o.writeTimeout, "idle_timeout", o.idleTimeout,
		"no_idempotency", o.noIdempotency)

	purgeCtx, stopPurge := context.WithCancel(context.WithoutCancel(ctx))
	purgeDone := make(chan struct{})
	go func() {
		defer close(purgeDone)
		srv.Run(purgeCtx)
	}()
	defer func() {
		stopPurge()
		<-purgeDone
	}()

	go func() { served <- hs.Serve(ln) }()
	select {
	case err := <-served:
		return err
	case err := <-metricsServed:
		hs.Close()
		<-served
		metricsServed <- err // for the deferred wait
		return fmt.Errorf("-metrics-addr: %w", err)
	case <-ctx.Done():
	}

	log.Info("shutting down: waiting for in-flight requests", "timeout", o.shutdownTimeout)
	shutdownCtx, cancel := context.WithTimeout(context.Background(), o.shutdownTimeout)
	defer cancel()
	if err := hs.Shutdown(shutdownCtx); err != nil {
		hs.Close()
		return fmt.Errorf("graceful shutdown: %w; in-flight requests were cut and their keys may stay started until the lock timeout", err)
	}
	<-served
	log.Info("stopped")
	return nil
}

// serveAdmin serves the operators' API of srv on -admin-addr until the
// returned stop is called. Nothing on it is worth waiting for at shutdown.
func serveAdmin(srv *server.Server, o options, log *slog.Logger) (stop func(), err error) {
	h, err := srv.AdminHandler(o.adminToken)
	if err != nil {
		return nil, fmt.Errorf("-admin-addr: %w", err)
	}
	ln, err := net.Listen("tcp", o.adminAddr)
	if err != nil {
		return nil, fmt.Errorf("-admin-addr: %w", err)
	}
	hs := httpServer(h, o, log)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("admin listener failed", "err", err)
		}
	}()
	if ip := ln.Addr().(*net.TCPAddr).IP; ip.IsLoopback() {
		log.Info("admin listening", "addr", ln.Addr().String(), "reachable_from", "this host only (loopback)")
	} else {
		log.Warn("admin listening", "addr", ln.Addr().String(),
			"reachable_from", "every host that reaches this address: keep it on a private network, or give -admin-addr a loopback host")
	}
	return func() {
		hs.Close()
		<-done
	}, nil
}

// httpServer returns the http.Server that serves h with the timeouts of o.
func httpServer(h http.Handler, o options, log *slog.Logger) *http.Server {
	return &http.Server{
		Handler:           boundWrites(h, o.writeTimeout),
		ReadTimeout:       o.readTimeout,
		ReadHeaderTimeout: min(maxReadHeaderTimeout, cmp.Or(o.readTimeout, maxReadHeaderTimeout)),
		IdleTimeout:       o.idleTimeout,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
}

// boundWrites serves h with a write deadline of d (none if d is 0) that
// starts at the handler's first write, unlike http.Server.WriteTimeout,
// which starts when the request's headers are read and so would cut a
// response that was slow to compute. The deadline of the connection's
// previous request is cleared first.
func boundWrites(h http.Handler, d time.Duration) http.Handler {
	if d <= 0 {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		rc.SetWriteDeadline(time.Time{})
		h.ServeHTTP(&deadlineWriter{ResponseWriter: w, rc: rc, d: d}, r)
	})
}

// deadlineWriter sets the connection's write deadline d ahead at its first
// WriteHeader, Write or Flush.
type deadlineWriter struct {
	http.ResponseWriter
	rc    *http.ResponseController
	d     time.Duration
	armed bool
}

func (w *deadlineWriter) arm() {
	if !w.armed {
		w.armed = true
		w.rc.SetWriteDeadline(time.Now().Add(w.d))
	}
}

func (w *deadlineWriter) WriteHeader(code int) {
	// A 1xx informational header is not the response: it does not start
	// the clock.
	if code >= 200 {
		w.arm()
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *deadlineWriter) Write(b []byte) (int, error) {
	w.arm()
	return w.ResponseWriter.Write(b)
}

// Flush implements http.Flusher, for handlers that test for it.
func (w *deadlineWriter) Flush() {
	w.arm()
	w.rc.Flush()
}

// Unwrap lets http.ResponseController reach the connection.
func (w *deadlineWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// readSealKeys reads the seal key file of o (see server.ParseSealKeys)
// and logs which key seals and which open, and whether a response stored
// in the clear is refused (-seal-require). A file that its group or others
// may read is refused, unless -seal-key-file-insecure, which logs it at
// Warn.
func readSealKeys(o options, log *slog.Logger) (*idempotency.SealKeys, error) {
	path := o.sealKeyFile
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	// Windows has no such modes.
	if perm := fi.Mode().Perm(); perm&0o077 != 0 && runtime.GOOS != "windows" {
		if !o.sealKeyFileInsecure {
			return nil, fmt.Errorf("mode %04o lets its group or others read the keys: chmod 600 %s, or start with -seal-key-file-insecure", perm, path)
		}
		log.Warn("the seal key file may be read by others than its owner (-seal-key-file-insecure); chmod 600 it", "file", path, "mode", fmt.Sprintf("%04o", perm))
	}
	keys, err := server.ParseSealKeys(f)
	if err != nil {
		return nil, err
	}
	ks, err := idempotency.NewSealKeys(keys...)
	if err != nil {
		return nil, err
	}
	if o.sealRequire {
		if ks, err = ks.RequireSealed(); err != nil {
			return nil, fmt.Errorf("-seal-require and an open-only first key: new responses are stored in the clear, and -seal-require would refuse them; keep one")
		}
	}
	ids := make([]string, len(keys))
	for i, k := range keys {
		ids[i] = k.ID
	}
	sealing := ids[0]
	if keys[0].OpenOnly {
		sealing = "none (open-only)"
	}
	log.Info("stored responses are sealed at rest", "sealing_key", sealing, "opening_keys", strings.Join(ids, ","),
		"unsealed_replayed", !o.sealRequire)
	return ks, nil
}

// loopbackUnlessNamed returns addr, a host:port, with the loopback host
// 127.0.0.1 when it names none (":9090"), where net.Listen would listen
// on every interface.
func loopbackUnlessNamed(addr string) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", err
	}
	if host == "" {
		return net.JoinHostPort("127.0.0.1", port), nil
	}
	return addr, nil
}

// validShare reports whether f is a share in [0, 1] (NaN is not).
func validShare(f float64) bool { return f >= 0 && f <= 1 }
