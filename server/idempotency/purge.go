package idempotency

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math"
	"time"
)

// Defaults of [Purger].
const (
	DefaultPurgeInterval = time.Minute // [Purger.Interval]
	DefaultPurgeBatch    = 500         // [Purger.Batch]
	// DefaultPurgeDutyCycle is the share of its time a purge spends
	// deleting while it works through a backlog; see
	// [Purger.DutyCycle].
	DefaultPurgeDutyCycle = 0.25
)

// Purger deletes expired keys from a [Store] in bounded batches, paced so
// that a large backlog hardly slows the requests running meanwhile. The pace
// only bounds how large the table grows, never what a request sees: an
// expired key counts as absent on lookup whether or not it has been deleted
// yet. Run one per process (or one per database: purges of several
// processes share the work safely, each batch deleting keys no other batch
// holds).
//
// Only Store is required; every other zero field takes the default it
// documents, applied at use. A Purger is safe for concurrent use, though
// one [Purger.Run] per process is all it needs.
type Purger struct {
	// Store is the store to purge. It is required.
	Store Store
	// Interval is how often [Purger.Run] purges. If zero,
	// [DefaultPurgeInterval] (1m) is used.
	Interval time.Duration
	// Batch caps the keys deleted by one [Store.Purge] call; a purge runs
	// batches until one comes back short. A smaller batch is a shorter
	// burst of deletes (and of WAL, on PostgreSQL) that the requests
	// running at the same time wait behind. If zero, [DefaultPurgeBatch]
	// (500) is used.
	Batch int
	// DutyCycle is the share of time, in (0, 1], that a purge working
	// through a backlog spends deleting: after each full batch, which took
	// d, it pauses d × (1 − DutyCycle) / DutyCycle before the next, so
	// the pauses grow when the database is slow and the purge yields to
	// the requests; it does not pause after the last, short batch. If
	// zero, [DefaultPurgeDutyCycle] (0.25, a pause of three times each
	// batch) is used; 1 runs the batches back to back.
	DutyCycle float64
	// Logger receives a line per purge that deleted keys (Info) and the
	// failures (Error). If nil, [slog.Default] is used.
	Logger *slog.Logger
	// OnPurged, if not nil, is called after each batch with the number of
	// keys it deleted, for metrics.
	OnPurged func(n int64)

	// The pacing's clock and pause; test seams, nil in production.
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) error
}

// check returns the error of a Purger that cannot run.
func (p *Purger) check() error {
	switch {
	case p.Store == nil:
		return fmt.Errorf("idempotency: Purger.Store is nil")
	case p.Interval < 0 || p.Batch < 0:
		return fmt.Errorf("idempotency: Purger.Interval (%v) and Purger.Batch (%d) must not be negative", p.Interval, p.Batch)
	case p.DutyCycle != 0 && !(p.DutyCycle > 0 && p.DutyCycle <= 1):
		return fmt.Errorf("idempotency: Purger.DutyCycle %v is not in (0, 1]", p.DutyCycle)
	}
	return nil
}

// Run purges at once, then every [Purger.Interval], until ctx is done, and
// then returns nil. A purge that fails is logged and tried again at the
// next tick. It returns an error at once only for a Purger that cannot run
// (no Store, a negative Interval or Batch, a DutyCycle out of range).
func (p *Purger) Run(ctx context.Context) error {
	if err := p.check(); err != nil {
		return err
	}
	t := time.NewTicker(cmp.Or(p.Interval, DefaultPurgeInterval))
	defer t.Stop()
	for {
		if _, err := p.Purge(ctx); err != nil && ctx.Err() == nil {
			p.logger().Error("idempotency: purge failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (p *Purger) logger() *slog.Logger { return cmp.Or(p.Logger, slog.Default()) }

// Purge deletes the expired keys, one bounded batch at a time, until a
// batch comes back short, and returns how many it deleted. Between two
// batches it pauses in proportion to the time the last one took
// ([Purger.DutyCycle]). It returns early, with ctx's error, when ctx is
// done.
func (p *Purger) Purge(ctx context.Context) (int64, error) {
	if err := p.check(); err != nil {
		return 0, err
	}
	batch := cmp.Or(p.Batch, DefaultPurgeBatch)
	duty := cmp.Or(p.DutyCycle, DefaultPurgeDutyCycle)
	now, sleep := p.now, p.sleep
	if now == nil {
		now = time.Now
	}
	if sleep == nil {
		sleep = sleepCtx
	}
	var total int64
	var paused time.Duration
	for batches := 1; ; batches++ {
		start := now()
		n, err := p.Store.Purge(ctx, batch)
		took := now().Sub(start)
		total += n
		if p.OnPurged != nil {
			p.OnPurged(n)
		}
		if err != nil {
			return total, err
		}
		if n < int64(batch) {
			if total > 0 {
				p.logger().Info("idempotency: purged expired keys", "keys", total, "batches", batches, "paused", paused)
			}
			return total, nil
		}
		pause := purgePause(took, duty)
		if err := sleep(ctx, pause); err != nil {
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
