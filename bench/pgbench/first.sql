-- One first execution of POST /v1/payments on the reference server on
-- PostgreSQL, as pgbench runs it: claim the key (pgstore), insert the card
-- processor's charge, then in one transaction insert the payment (the
-- handler's write through pgstore.Tx) and complete the key
-- (pgstore's completion, sent with the COMMIT). GENERATED from
-- server/postgres.go and server/pgstore by bench/pgbench_test.go (go test
-- -run TestPgbenchScripts -update); do not edit.
--
-- The statements are the server's, with its $n parameters as pgbench
-- variables, and these changes, which pgbench needs and which leave the
-- plans alone: an unnamed result column of the charge is
-- named (\gset needs names); the charge's $1 is '' and $5 NULL, and the
-- payment's created_at NULL, as the server sends them. pgbench runs BEGIN,
-- the transaction's ID, the INSERT, the completion and COMMIT as five
-- round trips; the server pipelines BEGIN with the transaction's ID, and
-- the completion with the COMMIT (three, with the INSERT): the same WAL
-- flushes.
--
-- Variables (-D, see bench/pgbench/run.sh): client method path fp lockus
-- retus status ctype hdr body customer currency.

\set key random(1, 9000000000000000000)
\set amount random(100, 100000)

-- claimInsertSQL
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
    request_hash, status, operation_id, lock_token, created_at, locked_at,
    lease_us, retention_us, expires_at)
SELECT :client::text, :key::text, :method::text, :path::text, :fp::bytea, 'started', md5(:key::text)::uuid::uuid, :key::bigint,
    statement_timestamp(), statement_timestamp(), :lockus::bigint, :retus::bigint, CASE WHEN :retus::bigint > 0
            THEN statement_timestamp() + :retus::bigint * interval '1 microsecond' END
WHERE pg_try_advisory_xact_lock_shared(hashtextextended(:key, hashtextextended(:client, 'idempotency_keys'::regclass::oid::bigint)))
ON CONFLICT (client_id, idempotency_key) DO NOTHING;

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
-- txIDSQL (pgstore reads the transaction's ID and level with the BEGIN)
SELECT pg_current_xact_id()::text AS xid,
    current_setting('transaction_isolation') IN ('repeatable read', 'serializable') AS snapshot
\gset
-- insertPaymentSQL (the handler's write)
INSERT INTO payments (payment_id, client_id, customer_id, amount, currency,
    idempotency_key, operation_id, charge_id, created_at)
VALUES ('pay_' || :key, :client, :customer, :amount, :currency, :key, nullif(md5(:key::text), '')::uuid, nullif(:ch_charge_id, ''), coalesce(NULL::timestamptz, now()))
ON CONFLICT DO NOTHING;
-- completeInTxSQL (the key's completion, checked to run in the transaction begun)
WITH done AS (
UPDATE idempotency_keys SET
    status = 'completed',
    response_status = :status,
    response_content_type = :ctype,
    response_headers = :hdr::jsonb,
    response_body = :body,
    locked_at = statement_timestamp()
WHERE client_id = :client AND idempotency_key = :key AND lock_token = :key AND status = 'started'
    RETURNING 1)
SELECT ((CASE WHEN pg_current_xact_id() = (:xid)::text::xid8 THEN 0 ELSE 2147483647 END) + 1) * 0 + 1 / (SELECT count(*)::integer FROM done);
COMMIT;
