-- Who may do what in a spoolq database, for the two group roles spoolq
-- knows (docs/postgres.md): granted by every `spoolq init` to those of
-- them that exist, so init can simply be run again once they are made.
-- The role that ran init owns the schema and alone may change settings,
-- delete history (retention) or drop the spool.
DO $$
BEGIN
    -- Producers enqueue and read: they set a new job's id, record, due
    -- time and the columns its record's ordering fields become (it comes
    -- in new, held or waiting: a trigger refuses any other state; who
    -- enqueued it is theirs), and mark its dependencies as depended on (spoolq.depend_on, which
    -- changes nothing else).
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'spoolq_producer') THEN
        GRANT USAGE ON SCHEMA spoolq TO spoolq_producer;
        GRANT SELECT ON spoolq.jobs, spoolq.workers, spoolq.settings, spoolq.counters, spoolq.notes,
                        spoolq.schema_version, spoolq.paused TO spoolq_producer;
        GRANT INSERT (id, record, at, state, priority, after, unique_key, locks, origin, reason, has_dependents)
            ON spoolq.jobs TO spoolq_producer;
    END IF;
    -- Workers also claim, finish, cancel, retry and recover jobs, and keep
    -- their registrations.
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'spoolq_worker') THEN
        GRANT USAGE ON SCHEMA spoolq TO spoolq_worker;
        GRANT SELECT ON spoolq.jobs, spoolq.workers, spoolq.settings, spoolq.counters, spoolq.notes,
                        spoolq.schema_version TO spoolq_worker;
        -- and send and carry out job control requests (stop, pause, kill).
        GRANT SELECT, INSERT, DELETE ON spoolq.requests, spoolq.paused TO spoolq_worker;
        GRANT INSERT (id, record, at, state, priority, after, unique_key, locks, origin, reason, has_dependents),
              UPDATE ON spoolq.jobs TO spoolq_worker;
        GRANT INSERT (worker, host, pid, uid, boot_id, proc_start, kinds), UPDATE (runs, lost_at), DELETE
            ON spoolq.workers TO spoolq_worker;
        GRANT INSERT, UPDATE ON spoolq.notes TO spoolq_worker;
    END IF;
END $$;
