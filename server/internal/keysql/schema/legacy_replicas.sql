-- A compatible step of the key table (see Migrate): defaults for the replicas of an idem-server
-- from before package pgstore (the reference server's schema versions 1 to
-- 3) that still serve beside the new ones during a rolling upgrade. Their
-- claims insert keys without lease_us, retention_us and expires_at, which
-- the upgrade to version 1 left without a default (every insert of theirs
-- failed on NOT NULL); the defaults are their flags' defaults (a 30 s lock timeout, a
-- 24 h retention) and the expiry that follows for a key claimed now. They
-- claim, complete and release keys without touching expires_at either; the
-- store computes a started key's expiry again from locked_at (see
-- expiredExpr), so a key one of them has claimed never counts as expired
-- under it. This package always writes the three columns itself.
ALTER TABLE idempotency_keys ALTER COLUMN lease_us SET DEFAULT 30000000;
ALTER TABLE idempotency_keys ALTER COLUMN retention_us SET DEFAULT 86400000000;
ALTER TABLE idempotency_keys ALTER COLUMN expires_at SET DEFAULT now() + interval '24 hours 30 seconds';
