package keysql

import (
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// TestPeekDecideAtTheBoundaries moves the database's time across each
// boundary of PeekRow.Decide's rules, a microsecond at a time, as
// PostgreSQL counts: a key expires the microsecond after its expiry
// (expiredExpr's <), a lease runs out the microsecond after locked_at
// plus the lease (staleExpr's <), and the first-sent check compares the
// key's creation with the earliest begin as sent, to the microsecond.
func TestPeekDecideAtTheBoundaries(t *testing.T) {
	base := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	const us = time.Microsecond
	peek := func(status string, lease, retention time.Duration, now time.Time, expires *time.Time) *PeekRow {
		return &PeekRow{Status: status, Fingerprint: []byte("a"), CreatedAt: base.Add(-time.Hour), LockedAt: base,
			RetentionUS: retention.Microseconds(), LeaseUS: lease.Microseconds(), ExpiresAt: expires, Now: now}
	}
	at := func(d time.Duration) *time.Time { t := base.Add(d); return &t }
	req := idempotency.ClaimRequest{Fingerprint: []byte("a")}
	other := idempotency.ClaimRequest{Fingerprint: []byte("b")}
	early := req
	early.FirstSent.EarliestBegin = base.Add(-time.Hour + 500*time.Nanosecond) // sent to the microsecond: the creation
	late := req
	late.FirstSent.EarliestBegin = base.Add(-time.Hour + us)
	for _, tt := range []struct {
		name string
		row  *PeekRow
		req  idempotency.ClaimRequest
		code idempotency.Outcome
		lost bool
	}{
		{"completed, at its expiry", peek("completed", time.Minute, time.Hour, base.Add(time.Hour), nil), req, idempotency.Exists, false},
		{"completed, a microsecond after", peek("completed", time.Minute, time.Hour, base.Add(time.Hour+us), nil), req, idempotency.Exists, true},
		{"expires_at later than the computed expiry", peek("completed", 0, time.Hour, base.Add(time.Hour+us), at(time.Hour+2*us)), req, idempotency.Exists, false},
		{"started, at its expiry", peek("started", time.Minute, time.Hour, base.Add(time.Hour+time.Minute), nil), other, idempotency.Exists, false},
		{"started, a microsecond after", peek("started", time.Minute, time.Hour, base.Add(time.Hour+time.Minute+us), nil), other, idempotency.Exists, true},
		{"started without a lease, never", peek("started", 0, time.Hour, base.Add(1000*time.Hour), at(0)), req, idempotency.Exists, false},
		{"no retention, never", peek("completed", time.Minute, 0, base.Add(1000*time.Hour), at(0)), req, idempotency.Exists, false},
		{"lease running, at its end", peek("started", time.Minute, 0, base.Add(time.Minute), nil), req, idempotency.Exists, false},
		{"lease run out a microsecond ago", peek("started", time.Minute, 0, base.Add(time.Minute+us), nil), req, idempotency.Exists, true},
		{"lease run out, another request", peek("started", time.Minute, 0, base.Add(time.Minute+us), nil), other, idempotency.Exists, false},
		{"released, same request", peek("released", time.Minute, time.Hour, base, nil), req, idempotency.Exists, true},
		{"released, another request", peek("released", time.Minute, time.Hour, base, nil), other, idempotency.Exists, false},
		{"expired, first sent at its creation", peek("completed", 0, time.Hour, base.Add(2*time.Hour), nil), early, idempotency.Refused, false},
		{"expired, first sent after its creation", peek("completed", 0, time.Hour, base.Add(2*time.Hour), nil), late, idempotency.Exists, true},
	} {
		got := tt.row.Decide(tt.req)
		if idempotency.Outcome(got.Code) != tt.code || got.Lost != tt.lost {
			t.Errorf("%s: outcome %d, lost %v; want %d, %v", tt.name, got.Code, got.Lost, tt.code, tt.lost)
		}
	}
	rejected := peek("released", time.Minute, time.Hour, base, nil)
	rejected.Rejected = true
	if got := rejected.Decide(other); !got.Lost {
		t.Error("released as rejected, another request: not lost, want lost (the key is free)")
	}
}
