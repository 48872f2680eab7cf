\set r random(1, 9000000000000000000)
INSERT INTO idempotency_keys_article (client_id, idempotency_key, request_method, request_path, request_hash, status, locked_at) VALUES ('cli_demo', ('k' || :r::bigint), 'POST', '/article/v1/payments', '\x00112233', 'started', now()) ON CONFLICT (client_id, idempotency_key) DO NOTHING RETURNING 1;
BEGIN;
INSERT INTO bench_payments (client_id, customer, amount, currency, charge_id) VALUES ('cli_demo', 'cus_1', 100, 'usd', 'ch_x') RETURNING id;
UPDATE idempotency_keys_article SET status = 'completed', response_status = 201, response_body = '{}' WHERE client_id = 'cli_demo' AND idempotency_key = ('k' || :r::bigint);
COMMIT;
