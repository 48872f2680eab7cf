package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/server"
)

// The runner's API client: its bearer token and the client id the server
// maps it to.
const (
	token    = "sk_test_scenarios"
	clientID = "scenarios"
)

// policy is the retry policy of the scenarios' clients: idem's defaults
// (4 attempts, jittered exponential backoff, 409 waits on their own budget)
// with shorter waits, so that a whole run takes seconds.
var policy = idem.RetryPolicy{
	InitialInterval: 50 * time.Millisecond,
	MaxInterval:     2 * time.Second,
	MaxElapsedTime:  30 * time.Second,
	ConflictTimeout: 15 * time.Second,
}

// payment is the body of POST /v1/payments and the part of its answer the
// scenarios read.
type payment struct {
	ID       string `json:"id,omitempty"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Customer string `json:"customer"`
	Charge   string `json:"charge,omitempty"`
}

// A scenario is one story of the article, told against a fresh server on
// an empty store, with the invariants it must keep.
type scenario struct {
	name  string // for -run and the summary
	title string // the story in one line
	// server, if not nil, adjusts the server's configuration (a short
	// lock timeout, a slow card processor, …).
	server func(*server.Config)
	// run drives the clients and records its checks on e. An error means
	// the scenario could not be told (not that an invariant failed).
	run func(ctx context.Context, e *env) error
	// want is what the store must hold when the story ends: the runner
	// checks it and the summary shows it beside what was found.
	want expected
}

// expected is what a scenario must leave in its store, in all, and why
// when the figures are not the obvious one payment and one charge.
type expected struct {
	payments, charges int
	why               string
}

// env is what a scenario runs in: the server behind the fault injector,
// the timeline, the store's ledger, and the checks made so far.
type env struct {
	url    string // the server's base URL, through the fault injector
	srv    *server.Server
	cfg    server.Config // srv's configuration, to start another instance on the same storage
	faults *faults
	tl     *timeline
	ledger ledger
	// base sends every client's requests. Keep-alives are off so that
	// each attempt has a connection of its own: net/http itself resends a
	// keyed request once when a reused connection dies before the answer
	// (see isReplayable in net/http), which would hide from the timeline
	// the very retry a scenario is about.
	base *http.Transport

	mu          sync.Mutex
	watch       func(idem.Attempt)
	afterCharge func(context.Context) error
	checks      []check
	notes       []string
}

// check is one invariant of a scenario, as it turned out.
type check struct {
	text string // what was checked, with the figures found
	ok   bool
}

// onAttempt sets a function that sees every attempt of the scenario's idem
// clients, after the timeline has recorded it.
func (e *env) onAttempt(f func(idem.Attempt)) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.watch = f
}

// onCharge sets the server's AfterCharge hook: it runs after the card
// processor has charged and before the payment is recorded; an error
// simulates a crash at that point.
func (e *env) onCharge(f func(context.Context) error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.afterCharge = f
}

func (e *env) runAfterCharge(ctx context.Context) error {
	e.mu.Lock()
	f := e.afterCharge
	e.mu.Unlock()
	if f == nil {
		return nil
	}
	return f(ctx)
}

// transport returns an idem.Transport that reports its attempts to the
// timeline. A policy other than the runner's is shown on the timeline when
// the transport is made, and an operation that runs out of attempts says
// how many it had, so a story that stops early reads as intended.
func (e *env) transport(p idem.RetryPolicy) *idem.Transport {
	if d := policyDiff(p); d != "" {
		e.tl.note("this client's retry policy: %s", d)
	}
	maxAttempts := cmp.Or(p.MaxAttempts, idem.DefaultMaxAttempts)
	return &idem.Transport{
		Base:  e.base,
		Retry: p,
		OnAttempt: func(a idem.Attempt) {
			if a.Reason == "attempts exhausted" {
				a.Reason = fmt.Sprintf("attempts exhausted (MaxAttempts %d)", maxAttempts)
			}
			e.tl.attempt(a)
			e.mu.Lock()
			watch := e.watch
			e.mu.Unlock()
			if watch != nil {
				watch(a)
			}
		},
	}
}

// policyDiff describes how p differs from the runner's policy, with the
// value it replaces; "" when it does not.
func policyDiff(p idem.RetryPolicy) string {
	var d []string
	if got, def := cmp.Or(p.MaxAttempts, idem.DefaultMaxAttempts), cmp.Or(policy.MaxAttempts, idem.DefaultMaxAttempts); got != def {
		d = append(d, fmt.Sprintf("MaxAttempts %d, then give up (the default is %d)", got, def))
	}
	if p.AttemptTimeout != policy.AttemptTimeout {
		d = append(d, fmt.Sprintf("AttemptTimeout %s (the default is none)", p.AttemptTimeout))
	}
	if p.ConflictTimeout != policy.ConflictTimeout {
		d = append(d, fmt.Sprintf("ConflictTimeout %s (here %s)", p.ConflictTimeout, policy.ConflictTimeout))
	}
	return strings.Join(d, ", ")
}

// client returns an idem.Client of the payments API over tr.
func (e *env) client(tr *idem.Transport) *idem.Client {
	return &idem.Client{BaseURL: e.url, Token: token, HTTPClient: &http.Client{Transport: tr}}
}

// pay creates a payment with c, labelled op on the timeline.
func (e *env) pay(ctx context.Context, c *idem.Client, op string, in payment) (payment, *http.Response, error) {
	var out payment
	resp, err := c.Post(withOp(ctx, op), "/v1/payments", in, &out)
	return out, resp, err
}

// answer is what one payment call returned.
type answer struct {
	p    payment
	resp *http.Response
	err  error
}

// payAsync pays like pay, in a goroutine, and sends its answer on the
// returned channel, for the operations a scenario runs at once.
func (e *env) payAsync(ctx context.Context, c *idem.Client, op string, in payment) <-chan answer {
	ch := make(chan answer, 1)
	go func() {
		p, resp, err := e.pay(ctx, c, op, in)
		ch <- answer{p, resp, err}
	}()
	return ch
}

// expect records a check that holds when ok.
func (e *env) expect(ok bool, format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.checks = append(e.checks, check{text: fmt.Sprintf(format, args...), ok: ok})
}

// expectCount records the check that a count is want.
func (e *env) expectCount(what string, got, want int) {
	if got == want {
		e.expect(true, "%s %d", what, got)
	} else {
		e.expect(false, "%s %d, want %d", what, got, want)
	}
}

// note adds lines shown under the scenario's timeline: what a developer
// would see.
func (e *env) note(lines ...string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.notes = append(e.notes, lines...)
}

// payments counts the committed payments of customer ("" for all).
func (e *env) payments(ctx context.Context, customer string) (int, error) {
	n, err := e.ledger.Payments(ctx, customer)
	if err != nil {
		return 0, fmt.Errorf("counting payments: %w", err)
	}
	return n, nil
}

// charges counts the card processor's charges.
func (e *env) charges(ctx context.Context) (int, error) {
	n, err := e.ledger.Charges(ctx)
	if err != nil {
		return 0, fmt.Errorf("counting charges: %w", err)
	}
	return n, nil
}

// expectStored checks the payments of customer and all the charges in the
// store.
func (e *env) expectStored(ctx context.Context, customer string, payments, charges int) error {
	p, err := e.payments(ctx, customer)
	if err != nil {
		return err
	}
	c, err := e.charges(ctx)
	if err != nil {
		return err
	}
	e.expectCount("payments", p, payments)
	e.expectCount("charges", c, charges)
	return nil
}

// counter returns the value of one of the server's counters (its /metrics).
func (e *env) counter(name string) (float64, error) {
	if v, ok := e.srv.Metrics().Counter(name); ok {
		return v, nil
	}
	return 0, fmt.Errorf("the server has no counter %s", name)
}

// result is how a scenario went.
type result struct {
	scenario
	tl       *timeline
	checks   []check
	notes    []string
	err      error // the scenario could not be told to its end
	attempts int
	payments int
	charges  int
	elapsed  time.Duration
}

// passed reports whether the scenario ran to its end and kept every
// invariant.
func (r *result) passed() bool {
	if r.err != nil || len(r.checks) == 0 {
		return false
	}
	for _, c := range r.checks {
		if !c.ok {
			return false
		}
	}
	return true
}

// runScenario tells sc against a new server on storage from b, and returns
// how it went. verbose puts the server's warnings on the timeline.
func runScenario(ctx context.Context, sc scenario, b backend, verbose bool) *result {
	res := &result{scenario: sc, tl: newTimeline()}
	start := time.Now()
	res.err = tell(ctx, sc, b, verbose, res)
	res.elapsed = time.Since(start)
	res.attempts = res.tl.count(func(event) bool { return true })
	return res
}

// tell runs sc and fills in res; it returns why the story could not be
// told, if it could not.
func tell(ctx context.Context, sc scenario, b backend, verbose bool, res *result) (err error) {
	st, err := b.open(ctx, sc.name)
	if err != nil {
		return fmt.Errorf("opening the store: %w", err)
	}
	if st.close != nil {
		defer func() { err = errors.Join(err, st.close()) }()
	}

	logger := slog.New(slog.DiscardHandler)
	if verbose {
		logger = slog.New(&logHandler{tl: res.tl})
	}
	e := &env{
		tl:     res.tl,
		ledger: st.ledger,
		base:   &http.Transport{DisableKeepAlives: true, ResponseHeaderTimeout: time.Minute},
	}
	defer e.base.CloseIdleConnections()
	cfg := server.Config{
		Storage:     st.store,
		APIKeys:     map[string]string{token: clientID},
		Logger:      logger,
		AfterCharge: e.runAfterCharge,
	}
	if sc.server != nil {
		sc.server(&cfg)
	}
	e.cfg = cfg
	if e.srv, err = server.New(cfg); err != nil {
		return err
	}
	defer func() { err = errors.Join(err, e.srv.Close()) }()
	e.faults = &faults{next: e.srv, tl: res.tl}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	hs := &http.Server{
		Handler:           e.faults,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		err = errors.Join(err, hs.Shutdown(sctx))
		if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
			err = errors.Join(err, serr)
		}
	}()
	e.url = "http://" + ln.Addr().String()

	res.tl.restart()
	runErr := sc.run(ctx, e)

	e.mu.Lock()
	res.checks, res.notes = e.checks, e.notes
	e.mu.Unlock()
	if runErr != nil {
		return runErr
	}
	if res.payments, err = e.payments(ctx, ""); err != nil {
		return err
	}
	if res.charges, err = e.charges(ctx); err != nil {
		return err
	}
	if res.payments != sc.want.payments || res.charges != sc.want.charges {
		res.checks = append(res.checks, check{ok: false, text: fmt.Sprintf(
			"the store holds %d payments and %d charges, expected %d and %d",
			res.payments, res.charges, sc.want.payments, sc.want.charges)})
	}
	return nil
}
