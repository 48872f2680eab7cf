-- claim(): claimSQL of server/postgres.go for the partitioned key table of
-- schema.sql, in one call (one round trip), with the same 15 result columns
-- and outcomes (1 claimed / took over, 2 resumed, 3 exists; lost = run it
-- again). Load with psql -v schema=part after schema.sql.
--
-- Why it is correct without a unique index across partitions:
--
-- 1. pg_advisory_xact_lock on a 64-bit hash of (client_id, key) serialises
--    every claim of one key, whatever partition its row is or will be in;
--    the lock is held until the claim's transaction commits. A hash
--    collision only serialises two unrelated keys.
-- 2. The claim statement below runs AFTER the lock is granted and, being a
--    statement of a VOLATILE function under READ COMMITTED, takes a fresh
--    snapshot then: it sees every row committed by the previous holder of
--    the lock, in any partition. (One statement that took the lock in a CTE
--    would not: its snapshot predates the lock.) A pgx batch
--    "SELECT pg_advisory_xact_lock(..); <claim>" in one implicit transaction
--    has the same property.
-- 3. The lookup reads every partition that can hold a live key,
--    created_at >= now() - retention: an expired row is invisible, so its
--    key is claimed afresh by an INSERT into the current partition (new
--    operation_id, created_at now()), which is what claimSQL's renewal of
--    an expired key does in place. The old row stays until its partition
--    is dropped. Since the partition width is at most the retention, the
--    new row is never in the old row's partition, so the per-partition
--    UNIQUE (client_id, idempotency_key) index still holds; it catches a
--    writer that skipped the lock, within one partition only.
-- 4. At most one live row per key exists (1-3), so existing has at most one
--    row; ORDER BY created_at DESC LIMIT 1 is only a guard for a claim whose
--    now() (transaction start) predates the previous holder's by the lock
--    wait, which could see an old row as still live.
-- 5. The renewal (stale takeover, released key) targets that row by its
--    lock_token (unique: a sequence) and created_at (prunes to its
--    partition). A released key replaced by another request gets
--    created_at = now() as in claimSQL, which moves the row to the current
--    partition (an UPDATE of the partition key: delete + insert). Only
--    claims move rows, and they are serialised by the lock; completion and
--    release need status 'started', which a released row is not, so none of
--    them can hit PostgreSQL's "tuple ... was already moved to another
--    partition" error (40001) on it.
--
-- use_lock = false exists only for the stress test (run.sh stress) that
-- shows the lock is needed.
CREATE OR REPLACE FUNCTION :"schema".claim(
    p_client text, p_key text, p_method text, p_path text, p_fp bytea, p_fpver integer,
    p_lockus bigint, p_retus bigint, use_lock boolean DEFAULT true)
RETURNS TABLE (outcome integer, lock_token bigint, operation_id text,
    request_method text, request_path text, request_hash bytea, fingerprint_version integer, status text,
    response_status integer, response_content_type text, response_headers jsonb, response_body bytea,
    created_at timestamptz, locked_at timestamptz, lost boolean)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    IF use_lock THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_client || ':' || p_key, 0));
    END IF;
    RETURN QUERY
    WITH existing AS (
        SELECT k.*,
            (k.status = 'started'
                AND p_lockus > 0 AND k.locked_at < now() - p_lockus * interval '1 microsecond'
                AND k.fingerprint_version = p_fpver AND k.request_hash = p_fp) AS stale,
            (k.status = 'released' AND k.fingerprint_version = p_fpver) AS free
        FROM idempotency_keys k
        WHERE k.client_id = p_client AND k.idempotency_key = p_key
            AND k.created_at >= CASE WHEN p_retus > 0
                THEN now() - p_retus * interval '1 microsecond' ELSE '-infinity' END
        ORDER BY k.created_at DESC
        LIMIT 1
    ), renewed AS (
        UPDATE idempotency_keys k SET
            request_method = p_method,
            request_path = p_path,
            request_hash = p_fp,
            fingerprint_version = p_fpver,
            status = 'started',
            operation_id = CASE WHEN k.status = 'released' AND k.request_hash <> p_fp
                THEN gen_random_uuid() ELSE k.operation_id END,
            lock_token = nextval('idempotency_lock_tokens'),
            created_at = CASE WHEN k.status = 'released' AND k.request_hash <> p_fp
                THEN now() ELSE k.created_at END,
            locked_at = now(),
            response_status = NULL,
            response_content_type = NULL,
            response_headers = NULL,
            response_body = NULL
        WHERE k.client_id = p_client AND k.idempotency_key = p_key
            AND k.lock_token = (SELECT e.lock_token FROM existing e)
            AND k.created_at = (SELECT e.created_at FROM existing e)
            AND k.status = (SELECT e.status FROM existing e)
            AND ((k.status = 'released' AND k.fingerprint_version = p_fpver)
                OR (k.status = 'started'
                    AND p_lockus > 0 AND k.locked_at < now() - p_lockus * interval '1 microsecond'
                    AND k.fingerprint_version = p_fpver AND k.request_hash = p_fp))
        RETURNING k.lock_token, k.operation_id,
            k.created_at = now() OR (SELECT e.status FROM existing e) = 'released' AS claimed
    ), inserted AS (
        INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
            request_hash, fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
        SELECT p_client, p_key, p_method, p_path, p_fp, p_fpver, 'started', gen_random_uuid(),
            nextval('idempotency_lock_tokens'), now(), now()
        WHERE NOT EXISTS (SELECT FROM existing)
        ON CONFLICT DO NOTHING
        RETURNING lock_token, operation_id
    )
    SELECT 1, i.lock_token, i.operation_id::text,
        NULL::text, NULL::text, NULL::bytea, NULL::integer, NULL::text,
        NULL::integer, NULL::text, NULL::jsonb, NULL::bytea, NULL::timestamptz, NULL::timestamptz, false
    FROM inserted i
    UNION ALL
    SELECT CASE WHEN r.claimed THEN 1 ELSE 2 END, r.lock_token, r.operation_id::text,
        NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false
    FROM renewed r
    UNION ALL
    SELECT 3, NULL, NULL,
        e.request_method, e.request_path, e.request_hash, e.fingerprint_version, e.status,
        e.response_status, e.response_content_type, e.response_headers, e.response_body, e.created_at, e.locked_at,
        e.stale OR e.free
    FROM existing e
    WHERE NOT EXISTS (SELECT FROM renewed);
END $$;
