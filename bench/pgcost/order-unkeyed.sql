\set k random(1, 1000000000000)
BEGIN;
INSERT INTO bench_orders(client_id, customer, amount, currency) VALUES ('zz', 'cus_1', 100, 'usd');
COMMIT;
