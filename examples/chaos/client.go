package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
)

// account is one API client of the payments API: a bearer token and the
// client id the servers scope its keys by.
type account struct{ token, id string }

func accounts(n int) []account {
	as := make([]account, n)
	for i := range as {
		as[i] = account{token: fmt.Sprintf("sk_chaos_%d", i), id: fmt.Sprintf("chaos%d", i)}
	}
	return as
}

// apiKeysFlag is the idem-server -api-keys value for accounts.
func apiKeysFlag(as []account) string {
	s := ""
	for i, a := range as {
		if i > 0 {
			s += ","
		}
		s += a.token + ":" + a.id
	}
	return s
}

// state is where a logical operation stands, as its client knows it.
type state int

const (
	pending   state = iota // no definitive answer yet
	succeeded              // 2xx: the payment exists
	failed                 // a definitive error: the payment does not exist
)

// op is one logical payment. Its amount and customer are unique to it, so
// the final check finds its payment and its downstream charge in the
// database whatever key they were made with.
type op struct {
	n        int
	account  account
	key      string
	amount   int64
	customer string
	// firstSent is when the operation was first sent, stored with its key
	// before its first call and pinned with it on every call, as the
	// README tells users to: a call after the servers let the key go is
	// then refused (410), never run again.
	firstSent time.Time

	// Owned by the client goroutine that made the op until the clients
	// are done.
	state     state
	calls     int
	start     time.Time
	end       time.Time // of the definitive answer
	next      time.Time // when to call again, while pending
	paymentID string    // as the API answered
	chargeID  string
	replayed  bool   // the success was a replay of an earlier attempt's outcome
	last      string // the last unknown outcome or the definitive error

	// invalid: the first request carries a NUL in the customer, until it
	// is refused with 400 (rejected); then the corrected request is sent
	// with the same key. acceptedInvalid: a server took it.
	invalid, rejected, acceptedInvalid bool
	// vanished: after an unknown outcome, its client vanished for good and
	// never asked again; its state stays pending.
	vanished bool
}

func newOp(n int, a account, now time.Time) *op {
	return &op{
		n:         n,
		account:   a,
		key:       idem.NewKey(),
		firstSent: now,
		amount:    amountOf(n),
		customer:  customerOf(n),
	}
}

func amountOf(n int) int64    { return 1000 + int64(n) }
func customerOf(n int) string { return fmt.Sprintf("cus_chaos_%d", n) }

// outcome is what one call taught the client about its operation.
type outcome struct {
	state  state  // pending: unknown
	reason string // why it is unknown, or the definitive error
}

// classify maps the result of one idem.Client call to what the caller
// knows, as the README tells users: idem.OutcomeOf decides. Only a 2xx with
// its answer and a definitive refusal settle an operation; an outcome that
// is unknown, a payment made whose answer was lost, and a call that was
// not sent are asked about again later with the same key and first-sent
// time. The error only names the reason, for the report.
func classify(resp *http.Response, err error) outcome {
	var lost *idem.AnswerLostError
	switch idem.OutcomeOf(resp, err) {
	case idem.OutcomeDone:
		switch {
		case err == nil:
			return outcome{state: succeeded}
		case errors.As(err, &lost):
			// Paid, but the payment's id was lost with the answer: ask
			// again with the key for its replay.
			return outcome{pending, fmt.Sprintf("%d answered, its body lost", lost.StatusCode)}
		}
		return outcome{failed, reason(err)}
	case idem.OutcomeNotSent:
		// Nothing happened: it could go anywhere under a new key; this
		// client keeps its key, so the final check can count it.
		return outcome{pending, "not sent: " + reason(err)}
	}
	return outcome{pending, reason(err)}
}

// reason names an outcome for the report.
func reason(err error) string {
	var (
		reuse      *idem.KeyReuseError
		inProgress *idem.InProgressError
		expired    *idem.KeyExpiredError
		retryErr   *idem.RetryError
		apiErr     *idem.APIError
	)
	switch {
	case errors.As(err, &reuse) && idem.OutcomeOf(nil, err) == idem.OutcomeUnknown:
		return "422 to a retry"
	case errors.As(err, &reuse):
		return "422 key reused"
	case errors.As(err, &inProgress):
		return "still in progress (409s)"
	case errors.As(err, &expired):
		return "410 key expired"
	case errors.Is(err, idem.ErrBudgetExhausted):
		return "retry budget exhausted"
	case errors.As(err, &retryErr) && errors.Is(err, idem.ErrAttemptTimeout):
		return "attempts ran out: timeout"
	case errors.As(err, &retryErr):
		return "attempts ran out: connection error"
	case errors.As(err, &apiErr) && idem.OutcomeOf(nil, err) == idem.OutcomeUnknown:
		return fmt.Sprintf("attempts ran out: %d", apiErr.StatusCode)
	case errors.As(err, &apiErr):
		return fmt.Sprintf("%d %s", apiErr.StatusCode, http.StatusText(apiErr.StatusCode))
	}
	return "other error"
}

// stats are the clients' counters, safe for concurrent use.
type stats struct {
	attempts atomic.Int64
	mu       sync.Mutex
	byResult map[string]int64 // attempts by result
	unknown  map[string]int64 // calls with an unknown outcome, by reason
	calls    int64
	// watchFrom, firstOK: the first 2xx answer after watchFrom (a
	// failover's kill, see watch); zero until then.
	watchFrom, firstOK time.Time
}

// watch makes s note the first 2xx answer after now, and returns now.
func (s *stats) watch() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.watchFrom, s.firstOK = time.Now(), time.Time{}
	return s.watchFrom
}

// firstSuccess returns when the first 2xx answer came after the time
// watch returned, or zero.
func (s *stats) firstSuccess() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.firstOK
}

func newStats() *stats {
	return &stats{byResult: map[string]int64{}, unknown: map[string]int64{}}
}

// onAttempt is the Transport's OnAttempt hook.
func (s *stats) onAttempt(a idem.Attempt) {
	s.attempts.Add(1)
	var k string
	switch {
	case a.Err != nil && errors.Is(a.Err, idem.ErrAttemptTimeout):
		k = "timeout"
	case a.Err != nil:
		k = "connection error"
	case a.Response.StatusCode < 300:
		if idem.Replayed(a.Response) {
			k = "2xx replayed"
		} else {
			k = "2xx"
		}
	default:
		k = fmt.Sprint(a.Response.StatusCode)
	}
	s.mu.Lock()
	s.byResult[k]++
	if a.Err == nil && a.Response.StatusCode < 300 && !s.watchFrom.IsZero() && s.firstOK.IsZero() {
		s.firstOK = time.Now()
	}
	s.mu.Unlock()
}

func (s *stats) call(o outcome) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	if o.state == pending {
		s.unknown[o.reason]++
	}
}

// clients runs the client goroutines.
type clients struct {
	cfg      config
	api      []*idem.Client // one per account
	accounts []account
	stats    *stats
	seq      atomic.Int64 // op numbers

	pending  atomic.Int64 // ops without a definitive answer whose client still asks
	vanished atomic.Int64 // ops whose client vanished after an unknown outcome
	late     lateStats    // of lateRetries, which runs alone once the clients are done

	mu  sync.Mutex
	ops []*op // every op ever started
}

// newClients returns clients that call baseURL through one idem.Transport
// (so one retry budget, as in a real process).
func newClients(cfg config, baseURL string, st *stats) (*clients, *http.Transport) {
	base := &http.Transport{
		// One connection per attempt: the proxy draws its fault per
		// connection, so every attempt gets a draw of its own.
		DisableKeepAlives:     true,
		ResponseHeaderTimeout: 4 * cfg.attemptTimeout,
	}
	var rt http.RoundTripper = base
	if cfg.keyPerAttempt {
		rt = newKeyPerAttempt{base}
	}
	tr := &idem.Transport{
		Base: rt,
		Retry: idem.RetryPolicy{
			// Few attempts and a conflict budget shorter than the servers'
			// lock timeout, so that some calls end without an answer
			// (a RetryError, or an InProgressError while a killed
			// server's key waits to be taken over) and their operations
			// are asked about again by a later call, as an application
			// would from its own queue.
			MaxAttempts:     3,
			InitialInterval: 50 * time.Millisecond,
			MaxInterval:     time.Second,
			MaxElapsedTime:  15 * time.Second,
			AttemptTimeout:  cfg.attemptTimeout,
			ConflictTimeout: cfg.lockTimeout * 3 / 4,
		},
		OnAttempt: st.onAttempt,
	}
	hc := &http.Client{Transport: tr}
	c := &clients{cfg: cfg, accounts: accounts(cfg.accounts), stats: st}
	for _, a := range c.accounts {
		c.api = append(c.api, &idem.Client{BaseURL: baseURL, Token: a.token, HTTPClient: hc})
	}
	return c, base
}

// run runs client goroutine w: it starts new operations until newOps is
// done, and asks again about each of its operations whose outcome is
// unknown, later, with the same key, until it learns the outcome or ctx is
// done.
func (c *clients) run(ctx, newOps context.Context, w int, rng *rand.Rand) {
	acct := w % len(c.accounts)
	vanish := rand.New(rand.NewPCG(c.cfg.seed, streamVanish+uint64(w)))
	var todo []*op // pending, in no order
	for ctx.Err() == nil {
		// The pending operation that is due first.
		var o *op
		due := -1
		for i, p := range todo {
			if due < 0 || p.next.Before(todo[due].next) {
				due = i
			}
		}
		now := time.Now()
		switch {
		case due >= 0 && !todo[due].next.After(now):
			o = todo[due]
			todo = append(todo[:due], todo[due+1:]...)
		case newOps.Err() == nil:
			o = newOp(int(c.seq.Add(1)), c.accounts[acct], now)
			o.start = now
			o.invalid = rng.Float64() < c.cfg.invalidRate
			c.pending.Add(1)
			c.mu.Lock()
			c.ops = append(c.ops, o)
			c.mu.Unlock()
		case due < 0:
			return // nothing pending and no new operations: done
		default:
			if !sleep(ctx, todo[due].next.Sub(now)) {
				return
			}
			continue
		}
		c.call(ctx, acct, o, rng)
		if o.state == pending && ctx.Err() == nil && vanish.Float64() < c.cfg.vanishRate {
			// Gone for good: only the servers' sweepers settle it now.
			o.vanished = true
			c.pending.Add(-1)
			c.vanished.Add(1)
			continue
		}
		if o.state == pending {
			// Ask again later; the wait grows with the calls made.
			wait := min(100*time.Millisecond<<min(o.calls-1, 5), 2*time.Second)
			o.next = time.Now().Add(wait/2 + time.Duration(rng.Int64N(int64(wait))))
			todo = append(todo, o)
		}
	}
}

// call makes one call for o and records what it learned. A share of the
// calls (-cancel) is cancelled by the caller at a random moment within the
// time a call takes, as an application's own deadline or shutdown would.
func (c *clients) call(ctx context.Context, acct int, o *op, rng *rand.Rand) {
	o.calls++
	callCtx := ctx
	if rng.Float64() < c.cfg.cancelRate {
		var cancel context.CancelFunc
		callCtx, cancel = context.WithCancel(ctx)
		// Within the time a call takes on a replica that is not slow, so
		// most cancellations cut a call in flight.
		window := min(2*c.cfg.attemptTimeout, 4*c.cfg.processorDelay+20*time.Millisecond)
		t := time.AfterFunc(time.Duration(rng.Int64N(int64(window)+1)), cancel)
		defer func() {
			t.Stop()
			cancel()
		}()
	}
	var out struct {
		ID     string `json:"id"`
		Charge string `json:"charge"`
	}
	body := map[string]any{"amount": o.amount, "currency": "usd", "customer": o.customer}
	sentInvalid := o.invalid && !o.rejected
	if sentInvalid {
		body["customer"] = o.customer + "\x00" // encoded as \u0000
	}
	// The key and the first-sent time, stored with the operation, pinned
	// on every call.
	resp, err := c.api[acct].Post(idem.WithFirstSent(idem.WithKey(callCtx, o.key), o.firstSent), "/v1/payments", body, &out)
	res := classify(resp, err)
	var apiErr *idem.APIError
	switch {
	case sentInvalid && errors.As(err, &apiErr) && apiErr.StatusCode == http.StatusBadRequest:
		// Refused before anything was done: correct it and send it again
		// at once, with the same key.
		o.rejected = true
		res = outcome{pending, "invalid text refused (400); corrected"}
		c.stats.call(res)
		o.last = res.reason
		c.call(ctx, acct, o, rng)
		return
	case sentInvalid && res.state == succeeded:
		o.acceptedInvalid = true
	case res.state == succeeded && out.ID == "":
		res = outcome{pending, "2xx without a payment id"}
	case res.state == pending && ctx.Err() != nil:
		res = outcome{pending, "run ended"}
	case res.state == pending && callCtx.Err() != nil:
		res = outcome{pending, "cancelled by the caller"}
	}
	c.stats.call(res)
	switch res.state {
	case pending:
		o.last = res.reason
	case succeeded:
		c.pending.Add(-1)
		o.state, o.end = succeeded, time.Now()
		o.paymentID, o.chargeID = out.ID, out.Charge
		o.replayed = idem.Replayed(resp)
	case failed:
		c.pending.Add(-1)
		o.state, o.end = failed, time.Now()
		o.last = fmt.Sprintf("%s: %v", res.reason, err)
	}
}

// newKeyPerAttempt replaces the key of every attempt with a new one: the
// classic client bug that idem exists to prevent, for -bug-key-per-attempt.
type newKeyPerAttempt struct{ base http.RoundTripper }

func (t newKeyPerAttempt) RoundTrip(req *http.Request) (*http.Response, error) {
	r := req.Clone(req.Context())
	r.Header.Set("Idempotency-Key", idem.NewKey())
	return t.base.RoundTrip(r)
}

// sleep waits d or until ctx is done; it reports whether it waited d.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// allOps returns every operation started. Their fields may be read only
// once the client goroutines have returned.
func (c *clients) allOps() []*op {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]*op(nil), c.ops...)
}

// lateRetries sends a share (-late) of the operations that succeeded once
// more, after their key's retention, with the key and the first-sent time
// of their first call pinned, as a job queue that retries a payment it
// lost track of does: each must be refused (410, *idem.KeyExpiredError),
// never paid again. What each got is counted in the report.
func (c *clients) lateRetries(ctx context.Context, ch *chaos, rng *rand.Rand) {
	var late []*op
	for _, o := range c.allOps() {
		if o.state == succeeded && rng.Float64() < c.cfg.lateRate {
			late = append(late, o)
		}
	}
	if len(late) == 0 {
		return
	}
	latest := late[0].end
	for _, o := range late {
		if o.end.After(latest) {
			latest = o.end
		}
	}
	wait := time.Until(latest.Add(c.cfg.retention + time.Second))
	ch.event("late retries: %d operations that succeeded are sent again with their key and first-sent time, %s from now, after their retention",
		len(late), max(wait, 0).Round(time.Millisecond))
	if !sleep(ctx, wait) {
		return
	}
	for _, o := range late {
		rctx := idem.WithFirstSent(idem.WithKey(ctx, o.key), o.firstSent)
		body := map[string]any{"amount": o.amount, "currency": "usd", "customer": o.customer}
		var out struct {
			ID string `json:"id"`
		}
		resp, err := c.api[slices.Index(c.accounts, o.account)].Post(rctx, "/v1/payments", body, &out)
		var expired *idem.KeyExpiredError
		switch {
		case errors.As(err, &expired):
			c.late.refused++
		case err == nil && idem.Replayed(resp) && out.ID == o.paymentID:
			c.late.replayed++
		case err == nil:
			c.late.paid++ // a second payment: the final check counts it as a duplicate
		default:
			c.late.other++
		}
	}
	ch.event("late retries: %d refused (410), %d replayed, %d paid again, %d other", c.late.refused, c.late.replayed, c.late.paid, c.late.other)
}

// lateStats counts what the late retries got.
type lateStats struct{ refused, replayed, paid, other int }
