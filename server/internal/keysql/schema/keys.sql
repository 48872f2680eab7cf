-- The key table of package pgstore (version 1), created by pgstore.Migrate
-- in the first schema of the search_path, and recorded there in
-- idempotency_migrations. pgstore owns these three objects and no other:
-- the sequence, the table and its index.

-- Fencing tokens of the claims that renew a key's row (a takeover, a
-- resumed, replaced or expired key, an operator's statements) or insert it
-- after losing a race (ClaimSQL); a new key's first claim carries a random
-- 63-bit token the store draws instead (keysql.NewToken). A renewal,
-- completion or release whose token is no longer on the row is fenced;
-- tokens are only compared for equality.
CREATE SEQUENCE IF NOT EXISTS idempotency_lock_tokens AS bigint;

CREATE TABLE idempotency_keys (
    client_id             text        NOT NULL,  -- keys are scoped by the authenticated client
    idempotency_key       text        NOT NULL,
    request_method        text        NOT NULL,
    request_path          text        NOT NULL,
    request_hash          bytea       NOT NULL,  -- SHA-256 of the canonical request (idempotency.Fingerprint)
    status                text        NOT NULL,  -- started | completed | released
    operation_id          uuid        NOT NULL,  -- the logical operation; kept across takeovers and resumptions
    lock_token            bigint      NOT NULL,  -- fencing token of the current (or last) owner
    release_rejected      boolean     NOT NULL DEFAULT false,  -- released: any request may claim it (true) or only the same one
    response_status       integer,
    response_content_type text,
    response_headers      jsonb,                 -- the other replayed headers (Location), as a JSON object
    -- bytea, not jsonb: a replay must be the first response byte for byte.
    response_body         bytea,
    created_at            timestamptz NOT NULL DEFAULT now(),  -- when the operation began
    locked_at             timestamptz NOT NULL DEFAULT now(),  -- the last claim or renewal of the lease; once finished, when it finished
    lease_us              bigint      NOT NULL,  -- the owner's lease in microseconds; 0: never runs out
    retention_us          bigint      NOT NULL,  -- kept this long after finishing; 0: forever
    -- A bound below the time the key counts as absent, for the purge's
    -- index: greatest(expires_at, locked_at + retention, plus the lease
    -- while started); NULL: never. Written at the claim, so that a
    -- renewal, a completion and a release leave its index unchanged.
    expires_at            timestamptz,
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (client_id, idempotency_key)
);
-- No CHECK constraints: PostgreSQL reads a table's CHECK expressions back
-- from their stored text for every INSERT and UPDATE, so the five this
-- table had (the key's length, the status, a response exactly when
-- completed, the response's status, the lease and retention) cost about
-- 40 µs of PostgreSQL's CPU per first execution, a tenth of it (see
-- bench/NOTES.md). The stores are the table's only writers and check the
-- same rules before they write (a key of 1 to 255 bytes, a status of 100
-- to 599) and when they read a row: a row that breaks one (an unknown
-- status, a completed key without a response) is an error, never a
-- replay.

-- The purge walks this index, from the lowest bound, in bounded batches;
-- keys that never expire (NULL) are not in it.
CREATE INDEX idempotency_keys_expires_idx ON idempotency_keys (expires_at) WHERE expires_at IS NOT NULL;
