package server

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/idemkit/idem/server/idempotency"
)

// Metrics holds the counters of one server, served on /metrics in the
// Prometheus text exposition format (version 0.0.4):
//
//	idem_keys_claimed_total        keys claimed by a first request (or after expiry or release)
//	idem_keys_taken_over_total     started keys taken over once their lease ran out
//	idem_keys_completed_total      outcomes stored with their business writes
//	idem_replays_total             stored outcomes replayed to a retry
//	idem_conflicts_total           409s: the key's first request was still running
//	idem_mismatches_total          422s: a key reused with another request
//	idem_keys_released_total       keys freed after an outcome that is not stored
//	idem_completions_fenced_total  completions rolled back because of a takeover
//	idem_requests_rejected_total   keyed requests refused before the claim (400, 401, 413, 415)
//	idem_leases_renewed_total      leases of running requests renewed
//	idem_leases_lost_total         running requests whose key was taken over
//	idem_keys_purged_total         expired keys deleted by the purge job
//	idem_keys_swept_total          abandoned keys the sweeper took over and handed to its hook
//	idem_keys_settled_total        abandoned keys the sweeper settled: completed from a charge, or released
//	idem_keys_force_released_total keys released by an operator
//	idem_keys_expired_by_operator_total keys expired by an operator
//	idem_processor_charges_total   charges of the fake card processor, by result
//	idem_db_round_trips_total      round trips to PostgreSQL, by kind (with [Config.DBRoundTrips])
//
// and, when the key store implements [idempotency.Inspector], gauges of the
// keys that are not finished, counted at each scrape by one query (on
// PostgreSQL, a walk of the index of those keys):
//
//	idem_keys_running                     keys whose request runs
//	idem_keys_running_oldest_age_seconds  age of the operation of the oldest running key
//	idem_keys_lapsed                      started keys whose owner died, not yet taken over
//	idem_keys_released_failed             keys released after a failure, awaiting a retry or the sweeper
//
// They are counters of this server alone, not of the process (several
// servers may share one, as tests do), so the Prometheus client library,
// its registry and its runtime collectors are not needed: the format of a
// few counters is written here. A Metrics is safe for concurrent use.
type Metrics struct {
	events  map[idempotency.Event]*atomic.Int64
	purged  atomic.Int64
	charges sync.Map // result → *atomic.Int64
	trips   *DBRoundTrips
	order   []family
	// keyStats counts the keys behind the gauges; nil: no gauges.
	keyStats func(context.Context) (idempotency.KeyStats, error)
}

// family is one counter as /metrics shows it: a name, its help, and its
// samples by label value ("" for none).
type family struct {
	name, help, label string
	samples           func() map[string]int64
}

// NewMetrics returns zeroed counters.
func NewMetrics() *Metrics {
	m := &Metrics{events: make(map[idempotency.Event]*atomic.Int64)}
	event := func(e idempotency.Event, name, help string) {
		c := new(atomic.Int64)
		m.events[e] = c
		m.order = append(m.order, family{name: name, help: help, samples: func() map[string]int64 { return map[string]int64{"": c.Load()} }})
	}
	event(idempotency.EventClaimed, "idem_keys_claimed_total", "Idempotency keys claimed by a first request, or after expiry or release.")
	event(idempotency.EventTookOver, "idem_keys_taken_over_total", "Started idempotency keys taken over once their lease ran out.")
	event(idempotency.EventCompleted, "idem_keys_completed_total", "Outcomes stored together with their business writes.")
	event(idempotency.EventReplayed, "idem_replays_total", "Stored outcomes replayed to a retry.")
	event(idempotency.EventConflict, "idem_conflicts_total", "Requests answered 409 because the key's first request was still running.")
	event(idempotency.EventMismatch, "idem_mismatches_total", "Requests answered 422 because the key was used with another request.")
	event(idempotency.EventReleased, "idem_keys_released_total", "Keys released after an outcome that is not stored.")
	event(idempotency.EventFenced, "idem_completions_fenced_total", "Completions rolled back because the request was taken over.")
	event(idempotency.EventRejected, "idem_requests_rejected_total", "Keyed requests refused before the claim (400, 401, 413, 415).")
	event(idempotency.EventRenewed, "idem_leases_renewed_total", "Leases of running requests renewed.")
	event(idempotency.EventLeaseLost, "idem_leases_lost_total", "Running requests whose key was taken over (their renewals stopped reaching the store); their handler was cancelled.")
	event(idempotency.EventCancelled, "idem_requests_cancelled_total", "Keyed requests whose context ended (a deadline, a shutdown) before their handler answered; answered 503, nothing stored.")
	event(idempotency.EventExpiredRetry, "idem_expired_retries_total", "Retries first sent longer ago than their key is kept, whose key was gone or expired: answered 410, not run.")
	event(idempotency.EventSwept, "idem_keys_swept_total", "Abandoned keys the sweeper took over and handed to its hook.")
	event(idempotency.EventSettled, "idem_keys_settled_total", "Abandoned keys the sweeper settled: completed from the processor's charge, or released.")
	event(idempotency.EventForceReleased, "idem_keys_force_released_total", "Keys released by an operator.")
	event(idempotency.EventExpired, "idem_keys_expired_by_operator_total", "Keys expired by an operator.")
	m.order = append(m.order,
		family{name: "idem_keys_purged_total", help: "Expired idempotency keys deleted by the purge job.",
			samples: func() map[string]int64 { return map[string]int64{"": m.purged.Load()} }},
		family{name: "idem_processor_charges_total", label: "result",
			help: "Charge requests of the fake card processor, by result (created, replayed, failed, lost, mismatch, rejected).",
			samples: func() map[string]int64 {
				out := make(map[string]int64)
				m.charges.Range(func(k, v any) bool {
					out[k.(string)] = v.(*atomic.Int64).Load()
					return true
				})
				return out
			}},
	)
	return m
}

// countRoundTrips adds the counts of trips to the metrics, as
// idem_db_round_trips_total. Call it before the metrics are served.
func (m *Metrics) countRoundTrips(trips *DBRoundTrips) {
	m.trips = trips
	m.order = append(m.order, family{name: "idem_db_round_trips_total", label: "kind",
		help: "Round trips to PostgreSQL made by the server's pool, by kind (query, batch, prepare, connect).",
		samples: func() map[string]int64 {
			return map[string]int64{"query": trips.query.Load(), "batch": trips.batch.Load(),
				"prepare": trips.prepare.Load(), "connect": trips.connect.Load()}
		}})
}

// Observe counts one event; it fits [idempotency.Options.OnEvent].
func (m *Metrics) Observe(e idempotency.Event) {
	if c, ok := m.events[e]; ok {
		c.Add(1)
	}
}

// AddPurged counts keys deleted by the purge job; it fits
// [idempotency.Purger.OnPurged].
func (m *Metrics) AddPurged(n int64) { m.purged.Add(n) }

// observeCharge counts one charge request of the fake processor.
func (m *Metrics) observeCharge(result string) {
	c, _ := m.charges.LoadOrStore(result, new(atomic.Int64))
	c.(*atomic.Int64).Add(1)
}

// Counter returns the value of the counter name, summed over its labels,
// and whether there is such a counter.
func (m *Metrics) Counter(name string) (float64, bool) {
	for _, f := range m.order {
		if f.name == name {
			var sum int64
			for _, v := range f.samples() {
				sum += v
			}
			return float64(sum), true
		}
	}
	return 0, false
}

// Handler serves the counters in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var b strings.Builder
		for _, f := range m.order {
			fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s counter\n", f.name, f.help, f.name)
			samples := f.samples()
			for _, v := range slices.Sorted(maps.Keys(samples)) {
				if f.label == "" {
					fmt.Fprintf(&b, "%s %d\n", f.name, samples[v])
				} else {
					fmt.Fprintf(&b, "%s{%s=%s} %d\n", f.name, f.label, strconv.Quote(v), samples[v])
				}
			}
		}
		m.writeKeyGauges(r.Context(), &b)
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		w.Write([]byte(b.String()))
	})
}
