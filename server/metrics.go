package server

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemkit/idem/server/idempotency"
)

// Metrics holds the Prometheus counters of one server on a registry of its
// own, not the global one, so a process (a test) can run many servers. The
// counters are:
//
//	idem_keys_claimed_total        keys claimed by a first request (or after expiry or release)
//	idem_keys_taken_over_total     started keys taken over once their lease ran out
//	idem_keys_completed_total      outcomes stored with their business writes
//	idem_replays_total             stored outcomes replayed to a retry
//	idem_conflicts_total           409s: the key's first request was still running
//	idem_mismatches_total          422s: a key reused with another request
//	idem_keys_released_total       keys freed after an outcome that is not stored
//	idem_completions_fenced_total  completions rolled back because of a takeover
//	idem_requests_rejected_total   keyed requests refused before the claim (400, 401, 413)
//	idem_leases_renewed_total      leases of running requests renewed
//	idem_leases_lost_total         running requests whose key was taken over
//	idem_keys_purged_total         expired keys deleted by the purge job
//	idem_processor_charges_total   charges of the fake card processor, by result
//	idem_db_round_trips_total      round trips to PostgreSQL, by kind (with [Config.DBRoundTrips])
//
// plus the Go runtime and process collectors. A Metrics is safe for
// concurrent use.
type Metrics struct {
	registry *prometheus.Registry
	events   map[idempotency.Event]prometheus.Counter
	purged   prometheus.Counter
	charges  *prometheus.CounterVec
}

// NewMetrics returns counters registered on a new registry.
func NewMetrics() *Metrics {
	m := &Metrics{registry: prometheus.NewRegistry(), events: make(map[idempotency.Event]prometheus.Counter)}
	counter := func(name, help string) prometheus.Counter {
		c := prometheus.NewCounter(prometheus.CounterOpts{Namespace: "idem", Name: name, Help: help})
		m.registry.MustRegister(c)
		return c
	}
	m.events[idempotency.EventClaimed] = counter("keys_claimed_total", "Idempotency keys claimed by a first request, or after expiry or release.")
	m.events[idempotency.EventTookOver] = counter("keys_taken_over_total", "Started idempotency keys taken over once their lease ran out.")
	m.events[idempotency.EventCompleted] = counter("keys_completed_total", "Outcomes stored together with their business writes.")
	m.events[idempotency.EventReplayed] = counter("replays_total", "Stored outcomes replayed to a retry.")
	m.events[idempotency.EventConflict] = counter("conflicts_total", "Requests answered 409 because the key's first request was still running.")
	m.events[idempotency.EventMismatch] = counter("mismatches_total", "Requests answered 422 because the key was used with another request.")
	m.events[idempotency.EventReleased] = counter("keys_released_total", "Keys released after an outcome that is not stored.")
	m.events[idempotency.EventFenced] = counter("completions_fenced_total", "Completions rolled back because the request was taken over.")
	m.events[idempotency.EventRejected] = counter("requests_rejected_total", "Keyed requests refused before the claim (400, 401, 413).")
	m.events[idempotency.EventRenewed] = counter("leases_renewed_total", "Leases of running requests renewed.")
	m.events[idempotency.EventLeaseLost] = counter("leases_lost_total", "Running requests whose key was taken over (their renewals stopped reaching the store); their handler was cancelled.")
	m.purged = counter("keys_purged_total", "Expired idempotency keys deleted by the purge job.")
	m.charges = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "idem", Name: "processor_charges_total",
		Help: "Charge requests of the fake card processor, by result (created, replayed, failed, mismatch).",
	}, []string{"result"})
	m.registry.MustRegister(m.charges,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Observe counts one event; it fits [idempotency.Options.OnEvent].
func (m *Metrics) Observe(e idempotency.Event) {
	if c, ok := m.events[e]; ok {
		c.Inc()
	}
}

// AddPurged counts keys deleted by the purge job.
func (m *Metrics) AddPurged(n int64) { m.purged.Add(float64(n)) }

// observeCharge counts one charge request of the fake processor.
func (m *Metrics) observeCharge(result string) { m.charges.WithLabelValues(result).Inc() }

// Registry returns the registry the counters are on, to add more
// collectors or to gather them in tests.
func (m *Metrics) Registry() *prometheus.Registry { return m.registry }

// Handler serves the counters in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{Registry: m.registry})
}
