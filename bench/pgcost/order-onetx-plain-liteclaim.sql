\set k random(1, 1000000000000)
BEGIN;
SELECT pg_try_advisory_xact_lock(hashtextextended(('k'||:k), hashtextextended('zz', 'idempotency_keys'::regclass::oid::bigint))) AS held, nextval('idempotency_lock_tokens') AS tok, gen_random_uuid()::text AS op, statement_timestamp() AS created, EXISTS (SELECT FROM idempotency_keys k WHERE k.client_id = 'zz' AND k.idempotency_key = ('k'||:k)) AS found \gset
INSERT INTO bench_orders(client_id, customer, amount, currency) VALUES ('zz', 'cus_1', 100, 'usd');
INSERT INTO idempotency_keys (client_id, idempotency_key, lock_token, status,
    response_status, response_content_type, response_headers, response_body,
    request_method, request_path, request_hash, fingerprint_version, operation_id,
    created_at, locked_at, lease_us, retention_us, expires_at)
VALUES ('zz', ('k'||:k), :tok, 'completed', 201, 'application/json', '{"Location": "/v1/orders/ord_x"}'::jsonb, convert_to(repeat('x', 200), 'UTF8'), 'POST', '/v1/orders', '\x0001020304050607080900010203040506070809000102030405060708090001'::bytea, 1, :op::uuid, :created::timestamptz, statement_timestamp(), 30000000, 86400000000,
    CASE WHEN 86400000000::bigint > 0 THEN statement_timestamp() + 86400000000::bigint * interval '1 microsecond' END);
COMMIT;
