-- The seed article's two commits by hand (bench/cmd/benchserver/article.go):
-- the claim committed on its own, then the order and the completion.
\set k random(1, 1000000000000)
INSERT INTO idempotency_keys_article (client_id, idempotency_key, request_method, request_path, request_hash, status, locked_at)
VALUES ('zz', ('k'||:k), 'POST', '/v1/orders', '\x0001020304050607080900010203040506070809000102030405060708090001'::bytea, 'started', now())
ON CONFLICT (client_id, idempotency_key) DO NOTHING
RETURNING 1;
BEGIN;
INSERT INTO bench_orders(client_id, customer, amount, currency) VALUES ('zz', 'cus_1', 100, 'usd');
UPDATE idempotency_keys_article SET status = 'completed', response_status = 201, response_body = ('{"x":"' || repeat('x', 190) || '"}')::jsonb
WHERE client_id = 'zz' AND idempotency_key = ('k'||:k);
COMMIT;
