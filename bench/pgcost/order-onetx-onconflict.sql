\set k random(1, 1000000000000)
BEGIN;
WITH existing AS (
    SELECT k.*,
        (k.retention_us > 0 AND (k.status <> 'started' OR k.lease_us > 0)
        AND greatest(k.expires_at, k.locked_at + (k.retention_us
            + CASE WHEN k.status = 'started' THEN k.lease_us ELSE 0 END) * interval '1 microsecond') < statement_timestamp()) IS TRUE AS expired,
        (((k.retention_us > 0 AND (k.status <> 'started' OR k.lease_us > 0)
        AND greatest(k.expires_at, k.locked_at + (k.retention_us
            + CASE WHEN k.status = 'started' THEN k.lease_us ELSE 0 END) * interval '1 microsecond') < statement_timestamp())) AND (false::boolean OR k.created_at >= NULL::timestamptz) IS TRUE) AS refused,
        ((k.status = 'started' AND k.lease_us > 0 AND k.locked_at < statement_timestamp() - k.lease_us * interval '1 microsecond') AND k.fingerprint_version = 1 AND k.request_hash = '\x0001020304050607080900010203040506070809000102030405060708090001'::bytea) AS stale,
        (k.status = 'released' AND k.fingerprint_version = 1
            AND (k.release_rejected OR k.request_hash = '\x0001020304050607080900010203040506070809000102030405060708090001'::bytea)) AS free
    FROM idempotency_keys k
    WHERE k.client_id = 'zz' AND k.idempotency_key = ('k'||:k)
), probe AS (
    SELECT CASE WHEN EXISTS (SELECT FROM existing) OR false::boolean THEN NULL
        ELSE pg_try_advisory_xact_lock(hashtextextended(('k'||:k), hashtextextended('zz', 'idempotency_keys'::regclass::oid::bigint))) END AS held,
        'POST'::text AS method, '/v1/orders'::text AS path, 30000000::bigint AS lease_us, 86400000000::bigint AS retention_us 
)
SELECT 1 AS outcome, nextval('idempotency_lock_tokens') AS tok, gen_random_uuid()::text AS op,
    NULL::text AS c0, NULL::text AS c1, NULL::bytea AS c2, NULL::integer AS c3, NULL::text AS c4,
    NULL::integer AS c5, NULL::text AS c6, NULL::jsonb AS c7, NULL::bytea AS c8, statement_timestamp() AS created, NULL::timestamptz AS c98, false AS c99
FROM probe WHERE held
UNION ALL
SELECT 5, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false
FROM probe WHERE NOT held
UNION ALL
SELECT CASE WHEN refused THEN 4 ELSE 3 END, NULL, NULL,
    request_method, request_path, request_hash, fingerprint_version, status,
    response_status, response_content_type, response_headers, response_body, created_at, locked_at,
    (expired OR stale OR free) AND NOT refused
FROM existing
UNION ALL
SELECT 4, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false
WHERE false::boolean AND NOT EXISTS (SELECT FROM existing) \gset
INSERT INTO bench_orders(client_id, customer, amount, currency) VALUES ('zz', 'cus_1', 100, 'usd');
INSERT INTO idempotency_keys (client_id, idempotency_key, lock_token, status,
    response_status, response_content_type, response_headers, response_body,
    request_method, request_path, request_hash, fingerprint_version, operation_id,
    created_at, locked_at, lease_us, retention_us, expires_at)
VALUES ('zz', ('k'||:k), :tok, 'completed', 201, 'application/json', '{"Location": "/v1/orders/ord_x"}'::jsonb, convert_to(repeat('x', 200), 'UTF8'), 'POST', '/v1/orders', '\x0001020304050607080900010203040506070809000102030405060708090001'::bytea, 1, :op::uuid, :created::timestamptz, statement_timestamp(), 30000000, 86400000000,
    CASE WHEN 86400000000::bigint > 0 THEN statement_timestamp() + 86400000000::bigint * interval '1 microsecond' END)
ON CONFLICT (client_id, idempotency_key) DO NOTHING;
COMMIT;
