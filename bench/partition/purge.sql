-- Helpers of run.sh, in schema public of the benchmark database.

-- purge_loop runs the server's purgeSQL (server/postgres.go, verbatim but
-- for $1/$2) in batches of batch rows until a batch deletes nothing, each
-- batch its own transaction; after a batch that took d it sleeps
-- d * (1 - duty) / duty, as idem-server's -purge-duty-cycle does (duty 1:
-- flat out). Retention 24 h, as the server's default.
CREATE OR REPLACE PROCEDURE purge_loop(batch integer, duty double precision,
    INOUT purged bigint DEFAULT 0, INOUT batches integer DEFAULT 0)
LANGUAGE plpgsql AS $$
DECLARE
    t0 timestamptz;
    d  double precision;
    n  bigint;
BEGIN
    LOOP
        t0 := clock_timestamp();
        DELETE FROM idempotency_keys
        WHERE ctid = ANY (ARRAY(
            SELECT ctid FROM idempotency_keys
            WHERE created_at < now() - 86400000000::bigint * interval '1 microsecond'
            ORDER BY created_at
            LIMIT batch
            FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS n = ROW_COUNT;
        COMMIT;
        EXIT WHEN n = 0;
        purged := purged + n;
        batches := batches + 1;
        d := extract(epoch FROM clock_timestamp() - t0);
        IF duty < 1 THEN
            PERFORM pg_sleep(d * (1 - duty) / duty);
            COMMIT;
        END IF;
    END LOOP;
END $$;

-- lock_sampler samples pg_stat_activity of this database every 5 ms for
-- secs seconds: how many backends wait on a heavyweight lock (a claim
-- queued behind DROP / DETACH), at most and summed over the samples.
CREATE OR REPLACE FUNCTION lock_sampler(secs double precision,
    OUT samples integer, OUT max_waiting integer, OUT samples_with_waiters integer)
LANGUAGE plpgsql AS $$
DECLARE
    stop timestamptz := clock_timestamp() + secs * interval '1 second';
    w integer;
BEGIN
    samples := 0; max_waiting := 0; samples_with_waiters := 0;
    WHILE clock_timestamp() < stop LOOP
        PERFORM pg_stat_clear_snapshot();
        SELECT count(*) INTO w FROM pg_stat_activity
        WHERE datname = current_database() AND wait_event_type = 'Lock';
        samples := samples + 1;
        max_waiting := greatest(max_waiting, w);
        IF w > 0 THEN samples_with_waiters := samples_with_waiters + 1; END IF;
        PERFORM pg_sleep(0.005);
    END LOOP;
END $$;
