package pgstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// TestPeekDecidesAsTheClaimReads writes a key's row in each combination of
// status, lease, retention, age of its last claim or renewal, expires_at
// and fingerprint, and checks that what a retry's read decides of it in Go
// (keysql.PeekRow.Decide) is what keysql.ClaimReadSQL, whose rules are
// SQL, returns for the same request, for requests with each first-sent
// check: the same outcome, and the same flag for a row to renew. The times
// lie far from every boundary, which keysql's own test moves across.
func TestPeekDecidesAsTheClaimReads(t *testing.T) {
	ctx := context.Background()
	_, pool := newStore(t, nil)
	var now time.Time
	if err := pool.QueryRow(ctx, `SELECT statement_timestamp()`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	type row struct {
		status           string
		rejected         bool
		lease, retention time.Duration
		age              time.Duration // since its last claim, renewal or finish
		expires          string
		hash             string
	}
	var rows []row
	for _, st := range []struct {
		status   string
		rejected bool
	}{{"started", false}, {"completed", false}, {"released", false}, {"released", true}} {
		for _, lease := range []time.Duration{0, time.Minute} {
			for _, keep := range []time.Duration{0, time.Hour} {
				for _, age := range []time.Duration{time.Second, 2 * time.Minute, 2 * time.Hour} {
					for _, exp := range []string{"none", "past", "future", "claim"} {
						for _, hash := range []string{"a", "b"} {
							rows = append(rows, row{st.status, st.rejected, lease, keep, age, exp, hash})
						}
					}
				}
			}
		}
	}
	for i, r := range rows {
		locked := now.Add(-r.age)
		created := locked.Add(-10 * time.Minute)
		var expires *time.Time
		switch r.expires {
		case "past":
			at := now.Add(-24 * time.Hour)
			expires = &at
		case "future":
			at := now.Add(24 * time.Hour)
			expires = &at
		case "claim":
			at := created.Add(r.retention)
			expires = &at
		}
		var status *int
		if r.status == "completed" {
			status = new(int)
			*status = 201
		}
		if _, err := pool.Exec(ctx, `INSERT INTO idempotency_keys (client_id, idempotency_key, request_method,
			request_path, request_hash, status, operation_id, lock_token, release_rejected, response_status,
			created_at, locked_at, lease_us, retention_us, expires_at)
			VALUES ('cli_a', $1, 'POST', '/v1/orders', $2, $3, gen_random_uuid(), 7, $4, $5, $6, $7, $8, $9, $10)`,
			fmt.Sprint("key-", i), []byte(r.hash), r.status, r.rejected, status, created, locked,
			r.lease.Microseconds(), r.retention.Microseconds(), expires); err != nil {
			t.Fatal(err)
		}
	}
	checks := []struct {
		name  string
		check idempotency.FirstSentCheck
	}{
		{"no first-sent time", idempotency.FirstSentCheck{}},
		{"stale", idempotency.FirstSentCheck{Stale: true}},
		{"first sent before the key began", idempotency.FirstSentCheck{EarliestBegin: now.Add(-3 * time.Hour)}},
		{"first sent after the key began", idempotency.FirstSentCheck{EarliestBegin: now.Add(time.Hour)}},
	}
	decided := map[string]int{}
	for i, r := range rows {
		for _, c := range checks {
			q := req(fmt.Sprint("key-", i), "a")
			q.FirstSent = c.check
			var want keysql.ClaimRow
			if err := pool.QueryRow(ctx, keysql.ClaimReadSQL, keysql.ClaimArgs(q)...).Scan(want.Dests(&want.RespHeader)...); err != nil {
				t.Fatalf("%+v: ClaimReadSQL: %v", r, err)
			}
			var peek keysql.PeekRow
			if err := pool.QueryRow(ctx, keysql.ClaimPeekSQL, keysql.PeekArgs(q)...).Scan(peek.Dests(&peek.RespHeader)...); err != nil {
				t.Fatalf("%+v: ClaimPeekSQL: %v", r, err)
			}
			got := peek.Decide(q)
			if got.Code != want.Code || got.Lost != want.Lost {
				t.Errorf("%+v, %s: the peek decides outcome %d, lost %v; ClaimReadSQL %d, %v",
					r, c.name, got.Code, got.Lost, want.Code, want.Lost)
			}
			decided[fmt.Sprint(want.Code, want.Lost)]++
		}
	}
	// Every answer the rules can give was among the cases.
	for _, k := range []string{"3 false", "3 true", "4 false"} {
		if decided[k] == 0 {
			t.Errorf("no case where ClaimReadSQL answers %s; cases by answer: %v", k, decided)
		}
	}
}
