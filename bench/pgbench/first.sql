-- One first execution of POST /v1/payments on the reference server on
-- PostgreSQL, as pgbench runs it: claim the key (pgstore), insert the card
-- processor's charge, then in one transaction insert the payment (the
-- handler's write through pgstore.TxFromContext) and complete the key
-- (pgstore's completion, sent with the COMMIT). GENERATED from
-- server/postgres.go and server/pgstore by bench/pgbench_test.go (go test
-- -run TestPgbenchScripts -update); do not edit.
--
-- The statements are the server's, with its $n parameters as pgbench
-- variables, and these changes, which pgbench needs and which leave the
-- plans alone: unnamed result columns of the claim and the charge are
-- named (\gset needs names); the charge's $1 is '' and $5 NULL, and the
-- payment's created_at NULL, as the server sends them. pgbench runs BEGIN,
-- the INSERT, the SHOW, the completion and COMMIT as five round trips; the
-- server pipelines BEGIN with the INSERT and the SHOW, and the completion
-- with the COMMIT (two): the same WAL flushes.
--
-- Variables (-D, see bench/pgbench/run.sh): client method path fp fpver
-- lockus retus status ctype hdr body customer currency.

\set key random(1, 9000000000000000000)
\set amount random(100, 100000)

-- claimNewSQL
WITH existing AS (
    SELECT k.*,
        (k.retention_us > 0 AND (k.status <> 'started' OR k.lease_us > 0)
        AND greatest(k.expires_at, k.locked_at + (k.retention_us
            + CASE WHEN k.status = 'started' THEN k.lease_us ELSE 0 END) * interval '1 microsecond') < statement_timestamp()) IS TRUE AS expired,
        (((k.retention_us > 0 AND (k.status <> 'started' OR k.lease_us > 0)
        AND greatest(k.expires_at, k.locked_at + (k.retention_us
            + CASE WHEN k.status = 'started' THEN k.lease_us ELSE 0 END) * interval '1 microsecond') < statement_timestamp())) AND (false::boolean OR k.created_at >= NULL::timestamptz::timestamptz) IS TRUE) AS refused,
        ((k.status = 'started' AND k.lease_us > 0 AND k.locked_at < statement_timestamp() - k.lease_us * interval '1 microsecond') AND k.fingerprint_version = :fpver AND k.request_hash = :fp) AS stale,
        (k.status = 'released' AND k.fingerprint_version = :fpver
            AND (k.release_rejected OR k.request_hash = :fp)) AS free
    FROM idempotency_keys k
    WHERE k.client_id = :client AND k.idempotency_key = :key
), inserted AS (
    INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
        request_hash, fingerprint_version, status, operation_id, lock_token, created_at, locked_at,
        lease_us, retention_us, expires_at)
    SELECT :client, :key, :method, :path, :fp, :fpver, 'started', gen_random_uuid(), nextval('idempotency_lock_tokens'), statement_timestamp(), statement_timestamp(),
        :lockus, :retus, CASE WHEN :lockus::bigint > 0 AND :retus::bigint > 0
            THEN statement_timestamp() + (:lockus::bigint + :retus::bigint) * interval '1 microsecond' END
    WHERE NOT EXISTS (SELECT FROM existing) AND NOT false::boolean
    ON CONFLICT (client_id, idempotency_key) DO NOTHING
    RETURNING lock_token, operation_id
)
SELECT 1 AS outcome, lock_token, operation_id::text,
    NULL::text, NULL::text, NULL::bytea, NULL::integer, NULL::text,
    NULL::integer, NULL::text, NULL::jsonb, NULL::bytea, NULL::timestamptz, NULL::timestamptz, false AS lost
FROM inserted
UNION ALL
SELECT CASE WHEN refused THEN 4 ELSE 3 END, NULL, NULL,
    request_method, request_path, request_hash, fingerprint_version, status,
    response_status, response_content_type, response_headers, response_body, created_at, locked_at,
    (expired OR stale OR free) AND NOT refused
FROM existing
UNION ALL
SELECT 4, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false
WHERE false::boolean AND NOT EXISTS (SELECT FROM existing)
\gset

-- createChargeSQL (the fake card processor)
WITH inserted AS (
    INSERT INTO charges (charge_id, idempotency_key, amount, currency, customer_id, created_at)
    VALUES (coalesce(nullif('', ''), 'ch_' || replace(gen_random_uuid()::text, '-', '')), :key, :amount, :currency, nullif(:customer, ''),
        coalesce(NULL::timestamptz, now()))
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING charge_id, idempotency_key, amount, currency, customer_id, created_at
)
SELECT charge_id, idempotency_key, amount, currency, coalesce(customer_id, ''), created_at, true AS created FROM inserted
UNION ALL
SELECT charge_id, idempotency_key, amount, currency, coalesce(customer_id, ''), created_at, false FROM charges
WHERE idempotency_key = :key AND NOT EXISTS (SELECT FROM inserted)
\gset ch_

BEGIN;
-- insertPaymentSQL (the handler's write)
INSERT INTO payments (payment_id, client_id, customer_id, amount, currency,
    idempotency_key, operation_id, charge_id, created_at)
VALUES ('pay_' || :key, :client, :customer, :amount, :currency, :key, nullif(:operation_id, '')::uuid, nullif(:ch_charge_id, ''), coalesce(NULL::timestamptz, now()));
-- showIsolationSQL (pgstore reads the isolation level with the first statement)
SHOW transaction_isolation;
-- completeInTxSQL (the key's completion)
WITH done AS (
UPDATE idempotency_keys SET
    status = 'completed',
    response_status = :status,
    response_content_type = :ctype,
    response_headers = :hdr,
    response_body = :body,
    expires_at = CASE WHEN retention_us > 0 THEN statement_timestamp() + retention_us * interval '1 microsecond' END
WHERE client_id = :client AND idempotency_key = :key AND lock_token = :lock_token AND status = 'started'
    RETURNING 1)
SELECT 1 / (SELECT count(*)::integer FROM done);
COMMIT;
