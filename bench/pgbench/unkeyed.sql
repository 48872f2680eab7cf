-- One unkeyed POST /v1/payments of the reference server started with
-- -no-idempotency, as pgbench runs it: insert the card processor's charge,
-- then insert the payment in a transaction of its own (BEGIN, INSERT,
-- COMMIT, as PostgresStorage.CreatePayment does outside a keyed request).
-- The database's side of the load test's "unkeyed" scenario (c), to set
-- against first.sql (a). GENERATED from server/postgres.go by
-- bench/pgbench_test.go (go test -run TestPgbenchScripts -update); do not
-- edit.
--
-- The same substitutions as first.sql; the payment's id, key and operation
-- are what the server derives from a fresh random operation ID: here the
-- random :key, '' (no key) and gen_random_uuid()::text.

\set key random(1, 9000000000000000000)
\set amount random(100, 100000)

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
-- insertPaymentSQL
INSERT INTO payments (payment_id, client_id, customer_id, amount, currency,
    idempotency_key, operation_id, charge_id, created_at)
VALUES ('pay_' || :key, :client, :customer, :amount, :currency, '', nullif(gen_random_uuid()::text, '')::uuid, nullif(:ch_charge_id, ''), coalesce(NULL::timestamptz, now()))
ON CONFLICT DO NOTHING;
COMMIT;
