-- Functional checks of claim() on schema part (run.sh check). Each SELECT
-- shows what it expects in its column names.
\set fp '\'\\x01\'::bytea'
\set fp2 '\'\\x02\'::bytea'
SET search_path = part, public;
DELETE FROM idempotency_keys WHERE client_id = 'check';
-- 1. A first claim inserts into the current partition; a second finds it.
SELECT outcome AS expect_1 FROM claim('check', 'k1', 'POST', '/p', :fp, 1, 30000000, 86400000000);
SELECT outcome AS expect_3, status AS expect_started, lost AS expect_f FROM claim('check', 'k1', 'POST', '/p', :fp, 1, 30000000, 86400000000);
-- 2. A live key in an older partition is found.
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
    fingerprint_version, status, operation_id, lock_token, response_status, created_at, locked_at)
VALUES ('check', 'k2', 'POST', '/p', :fp, 1, 'completed', gen_random_uuid(), nextval('idempotency_lock_tokens'), 201,
    now() - interval '23 hours', now() - interval '23 hours');
SELECT outcome AS expect_3, status AS expect_completed FROM claim('check', 'k2', 'POST', '/p', :fp, 1, 30000000, 86400000000);
-- 3. An expired key (25 h, possibly in a partition not dropped yet) is claimed
--    afresh: a new row, a new operation, in the current partition.
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
    fingerprint_version, status, operation_id, lock_token, response_status, created_at, locked_at)
VALUES ('check', 'k3', 'POST', '/p', :fp, 1, 'completed', '00000000-0000-0000-0000-000000000003', nextval('idempotency_lock_tokens'), 201,
    now() - interval '25 hours', now() - interval '25 hours');
SELECT outcome AS expect_1, operation_id <> '00000000-0000-0000-0000-000000000003' AS expect_t
FROM claim('check', 'k3', 'POST', '/p', :fp, 1, 30000000, 86400000000);
SELECT count(*) AS expect_2_rows, count(DISTINCT tableoid) AS expect_2_partitions
FROM idempotency_keys WHERE client_id = 'check' AND idempotency_key = 'k3';
-- 4. A stale started key (lock timeout 1 s) is taken over in its partition.
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
    fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
VALUES ('check', 'k4', 'POST', '/p', :fp, 1, 'started', '00000000-0000-0000-0000-000000000004', nextval('idempotency_lock_tokens'),
    now() - interval '23 hours', now() - interval '23 hours');
SELECT outcome AS expect_2, operation_id AS expect_op_4 FROM claim('check', 'k4', 'POST', '/p', :fp, 1, 1000000, 86400000000);
-- 5. A released key of an older partition: the same request resumes it
--    (same operation); another request replaces it and its row moves to the
--    current partition (created_at now()).
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
    fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
VALUES ('check', 'k5', 'POST', '/p', :fp, 1, 'released', '00000000-0000-0000-0000-000000000005', nextval('idempotency_lock_tokens'),
    now() - interval '23 hours', now() - interval '23 hours');
SELECT tableoid::regclass AS old_partition FROM idempotency_keys WHERE client_id = 'check' AND idempotency_key = 'k5';
SELECT outcome AS expect_1, operation_id AS expect_op_5 FROM claim('check', 'k5', 'POST', '/p', :fp, 1, 30000000, 86400000000);
UPDATE idempotency_keys SET status = 'released' WHERE client_id = 'check' AND idempotency_key = 'k5';
SELECT outcome AS expect_1, operation_id <> '00000000-0000-0000-0000-000000000005' AS expect_t
FROM claim('check', 'k5', 'POST', '/p', :fp2, 1, 30000000, 86400000000);
SELECT tableoid::regclass AS new_partition, created_at > now() - interval '1 minute' AS expect_t
FROM idempotency_keys WHERE client_id = 'check' AND idempotency_key = 'k5';
-- 6. Completion finds the row by lock token, whatever its partition.
SELECT lock_token AS tok FROM claim('check', 'k6', 'POST', '/p', :fp, 1, 30000000, 86400000000) \gset
UPDATE idempotency_keys SET status = 'completed', response_status = 201
WHERE client_id = 'check' AND idempotency_key = 'k6' AND lock_token = :tok AND status = 'started'
RETURNING 'completed' AS expect_completed;
-- 7. The per-partition unique index is an arbiter of ON CONFLICT DO NOTHING
--    on the parent: a duplicate in one partition is not inserted.
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
    fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
VALUES ('check', 'k1', 'POST', '/p', :fp, 1, 'started', gen_random_uuid(), nextval('idempotency_lock_tokens'), now(), now())
ON CONFLICT DO NOTHING;
SELECT count(*) AS expect_1 FROM idempotency_keys WHERE client_id = 'check' AND idempotency_key = 'k1';
DELETE FROM idempotency_keys WHERE client_id = 'check';
