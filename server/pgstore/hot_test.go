package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// expiry returns when cli_a's key starts counting as absent, as every
// statement of the store computes it; nil for never.
func expiry(t *testing.T, pool *pgxpool.Pool, key string) *time.Time {
	t.Helper()
	var at *time.Time
	err := pool.QueryRow(context.Background(), `
		SELECT CASE WHEN retention_us > 0 AND (status <> 'started' OR lease_us > 0)
			THEN greatest(expires_at, locked_at + (retention_us
				+ CASE WHEN status = 'started' THEN lease_us ELSE 0 END) * interval '1 microsecond') END
		FROM idempotency_keys WHERE client_id = 'cli_a' AND idempotency_key = $1`, key).Scan(&at)
	if err != nil {
		t.Fatal(err)
	}
	return at
}

// TestFinishKeepsExpiresAt completes and releases keys a while after their
// claim, with a lease and without: each expires its retention after it
// finished, exactly, with locked_at the time it finished, and expires_at
// (the purge's index) as the claim wrote it. A replica of the previous
// release that completes a key this one claimed (during a rolling upgrade)
// keeps the retention exact too.
func TestFinishKeepsExpiresAt(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	const lease, keep = time.Minute, time.Hour
	for _, tt := range []struct {
		name    string
		lease   time.Duration
		release bool
		inTx    bool // the handler wrote through the transaction
		keeps   bool // expires_at stays as it was
		// completed by a replica of the previous release, which sets
		// expires_at to the expiry and leaves locked_at
		previous bool
	}{
		{"completed", lease, false, false, true, false},
		{"completed with writes", lease, false, true, true, false},
		{"released", lease, true, false, true, false},
		{"no lease", 0, false, false, true, false},
		{"completed by the previous release", lease, false, false, false, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			key := "key-" + tt.name
			c := mustClaim(t, s, leased(req(key, "a"), tt.lease, keep), idempotency.Claimed).Claim
			elapse(t, pool, key, time.Second) // claimed a second ago
			claimed, _ := readKey(t, pool, key)
			var err error
			switch {
			case tt.previous:
				_, err = pool.Exec(ctx, previousCompleteSQL, c.ClientID, c.Key, c.Token, 201, "application/json", nil, []byte(`{}`))
			case tt.release:
				err = s.Release(ctx, c, idempotency.ReleaseFailed)
			default:
				var tx idempotency.Tx
				tx, err = s.Begin(ctx, c)
				if err == nil && tt.inTx {
					err = write(idempotency.NewContext(ctx, c, tx), "w-"+key)
				}
				if err == nil {
					err = tx.Complete(ctx, created(key))
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			done, _ := readKey(t, pool, key)
			finished := done.lockedAt
			if tt.previous {
				finished = done.expiresAt.Add(-keep) // the previous release's expiry
			}
			if !finished.After(claimed.lockedAt) {
				t.Errorf("finished at %v, want later than the claim's %v", finished, claimed.lockedAt)
			}
			if got := expiry(t, pool, key); got == nil || got.Sub(finished) != keep {
				t.Errorf("expiry %v, want the retention after it finished, %v, exactly", got, finished)
			}
			kept := claimed.expiresAt != nil && done.expiresAt != nil && done.expiresAt.Equal(*claimed.expiresAt)
			if kept != tt.keeps {
				t.Errorf("expires_at %v after finishing, %v after the claim; kept = %v, want %v",
					done.expiresAt, claimed.expiresAt, kept, tt.keeps)
			}
		})
	}
}

// previousCompleteSQL is completeSQL of the previous release, which set
// expires_at to the expiry and left locked_at alone.
const previousCompleteSQL = `
UPDATE idempotency_keys SET
    status = 'completed',
    response_status = $4,
    response_content_type = $5,
    response_headers = $6,
    response_body = $7,
    expires_at = CASE WHEN retention_us > 0 THEN statement_timestamp() + retention_us * interval '1 microsecond' END
WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'`

// TestFinishIsHOT renews, completes (with and without the handler's
// writes) and releases keys on a table from plain Migrate, then reads from
// PostgreSQL's statistics that every one of these updates of the key table
// was HOT: none added an index entry (there is room on the pages of a
// small table). A completion that set expires_at, as before, was not.
func TestFinishIsHOT(t *testing.T) {
	updated, hot := finishUpdates(t, migratedPool(t, nil))
	if hot != updated {
		t.Errorf("updates of the key table: %d, %d of them HOT; want all HOT", updated, hot)
	}
}

// TestOpenKeysIndexMakesNoUpdateHOT is TestFinishIsHOT's converse: with
// the open keys' index (CreateOpenKeysIndex), which is on locked_at for
// the keys whose status is not completed, none of these updates is HOT.
// PostgreSQL makes no update HOT that changes a column an index reads, in
// its key or its predicate, and a renewal, a completion and a release all
// do. (Leaving the other indexes' columns unchanged still lets PostgreSQL
// delete their stale entries bottom-up.)
func TestOpenKeysIndexMakesNoUpdateHOT(t *testing.T) {
	pool := migratedPool(t, nil)
	if err := pgstore.CreateOpenKeysIndex(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	if updated, hot := finishUpdates(t, pool); hot != 0 {
		t.Errorf("updates of the key table with the open keys' index: %d, %d of them HOT; want none HOT", updated, hot)
	}
}

// finishUpdates renews, completes (with and without the handler's writes)
// and releases keys on pool, which it closes, and returns the updates of
// the key table that PostgreSQL's statistics count and how many were HOT;
// it fails the test unless it counts all of them.
func finishUpdates(t *testing.T, pool *pgxpool.Pool) (updated, hot int64) {
	t.Helper()
	ctx := context.Background()
	dsn := pool.Config().ConnString()
	s := pgstore.New(pool)
	const n = 6
	for i := range n {
		key := fmt.Sprint("key-", i)
		c := mustClaim(t, s, leased(req(key, "a"), time.Minute, time.Hour), idempotency.Claimed).Claim
		if err := s.Renew(ctx, c); err != nil {
			t.Fatal(err)
		}
		switch i % 3 {
		case 0:
			mustComplete(t, s, c, "w-"+key)
		case 1:
			tx, err := s.Begin(ctx, c)
			if err == nil {
				err = tx.Complete(ctx, created(key))
			}
			if err != nil {
				t.Fatal(err)
			}
		case 2:
			if err := s.Release(ctx, c, idempotency.ReleaseRejected); err != nil {
				t.Fatal(err)
			}
		}
	}
	pool.Close() // the backends end, and report their statistics
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	const want = 2 * n // a renewal and a completion or a release each
	for deadline := time.Now().Add(time.Minute); ; {
		err := conn.QueryRow(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
			WHERE relid = 'idempotency_keys'::regclass`).Scan(&updated, &hot)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		if updated >= want || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if updated != want {
		t.Fatalf("updates of the key table: %d, want %d", updated, want)
	}
	return updated, hot
}
