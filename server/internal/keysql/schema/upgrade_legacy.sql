-- Upgrade of the key table created by idem-server before package pgstore
-- (the reference server's schema versions 1 to 3, recorded in
-- idem_schema_migrations) to pgstore's version 1: the lease and the
-- retention stored with each key, and its expiry.
--
-- Those servers counted retention from created_at and the lock timeout
-- from locked_at with their own flags; rows written before the upgrade get
-- the defaults of those flags (24h, 30s) and keep the expiry they had:
-- created_at + 24h, or, for a started key, 24h after its lock ran out.
-- The UPDATE rewrites every row once, under the migration's lock. The
-- defaults stay, for the earlier replicas still serving during a rolling
-- upgrade (see legacy_replicas.sql).
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS release_rejected boolean NOT NULL DEFAULT false;
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS lease_us bigint NOT NULL DEFAULT 30000000;
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS retention_us bigint NOT NULL DEFAULT 86400000000;
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS expires_at timestamptz;
UPDATE idempotency_keys SET
    locked_at = coalesce(locked_at, created_at),
    expires_at = CASE WHEN status = 'started'
        THEN coalesce(locked_at, created_at) + interval '30 seconds' + interval '24 hours'
        ELSE created_at + interval '24 hours' END;
ALTER TABLE idempotency_keys ALTER COLUMN locked_at SET NOT NULL;
ALTER TABLE idempotency_keys ALTER COLUMN locked_at SET DEFAULT now();
-- Its CHECK constraints (a status of started or completed only, among
-- them) go with drop_checks.sql, which Migrate applies next.
DROP INDEX IF EXISTS idempotency_keys_created_idx;
CREATE INDEX idempotency_keys_expires_idx ON idempotency_keys (expires_at) WHERE expires_at IS NOT NULL;
