package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// The statements of an idem-server from before package pgstore, as its
// PostgresStore ran them (git show 073a2ce:server/postgres.go), for the
// replicas of that release that keep serving beside new ones during a
// rolling upgrade.
const (
	// $1 client, $2 key, $3 method, $4 path, $5 hash, $6 fingerprint
	// version, $7 lock timeout, $8 retention (microseconds); one row:
	// outcome (1 claimed, 2 took over, 3 exists), token, operation, ...
	legacyClaimSQL = `
WITH existing AS (
    SELECT k.*,
        ($8::bigint > 0 AND k.created_at < now() - $8::bigint * interval '1 microsecond') AS expired,
        (k.status = 'started'
            AND $7::bigint > 0 AND k.locked_at < now() - $7::bigint * interval '1 microsecond'
            AND k.fingerprint_version = $6 AND k.request_hash = $5) AS stale,
        (k.status = 'released' AND k.fingerprint_version = $6
            AND (k.release_rejected OR k.request_hash = $5)) AS free
    FROM idempotency_keys k
    WHERE k.client_id = $1 AND k.idempotency_key = $2
), renewed AS (
    UPDATE idempotency_keys k SET
        request_method = $3,
        request_path = $4,
        request_hash = $5,
        fingerprint_version = $6,
        status = 'started',
        operation_id = CASE
            WHEN ($8::bigint > 0 AND k.created_at < now() - $8::bigint * interval '1 microsecond')
                OR (k.status = 'released' AND k.request_hash <> $5)
            THEN gen_random_uuid() ELSE k.operation_id END,
        lock_token = nextval('idempotency_lock_tokens'),
        created_at = CASE
            WHEN ($8::bigint > 0 AND k.created_at < now() - $8::bigint * interval '1 microsecond')
                OR (k.status = 'released' AND k.request_hash <> $5)
            THEN now() ELSE k.created_at END,
        locked_at = now(),
        release_rejected = false,
        response_status = NULL,
        response_content_type = NULL,
        response_headers = NULL,
        response_body = NULL
    WHERE k.client_id = $1 AND k.idempotency_key = $2
        AND k.status = (SELECT status FROM existing)
        AND (($8::bigint > 0 AND k.created_at < now() - $8::bigint * interval '1 microsecond')
            OR (k.status = 'released' AND k.fingerprint_version = $6
                AND (k.release_rejected OR k.request_hash = $5))
            OR (k.status = 'started'
                AND $7::bigint > 0 AND k.locked_at < now() - $7::bigint * interval '1 microsecond'
                AND k.fingerprint_version = $6 AND k.request_hash = $5))
    RETURNING k.lock_token, k.operation_id,
        k.created_at = now() OR (SELECT status FROM existing) = 'released' AS claimed
), inserted AS (
    INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
        request_hash, fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
    SELECT $1, $2, $3, $4, $5, $6, 'started', gen_random_uuid(), nextval('idempotency_lock_tokens'), now(), now()
    WHERE NOT EXISTS (SELECT FROM existing)
    ON CONFLICT (client_id, idempotency_key) DO NOTHING
    RETURNING lock_token, operation_id
)
SELECT 1, lock_token, operation_id::text,
    NULL::text, NULL::text, NULL::bytea, NULL::integer, NULL::text,
    NULL::integer, NULL::text, NULL::jsonb, NULL::bytea, NULL::timestamptz, NULL::timestamptz, false
FROM inserted
UNION ALL
SELECT CASE WHEN claimed THEN 1 ELSE 2 END, lock_token, operation_id::text,
    NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false
FROM renewed
UNION ALL
SELECT 3, NULL, NULL,
    request_method, request_path, request_hash, fingerprint_version, status,
    response_status, response_content_type, response_headers, response_body, created_at, locked_at,
    expired OR stale OR free
FROM existing
WHERE NOT EXISTS (SELECT FROM renewed)`
	// $1 client, $2 key, $3 token, $4-$7 the response, $8-$16 the
	// payments as parallel arrays; one row: keys completed, payments made.
	legacyCompleteSQL = `
WITH done AS (
    UPDATE idempotency_keys SET
        status = 'completed',
        response_status = $4,
        response_content_type = $5,
        response_headers = $6,
        response_body = $7
    WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'
    RETURNING 1
), paid AS (
    INSERT INTO payments (payment_id, client_id, customer_id, amount, currency,
        idempotency_key, operation_id, charge_id, created_at)
    SELECT p.id, p.client_id, p.customer, p.amount, p.currency,
        p.key, nullif(p.operation, '')::uuid, nullif(p.charge, ''), coalesce(p.created_at, now())
    FROM unnest($8::text[], $9::text[], $10::text[], $11::bigint[], $12::text[],
            $13::text[], $14::text[], $15::text[], $16::timestamptz[])
        AS p(id, client_id, customer, amount, currency, key, operation, charge, created_at)
    WHERE EXISTS (SELECT FROM done)
    RETURNING 1
)
SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM paid)`
	// $1 client, $2 key, $3 token, $4 release_rejected.
	legacyReleaseSQL = `
UPDATE idempotency_keys SET status = 'released', release_rejected = $4
WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'`
	// $1 retention, $2 batch size.
	legacyPurgeSQL = `
DELETE FROM idempotency_keys
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM idempotency_keys
    WHERE created_at < now() - $1::bigint * interval '1 microsecond'
    ORDER BY created_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED))`
)

// legacyReplica runs the statements of an idem-server from before package
// pgstore with its default flags: a 30 s lock timeout, a 24 h retention.
type legacyReplica struct {
	t    *testing.T
	pool *pgxpool.Pool
}

// legacyClaim is what legacyClaimSQL answered.
type legacyClaim struct {
	outcome int
	token   int64
	op      string
	status  string // of an existing row (outcome 3)
}

func (r legacyReplica) claim(key, body string) legacyClaim {
	r.t.Helper()
	var c legacyClaim
	var token *int64
	var op, status *string
	err := r.pool.QueryRow(context.Background(), legacyClaimSQL, "cli_a", key, "POST", "/v1/payments",
		[]byte(body), 1, (30*time.Second).Microseconds(), (24*time.Hour).Microseconds()).
		Scan(&c.outcome, &token, &op, nil, nil, nil, nil, &status, nil, nil, nil, nil, nil, nil, nil)
	require.NoError(r.t, err, "the earlier replica's claim of %s", key)
	if token != nil {
		c.token, c.op = *token, *op
	}
	if status != nil {
		c.status = *status
	}
	return c
}

// complete completes the key of c with a 201 and one payment, as the
// earlier replica's payment handler did.
func (r legacyReplica) complete(key string, c legacyClaim) {
	r.t.Helper()
	var done, paid int
	err := r.pool.QueryRow(context.Background(), legacyCompleteSQL, "cli_a", key, c.token,
		201, "application/json", nil, []byte(`{"id":"pay_`+key+`"}`),
		[]string{"pay_" + key}, []string{"cli_a"}, []string{"cus_1"}, []int64{4200}, []string{"usd"},
		[]string{key}, []string{c.op}, []string{""}, []*time.Time{nil}).Scan(&done, &paid)
	require.NoError(r.t, err, "the earlier replica's completion of %s", key)
	require.Equal(r.t, [2]int{1, 1}, [2]int{done, paid}, "the earlier replica's completion of %s: keys completed, payments", key)
}

func (r legacyReplica) release(key string, c legacyClaim, rejected bool) {
	r.t.Helper()
	tag, err := r.pool.Exec(context.Background(), legacyReleaseSQL, "cli_a", key, c.token, rejected)
	require.NoError(r.t, err)
	require.EqualValues(r.t, 1, tag.RowsAffected(), "the earlier replica's release of %s", key)
}

// TestLegacyReplicasServeBeside runs the statements of an idem-server from
// before package pgstore against the key table Migrate upgraded, beside a
// Store: during a rolling upgrade, replicas of both releases serve one
// table. Each sees the other's keys as the contract says (started: 409;
// completed: the replay; released: resumed by the same request only), and
// no key that one of them is running or has just completed counts as
// expired for the other, also a key the earlier replica claimed again after
// its own retention, which leaves the expiry the new replica wrote behind.
func TestLegacyReplicasServeBeside(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	_, err := pool.Exec(ctx, legacy001+legacy002+legacy003+legacyMigrations+`
		INSERT INTO idem_schema_migrations (version, name)
		VALUES (1, '001_init.sql'), (2, '002_released.sql'), (3, '003_release_kind.sql')`)
	require.NoError(t, err)
	require.NoError(t, pgstore.Migrate(ctx, pool))
	old := legacyReplica{t, pool}
	s := pgstore.New(pool)
	req := func(key, body string) idempotency.ClaimRequest {
		return idempotency.ClaimRequest{ClientID: "cli_a", Key: key, Method: "POST", Path: "/v1/payments",
			Fingerprint: []byte(body),
			LockTimeout: idempotency.DefaultLockTimeout, Retention: idempotency.DefaultRetention}
	}
	// age moves a key's times back by d, as if it had been written d ago.
	age := func(key string, d time.Duration) {
		t.Helper()
		_, err := pool.Exec(ctx, `UPDATE idempotency_keys SET created_at = created_at - $2::interval,
			locked_at = locked_at - $2::interval, expires_at = expires_at - $2::interval
			WHERE client_id = 'cli_a' AND idempotency_key = $1`, key, d)
		require.NoError(t, err)
	}

	t.Run("a new key of the earlier replica", func(t *testing.T) {
		c := old.claim("old-1", "a")
		require.Equal(t, 1, c.outcome, "the earlier replica's claim of a new key")
		assert.Equal(t, idempotency.StatusStarted, mustClaim(t, s, req("old-1", "a"), idempotency.Exists).Record.Status)
		old.complete("old-1", c)
		rec := mustClaim(t, s, req("old-1", "a"), idempotency.Exists).Record
		assert.Equal(t, idempotency.StatusCompleted, rec.Status)
		assert.Equal(t, `{"id":"pay_old-1"}`, string(rec.Response.Body))
		n, err := s.Purge(ctx, 100)
		require.NoError(t, err)
		assert.Zero(t, n, "purged keys")
	})

	t.Run("a new key of the new replica", func(t *testing.T) {
		c := mustClaim(t, s, req("new-1", "a"), idempotency.Claimed).Claim
		assert.Equal(t, legacyClaim{outcome: 3, status: "started"}, old.claim("new-1", "a"))
		mustComplete(t, s, c)
		assert.Equal(t, legacyClaim{outcome: 3, status: "completed"}, old.claim("new-1", "a"))
	})

	t.Run("the earlier replica reuses a key past its retention", func(t *testing.T) {
		// Completed by the new replica a day and more ago: expired for
		// both, and the earlier replica starts a new operation with it.
		mustComplete(t, s, mustClaim(t, s, req("reused-1", "a"), idempotency.Claimed).Claim)
		age("reused-1", 25*time.Hour)
		c := old.claim("reused-1", "b")
		require.Equal(t, 1, c.outcome, "the earlier replica's claim of its expired key")
		// Its expires_at is the one of the day-old completion: the new
		// replica must still see the new operation running, not claim it
		// a second time.
		assert.Equal(t, idempotency.StatusStarted, mustClaim(t, s, req("reused-1", "b"), idempotency.Exists).Record.Status)
		old.complete("reused-1", c)
		rec := mustClaim(t, s, req("reused-1", "b"), idempotency.Exists).Record
		assert.Equal(t, idempotency.StatusCompleted, rec.Status, "the retry of the completed operation")
		n, err := s.Purge(ctx, 100)
		require.NoError(t, err)
		assert.Zero(t, n, "purged keys")
		var payments int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM payments WHERE idempotency_key = 'reused-1'`).Scan(&payments))
		assert.Equal(t, 1, payments)
	})

	t.Run("the earlier replica takes over a crashed key of the new one", func(t *testing.T) {
		crashed := mustClaim(t, s, req("crashed-1", "a"), idempotency.Claimed).Claim
		age("crashed-1", time.Minute)
		c := old.claim("crashed-1", "a")
		require.Equal(t, 2, c.outcome, "the earlier replica's takeover")
		assert.Equal(t, crashed.OperationID, c.op)
		assert.Equal(t, idempotency.StatusStarted, mustClaim(t, s, req("crashed-1", "a"), idempotency.Exists).Record.Status)
		old.complete("crashed-1", c)
		assert.Equal(t, idempotency.StatusCompleted, mustClaim(t, s, req("crashed-1", "a"), idempotency.Exists).Record.Status)
	})

	t.Run("a release of the earlier replica", func(t *testing.T) {
		c := old.claim("released-1", "a")
		require.Equal(t, 1, c.outcome)
		old.release("released-1", c, false)
		assert.Equal(t, idempotency.StatusReleased, mustClaim(t, s, req("released-1", "other"), idempotency.Exists).Record.Status)
		resumed := mustClaim(t, s, req("released-1", "a"), idempotency.Claimed).Claim
		assert.Equal(t, c.op, resumed.OperationID)
		s.Release(ctx, resumed, idempotency.ReleaseRejected)
		c = old.claim("released-1", "b")
		assert.Equal(t, 1, c.outcome, "the earlier replica's claim of a key the new one released as rejected")
		assert.NotEqual(t, resumed.OperationID, c.op)
	})

	t.Run("the earlier replica's purge", func(t *testing.T) {
		tag, err := pool.Exec(ctx, legacyPurgeSQL, (24 * time.Hour).Microseconds(), 100)
		require.NoError(t, err)
		assert.Zero(t, tag.RowsAffected())
		// Each key's row is where it was.
		rows, _ := pool.Query(ctx, `SELECT idempotency_key || ' ' || status FROM idempotency_keys ORDER BY 1`)
		keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		assert.Equal(t, []string{"crashed-1 completed", "new-1 completed", "old-1 completed", "released-1 started", "reused-1 completed"}, keys)
	})
}
