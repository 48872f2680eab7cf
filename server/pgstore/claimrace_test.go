package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// The claimers of a claim race: the request that made the key
// (fingerprint a) and another request (b).
type raceVariant struct {
	name string
	body string
}

var (
	variantA = raceVariant{"a", "a"}
	variantB = raceVariant{"b", "b"}
)

// raceLease and raceKeep are the lease and retention of every claim of the
// race test: long enough that no key goes stale or expires by itself
// during a round, however slow the machine. Stale and expired keys are
// made so by SQL.
const (
	raceLease = time.Minute
	raceKeep  = time.Hour
)

// raceRequest is the claim request of variant v for key.
func raceRequest(key string, v raceVariant) idempotency.ClaimRequest {
	return leased(req(key, v.body), raceLease, raceKeep)
}

// raceState is a starting state of the key raced for: how to make it, and
// what the contract says a claim of each variant does with it.
type raceState struct {
	name    string
	prepare func(t *testing.T, s *pgstore.Store, pool *pgxpool.Pool, key string)
	// canWin: the variant's claim would get Claimed or TookOver alone.
	canWin func(v raceVariant) bool
	// outcome of the winner.
	outcome idempotency.Outcome
	// keepsOp: the winner of the variant keeps the key's operation ID
	// (and creation time); otherwise it begins its own request's
	// (idempotency.ClaimRequest.OperationID), created now.
	keepsOp func(v raceVariant) bool
}

// raceRow is a key's row as the race test reads it.
type raceRow struct {
	present     bool
	status      string
	token       int64
	operationID string
	fingerprint []byte
	createdAt   time.Time
	lockedAt    time.Time
	leaseUS     int64
	keepUS      int64
	respStatus  *int32
}

func readRaceRow(t *testing.T, pool *pgxpool.Pool, key string) raceRow {
	t.Helper()
	r := raceRow{present: true}
	err := pool.QueryRow(context.Background(), `
		SELECT status, lock_token, operation_id::text, request_hash,
			created_at, locked_at, lease_us, retention_us, response_status
		FROM idempotency_keys WHERE client_id = 'cli_a' AND idempotency_key = $1`, key).
		Scan(&r.status, &r.token, &r.operationID, &r.fingerprint,
			&r.createdAt, &r.lockedAt, &r.leaseUS, &r.keepUS, &r.respStatus)
	if errors.Is(err, pgx.ErrNoRows) {
		return raceRow{}
	}
	require.NoError(t, err)
	return r
}

// setRow runs an UPDATE of key's row (a SET clause) and requires it to
// change the row.
func setRow(t *testing.T, pool *pgxpool.Pool, key, set string) {
	t.Helper()
	tag, err := pool.Exec(context.Background(),
		`UPDATE idempotency_keys SET `+set+` WHERE client_id = 'cli_a' AND idempotency_key = $1`, key)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
}

// claimA claims key afresh with variant a.
func claimA(t *testing.T, s *pgstore.Store, key string) idempotency.Claim {
	t.Helper()
	return mustClaim(t, s, raceRequest(key, variantA), idempotency.Claimed).Claim
}

func releaseA(t *testing.T, s *pgstore.Store, key string, kind idempotency.ReleaseKind) {
	t.Helper()
	require.NoError(t, s.Release(context.Background(), claimA(t, s, key), kind))
}

// stale makes a started key's lease run out by its stored lease (one
// minute), its retention still ahead.
const staleSQL = `locked_at = now() - interval '2 minutes', expires_at = now() + interval '1 hour'`

// expired makes a key expired: its last claim or renewal (locked_at) and
// its expiry are both past its stored lease and retention (one minute, one
// hour), as they are for a key that expired with time.
const expiredSQL = `locked_at = now() - interval '2 hours', expires_at = now() - interval '1 second'`

func raceStates() []raceState {
	all := func(raceVariant) bool { return true }
	none := func(raceVariant) bool { return false }
	onlyA := func(v raceVariant) bool { return v == variantA }
	return []raceState{
		{name: "absent", prepare: func(*testing.T, *pgstore.Store, *pgxpool.Pool, string) {},
			canWin: all, outcome: idempotency.Claimed, keepsOp: none},
		{name: "started live", prepare: func(t *testing.T, s *pgstore.Store, _ *pgxpool.Pool, key string) {
			claimA(t, s, key)
		}, canWin: none},
		{name: "started stale", prepare: func(t *testing.T, s *pgstore.Store, pool *pgxpool.Pool, key string) {
			claimA(t, s, key)
			setRow(t, pool, key, staleSQL)
		}, canWin: onlyA, outcome: idempotency.TookOver, keepsOp: all},
		{name: "completed", prepare: func(t *testing.T, s *pgstore.Store, _ *pgxpool.Pool, key string) {
			mustComplete(t, s, claimA(t, s, key))
		}, canWin: none},
		{name: "released rejected", prepare: func(t *testing.T, s *pgstore.Store, _ *pgxpool.Pool, key string) {
			releaseA(t, s, key, idempotency.ReleaseRejected)
		}, canWin: all, outcome: idempotency.Claimed,
			keepsOp: func(v raceVariant) bool { return v.body == "a" }},
		{name: "released failed", prepare: func(t *testing.T, s *pgstore.Store, _ *pgxpool.Pool, key string) {
			releaseA(t, s, key, idempotency.ReleaseFailed)
		}, canWin: onlyA, outcome: idempotency.Claimed, keepsOp: all},
		{name: "expired completed", prepare: func(t *testing.T, s *pgstore.Store, pool *pgxpool.Pool, key string) {
			mustComplete(t, s, claimA(t, s, key))
			setRow(t, pool, key, expiredSQL)
		}, canWin: all, outcome: idempotency.Claimed, keepsOp: none},
		{name: "expired stale", prepare: func(t *testing.T, s *pgstore.Store, pool *pgxpool.Pool, key string) {
			claimA(t, s, key)
			setRow(t, pool, key, expiredSQL)
		}, canWin: all, outcome: idempotency.Claimed, keepsOp: none},
		{name: "expired released failed", prepare: func(t *testing.T, s *pgstore.Store, pool *pgxpool.Pool, key string) {
			releaseA(t, s, key, idempotency.ReleaseFailed)
			setRow(t, pool, key, expiredSQL)
		}, canWin: all, outcome: idempotency.Claimed, keepsOp: none},
	}
}

// The mixes of claimers in a round: all the key's own request, all another
// request, or a and b in turn.
var raceMixes = []struct {
	name    string
	variant func(i int) raceVariant
}{
	{"same", func(int) raceVariant { return variantA }},
	{"other", func(int) raceVariant { return variantB }},
	{"mixed", func(i int) raceVariant { return []raceVariant{variantA, variantB}[i%2] }},
}

// TestClaimRace races raceClaimers claims of one key, for every starting
// state of the key and mix of requests, on one store and on two stores on
// one table (as replicas), raceRounds times on a fresh key each, and
// checks the outcome against the contract of idempotency.Store.Claim: at
// most one winner (exactly one when any claimer may win, none of a variant
// that may not), with the outcome, operation and token that end up on the
// row; every other claimer gets Exists with a record that is either the
// winner's row or, for a claimer that could not have won, the row as it
// was; no errors (a claim that lost maxRaces races is one).
func TestClaimRace(t *testing.T) {
	const raceClaimers, raceRounds = 32, 4
	for _, mode := range []struct {
		name   string
		stores int
	}{
		{"one store", 1},
		{"two stores", 2},
	} {
		t.Run(mode.name, func(t *testing.T) {
			stmts := &claimStatements{}
			pool := racePool(t, raceClaimers+2, stmts)
			defer func() { t.Logf("statements: %s", stmts) }()
			setup := pgstore.New(pool) // makes the starting states
			stores := make([]*pgstore.Store, mode.stores)
			for i := range stores {
				stores[i] = pgstore.New(pool)
			}
			for _, st := range raceStates() {
				for _, mix := range raceMixes {
					t.Run(st.name+"/"+mix.name, func(t *testing.T) {
						for round := range raceRounds {
							key := fmt.Sprintf("key-%s-%s-%d", st.name, mix.name, round)
							st.prepare(t, setup, pool, key)
							raceRound(t, stores, pool, st, key, raceClaimers, mix.variant)
							if t.Failed() {
								return
							}
						}
					})
				}
			}
		})
	}
}

// racePool is widePool with conns connections, traced by tracer.
func racePool(t *testing.T, conns int32, tracer pgx.QueryTracer) *pgxpool.Pool {
	t.Helper()
	pool := migratedPool(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = conns
		cfg.ConnConfig.Tracer = tracer
	})
	openAll(t, pool, conns)
	return pool
}

// raceRound runs one race of n claimers for key, made in state st, and
// checks it; claimer i claims on stores[i%len(stores)].
func raceRound(t *testing.T, stores []*pgstore.Store, pool *pgxpool.Pool, st raceState, key string, n int,
	variant func(i int) raceVariant) {
	t.Helper()
	before := readRaceRow(t, pool, key)

	results := make([]idempotency.ClaimResult, n)
	errs := make([]error, n)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // a hang fails, not blocks
	defer cancel()
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			results[i], errs[i] = stores[i%len(stores)].Claim(ctx, raceRequest(key, variant(i)))
		})
	}
	close(start)
	wg.Wait()

	mayWin := false
	for i := range n {
		mayWin = mayWin || st.canWin(variant(i))
	}
	winner := -1
	for i, err := range errs {
		require.NoError(t, err, "claim %d (%s) of %s", i, variant(i).name, key)
		if o := results[i].Outcome; o == idempotency.Claimed || o == idempotency.TookOver {
			require.Equal(t, -1, winner, "%s: claims %d and %d both won (%v, %v)", key, winner, i,
				results[max(winner, 0)].Outcome, o)
			winner = i
		}
	}
	after := readRaceRow(t, pool, key)
	require.True(t, after.present, "%s: no row after the race", key)

	if !mayWin {
		require.Equal(t, -1, winner, "%s: a claim of %s won a key no claimer may win", key,
			variant(max(winner, 0)).name)
		assert.Equal(t, before, after, "%s: the row changed though nobody won", key)
	} else {
		require.NotEqual(t, -1, winner, "%s: %d claimers that may win, none won", key, n)
		v, c := variant(winner), results[winner].Claim
		assert.True(t, st.canWin(v), "%s: a claim of %s won", key, v.name)
		assert.Equal(t, st.outcome, results[winner].Outcome, "%s: outcome of the winner (%s)", key, v.name)
		assert.Equal(t, "cli_a", c.ClientID)
		assert.Equal(t, key, c.Key)
		assert.Equal(t, c.Token, after.token, "%s: the winner's token is not the row's", key)
		assert.Equal(t, c.OperationID, after.operationID, "%s: the winner's operation is not the row's", key)
		assert.Equal(t, "started", after.status, "%s: status after the race", key)
		assert.Equal(t, []byte(v.body), after.fingerprint, "%s: fingerprint on the row, winner %s", key, v.name)
		assert.Equal(t, raceLease.Microseconds(), after.leaseUS, "%s: lease on the row", key)
		assert.Equal(t, raceKeep.Microseconds(), after.keepUS, "%s: retention on the row", key)
		if !before.present || !st.keepsOp(v) {
			assert.Equal(t, raceRequest(key, v).OperationID(), c.OperationID, "%s: winner %s began another operation than its request's", key, v.name)
		}
		if before.present {
			assert.NotEqual(t, before.token, c.Token, "%s: the winner kept the key's token: its owner is not fenced", key)
			if st.keepsOp(v) {
				assert.Equal(t, before.operationID, c.OperationID, "%s: winner %s changed the operation", key, v.name)
				assert.Equal(t, before.createdAt, after.createdAt, "%s: winner %s changed the creation time", key, v.name)
			} else {
				assert.True(t, after.createdAt.After(before.createdAt),
					"%s: winner %s kept the creation time %v (now %v)", key, v.name, before.createdAt, after.createdAt)
			}
		}
	}

	for i, res := range results {
		if i == winner {
			continue
		}
		v := variant(i)
		if !assert.Equal(t, idempotency.Exists, res.Outcome, "%s: claim %d (%s) lost the race or could not win", key, i, v.name) ||
			!assert.NotNil(t, res.Record, "%s: Exists without a record", key) {
			continue
		}
		rec := res.Record
		assert.Equal(t, "cli_a", rec.ClientID)
		assert.Equal(t, key, rec.Key)
		assert.Equal(t, "POST", rec.Method)
		assert.Equal(t, "/v1/orders", rec.Path)
		// The record is the row as it is after the race (the winner's, or
		// the unchanged one), or, for a claimer that could not have won,
		// the row as it was before the winner's commit.
		isAfter := recordIs(rec, after)
		isBefore := before.present && recordIs(rec, before)
		switch {
		case winner == -1 || st.canWin(v):
			assert.True(t, isAfter, "%s: claim %d (%s) got Exists with record %+v; want the row after the race %+v",
				key, i, v.name, rec, after)
		default:
			assert.True(t, isAfter || isBefore, "%s: claim %d (%s) got Exists with record %+v; want the row before %+v or after %+v",
				key, i, v.name, rec, before, after)
		}
		if rec.Status == idempotency.StatusCompleted {
			assert.Equal(t, &idempotency.StoredResponse{Status: 201, ContentType: "application/json",
				Header: map[string]string{"Location": "/v1/orders/ord_" + key},
				Body:   []byte(`{"id":"ord_` + key + `"}`)}, rec.Response, "%s: replayed response", key)
		} else {
			assert.Nil(t, rec.Response, "%s: a %s record with a response", key, rec.Status)
		}
	}
}

// claimStatements counts the claim statements a pool runs, to show in
// the log that the races took the retry paths: claimInsertSQL,
// claimReadSQL, claimSQL.
type claimStatements struct {
	mu     sync.Mutex
	counts map[string]int
}

func (c *claimStatements) add(sql string) {
	kind := ""
	switch {
	case strings.Contains(sql, "renewed AS"):
		kind = "claimSQL"
	case strings.Contains(sql, "typed AS"):
		kind = "claimReadSQL"
	case strings.HasPrefix(strings.TrimSpace(sql), "INSERT INTO idempotency_keys") && strings.Contains(sql, "VALUES"):
		kind = "claimInsertSQL"
	default:
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.counts == nil {
		c.counts = map[string]int{}
	}
	c.counts[kind]++
}

func (c *claimStatements) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return fmt.Sprint(c.counts)
}

func (c *claimStatements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.add(d.SQL)
	return ctx
}
func (c *claimStatements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// recordIs reports whether rec shows row.
func recordIs(rec *idempotency.Record, row raceRow) bool {
	return string(rec.Status) == row.status && string(rec.Fingerprint) == string(row.fingerprint) &&
		rec.CreatedAt.Equal(row.createdAt) && rec.LockedAt.Equal(row.lockedAt)
}
