package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"time"

	"github.com/idemkit/idem"
)

// Defaults of [Config].
const (
	DefaultPurgeInterval = time.Minute
	DefaultPurgeBatch    = 500
	// DefaultPurgeDutyCycle is the share of its time the purge job spends
	// deleting while it works through a backlog; see [Config.PurgeDutyCycle].
	DefaultPurgeDutyCycle = 0.25
	// DefaultAPIKeys is the API key of the demo client, "sk_test_demo" for
	// client "demo", in the -api-keys format.
	DefaultAPIKeys = "sk_test_demo:demo"
)

// Config configures a [Server]. Only Store is required; every other zero
// field takes the default it documents. [New] applies the defaults on a copy.
type Config struct {
	// Store keeps the idempotency keys. It is required.
	Store Store
	// Payments keeps the payments. If nil, Store is used, which must then
	// implement [PaymentStore] (both stores of this package do), so that a
	// payment commits with its key.
	Payments PaymentStore
	// Charges keeps the fake card processor's charges. If nil, Store is
	// used when it implements [ChargeStore], else a new [MemoryStore].
	Charges ChargeStore

	// APIKeys maps bearer tokens to client ids. If empty, the demo key of
	// [DefaultAPIKeys] is used (and New logs it).
	APIKeys map[string]string

	// Retention, LockTimeout, RetryAfter, WaitForCompletion,
	// StoreServerErrors and MaxBodyBytes are passed to [Idempotency]; see
	// [IdempotencyOptions] for their meaning and defaults (24h, 30s, 1s, 0,
	// false, 1 MiB).
	Retention         time.Duration
	LockTimeout       time.Duration
	RetryAfter        time.Duration
	WaitForCompletion time.Duration
	StoreServerErrors bool
	MaxBodyBytes      int64

	// PurgeInterval is how often [Server.Run] purges expired keys. If zero,
	// [DefaultPurgeInterval] (1m) is used.
	PurgeInterval time.Duration
	// PurgeBatch caps the keys deleted by one [Store.Purge] call; a purge
	// runs batches until one comes back short. A smaller batch is a
	// shorter burst of deletes (and of WAL, on PostgreSQL) that the
	// requests running at the same time wait behind. If zero,
	// [DefaultPurgeBatch] (500) is used.
	PurgeBatch int
	// PurgeDutyCycle is the share of time, in (0, 1], that a purge
	// working through a backlog spends deleting: after each full batch,
	// which took d, it pauses d × (1 − PurgeDutyCycle) / PurgeDutyCycle
	// before the next, so the pauses grow when the database is slow and
	// the purge yields to the requests; it does not pause after the last,
	// short batch. The pace only bounds how fast the table shrinks, never
	// what a request sees: an expired key counts as absent on lookup
	// whether or not it has been deleted yet. If zero,
	// [DefaultPurgeDutyCycle] (0.25, a pause of three times each batch) is
	// used; 1 runs the batches back to back.
	PurgeDutyCycle float64

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

	// AfterCharge, if not nil, is called by the payments API after the
	// processor charged and before the payment is recorded. A non-nil error
	// simulates a crash at that point: the request is aborted (the client's
	// connection is cut) and its key stays started, neither released nor
	// completed, until a retry takes it over after LockTimeout and finds
	// the charge already made. For tests and scenarios; leave it nil.
	AfterCharge func(ctx context.Context) error

	// NoIdempotency serves POST /v1/payments without the [Idempotency]
	// middleware: no Idempotency-Key is needed (one sent is ignored), no
	// key is stored, and every request is a new payment, charged under a
	// downstream key derived from a fresh random operation ID and
	// inserted in one autocommitted statement ([PaymentInserter]). A retry
	// pays twice. It exists only so that a load test can measure what the
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
// with the payments routes behind [BearerAuth] and [Idempotency]. Run its
// purge job with [Server.Run] and stop it with [Server.Close]. A Server is
// safe for concurrent use.
//
// For a graceful stop, call http.Server.Shutdown on the server that serves
// it first, so in-flight requests finish and complete or release their
// keys, then Close.
type Server struct {
	cfg       Config
	log       *slog.Logger
	handler   http.Handler
	metrics   *Metrics
	processor *Processor
	client    *processorClient
	procSrv   *http.Server // nil when Config.ProcessorURL is set
	procURL   string

	// The purge pacing's clock and pause; test seams, set by New to
	// time.Now and sleepCtx.
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) error
}

// New returns a server for cfg. It starts the fake processor's listener
// unless cfg.ProcessorURL is set; Close stops it.
func New(cfg Config) (*Server, error) {
	if cfg.Store == nil {
		return nil, errors.New("server: Config.Store is nil")
	}
	if cfg.Payments == nil {
		ps, ok := cfg.Store.(PaymentStore)
		if !ok {
			return nil, fmt.Errorf("server: Config.Payments is nil and the Store (%T) is not a PaymentStore", cfg.Store)
		}
		cfg.Payments = ps
	}
	if cfg.Charges == nil {
		if cs, ok := cfg.Store.(ChargeStore); ok {
			cfg.Charges = cs
		} else {
			cfg.Charges = NewMemoryStore()
		}
	}
	log := cmp.Or(cfg.Logger, slog.Default())
	if len(cfg.APIKeys) == 0 {
		keys, _ := ParseAPIKeys(DefaultAPIKeys)
		cfg.APIKeys = keys
		log.Warn("server: no API keys configured; using the demo key", "api_keys", DefaultAPIKeys)
	}
	cfg.PurgeInterval = cmp.Or(cfg.PurgeInterval, DefaultPurgeInterval)
	cfg.PurgeBatch = cmp.Or(cfg.PurgeBatch, DefaultPurgeBatch)
	cfg.PurgeDutyCycle = cmp.Or(cfg.PurgeDutyCycle, DefaultPurgeDutyCycle)
	if cfg.PurgeInterval < 0 || cfg.PurgeBatch < 0 {
		return nil, errors.New("server: PurgeInterval and PurgeBatch must not be negative")
	}
	if !(cfg.PurgeDutyCycle > 0 && cfg.PurgeDutyCycle <= 1) {
		return nil, fmt.Errorf("server: PurgeDutyCycle %v is not in (0, 1]", cfg.PurgeDutyCycle)
	}
	var inserter PaymentInserter
	if cfg.NoIdempotency {
		var ok bool
		if inserter, ok = cfg.Payments.(PaymentInserter); !ok {
			return nil, fmt.Errorf("server: Config.NoIdempotency needs a PaymentStore that is also a PaymentInserter; %T is not", cfg.Payments)
		}
	}
	s := &Server{cfg: cfg, log: log, metrics: NewMetrics(), now: time.Now, sleep: sleepCtx}
	if cfg.DBRoundTrips != nil {
		s.metrics.registry.MustRegister(roundTripsCollector{cfg.DBRoundTrips})
	}
	s.processor = &Processor{
		Charges:     cfg.Charges,
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

	api := &payments{
		store:         cfg.Payments,
		processor:     s.client,
		log:           log,
		chargeTimeout: cmp.Or(durationOpt(cfg.LockTimeout, DefaultLockTimeout), DefaultLockTimeout),
		afterCharge:   cfg.AfterCharge,
		inserter:      inserter,
	}
	keyed := Idempotency(cfg.Store, IdempotencyOptions{
		LockTimeout:       cfg.LockTimeout,
		Retention:         cfg.Retention,
		RetryAfter:        cfg.RetryAfter,
		StoreServerErrors: cfg.StoreServerErrors,
		WaitForCompletion: cfg.WaitForCompletion,
		MaxBodyBytes:      cfg.MaxBodyBytes,
		Logger:            log,
		OnEvent:           s.metrics.Observe,
	})
	v1 := http.NewServeMux()
	if cfg.NoIdempotency {
		log.Warn("server: POST /v1/payments runs WITHOUT the idempotency layer (NoIdempotency): no key is needed or stored, and a retry pays twice; for measuring the layer's cost only")
		v1.HandleFunc("POST /v1/payments", api.createUnkeyed)
	} else {
		v1.Handle("POST /v1/payments", keyed(http.HandlerFunc(api.create)))
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

// Run runs the purge job until ctx is done: at once, then every
// [Config.PurgeInterval], it deletes the keys older than the retention in
// batches of [Config.PurgeBatch] ([Server.Purge]). Failures are logged and
// retried at the next tick. Run returns nil when ctx is done.
func (s *Server) Run(ctx context.Context) error {
	t := time.NewTicker(s.cfg.PurgeInterval)
	defer t.Stop()
	for {
		if _, err := s.Purge(ctx); err != nil && ctx.Err() == nil {
			s.log.Error("purge: failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Purge deletes the keys older than the retention, one bounded batch of
// [Config.PurgeBatch] at a time, until a batch comes back short, and
// returns how many it deleted. Between two batches it pauses in proportion
// to the time the last one took ([Config.PurgeDutyCycle]), so a large
// backlog is deleted at a pace the requests running meanwhile hardly feel.
// It returns early, with ctx's error, when ctx is done. With a negative
// retention (keys never expire) it deletes nothing.
func (s *Server) Purge(ctx context.Context) (int64, error) {
	retention := durationOpt(s.cfg.Retention, DefaultRetention)
	if retention == 0 {
		return 0, nil
	}
	var total int64
	var paused time.Duration
	for batches := 1; ; batches++ {
		start := s.now()
		n, err := s.cfg.Store.Purge(ctx, retention, s.cfg.PurgeBatch)
		took := s.now().Sub(start)
		total += n
		s.metrics.AddPurged(n)
		if err != nil {
			return total, err
		}
		if n < int64(s.cfg.PurgeBatch) {
			if total > 0 {
				s.log.Info("purge: deleted expired keys", "keys", total, "retention", retention,
					"batches", batches, "paused", paused)
			}
			return total, nil
		}
		pause := purgePause(took, s.cfg.PurgeDutyCycle)
		if err := s.sleep(ctx, pause); err != nil {
			return total, err
		}
		paused += pause
	}
}

// purgePause returns the pause after a purge batch that took d, so that
// the purge spends the share duty of its time deleting: d × (1 − duty) /
// duty. A duty of 1 or more pauses for nothing, and so does a batch that
// took no measurable time.
func purgePause(d time.Duration, duty float64) time.Duration {
	if duty >= 1 || d <= 0 {
		return 0
	}
	return time.Duration(math.Round(float64(d) * (1 - duty) / duty))
}

// sleepCtx waits d, or until ctx is done, and then returns ctx's error.
// It returns at once, with ctx's error if any, when d is not positive.
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

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
