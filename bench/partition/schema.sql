-- The partitioned variant of idempotency_keys, in schema :"schema" (psql
-- -v schema=part). The columns and checks are server/schema/001 and 002's;
-- payments, charges and the lock-token sequence stay the public ones.
--
-- RANGE on created_at, one partition per :width (psql -v width='1 day').
-- The width must be at most the retention: then a key and its renewal
-- after expiry are always in different partitions, and each partition can
-- have a UNIQUE (client_id, idempotency_key) index of its own. PostgreSQL
-- refuses that index on the parent (a unique index of a partitioned table
-- must include the partition key), so uniqueness ACROSS partitions is the
-- claim's job: see claim.sql.
--
-- No DEFAULT partition: DETACH ... CONCURRENTLY refuses to run when there is
-- one, and a row in it would block the creation of the partition it belongs
-- to. So partitions must be created ahead of time (make_partitions), or an
-- insert fails with "no partition of relation ... found for row".
CREATE SCHEMA IF NOT EXISTS :"schema";
SET search_path = :"schema", public;

DROP TABLE IF EXISTS :"schema".idempotency_keys CASCADE;
CREATE TABLE :"schema".idempotency_keys (
    client_id             text        NOT NULL,
    idempotency_key       text        NOT NULL,
    request_method        text        NOT NULL,
    request_path          text        NOT NULL,
    request_hash          bytea       NOT NULL,
    fingerprint_version   integer     NOT NULL,
    status                text        NOT NULL,
    operation_id          uuid        NOT NULL,
    lock_token            bigint      NOT NULL,
    response_status       integer,
    response_content_type text,
    response_headers      jsonb,
    response_body         bytea,
    created_at            timestamptz NOT NULL DEFAULT now(),
    locked_at             timestamptz,
    CONSTRAINT idempotency_keys_key_check CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255),
    CONSTRAINT idempotency_keys_status_check CHECK (status IN ('started', 'completed', 'released')),
    CONSTRAINT idempotency_keys_response_check CHECK ((status = 'completed') = (response_status IS NOT NULL)),
    CONSTRAINT idempotency_keys_response_status_check CHECK (response_status BETWEEN 100 AND 599)
) PARTITION BY RANGE (created_at);

-- make_partitions creates the partitions of width w covering [from, to),
-- each with its unique (client_id, idempotency_key) index; existing ones
-- are kept. Bounds are multiples of w since the epoch (w divides a day or
-- is a whole number of days), named idempotency_keys_p<epoch seconds>.
CREATE OR REPLACE FUNCTION make_partitions(w interval, from_ts timestamptz, to_ts timestamptz)
RETURNS integer LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    ws  double precision := extract(epoch FROM w);
    lo  double precision := floor(extract(epoch FROM from_ts) / ws) * ws;
    n   integer := 0;
    rel text;
BEGIN
    WHILE lo < extract(epoch FROM to_ts) LOOP
        rel := 'idempotency_keys_p' || lo::bigint;
        IF to_regclass(quote_ident(current_schema()) || '.' || rel) IS NULL THEN
            EXECUTE format('CREATE TABLE %I PARTITION OF idempotency_keys FOR VALUES FROM (%L) TO (%L)',
                rel, to_timestamp(lo), to_timestamp(lo + ws));
            EXECUTE format('CREATE UNIQUE INDEX %I ON %I (client_id, idempotency_key)', rel || '_key', rel);
            n := n + 1;
        END IF;
        lo := lo + ws;
    END LOOP;
    RETURN n;
END $$;

-- expired_partitions lists the partitions whose every row is expired: upper
-- bound at or before now() - retention.
CREATE OR REPLACE FUNCTION expired_partitions(retention interval)
RETURNS SETOF regclass LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT c.oid::regclass
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'idempotency_keys'::regclass
      AND (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz
          <= now() - retention
    ORDER BY 1
$$;
