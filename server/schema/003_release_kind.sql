-- Schema version 3: what a released key's request may have left behind.
--
-- A released key used to be free for any request: with another request's
-- fingerprint, the claim replaced its operation. That is right after a
-- request refused before it did anything (a 400, whose corrected retry is
-- a new request), and wrong after one that failed once it may have charged
-- the card (the processor's answer lost, then a 502): the other request
-- got a new operation, so the first charge was left without a payment, or
-- the card was charged twice. Store.Release now says which kind of release
-- it is (server.ReleaseKind), and claimSQL in postgres.go replaces the
-- operation of a released key only when it was released as rejected;
-- otherwise only the same request may claim it, and resumes it.
--
-- Rows released before this migration did not record their kind. They get
-- false, the safe answer: only their own request may claim them. Adding a
-- column with a constant default rewrites no rows (PostgreSQL 11 and
-- later), so the ALTER TABLE holds its lock only for a moment.
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS release_rejected boolean NOT NULL DEFAULT false;

COMMENT ON COLUMN idempotency_keys.release_rejected IS
    'read while status = released: true when the request was refused before it did anything (any request may claim the key next), false when it failed after it may have done work keyed by its operation (only the same request may claim the key, and resumes the operation)';
