-- Schema version 1 of the idem reference server: the article's
-- idempotency_keys and payments tables, plus the fake card processor's
-- charges. Applied by server.Migrate, which records it in
-- idem_schema_migrations; IF NOT EXISTS keeps it harmless to run again.

-- Fencing tokens. Every claim and every takeover of a key takes the next
-- value, so a token names one ownership of one key and is never reused; a
-- completion or release whose token is no longer on the row is fenced.
CREATE SEQUENCE IF NOT EXISTS idempotency_lock_tokens AS bigint;

CREATE TABLE IF NOT EXISTS idempotency_keys (
    client_id             text        NOT NULL,  -- keys are scoped by the authenticated client
    idempotency_key       text        NOT NULL,
    request_method        text        NOT NULL,
    request_path          text        NOT NULL,
    request_hash          bytea       NOT NULL,  -- SHA-256 of the canonical request
    fingerprint_version   integer     NOT NULL,  -- version of the canonical form request_hash was made with
    status                text        NOT NULL,  -- 'started' | 'completed'
    operation_id          uuid        NOT NULL,  -- the logical operation; kept across takeovers, new after expiry
    lock_token            bigint      NOT NULL,  -- fencing token of the current owner
    response_status       integer,
    response_content_type text,
    response_headers      jsonb,                 -- the other replayed headers (Location), as a JSON object
    -- bytea, not the article's jsonb: jsonb stores the parsed document and
    -- gives back its own key order and whitespace (and accepts JSON only),
    -- while a replay must be the first response byte for byte.
    response_body         bytea,
    created_at            timestamptz NOT NULL DEFAULT now(),  -- retention counts from here
    locked_at             timestamptz,                         -- the lock timeout counts from here
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (client_id, idempotency_key),
    CONSTRAINT idempotency_keys_key_check CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255),
    CONSTRAINT idempotency_keys_status_check CHECK (status IN ('started', 'completed')),
    CONSTRAINT idempotency_keys_response_check CHECK ((status = 'completed') = (response_status IS NOT NULL)),
    CONSTRAINT idempotency_keys_response_status_check CHECK (response_status BETWEEN 100 AND 599)
);

-- The purge job walks this index, oldest first, in bounded batches.
CREATE INDEX IF NOT EXISTS idempotency_keys_created_idx ON idempotency_keys (created_at);

CREATE TABLE IF NOT EXISTS payments (
    payment_id      text        NOT NULL,
    client_id       text        NOT NULL,
    customer_id     text        NOT NULL,
    amount          bigint      NOT NULL,  -- in the currency's minor unit
    currency        text        NOT NULL,
    idempotency_key text        NOT NULL,  -- the key the payment was created with
    operation_id    uuid        NOT NULL,  -- idempotency_keys.operation_id
    charge_id       text,                  -- the card processor's charge
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT payments_pkey PRIMARY KEY (payment_id),
    -- The safety net: one payment per operation, also once the key row has
    -- been purged, and also if a fenced request ever got past its fence.
    CONSTRAINT payments_client_operation_key UNIQUE (client_id, operation_id),
    CONSTRAINT payments_amount_check CHECK (amount > 0),
    CONSTRAINT payments_currency_check CHECK (currency <> '')
);

-- The fake card processor's charges: one per downstream idempotency key.
CREATE TABLE IF NOT EXISTS charges (
    charge_id       text        NOT NULL,
    idempotency_key text        NOT NULL,  -- derived by the payments API from (client, operation)
    amount          bigint      NOT NULL,
    currency        text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT charges_pkey PRIMARY KEY (charge_id),
    CONSTRAINT charges_idempotency_key_key UNIQUE (idempotency_key)
);
