package server

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// keyStatsTimeout bounds the query behind the key gauges of one scrape.
const keyStatsTimeout = 2 * time.Second

// watchKeys makes /metrics serve gauges of the keys that are not finished,
// counted by stats at each scrape. Call it before the metrics are served.
func (m *Metrics) watchKeys(stats func(context.Context) (idempotency.KeyStats, error)) {
	m.keyStats = stats
}

// writeKeyGauges writes the key gauges, counted now; when they cannot be
// counted, it writes a comment saying why, and no gauge.
func (m *Metrics) writeKeyGauges(ctx context.Context, b *strings.Builder) {
	if m.keyStats == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, keyStatsTimeout)
	defer cancel()
	st, err := m.keyStats(ctx)
	if err != nil {
		fmt.Fprintf(b, "# idem_keys_* gauges unavailable: %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
		return
	}
	gauge := func(name, help string, v any) {
		fmt.Fprintf(b, "# HELP %s %s\n# TYPE %s gauge\n%s %v\n", name, help, name, name, v)
	}
	gauge("idem_keys_running", "Idempotency keys whose request is running (started, lease live).", st.Running)
	gauge("idem_keys_running_oldest_age_seconds",
		"How long ago the operation of the oldest running key began; 0 when none runs.", st.OldestRunning.Seconds())
	gauge("idem_keys_lapsed",
		"Started keys whose lease ran out (their owner died), not yet taken over by a retry or the sweeper, nor expired.", st.Lapsed)
	gauge("idem_keys_released_failed",
		"Keys released after a failure, awaiting the retry of their request or the sweeper, not yet expired.", st.ReleasedFailed)
}
