-- Who may do what in a spoolq database, for the two group roles spoolq
-- knows (docs/postgres.md): granted by every `spoolq init` to those of
-- them that exist, so init can simply be run again once they are made.
-- The role that ran init owns the schema and alone may change settings,
-- delete history (retention) or drop the spool.
-- A producer's kill or cancel of a running job it enqueued (the login
-- role that enqueued it: session_user, whatever role it has set): a
-- request row as a worker role writes one, after the checks. Refused with
-- one line for a job of another role, a job not running, or no such job.
CREATE OR REPLACE FUNCTION spoolq.request_kill(job text, attempt integer, sig integer) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    found_state text;
    enqueuer text;
    token bigint;
BEGIN
    SELECT j.state, j.enqueued_by INTO found_state, enqueuer FROM spoolq.jobs j WHERE j.id = job;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'P0002', MESSAGE = format('no job %s in this spool', job);
    END IF;
    IF enqueuer IS DISTINCT FROM session_user THEN
        RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format(
            'job %s was enqueued by %s, not by %s: a producer kills only its own jobs', job, enqueuer, session_user);
    END IF;
    IF found_state <> 'running' THEN
        RAISE EXCEPTION USING ERRCODE = 'P0001', MESSAGE = format('job %s is not running; nothing to kill', job);
    END IF;
    INSERT INTO spoolq.requests (body)
        VALUES (jsonb_build_object('request', 'kill', 'id', job, 'attempt', attempt, 'by', session_user::text,
                                   'at', extract(epoch FROM clock_timestamp()))
                || CASE WHEN sig IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('signal', sig) END)
        RETURNING id INTO token;
    PERFORM pg_notify('spoolq_control', '');
    RETURN token;
END $$;
REVOKE ALL ON FUNCTION spoolq.request_kill(text, integer, integer) FROM PUBLIC;

DO $$
BEGIN
    -- Producers enqueue and read (every job's record, and so every running
    -- job's output): they set a new job's id, record, due time and the
    -- columns its record's ordering fields become (it comes in new, held or
    -- waiting: a trigger refuses any other state; who enqueued it is
    -- theirs), and mark its dependencies as depended on (spoolq.depend_on,
    -- which changes nothing else).
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'spoolq_producer') THEN
        GRANT USAGE ON SCHEMA spoolq TO spoolq_producer;
        GRANT SELECT ON spoolq.jobs, spoolq.workers, spoolq.settings, spoolq.counters, spoolq.notes,
                        spoolq.schema_version, spoolq.paused, spoolq.outputs TO spoolq_producer;
        GRANT INSERT (id, record, at, state, priority, after, unique_key, locks, origin, reason, has_dependents)
            ON spoolq.jobs TO spoolq_producer;
        -- They kill or cancel their own running jobs (and see whether a
        -- worker has taken the request); stop, pause and resume are not theirs.
        GRANT EXECUTE ON FUNCTION spoolq.request_kill(text, integer, integer) TO spoolq_producer;
        GRANT SELECT (id) ON spoolq.requests TO spoolq_producer;
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
        -- and keep their running jobs' output (removed with a job's move
        -- out of the running state, and by recovery).
        GRANT SELECT, INSERT, UPDATE, DELETE ON spoolq.outputs TO spoolq_worker;
    END IF;
END $$;
