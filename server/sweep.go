package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// sweepTimes returns the sweeper's grace and the processor timeout of cfg,
// their defaults adapted to each other (see [Config.SweepGrace]), or an
// error for values that contradict each other.
func sweepTimes(cfg Config) (grace, processorTimeout time.Duration, err error) {
	grace, processorTimeout = cfg.SweepGrace, cfg.ProcessorTimeout
	switch {
	case grace < 0 || cfg.SweepInterval < 0 || processorTimeout < 0:
		return 0, 0, fmt.Errorf("server: Config.SweepGrace (%v), SweepInterval (%v) and ProcessorTimeout (%v) must not be negative",
			grace, cfg.SweepInterval, processorTimeout)
	case cfg.NoSweep || cfg.NoIdempotency:
		return 0, cmp.Or(processorTimeout, DefaultProcessorTimeout), nil
	case grace > 0 && processorTimeout > 0 && grace < processorTimeout:
		return 0, 0, fmt.Errorf("server: Config.SweepGrace %v is shorter than Config.ProcessorTimeout %v: "+
			"the sweeper could find no charge for a payment whose charge call is still running, and release its key", grace, processorTimeout)
	case grace == 0:
		processorTimeout = cmp.Or(processorTimeout, DefaultProcessorTimeout)
		grace = max(idempotency.DefaultSweepGrace, processorTimeout)
	case processorTimeout == 0:
		processorTimeout = min(DefaultProcessorTimeout, grace)
	}
	return grace, processorTimeout, nil
}

// newSweeper returns the sweeper of the payments API on cfg's key store,
// or nil when cfg has none or the store cannot be swept.
func newSweeper(cfg Config, keys idempotency.Store, api *payments, grace time.Duration, log *slog.Logger, m *Metrics) *idempotency.Sweeper {
	if cfg.NoSweep || cfg.NoIdempotency {
		return nil
	}
	if _, ok := keys.(idempotency.Sweepable); !ok {
		log.Warn("server: the key store does not implement idempotency.Sweepable: abandoned payments are not swept",
			"store", fmt.Sprintf("%T", cfg.Storage.Keys))
		return nil
	}
	return &idempotency.Sweeper{
		Store:  keys, // sealed, when the stored responses are
		Settle: api.settle,
		// As the Middleware's (see New).
		StoreServerErrors: cfg.StoreServerErrors,
		Grace:             grace,
		Interval:          cfg.SweepInterval,
		LockTimeout:       max(cfg.LockTimeout, 0),
		Logger:            log,
		OnEvent:           m.Observe,
	}
}

// errNoSweeper is returned by Sweep on a server without a sweeper.
var errNoSweeper = errors.New("server: no sweeper (Config.NoSweep, Config.NoIdempotency, or a key store without idempotency.Sweepable)")

// Sweep runs one pass of the sweeper (see [idempotency.Sweeper.Sweep]):
// it settles the payments abandoned for [Config.SweepGrace], and returns
// what it did.
func (s *Server) Sweep(ctx context.Context) (idempotency.SweepResult, error) {
	if s.sweeper == nil {
		return idempotency.SweepResult{}, errNoSweeper
	}
	return s.sweeper.Sweep(ctx)
}
