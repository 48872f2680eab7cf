-- Schema version 2: a third key status, 'released'.
--
-- Store.Release used to delete the key, so the next claim of it got a new
-- operation_id, and a request that had charged downstream (keyed by the
-- operation) before failing could be charged again by its retry. A
-- released key now stays, marked 'released', with its operation_id,
-- request and created_at: the retry of the same request resumes the
-- operation, another request replaces it, and the purge job deletes it by
-- created_at like any other key. See claimSQL in postgres.go.
--
-- Applied once by server.Migrate (recorded in idem_schema_migrations, under
-- its advisory lock); the DROP ... IF EXISTS keeps it harmless if run again.
--
-- NOT VALID skips the scan of existing rows, which would run under the
-- ACCESS EXCLUSIVE lock of ALTER TABLE and block every claim meanwhile:
-- every existing row passed the old, narrower check ('started' or
-- 'completed'), so it passes this one. The constraint is enforced for
-- every row written from now on.
ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_status_check;
ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_status_check
    CHECK (status IN ('started', 'completed', 'released')) NOT VALID;

COMMENT ON COLUMN idempotency_keys.status IS
    'started (claimed, running or crashed) | completed (outcome stored) | released (given up without an outcome; keeps operation_id for the retry of the same request)';
