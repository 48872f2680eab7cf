-- A compatible step of the key table (see Migrate): the CHECK constraints
-- that pgstore's first release created (keys.sql, and the idem-server
-- before it) are dropped. PostgreSQL reads every CHECK expression of a
-- table back from its stored text for each INSERT and UPDATE; these five
-- cost about 40 µs of PostgreSQL's CPU per first execution (a claim and a
-- completion), a tenth of what the key table costs it. The stores are the
-- table's only writers, and keep the rules themselves: a claim refuses a
-- key outside 1 to 255 bytes and a completion a status outside 100 to 599
-- before they reach PostgreSQL, and a row read that breaks one (an unknown
-- status, a completed key without a response) is an error, never a replay.
-- Replicas of the same version serve beside a table without them. The
-- ALTER TABLE needs the table's ACCESS EXCLUSIVE lock, and every claim
-- queues behind it while it waits, so Migrate waits at most 100 ms for it,
-- three times, and leaves the step to a later start when a transaction
-- holds the table that long (applyBriefly): the constraints only cost
-- time.
ALTER TABLE idempotency_keys
    DROP CONSTRAINT IF EXISTS idempotency_keys_key_check,
    DROP CONSTRAINT IF EXISTS idempotency_keys_status_check,
    DROP CONSTRAINT IF EXISTS idempotency_keys_response_check,
    DROP CONSTRAINT IF EXISTS idempotency_keys_response_status_check,
    DROP CONSTRAINT IF EXISTS idempotency_keys_lease_check;
