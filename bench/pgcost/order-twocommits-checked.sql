\set k random(1, 1000000000000)
INSERT INTO idempotency_keys_checked (client_id, idempotency_key, request_method, request_path,
    request_hash, fingerprint_version, status, operation_id, lock_token, created_at, locked_at,
    lease_us, retention_us, expires_at)
VALUES ('zz', ('k'||:k), 'POST', '/v1/orders', '\x0001020304050607080900010203040506070809000102030405060708090001'::bytea, 1, 'started', gen_random_uuid(), nextval('idempotency_lock_tokens'),
    statement_timestamp(), statement_timestamp(), 30000000, 86400000000, CASE WHEN 30000000::bigint > 0 AND 86400000000::bigint > 0
            THEN statement_timestamp() + 86400000000::bigint * interval '1 microsecond' END)
ON CONFLICT (client_id, idempotency_key) DO NOTHING
RETURNING lock_token AS tok, operation_id::text AS op \gset
BEGIN;
INSERT INTO bench_orders(client_id, customer, amount, currency) VALUES ('zz', 'cus_1', 100, 'usd');
WITH done AS (UPDATE idempotency_keys_checked SET
    status = 'completed',
    response_status = 201,
    response_content_type = 'application/json',
    response_headers = '{"Location": "/v1/orders/ord_x"}'::jsonb,
    response_body = convert_to(repeat('x', 200), 'UTF8'),
    locked_at = statement_timestamp(),
    expires_at = CASE WHEN retention_us > 0
        THEN least(expires_at, statement_timestamp() + retention_us * interval '1 microsecond') END
WHERE client_id = 'zz' AND idempotency_key = ('k'||:k) AND lock_token = :tok AND status = 'started'
    RETURNING 1)
SELECT 1 / (SELECT count(*)::integer FROM done);
COMMIT;
