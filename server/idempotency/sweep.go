package idempotency

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"
)

// Defaults of [Sweeper].
const (
	// DefaultSweepGrace is how long an abandoned key is left to the
	// retries of its client before the sweeper takes it: six default lock
	// timeouts, longer than the SDK's backoff between two attempts.
	DefaultSweepGrace    = time.Minute
	DefaultSweepInterval = 10 * time.Second // [Sweeper.Interval]
	DefaultSweepBatch    = 100              // [Sweeper.Batch]
)

// ErrNotSweepable is returned by [Sweeper] on a [Store] that does not
// implement [Sweepable].
var ErrNotSweepable = errors.New("idempotency: the store does not implement Sweepable")

// Sweepable is what a [Store] offers a [Sweeper]: the abandoned keys, and
// a takeover of one of them. [MemoryStore] and the PostgreSQL stores
// (packages pgstore and sqlstore) implement it; theirs needs an index that
// their CreateOpenKeysIndex creates, and without it Abandoned returns an
// error saying so, which every pass of a [Sweeper] returns (and
// [Sweeper.Run] logs). A store need not implement it to serve
// [Middleware].
//
// A key is abandoned when it is not expired and either started, its lease
// run out at least grace ago (its owner died and no retry took it over),
// or released as [ReleaseFailed] at least grace ago (its request failed
// after it may have done work, and was not retried). A key released as
// [ReleaseRejected] is never abandoned: nothing was done.
type Sweepable interface {
	// Abandoned returns at most limit abandoned keys (see [Sweepable]),
	// those abandoned first first (by LockedAt), as [Inspector.List]
	// returns keys. A limit of zero or less returns none.
	Abandoned(ctx context.Context, grace time.Duration, limit int) ([]KeyInfo, error)
	// Adopt takes over the key k describes, which Abandoned returned,
	// and returns its new claim: the key is started again, under a new
	// fencing token and the same operation, with a lease of lease (zero:
	// one that never runs out), counted from now; its retention is kept.
	// It is a takeover: the claim is fenced like a request's, and a
	// request that takes it over later (once its lease ran out) fences it.
	// Adopt returns [ErrFenced], and changes nothing, when the key is no
	// longer as k describes it (another token or status: a retry or
	// another sweeper came first) or no longer abandoned with grace.
	Adopt(ctx context.Context, k KeyInfo, grace, lease time.Duration) (Claim, error)
}

// Settlement is what a [SweepFunc] decided for an abandoned key. The zero
// value leaves the key for a later sweep.
type Settlement struct {
	// Response, if not nil, completes the key with this outcome, stored
	// with the writes the hook made in the key's unit of work, as a
	// handler's response and writes are: every retry of the key gets it
	// again. It is stored as [Middleware] stores a handler's answer: its
	// status only when the middleware would store it (not a 5xx, unless
	// [Sweeper.StoreServerErrors]; not a 4xx that rejects a request, such
	// as 400, 409 or 429; not a 1xx, which is no final answer), and only the headers [Sweeper.StoredHeaders]
	// keeps, never a credential nor the key header. A status that is not
	// stored leaves the key, as an error does. Unlike a handler's answer,
	// it is neither redacted ([Options.Redact]) nor capped
	// ([Options.MaxStoredBodyBytes]): the hook writes what is replayed.
	Response *StoredResponse
	// Release frees the key for any request, as released with
	// [ReleaseRejected]: the hook knows that nothing of the operation took
	// effect (no downstream charge under its operation, say). The retry of
	// the same request resumes the operation (same [Claim.OperationID]);
	// the sweeper leaves the key alone from then on.
	Release bool
}

// SweepFunc settles one abandoned key, as an application knows how: it
// looks for the work done under k.OperationID outside the key's unit of
// work (a downstream charge keyed by it), and completes the key with the
// response its request would have had, its business writes made through
// ctx as a handler's are (pgstore.Tx, [MemoryStore.Stage]); or
// it releases the key, when nothing was done; or it leaves it, returning
// the zero Settlement or an error (logged), for the next sweep.
//
// ctx carries the sweeper's claim of the key ([ClaimFromContext], with
// k's operation) and its unit of work ([NewContext]), and the client
// ([ClientIDFromContext]); it is cancelled when the sweeper stops, and,
// with cause [ErrLeaseLost], when a retry took the key over meanwhile,
// which fences whatever the hook still does. k is the key as it was found,
// before the sweeper took it: started or released, with the token of its
// last owner. A sweeper settles one key at a time, so the hook bounds its
// own work (a timeout on its downstream calls): while it runs, the next
// keys wait.
type SweepFunc func(ctx context.Context, k KeyInfo) (Settlement, error)

// Sweeper finds abandoned operations and hands each to an application
// hook that settles it: a key whose owner crashed after its downstream
// work (a card charged, the payment not recorded) and whose client never
// came back would otherwise stay unsettled until it expired, and nobody
// would know. Run one per process: sweepers of several processes on one
// store share the work safely, and each key is settled once, by one of
// them or by a late retry of its client, whichever takes it first.
//
// A pass takes the abandoned keys (see [Sweepable]) a batch at a time.
// For each it takes the key over, as a retry would, opens its unit of
// work, and calls Settle with both in the context, renewing the lease
// while Settle runs; then it stores the settlement: a completion (its
// writes and the response in one commit, fenced), a release as
// [ReleaseRejected], or, when Settle leaves the key, fails, or completes
// it with a status the middleware would not store (a 503: the hook could
// not tell yet), a release as [ReleaseFailed], rolling its writes back, so
// that the retry of its request still resumes it and the next pass after
// the grace finds it again. A response is stored as the middleware stores
// a handler's: give the Sweeper the [Options] the Middleware has for
// KeyHeader, StoredHeaders and StoreServerErrors. A key left that way is
// never purged while it is left, since each release keeps it for its
// retention from then on.
//
// Store and Settle are required; every other zero field takes the default
// it documents, applied at use. A Sweeper is safe for concurrent use.
type Sweeper struct {
	// Store holds the keys; it must implement [Sweepable].
	Store Store
	// Settle settles each abandoned key. It is required.
	Settle SweepFunc
	// Grace is how long a key stays abandoned before the sweeper takes
	// it, counted from when its lease ran out or it was released: time
	// for the client's own retries, which resume the operation
	// themselves. Keep it well below the retention, or keys expire
	// unsettled. If zero, [DefaultSweepGrace] (1m) is used.
	Grace time.Duration
	// Interval is how often [Sweeper.Run] sweeps. If zero,
	// [DefaultSweepInterval] (10s) is used.
	Interval time.Duration
	// Batch caps the keys one pass takes; the rest wait for the next
	// pass. If zero, [DefaultSweepBatch] (100) is used.
	Batch int
	// KeyHeader is the request header carrying the key, as
	// [Options.KeyHeader]: a settlement never stores it (a replay echoes
	// the key its request sent). If empty, "Idempotency-Key" is used.
	KeyHeader string
	// StoredHeaders lists the headers of a settlement's response that are
	// stored, as [Options.StoredHeaders] does for a handler's: give the
	// Middleware's. Credentials, framing headers and the key header are
	// never stored; a header left out is logged at Warn. If nil,
	// [DefaultStoredHeaders] is used.
	StoredHeaders []string
	// StoreServerErrors stores a settlement's 5xx, as
	// [Options.StoreServerErrors] does a handler's: give the
	// Middleware's. If false, a 5xx settlement is not stored, and the key
	// is left for the next sweep.
	StoreServerErrors bool
	// LockTimeout is the lease of the sweeper's claim while Settle runs,
	// renewed every third of it. If zero, [DefaultLockTimeout] (10s) is
	// used.
	LockTimeout time.Duration
	// Logger receives a line per key swept (Info when it is settled, Warn
	// when it is left) and the failures (Error). If nil, [slog.Default] is
	// used.
	Logger *slog.Logger
	// OnEvent, if not nil, is called with [EventSwept] for each key taken
	// over, [EventSettled] for each settlement stored, [EventFenced] for a
	// completion fenced by a retry, and [EventRenewed] and
	// [EventLeaseLost] from the renewals. It must be safe for concurrent
	// use.
	OnEvent func(Event)
}

// SweepResult counts what one pass did.
type SweepResult struct {
	Found     int // abandoned keys found
	Completed int // completed by Settle
	Released  int // released by Settle
	Left      int // left by Settle, or Settle failed: released for the next pass
	Lost      int // taken by a retry or another sweeper first, or fenced
}

// check returns the error of a Sweeper that cannot run.
func (s *Sweeper) check() (Sweepable, error) {
	switch {
	case s.Store == nil:
		return nil, errors.New("idempotency: Sweeper.Store is nil")
	case s.Settle == nil:
		return nil, errors.New("idempotency: Sweeper.Settle is nil")
	case s.Grace < 0 || s.Interval < 0 || s.Batch < 0 || s.LockTimeout < 0:
		return nil, fmt.Errorf("idempotency: Sweeper.Grace (%v), Interval (%v), Batch (%d) and LockTimeout (%v) must not be negative",
			s.Grace, s.Interval, s.Batch, s.LockTimeout)
	}
	sw, ok := s.Store.(Sweepable)
	if !ok {
		return nil, fmt.Errorf("%w (%T)", ErrNotSweepable, s.Store)
	}
	return sw, nil
}

func (s *Sweeper) logger() *slog.Logger { return cmp.Or(s.Logger, slog.Default()) }

func (s *Sweeper) event(e Event) {
	if s.OnEvent != nil {
		s.OnEvent(e)
	}
}

// Run sweeps at once, then every [Sweeper.Interval], until ctx is done,
// and then returns nil. A pass that fails is logged and tried again at the
// next tick. It returns an error at once only for a Sweeper that cannot
// run: no Store or Settle, a negative setting, or a Store that does not
// implement [Sweepable] ([ErrNotSweepable]).
func (s *Sweeper) Run(ctx context.Context) error {
	if _, err := s.check(); err != nil {
		return err
	}
	t := time.NewTicker(cmp.Or(s.Interval, DefaultSweepInterval))
	defer t.Stop()
	for {
		if _, err := s.Sweep(ctx); err != nil && ctx.Err() == nil {
			s.logger().Error("idempotency: sweep failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Sweep runs one pass: it settles, one after the other, at most
// [Sweeper.Batch] abandoned keys, and returns what it did. It stops early,
// with ctx's error, when ctx is done; a key whose Settle was cut short is
// released for the next pass.
func (s *Sweeper) Sweep(ctx context.Context) (SweepResult, error) {
	var res SweepResult
	sw, err := s.check()
	if err != nil {
		return res, err
	}
	grace := cmp.Or(s.Grace, DefaultSweepGrace)
	keys, err := sw.Abandoned(ctx, grace, cmp.Or(s.Batch, DefaultSweepBatch))
	if err != nil {
		return res, err
	}
	res.Found = len(keys)
	for _, k := range keys {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		s.settle(ctx, sw, k, grace, &res)
	}
	if res.Found > 0 {
		s.logger().Info("idempotency: swept abandoned keys", "found", res.Found, "completed", res.Completed,
			"released", res.Released, "left", res.Left, "lost", res.Lost)
	}
	return res, nil
}

// settle takes k over, hands it to Settle and stores the settlement.
func (s *Sweeper) settle(ctx context.Context, sw Sweepable, k KeyInfo, grace time.Duration, res *SweepResult) {
	log := s.logger().With("sweeper", true, "client", k.ClientID, "key", k.Key, "method", k.Method, "path", k.Path,
		"operation", k.OperationID, "found", k.Status)
	lease := cmp.Or(s.LockTimeout, DefaultLockTimeout)
	c, err := sw.Adopt(ctx, k, grace, lease)
	switch {
	case errors.Is(err, ErrFenced):
		res.Lost++
		log.Debug("idempotency: an abandoned key was taken by a retry or another sweeper first")
		return
	case err != nil:
		res.Lost++
		log.Error("idempotency: taking over an abandoned key failed", "err", err)
		return
	}
	s.event(EventSwept)
	detached := context.WithoutCancel(ctx)
	tx, err := s.Store.Begin(ctx, c)
	if err != nil {
		res.Left++
		log.Error("idempotency: opening the unit of work of an abandoned key failed; left for the next sweep", "err", err)
		s.release(detached, c, ReleaseFailed, log)
		return
	}
	st, err := s.call(ctx, c, tx, k, lease, log)
	switch {
	case err != nil:
		res.Left++
		log.Error("idempotency: settling an abandoned key failed; left for the next sweep", "err", err)
		s.abandon(detached, tx, c, ReleaseFailed, log)
	case st.Response != nil && st.Release:
		res.Left++
		log.Error("idempotency: the sweep hook both completed and released a key; left for the next sweep")
		s.abandon(detached, tx, c, ReleaseFailed, log)
	case st.Release:
		if s.abandon(detached, tx, c, ReleaseRejected, log) {
			res.Released++
			s.event(EventSettled)
			log.Info("idempotency: abandoned key released: nothing of its operation took effect")
		} else {
			res.Lost++
		}
	case st.Response != nil:
		resp, ok := s.stored(*st.Response, log)
		if !ok {
			res.Left++
			s.abandon(detached, tx, c, ReleaseFailed, log)
			return
		}
		switch err := tx.Complete(detached, resp); {
		case err == nil:
			res.Completed++
			s.event(EventSettled)
			log.Info("idempotency: abandoned key completed", "status", st.Response.Status)
		case errors.Is(err, ErrFenced):
			res.Lost++
			s.event(EventFenced)
			log.Warn("idempotency: completing an abandoned key was fenced: a retry took it over; its writes were rolled back")
		default:
			res.Left++
			log.Error("idempotency: completing an abandoned key failed; left for the next sweep", "err", err)
			s.abandon(detached, tx, c, ReleaseFailed, log)
		}
	default:
		res.Left++
		log.Warn("idempotency: abandoned key left unsettled for the next sweep")
		s.abandon(detached, tx, c, ReleaseFailed, log)
	}
}

// stored returns what is stored of a settlement's response, by the
// middleware's policy (see [Settlement.Response]), and false when its
// status is not stored.
func (s *Sweeper) stored(resp StoredResponse, log *slog.Logger) (StoredResponse, bool) {
	if !storableStatus(resp.Status, s.StoreServerErrors) {
		log.Warn("idempotency: the sweep hook settled a key with a status that is not stored (a 5xx without StoreServerErrors, a 4xx that rejects a request, or no HTTP status); its writes are rolled back and it is left for the next sweep",
			"status", resp.Status)
		return StoredResponse{}, false
	}
	p, _ := newKeepPolicy(Options{StoredHeaders: s.StoredHeaders}, http.CanonicalHeaderKey(cmp.Or(s.KeyHeader, DefaultKeyHeader)))
	out, dropped := p.settled(resp)
	if len(dropped) > 0 {
		log.Warn("idempotency: the sweep hook's response has headers that are not stored (credentials, the key header, headers StoredHeaders does not keep, or text a store cannot keep): its replays go without them",
			"headers", dropped)
	}
	return out, true
}

// call runs Settle with the claim and its unit of work in its context,
// renewing the lease meanwhile. A panic in Settle is returned as an error.
func (s *Sweeper) call(ctx context.Context, c Claim, tx Tx, k KeyInfo, lease time.Duration, log *slog.Logger) (st Settlement, err error) {
	hctx, cancel := context.WithCancelCause(WithClientID(NewContext(ctx, c, tx), c.ClientID))
	defer cancel(nil)
	lk := keepLease(hctx, s.Store, c, lease, cancel, s.event, log)
	defer lk.stop()
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("idempotency: the sweep hook panicked: %v", p)
		}
	}()
	return s.Settle(hctx, k)
}

// abandon rolls back the unit of work and releases the key; it reports
// whether the release took.
func (s *Sweeper) abandon(ctx context.Context, tx Tx, c Claim, kind ReleaseKind, log *slog.Logger) bool {
	if err := tx.Rollback(ctx); err != nil {
		log.Error("idempotency: rollback failed", "err", err)
	}
	return s.release(ctx, c, kind, log)
}

func (s *Sweeper) release(ctx context.Context, c Claim, kind ReleaseKind, log *slog.Logger) bool {
	switch err := s.Store.Release(ctx, c, kind); {
	case err == nil:
		return true
	case errors.Is(err, ErrFenced):
		log.Warn("idempotency: a retry took the abandoned key over while it was being settled")
	default:
		log.Error("idempotency: releasing an abandoned key failed; it stays started until the sweeper's lease runs out", "err", err)
	}
	return false
}
