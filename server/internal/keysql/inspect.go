package keysql

// More expressions over a key row k (see staleExpr).
const (
	// finishedExpr is when k was completed or released; NULL while
	// started. A key's locked_at is set when it finishes (see
	// finishedSetExpr), and expires_at less the retention is never later
	// than that; an operator's expiry (ExpireSQL) moves both back.
	finishedExpr = `(CASE WHEN k.status <> 'started'
        THEN greatest(k.locked_at, k.expires_at - k.retention_us * interval '1 microsecond') END)`
	// releasedAtExpr is when a released k was released, or its last
	// renewal before that when the release is not stored.
	releasedAtExpr = `coalesce(` + finishedExpr + `, k.locked_at)`
	// liveExpr: k does not count as absent.
	liveExpr = `(` + expiredExpr + ` IS NOT TRUE)`
	// abandonedExpr: k is abandoned (see [idempotency.Sweepable]) with
	// the grace in microseconds of parameter $1.
	abandonedExpr = `(` + liveExpr + ` AND (
        (` + staleExpr + ` AND k.locked_at <= statement_timestamp() - (k.lease_us + $1) * interval '1 microsecond')
        OR (k.status = 'released' AND NOT k.release_rejected
            AND ` + releasedAtExpr + ` <= statement_timestamp() - $1 * interval '1 microsecond')))`
)

// infoColumns are the columns of a KeyInfo, scanned by scanInfo, but for
// the response's body, which each statement adds (or NULL) as the last
// column.
const infoColumns = `k.client_id, k.idempotency_key, k.request_method, k.request_path, k.status, k.release_rejected,
    k.operation_id::text, k.lock_token, k.created_at, k.locked_at, ` + finishedExpr + `,
    ` + expiryExpr + `, k.lease_us, k.retention_us, (extract(epoch FROM statement_timestamp() - k.locked_at) * 1000000)::bigint,
    ` + staleExpr + `, ` + expiredExpr + ` IS TRUE,
    k.response_status, k.response_content_type, k.response_headers`

// LookupSQL reads one key ($1 client, $2 key), its body if $3.
const LookupSQL = `
SELECT ` + infoColumns + `, CASE WHEN $3 THEN k.response_body END
FROM idempotency_keys k
WHERE k.client_id = $1 AND k.idempotency_key = $2`

// ListSQL lists the live keys of status $1 (started or released), of
// client $2 (all if empty), older than $3 microseconds (started: by
// created_at, released: by their release), oldest first, at most $4. The
// status <> 'completed' lets PostgreSQL walk idempotency_keys_open_idx,
// which holds only the keys that are not completed (see
// CreateOpenKeysIndex; the stores do not run it without the index).
const ListSQL = `
SELECT ` + infoColumns + `, NULL::bytea
FROM idempotency_keys k
WHERE k.status <> 'completed' AND k.status = $1 AND ($2 = '' OR k.client_id = $2) AND ` + liveExpr + `
    AND CASE WHEN k.status = 'started' THEN k.created_at ELSE ` + releasedAtExpr + ` END
        <= statement_timestamp() - $3 * interval '1 microsecond'
ORDER BY k.created_at, k.client_id, k.idempotency_key
LIMIT $4`

// ForceReleaseSQL releases a key ($1 client, $2 key) as failed under a
// new token, which fences its owner; it expires its retention from now.
const ForceReleaseSQL = `
UPDATE idempotency_keys SET status = 'released', release_rejected = false,
    lock_token = nextval('idempotency_lock_tokens'), ` + finishedSetExpr + `
WHERE client_id = $1 AND idempotency_key = $2`

// ExpireSQL makes a key ($1 client, $2 key) count as absent at once
// (see expiredExpr), under a new token, which fences its owner: it expired
// a millisecond ago, and so did its retention after its last renewal,
// which is moved back for that when needed (a key kept forever is given a
// retention of one microsecond). A started key is released as rejected,
// so that nothing of the rules for started keys keeps it alive. It keeps
// created_at and the retention, which tell the purge to keep the row
// until the retention has passed since its operation began (see
// heldForRetriesExpr): the first-sent check refuses the retries of the
// operation by the row meanwhile.
const ExpireSQL = `
UPDATE idempotency_keys SET
    status = CASE WHEN status = 'started' THEN 'released' ELSE status END,
    release_rejected = release_rejected OR status = 'started',
    lock_token = nextval('idempotency_lock_tokens'),
    retention_us = greatest(retention_us, 1),
    locked_at = least(locked_at, statement_timestamp() - interval '1 millisecond' - greatest(retention_us, 1) * interval '1 microsecond'),
    expires_at = statement_timestamp() - interval '1 millisecond'
WHERE client_id = $1 AND idempotency_key = $2`

// ActSQL reads a key ($1 client, $2 key) and locks its row.
const ActSQL = `
SELECT ` + infoColumns + `, NULL::bytea
FROM idempotency_keys k
WHERE k.client_id = $1 AND k.idempotency_key = $2
FOR UPDATE`

// StatsSQL counts the live keys that are not completed; like ListSQL, it
// walks idempotency_keys_open_idx, and needs it.
const StatsSQL = `
SELECT count(*) FILTER (WHERE k.status = 'started' AND NOT ` + staleExpr + `),
    coalesce((extract(epoch FROM statement_timestamp() - min(k.created_at)
        FILTER (WHERE k.status = 'started' AND NOT ` + staleExpr + `)) * 1000000)::bigint, 0),
    count(*) FILTER (WHERE ` + staleExpr + `),
    count(*) FILTER (WHERE k.status = 'released' AND NOT k.release_rejected)
FROM idempotency_keys k
WHERE k.status <> 'completed' AND ` + liveExpr

// AbandonedSQL lists at most $2 keys abandoned with a grace of $1
// microseconds, those abandoned first first. Every abandoned key was
// renewed last at least the grace ago (a release comes after the last
// renewal), so PostgreSQL walks idempotency_keys_open_idx, the index of
// the keys that are not completed, by locked_at, and stops there; the
// stores do not run it without the index (see CreateOpenKeysIndex).
const AbandonedSQL = `
SELECT ` + infoColumns + `, NULL::bytea
FROM idempotency_keys k
WHERE k.status <> 'completed' AND k.locked_at <= statement_timestamp() - $1 * interval '1 microsecond'
    AND ` + abandonedExpr + `
ORDER BY k.locked_at, k.client_id, k.idempotency_key
LIMIT $2`

// AdoptKeySQL takes over the key ($2 client, $3 key) that was found with
// token $4 and status $6, if it is still abandoned with a grace of $1
// microseconds: started under a new token, with a lease of $5
// microseconds from now (0: never runs out) and its retention. Its WHERE
// is checked again on the newest row version when another transaction
// (a retry's claim, another sweeper) changed the row first, so one of
// them wins.
const AdoptKeySQL = `
UPDATE idempotency_keys k SET
    status = 'started',
    release_rejected = false,
    lock_token = nextval('idempotency_lock_tokens'),
    locked_at = statement_timestamp(),
    lease_us = $5,
    expires_at = CASE WHEN k.retention_us > 0
        THEN statement_timestamp() + k.retention_us * interval '1 microsecond' END
WHERE k.client_id = $2 AND k.idempotency_key = $3 AND k.lock_token = $4 AND k.status = $6
    AND ` + abandonedExpr + `
RETURNING k.lock_token, k.operation_id::text`
