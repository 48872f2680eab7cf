-- The service's own table. River's tables come from rivermigrate and the
-- key table from pgstore.Migrate, all in the same database: the order, its
-- job and the key's outcome commit in one transaction.
CREATE TABLE IF NOT EXISTS orders (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant       text    NOT NULL, -- idempotency.ClientIDFromContext: the client the key is scoped by
    operation_id text    NOT NULL, -- idempotency.Claim.OperationID: the shipment's key derives from it
    item         text    NOT NULL,
    qty          integer NOT NULL,
    shipment_id  text              -- set by the worker, in the transaction that completes the job
);
