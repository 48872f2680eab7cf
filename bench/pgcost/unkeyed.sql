\set k random(1, 1000000000000)
INSERT INTO charges(charge_id, idempotency_key, amount, currency) VALUES ('ch_'||:k, 'idem_ch_'||:k, 100, 'usd');
BEGIN;
INSERT INTO payments(payment_id, client_id, customer_id, amount, currency, idempotency_key, operation_id, charge_id) VALUES ('pay_'||:k, 'zz', 'cus_1', 100, 'usd', 'k'||:k, gen_random_uuid(), 'ch_'||:k);
COMMIT;
