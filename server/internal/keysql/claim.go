package keysql

// Expressions over a key row k shared by the statements below. A lease or
// retention of 0 microseconds means "never".
const (
	// staleExpr: k is started and its owner stopped renewing its lease.
	staleExpr = `(k.status = 'started' AND k.lease_us > 0 AND k.locked_at < statement_timestamp() - k.lease_us * interval '1 microsecond')`
	// expiredExpr: k counts as absent. Its expiry is computed from
	// locked_at, which is the last claim or renewal of a started key and
	// the time a finished one finished: a started key expires retention
	// after its lease runs out, a finished one retention after it
	// finished; never without a retention, nor while started without a
	// lease. expires_at is not the expiry but a bound below it, which the
	// purge walks in its index: the claim writes its time plus the
	// retention (NULL without a retention), and nothing else moves it, so
	// a renewal, a completion and a release change no indexed column and
	// can be HOT updates (without the open keys' index, which reads status
	// and locked_at). A key started without a lease has a bound too, and
	// never expires while started: the purge reads it and passes over it
	// (an abandoned one, at each batch: an operator's Expire ends that).
	// As expires_at is never after the computed expiry, the
	// greatest() in expiryTimeExpr returns the computed one; an operator's
	// expiry (ExpireSQL) moves both into the past.
	expiredExpr = `(k.retention_us > 0 AND (k.status <> 'started' OR k.lease_us > 0)
        AND ` + expiryTimeExpr + ` < statement_timestamp())`
	// expiryTimeExpr is when k starts counting as absent, for a key that
	// expires at all (see expiredExpr); expiryExpr is that or NULL (never).
	expiryTimeExpr = `greatest(k.expires_at, k.locked_at + (k.retention_us
            + CASE WHEN k.status = 'started' THEN k.lease_us ELSE 0 END) * interval '1 microsecond')`
	expiryExpr = `(CASE WHEN k.retention_us > 0 AND (k.status <> 'started' OR k.lease_us > 0)
        THEN ` + expiryTimeExpr + ` END)`
	// refusedExpr: k is expired and the claim's first-sent check ($9
	// stale, $10 earliest begin, NULL for none) says the request may belong
	// to its operation (see idempotency.FirstSentCheck).
	refusedExpr = `((` + expiredExpr + `) AND ($9::boolean OR k.created_at >= $10::timestamptz) IS TRUE)`
	// claimedExpiryExpr is the expires_at of a key claimed now with the
	// retention $7: now plus the retention, a bound below the key's expiry
	// (see expiredExpr), or NULL for a key that never expires.
	claimedExpiryExpr = `CASE WHEN $7::bigint > 0
            THEN statement_timestamp() + $7::bigint * interval '1 microsecond' END`
	// finishedSetExpr sets the columns of a key that finishes now: locked_at
	// to now, from which it expires. expires_at, the claim's bound below
	// that, stays as it is (see expiredExpr): a completion's or a
	// release's update changes no indexed column, and its statement sets
	// up one expression less.
	finishedSetExpr = `locked_at = statement_timestamp()`
)

// ClaimSQL claims, resumes or takes over a key, or returns it as it is (see
// [idempotency.Store.Claim] for the cases).
//
// Parameters: $1 client, $2 key, $3 method, $4 path, $5 fingerprint,
// $6 lease and $7 retention in microseconds (0: never), stored with the
// key, $8 the operation ID of a new operation
// (idempotency.ClaimRequest.OperationID), $9 and $10 the first-sent
// check (see refusedExpr). It returns one row: outcome 1 (Claimed)
// or 2 (TookOver) with the new token and the operation ID, or 3 (Exists)
// with the row as the statement's snapshot saw it.
//
// existing reads the row without locking it, so a duplicate of a live key
// costs a read and no write (no transaction ID, no WAL, no flush), and does
// not queue behind the owner's completion. renewed updates the row in
// place when it is
//
//   - expired (expires_at passed: it counts as absent, whatever its state
//     and fingerprint): a new operation ID and creation time;
//   - released: with the same fingerprint it is resumed (same operation
//     ID and creation time), with another it is replaced (new operation
//     ID, creation time, request) if it was released as rejected
//     (release_rejected), and left as it is, for an Exists row, if it was
//     released as failed;
//   - started, its lease run out (by the lease stored with it, not the
//     caller's), and with the same fingerprint: taken over (same
//     operation ID).
//
// Every case gets a new token, a fresh lease and the caller's lease and
// retention. Its WHERE is re-checked by PostgreSQL on the newest row
// version when another transaction changed the row first, so of many
// concurrent claimers of an expired, released or stale row exactly one
// wins; the re-check also requires the status (and release kind) the
// snapshot saw, so the outcome reported (Claimed for a new, expired or
// released row, TookOver for a stale started one) is the one that
// happened, and so is resumed (the last column): the claim kept the
// operation of a key released as failed or taken over, which may have
// done work (idempotency.Claim.Resumed). inserted creates the
// row when the snapshot had none.
//
// The snapshot is taken when the statement starts, so it can miss a row
// another transaction has just inserted, or show one it has just renewed
// or released: the statement then returns no row, or an Exists row flagged
// lost, and the caller runs it again with a fresh snapshot.
const ClaimSQL = `
WITH ` + existingCTE + `, ` + heldCTE + `, renewed AS (
    UPDATE idempotency_keys k SET
        request_method = $3,
        request_path = $4,
        request_hash = $5,
        status = 'started',
        operation_id = CASE
            WHEN ` + expiredExpr + ` IS TRUE OR (k.status = 'released' AND k.request_hash <> $5)
            THEN $8::uuid ELSE k.operation_id END,
        lock_token = nextval('idempotency_lock_tokens'),
        created_at = CASE
            WHEN ` + expiredExpr + ` IS TRUE OR (k.status = 'released' AND k.request_hash <> $5)
            THEN statement_timestamp() ELSE k.created_at END,
        locked_at = statement_timestamp(),
        lease_us = $6,
        retention_us = $7,
        expires_at = ` + claimedExpiryExpr + `,
        release_rejected = false,
        response_status = NULL,
        response_content_type = NULL,
        response_headers = NULL,
        response_body = NULL
    WHERE k.client_id = $1 AND k.idempotency_key = $2
        AND k.status = (SELECT status FROM existing)
        AND k.release_rejected = (SELECT release_rejected FROM existing)
        AND NOT ` + refusedExpr + `
        AND (` + expiredExpr + `
            OR (k.status = 'released' AND (k.release_rejected OR k.request_hash = $5))
            OR (` + staleExpr + ` AND k.request_hash = $5))
    RETURNING k.lock_token, k.operation_id,
        k.created_at = statement_timestamp() OR (SELECT status FROM existing) = 'released' AS claimed,
        k.created_at <> statement_timestamp() AND NOT (SELECT release_rejected FROM existing) AS resumed
), ` + insertedCTE + `
SELECT 1, lock_token, operation_id::text,
    NULL::text, NULL::text, NULL::bytea, NULL::text,
    NULL::integer, NULL::text, NULL::jsonb, NULL::bytea, NULL::timestamptz, NULL::timestamptz, NULL::bigint, false, false
FROM inserted
UNION ALL
SELECT CASE WHEN claimed THEN 1 ELSE 2 END, lock_token, operation_id::text,
    NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, resumed
FROM renewed
UNION ALL
` + existingRow + `
WHERE NOT EXISTS (SELECT FROM renewed)
UNION ALL
` + refusedAbsentRow + `
UNION ALL
` + busyAbsentRow

// ClaimInsertSQL is the claim that Claim runs first (for a request whose
// first-sent check is not stale, which must not insert the key): a plain
// insert of the key's row, started, which inserts nothing when the key has
// a row. A new key, the common case, costs PostgreSQL the insert alone: no
// subquery, no CTE around it (a sixth less CPU than a statement that reads
// the row and inserts it when it is absent; see bench/NOTES.md), no
// sequence and no RETURNING: the store draws the token (NewToken) and
// knows the operation ID, and the count of rows inserted tells whether it
// claimed the key. A retry (Resent) runs ClaimPeekSQL before it, and runs
// it only when the key has no row to answer. When it inserts nothing,
// ClaimReadSQL reads the row. It inserts
// nothing either while a claim in one transaction
// holds the key (its advisory lock, keyLockExpr, taken exclusive; the
// insert tries it shared, so that claims in commits of their own do not
// hold one another off, and holds it only to its own commit): a route
// without the mode never runs a key that a route with it is running
// (ClaimReadSQL then answers Busy).
// Parameters: $1 to $8 as ClaimSQL's, $9 the token (ClaimInsertArgs).
const ClaimInsertSQL = `
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
    request_hash, status, operation_id, lock_token, created_at, locked_at,
    lease_us, retention_us, expires_at)
SELECT $1::text, $2::text, $3::text, $4::text, $5::bytea, 'started', $8::uuid, $9::bigint,
    statement_timestamp(), statement_timestamp(), $6::bigint, $7::bigint, ` + claimedExpiryExpr + `
WHERE pg_try_advisory_xact_lock_shared(` + keyLockExpr + `)
ON CONFLICT (client_id, idempotency_key) DO NOTHING`

// ClaimReadSQL reads the row of a key that ClaimInsertSQL could not insert
// and ClaimPeekSQL did not find, or that a stale request claims: outcome
// 3 (Exists), or 4 (Refused), flagged (lost) when ClaimSQL would renew it
// (expired, free or stale), in which case the caller runs ClaimSQL;
// outcome 4 for a stale request whose key is absent; outcome 5 (Busy) for
// a key a claim in one transaction holds; no row for any other absent key
// (deleted since the insert failed), which ClaimSQL then inserts. Same
// parameters and rows as ClaimSQL.
const ClaimReadSQL = `
WITH ` + existingCTE + `, typed AS (
    SELECT $3::text, $4::text, $6::bigint, $7::bigint, $8::uuid -- unused: typed for the prepared statement
), ` + heldCTE + `
` + existingRow + `
UNION ALL
` + refusedAbsentRow + `
UNION ALL
` + busyAbsentRow

// ClaimPeekSQL reads the row of a key ($1 client, $2 key) for a retry
// (Resent), before any claim and outside any transaction, with the
// database's time: PeekRow.Decide then tells what ClaimReadSQL would of
// it (outcome 3, flagged when ClaimSQL would renew it, or 4), from the
// same rules (expiredExpr, staleExpr, refusedExpr) written in Go. No row:
// the key has none, and the claim that follows claims it. A retry's
// replay or duplicate is answered in one round trip, by a read that costs
// PostgreSQL what a read of the row by its primary key costs: no
// expressions to set up and evaluate (a third of a replay's database CPU
// when they were SQL; see bench/NOTES.md).
const ClaimPeekSQL = `
SELECT operation_id::text, request_method, request_path, request_hash, status,
    response_status, response_content_type, response_headers, response_body,
    created_at, locked_at, retention_us, lease_us, expires_at, release_rejected,
    statement_timestamp()
FROM idempotency_keys
WHERE client_id = $1 AND idempotency_key = $2`

// The parts that ClaimSQL, ClaimReadSQL and ClaimTxSQL share. existingCTE reads the
// key's row without locking it, with what ClaimSQL may do with it:
// expired, stale or free. insertedCTE creates the row when the snapshot
// had none; ON CONFLICT DO NOTHING covers a row inserted since. existingRow
// is the outcome 3 row, flagged (lost) when the row can be renewed.
const (
	existingCTE = `existing AS (
    SELECT k.*,
        ` + expiredExpr + ` IS TRUE AS expired,
        ` + refusedExpr + ` AS refused,
        (` + staleExpr + ` AND k.request_hash = $5) AS stale,
        (k.status = 'released' AND (k.release_rejected OR k.request_hash = $5)) AS free
    FROM idempotency_keys k
    WHERE k.client_id = $1 AND k.idempotency_key = $2
)`
	insertedCTE = `inserted AS (
    INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
        request_hash, status, operation_id, lock_token, created_at, locked_at,
        lease_us, retention_us, expires_at)
    SELECT $1, $2, $3, $4, $5, 'started', $8::uuid, nextval('idempotency_lock_tokens'), statement_timestamp(), statement_timestamp(),
        $6, $7, ` + claimedExpiryExpr + `
    WHERE NOT EXISTS (SELECT FROM existing) AND NOT $9::boolean AND (SELECT free FROM held)
    ON CONFLICT (client_id, idempotency_key) DO NOTHING
    RETURNING lock_token, operation_id
)`
	existingRow = `SELECT CASE WHEN refused THEN 4 ELSE 3 END, NULL::bigint, operation_id::text,
    request_method, request_path, request_hash, status,
    response_status, response_content_type, response_headers, response_body, created_at, locked_at, retention_us,
    (expired OR stale OR free) AND NOT refused, false
FROM existing`
	// heldCTE tells, for a key the snapshot does not have (and a request
	// whose first-sent check is not stale), whether a claim in one
	// transaction holds it: free is false then. It tries the key's advisory
	// lock shared, for this statement's transaction only.
	heldCTE = `held AS (
    SELECT pg_try_advisory_xact_lock_shared(` + keyLockExpr + `) AS free
    WHERE NOT EXISTS (SELECT FROM existing) AND NOT $9::boolean
)`
	// busyAbsentRow is the outcome 5 (Busy) row of a key the snapshot did
	// not have, held by a claim in one transaction (heldCTE).
	busyAbsentRow = `SELECT 5, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, false
FROM held WHERE NOT free`
	// refusedAbsentRow is the outcome 4 (Refused) row of a key the snapshot
	// did not have, for a stale first-sent check ($9), which inserted
	// nothing.
	refusedAbsentRow = `SELECT 4, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false, false
WHERE $9::boolean AND NOT EXISTS (SELECT FROM existing)`
)

// RenewSQL renews the lease of a key its claim still owns ($1 client, $2
// key, $3 token), by the lease stored with it: the lease, and the key's
// expiry with it, run from locked_at (see expiredExpr). It leaves
// expires_at as it is.
const RenewSQL = `
UPDATE idempotency_keys SET locked_at = statement_timestamp()
WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'`

// OwnedSQL tells whether a claim still owns its key ($1 client, $2 key,
// $3 token).
const OwnedSQL = `
SELECT EXISTS (SELECT FROM idempotency_keys
    WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started')`

// ReleaseSQL releases a key its claim still owns ($1 client, $2 key, $3
// token), as rejected or not ($4; see [idempotency.ReleaseKind]); the key
// expires its retention from now (see finishedSetExpr).
const ReleaseSQL = `
UPDATE idempotency_keys SET status = 'released', release_rejected = $4, ` + finishedSetExpr + `
WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'`

// heldForRetriesExpr: k's operation began less than its retention ago.
// A key that expired by its retention is never so: it expired the
// retention after its last claim, renewal or finish (locked_at), none of
// which comes before its operation began (created_at). A key an operator
// expired (ExpireSQL) may be, and the purge keeps it until it is not, so
// that the first-sent check refuses the retries of its operation (a
// request first sent before created_at, plus the allowance, see
// refusedExpr) as long as the check would not refuse them as stale
// without the row: past created_at plus the retention, a request first
// sent before created_at plus the allowance was first sent longer ago
// than the retention less the allowance, which is the check's stale
// (idempotency.FirstSentCheck), for a middleware whose Retention is no
// longer than the key's.
const heldForRetriesExpr = `(k.created_at + k.retention_us * interval '1 microsecond' >= statement_timestamp())`

// PurgeSQL deletes a bounded batch of expired keys: $1 the batch size.
// ctid = ANY (ARRAY(...)) is planned as a TID scan, never a scan of the
// whole table. It passes over a key an operator expired before its
// operation's retention ran out (heldForRetriesExpr): such keys come
// first in the expires_at index (ExpireSQL sets expires_at to the past),
// and each batch reads them again until then, which costs little, as
// operators expire few keys.
const PurgeSQL = `
DELETE FROM idempotency_keys
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM idempotency_keys k
    WHERE k.expires_at < statement_timestamp()
        AND ` + expiredExpr + ` IS TRUE AND NOT ` + heldForRetriesExpr + `
    ORDER BY k.expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED))`

// StatusUnderSQL tells whether a key has a status under a lock token ($1
// client, $2 key, $3 token, $4 status).
const StatusUnderSQL = `
SELECT status = $4 AND lock_token = $3 FROM idempotency_keys
WHERE client_id = $1 AND idempotency_key = $2
FOR SHARE`
