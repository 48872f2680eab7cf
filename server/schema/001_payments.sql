-- Schema version 1 of the reference payments server's own tables: the
-- payments and the fake card processor's charges. Applied by
-- server.Migrate, which records it in idem_server_migrations; the key
-- table is pgstore's (pgstore.Migrate). IF NOT EXISTS keeps it harmless on
-- a database of an earlier idem-server, which created the same tables.

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
