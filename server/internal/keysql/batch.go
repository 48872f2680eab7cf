package keysql

// BatchClaimSQL claims new keys, many in one statement: it inserts a
// started row for each key that has none, as ClaimSQL's inserted branch
// does for one, and returns the rows it inserted. A key that has a row, or
// that stands twice in the batch (the second time), is skipped; its caller
// runs ClaimSQL. Parameters: parallel arrays of $1 client, $2 key,
// $3 method, $4 path, $5 fingerprint, $6 fingerprint version, $7 lease and
// $8 retention in microseconds.
const BatchClaimSQL = `
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
    request_hash, fingerprint_version, status, operation_id, lock_token, created_at, locked_at,
    lease_us, retention_us, expires_at)
SELECT r.client, r.key, r.method, r.path, r.hash, r.version, 'started',
    gen_random_uuid(), nextval('idempotency_lock_tokens'), statement_timestamp(), statement_timestamp(),
    r.lease, r.retention, CASE WHEN r.lease > 0 AND r.retention > 0
        THEN statement_timestamp() + r.retention * interval '1 microsecond' END
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::integer[],
        $7::bigint[], $8::bigint[])
    AS r(client, key, method, path, hash, version, lease, retention)
ON CONFLICT (client_id, idempotency_key) DO NOTHING
RETURNING client_id, idempotency_key, lock_token, operation_id::text`
