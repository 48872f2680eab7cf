package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/server/idempotency"
)

// Defaults of [Config].
const (
	// DefaultAPIKeys is the API key of the demo client, "sk_test_demo" for
	// client "demo", in the -api-keys format.
	DefaultAPIKeys = "sk_test_demo:demo"
	// DefaultProcessorTimeout bounds one payment's calls to the card
	// processor, retries included.
	DefaultProcessorTimeout = 30 * time.Second
)

// Config configures a [Server]. Only Storage.Keys and Storage.Payments are
// required; every other zero field takes the default it documents. [New]
// applies the defaults on a copy.
type Config struct {
	// Storage keeps the keys, the payments and the fake processor's
	// charges: [NewMemoryStorage] or [NewPostgresStorage]. If
	// Storage.Charges is nil, the charges are kept in memory.
	Storage Storage

	// APIKeys maps bearer tokens to client ids. If empty, the demo key of
	// [DefaultAPIKeys] is used (and New logs it).
	APIKeys map[string]string

	// Retention, LockTimeout, RetryAfter, WaitForCompletion,
	// StoreServerErrors and MaxBodyBytes are passed to
	// [idempotency.Middleware]; see [idempotency.Options] for their meaning
	// and defaults (24h, 10s, 1s, 0, false, 1 MiB).
	Retention         time.Duration
	LockTimeout       time.Duration
	RetryAfter        time.Duration
	WaitForCompletion time.Duration
	StoreServerErrors bool
	MaxBodyBytes      int64
	// FirstSentSkew and IgnoreFirstSent are passed to
	// [idempotency.Middleware]: the first-sent policy is on by default
	// (see [idempotency.Options.FirstSentHeader]).
	FirstSentSkew   time.Duration
	IgnoreFirstSent bool

	// SealKeys, if not nil, seal the stored responses at rest
	// ([idempotency.Sealed]): the first key seals, every key opens. Nil:
	// responses are stored as they are (a sealed one found in the store is
	// answered 500, never run again).
	SealKeys *idempotency.SealKeys

	// PurgeInterval, PurgeBatch and PurgeDutyCycle pace the purge job of
	// [Server.Run]; see [idempotency.Purger] for their meaning and
	// defaults (1m, 500, 0.25).
	PurgeInterval  time.Duration
	PurgeBatch     int
	PurgeDutyCycle float64

	// SweepGrace and SweepInterval pace the sweeper of [Server.Run] (see
	// [idempotency.Sweeper]): every SweepInterval it settles the payments
	// whose key was abandoned for SweepGrace (its lease ran out, or it was
	// released after a failure, and no retry came): a charge found at the
	// processor becomes the payment and the key completes with its 201; no
	// charge releases the key. SweepGrace is at least ProcessorTimeout, so
	// that a request cut off from the database has finished its charge
	// call when the sweeper looks. If SweepGrace is zero, the longer of
	// [idempotency.DefaultSweepGrace] (1m) and ProcessorTimeout is used; if
	// SweepInterval is zero, [idempotency.DefaultSweepInterval] (10s).
	SweepGrace    time.Duration
	SweepInterval time.Duration
	// NoSweep leaves the sweeper out of [Server.Run]: abandoned payments
	// wait for their clients' retries, and expire with their keys.
	NoSweep bool

	// ProcessorURL is the base URL of the card processor the payments API
	// charges through (it posts to ProcessorURL + "/v1/charges"). If
	// empty, New starts the fake [Processor] on its own loopback listener
	// (127.0.0.1, a free port): a separate endpoint, as a real processor
	// would be, that API clients cannot reach through the public handler.
	// [Server.Close] stops it.
	ProcessorURL string
	// ProcessorDelay is the latency of the fake processor. Zero: none.
	ProcessorDelay time.Duration
	// ProcessorFailureRate is the share of charge requests the fake
	// processor fails with 503 (before charging). Zero: none.
	ProcessorFailureRate float64
	// ProcessorRetry is the retry policy of the calls to the processor,
	// made through an [idem.Transport]. If zero, 5 attempts from 20ms
	// apart, within 20s.
	ProcessorRetry idem.RetryPolicy
	// ProcessorTimeout bounds one payment's calls to the processor,
	// retries included; they run on when the client hangs up, so that a
	// charge once begun is recorded. The lease of the payment's key is
	// renewed meanwhile, so it need not be shorter than the lock timeout.
	// If zero, [DefaultProcessorTimeout] (30s) is used, or SweepGrace when
	// that is set and shorter; a SweepGrace shorter than a ProcessorTimeout
	// is refused.
	ProcessorTimeout time.Duration

	// AfterCharge, if not nil, is called by the payments API after the
	// processor charged and before the payment is recorded. A non-nil error
	// simulates a crash at that point: the request is aborted (the client's
	// connection is cut), its writes are rolled back and its key stays
	// started, neither released nor renewed, as after a real crash, until
	// a retry takes it over once its lease runs out and finds the charge
	// already made. For tests and scenarios; leave it nil.
	AfterCharge func(ctx context.Context) error

	// Faults make the keyed payments' own answers fail, vanish or lag
	// (see [Faults]). Zero: none.
	Faults Faults

	// NoIdempotency serves POST /v1/payments without
	// [idempotency.Middleware]: no Idempotency-Key is needed (one sent is
	// ignored), no key is stored, and every request is a new payment,
	// charged under a downstream key derived from a fresh random operation
	// ID and inserted by the same handler in a transaction of its own. A
	// retry pays twice. It exists only so that a load test can measure what the
	// idempotency layer costs against the same work without it; never
	// turn it on for anything else. New logs a warning when it is set.
	NoIdempotency bool

	// DBRoundTrips, if not nil, is the tracer of the PostgreSQL pool the
	// stores use; its counts are served on /metrics as
	// idem_db_round_trips_total (see [DBRoundTrips]). The server does not
	// install it: the pool's ConnConfig.Tracer must be set to it before
	// the pool is created.
	DBRoundTrips *DBRoundTrips

	// NoMetricsRoute leaves GET /metrics out of the handler, for a service
	// that serves [Server.Metrics] on a listener of its own (idem-server's
	// -metrics-addr): the route needs no authentication, so anyone who can
	// reach it reads the counters.
	NoMetricsRoute bool

	// Logger receives the server's structured logs. If nil, slog.Default
	// is used.
	Logger *slog.Logger
}

// Server is the reference payments API: an http.Handler serving
//
//	POST /v1/payments        create a payment; needs Authorization and Idempotency-Key
//	GET  /v1/payments/{id}   read one of the client's payments
//	GET  /healthz            liveness: 200 "ok"
//	GET  /metrics            Prometheus counters ([Metrics]), unauthenticated;
//	                         left out with [Config.NoMetricsRoute]
//
// with the payments routes behind [BearerAuth] and [idempotency.Middleware],
// built on the library exactly as any service would be. Run its purge job
// and its sweeper with [Server.Run] and stop it with [Server.Close]; serve
// the operators' API ([Server.AdminHandler]) on a listener of its own. A
// Server is safe for concurrent use.
//
// For a graceful stop, call http.Server.Shutdown on the server that serves
// it first, so in-flight requests finish and complete or release their
// keys, then Close.
type Server struct {
	cfg       Config
	log       *slog.Logger
	handler   http.Handler
	metrics   *Metrics
	purger    *idempotency.Purger
	sweeper   *idempotency.Sweeper // nil without one (see Config.NoSweep)
	processor *Processor
	client    *processorClient
	procSrv   *http.Server // nil when Config.ProcessorURL is set
	procURL   string
}

// New returns a server for cfg. It starts the fake processor's listener
// unless cfg.ProcessorURL is set; Close stops it.
func New(cfg Config) (*Server, error) {
	if cfg.Storage.Keys == nil || cfg.Storage.Payments == nil {
		return nil, errors.New("server: Config.Storage needs Keys and Payments (NewMemoryStorage or NewPostgresStorage)")
	}
	if cfg.Storage.Charges == nil {
		cfg.Storage.Charges = NewMemoryStorage()
	}
	log := cmp.Or(cfg.Logger, slog.Default())
	grace, processorTimeout, err := sweepTimes(cfg)
	if err != nil {
		return nil, err
	}
	if len(cfg.APIKeys) == 0 {
		keys, _ := ParseAPIKeys(DefaultAPIKeys)
		cfg.APIKeys = keys
		log.Warn("server: no API keys configured; using the demo key", "api_keys", DefaultAPIKeys)
	}
	s := &Server{cfg: cfg, log: log, metrics: NewMetrics()}
	s.purger = &idempotency.Purger{
		Store:     cfg.Storage.Keys,
		Interval:  cfg.PurgeInterval,
		Batch:     cfg.PurgeBatch,
		DutyCycle: cfg.PurgeDutyCycle,
		Logger:    log,
		OnPurged:  s.metrics.AddPurged,
	}
	if cfg.DBRoundTrips != nil {
		s.metrics.countRoundTrips(cfg.DBRoundTrips)
	}
	s.processor = &Processor{
		Charges:     cfg.Storage.Charges,
		Delay:       cfg.ProcessorDelay,
		FailureRate: cfg.ProcessorFailureRate,
		Logger:      log,
		metrics:     s.metrics,
	}
	s.procURL = cfg.ProcessorURL
	if s.procURL == "" {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("server: starting the card processor: %w", err)
		}
		s.procSrv = &http.Server{
			Handler:           s.processor,
			ReadHeaderTimeout: 10 * time.Second,
			ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
		}
		s.procURL = "http://" + ln.Addr().String()
		go s.procSrv.Serve(ln)
		log.Info("server: fake card processor listening", "url", s.procURL)
	}
	s.client = newProcessorClient(s.procURL, cfg.ProcessorRetry, log)

	keys := cfg.Storage.Keys
	if cfg.SealKeys != nil {
		keys = idempotency.Sealed(keys, cfg.SealKeys)
	}
	sweptKeys := keys // the sweeper settles through the sealing, never through a simulated crash
	var crashes *crashingStore
	if cfg.AfterCharge != nil {
		crashes = &crashingStore{Store: keys}
		keys = crashes
	}
	api := &payments{
		store:             cfg.Storage.Payments,
		processor:         s.client,
		log:               log,
		processorTimeout:  processorTimeout,
		afterCharge:       cfg.AfterCharge,
		crashes:           crashes,
		storeServerErrors: cfg.StoreServerErrors,
		faults:            cfg.Faults,
	}
	keyed, err := idempotency.New(keys, idempotency.Options{
		LockTimeout:       cfg.LockTimeout,
		Retention:         cfg.Retention,
		RetryAfter:        cfg.RetryAfter,
		StoreServerErrors: cfg.StoreServerErrors,
		WaitForCompletion: cfg.WaitForCompletion,
		MaxBodyBytes:      cfg.MaxBodyBytes,
		FirstSentSkew:     cfg.FirstSentSkew,
		IgnoreFirstSent:   cfg.IgnoreFirstSent,
		BodyFormat:        idempotency.BodyByContentType, // the API takes forms as well as JSON
		Validate:          api.validate,                  // a malformed payment leaves its key unused
		Logger:            log,
		OnEvent:           s.metrics.Observe,
	})
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("server: %w", err)
	}
	s.sweeper = newSweeper(cfg, sweptKeys, api, grace, log, s.metrics)
	if in, ok := cfg.Storage.Keys.(idempotency.Inspector); ok {
		s.metrics.watchKeys(in.Stats)
	}
	v1 := http.NewServeMux()
	if cfg.NoIdempotency {
		log.Warn("server: POST /v1/payments runs WITHOUT the idempotency layer (NoIdempotency): no key is needed or stored, and a retry pays twice; for measuring the layer's cost only")
		v1.HandleFunc("POST /v1/payments", api.createUnkeyed)
	} else {
		v1.Handle("POST /v1/payments", cfg.Faults.dropAnswers(keyed(http.HandlerFunc(api.create))))
	}
	v1.HandleFunc("GET /v1/payments/{id}", api.get)
	v1.HandleFunc("/v1/payments", methodNotAllowed("POST"))
	v1.HandleFunc("/v1/payments/{id}", methodNotAllowed("GET"))
	v1.HandleFunc("/", notFound)

	root := http.NewServeMux()
	root.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Write([]byte("ok\n"))
	})
	if !cfg.NoMetricsRoute {
		root.Handle("GET /metrics", s.metrics.Handler())
	}
	root.Handle("/v1/", BearerAuth(cfg.APIKeys)(v1))
	root.HandleFunc("/", notFound)
	s.handler = root
	return s, nil
}

func notFound(w http.ResponseWriter, r *http.Request) {
	writeProblem(w, r, ProblemNotFound, http.StatusNotFound, "No such resource. The API serves POST /v1/payments and GET /v1/payments/{id}.")
}

func methodNotAllowed(allow string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", allow)
		writeProblem(w, r, ProblemMethodNotAllowed, http.StatusMethodNotAllowed,
			fmt.Sprintf("%s is not supported here; use %s.", r.Method, allow))
	}
}

// ServeHTTP serves the API.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// Metrics returns the server's counters.
func (s *Server) Metrics() *Metrics { return s.metrics }

// Processor returns the fake card processor, to inject failures. It is not
// used when [Config.ProcessorURL] is set.
func (s *Server) Processor() *Processor { return s.processor }

// ProcessorURL returns the base URL the payments API charges through.
func (s *Server) ProcessorURL() string { return s.procURL }

// Run runs the purge job and the sweeper until ctx is done. At once, then
// every [Config.PurgeInterval], the purge deletes the expired keys in
// batches of [Config.PurgeBatch] ([Server.Purge]); at once, then every
// [Config.SweepInterval], the sweeper settles the abandoned payments
// ([Server.Sweep]). Failures are logged and retried at the next tick. Run
// returns nil when ctx is done, and an error at once for settings out of
// range (see [idempotency.Purger.Run]).
func (s *Server) Run(ctx context.Context) error {
	if s.sweeper == nil {
		return s.purger.Run(ctx)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, 2)
	go func() { errs <- s.purger.Run(ctx) }()
	go func() { errs <- s.sweeper.Run(ctx) }()
	err := <-errs
	cancel()
	return errors.Join(err, <-errs)
}

// Purge deletes the expired keys, one bounded batch at a time, paced by
// [Config.PurgeDutyCycle] (see [idempotency.Purger.Purge]), and returns how
// many it deleted.
func (s *Server) Purge(ctx context.Context) (int64, error) { return s.purger.Purge(ctx) }

// Close stops the fake processor's listener, letting its in-flight charges
// finish, and closes idle connections to it. Stop the HTTP server serving s
// first: a payment in flight needs the processor.
func (s *Server) Close() error {
	defer s.client.close()
	if s.procSrv == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return s.procSrv.Shutdown(ctx)
}
