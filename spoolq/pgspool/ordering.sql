-- Schema version 2: what decides when a job may run -- priorities,
-- dependencies, unique keys, locks (mutexes and limits) and held jobs.
-- Two more states: held (never claimed until released) and waiting (for
-- unfinished dependencies; parked, so claims never read it). Every
-- column is set from the record by enqueue (or from a row inserted by
-- hand, at its first sight by a worker) and stays as it is.

ALTER TABLE spoolq.jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE spoolq.jobs ADD CONSTRAINT jobs_state_check
    CHECK (state IN ('new', 'running', 'failed', 'dead', 'done', 'held', 'waiting'));
ALTER TABLE spoolq.jobs
    ADD COLUMN priority       integer NOT NULL DEFAULT 0,          -- higher first
    ADD COLUMN after          text[] COLLATE "C",                  -- the ids it waits for (NULL: none)
    ADD COLUMN unique_key     text,                                -- held while waiting, held, failed or running
    ADD COLUMN locks          text[] COLLATE "C",                  -- lock names, sorted (NULL: none)
    ADD COLUMN has_dependents boolean NOT NULL DEFAULT false,      -- some job's after names it
    ADD COLUMN origin         text;                                -- held: the state a release returns it to

-- Claims walk the due jobs by (priority desc, due time, id).
DROP INDEX spoolq.jobs_due;
CREATE INDEX jobs_due ON spoolq.jobs (priority DESC, at, id) WHERE state IN ('new', 'failed');
-- One job per unique key among the unfinished ones (enqueue's ON CONFLICT arbiter).
CREATE UNIQUE INDEX jobs_unique ON spoolq.jobs (unique_key)
    WHERE unique_key IS NOT NULL AND state IN ('new', 'failed', 'running', 'held', 'waiting');
-- The running holders of each lock name (claims count them).
CREATE INDEX jobs_locks_running ON spoolq.jobs USING gin (locks) WHERE state = 'running' AND locks IS NOT NULL;
-- The dependents of a job that finishes.
CREATE INDEX jobs_after ON spoolq.jobs USING gin (after) WHERE after IS NOT NULL;

-- Whether a job holding ``names`` (sorted) may start now: for each name,
-- fewer running holders than its limit (``limits``: name -> limit; 1 by
-- default). Each name's count is taken under a transaction advisory lock
-- of the name, held until the claim commits, so two claims never both
-- count a free slot; a name another claim is counting is passed over
-- for now (spoolq.lock_busy set, so the worker looks again at once)
-- rather than waited for. VOLATILE: each count sees what committed
-- before it, not the statement's snapshot.
CREATE FUNCTION spoolq.locks_free(names text[], limits jsonb) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    name text;
BEGIN
    IF names IS NULL THEN
        RETURN true;
    END IF;
    FOREACH name IN ARRAY names LOOP
        IF NOT pg_try_advisory_xact_lock(1397772114, hashtext(name)) THEN
            PERFORM set_config('spoolq.lock_busy', 'on', false);
            RETURN false;
        END IF;
        IF (SELECT count(*) FROM spoolq.jobs WHERE state = 'running' AND locks @> ARRAY[name]::text[])
           >= coalesce((limits ->> name)::int, 1) THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END $$;

-- Waiting jobs whose dependencies have all succeeded, to new (due now).
-- Each is locked first and looked at in a statement of its own, so that
-- of two dependencies finishing at once the later commit always sees
-- the other's (a dependency deleted by retention had finished: done).
CREATE FUNCTION spoolq.release_waiting(ids text[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM spoolq.jobs WHERE id = ANY(ids) AND state = 'waiting' ORDER BY id FOR UPDATE;
    UPDATE spoolq.jobs w SET state = 'new', at = now()
    WHERE w.id = ANY(ids) AND w.state = 'waiting'
      AND NOT EXISTS (SELECT 1 FROM spoolq.jobs d WHERE d.id = ANY(w.after) AND d.state <> 'done');
END $$;

-- A job with dependents that finishes: done releases them (those whose
-- other dependencies are done too); dead or cancelled sends them (and
-- theirs, by this trigger again) to dead with the reason. Either way the
-- waiting workers are woken, as they are when a lock holder finishes.
CREATE FUNCTION spoolq.job_finished() RETURNS trigger
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    ended text;
BEGIN
    IF NEW.has_dependents THEN
        IF NEW.state = 'dead' THEN
            ended := 'dead';
        ELSIF NEW.valid AND spoolq.outcome_of(NEW.record) = 'cancelled' THEN
            ended := 'cancelled';
        END IF;
        IF ended IS NULL THEN
            PERFORM spoolq.release_waiting(ARRAY(
                SELECT id FROM spoolq.jobs WHERE after @> ARRAY[NEW.id]::text[] AND state = 'waiting'));
        ELSE
            UPDATE spoolq.jobs SET state = 'dead', at = now(), origin = NULL,
                   reason = format('its dependency %s ended %s', NEW.id, ended)
            WHERE after @> ARRAY[NEW.id]::text[] AND state IN ('new', 'failed', 'held', 'waiting');
        END IF;
    END IF;
    PERFORM pg_notify('spoolq_jobs', '');
    RETURN NULL;
END $$;

CREATE FUNCTION spoolq.outcome_of(record text) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN record::json ->> 'outcome';
EXCEPTION WHEN others THEN
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_finished AFTER UPDATE OF state ON spoolq.jobs FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state AND NEW.state IN ('done', 'dead')
          AND (NEW.has_dependents OR NEW.locks IS NOT NULL))
    EXECUTE FUNCTION spoolq.job_finished();

-- A job comes in waiting (new), held, waiting for dependencies, or dead
-- (a dependency ended dead or cancelled before it came): never as done,
-- failed or running, whoever inserts it.
CREATE FUNCTION spoolq.refuse_inserted_state() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'a job is inserted new, held or waiting, not %', NEW.state USING ERRCODE = 'check_violation';
END $$;

CREATE TRIGGER jobs_inserted BEFORE INSERT ON spoolq.jobs FOR EACH ROW
    WHEN (NEW.state NOT IN ('new', 'held', 'waiting', 'dead'))
    EXECUTE FUNCTION spoolq.refuse_inserted_state();

-- Mark the jobs ``ids`` as depended on (their rows locked till the caller
-- commits, so none finishes unseen) and say what they are: (id, state,
-- outcome of a done one). SECURITY DEFINER: a producer marks them without
-- any right to change a job.
CREATE FUNCTION spoolq.depend_on(ids text[]) RETURNS TABLE (id text, state text, outcome text)
LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE spoolq.jobs j SET has_dependents = true WHERE j.id = ANY(ids)
    RETURNING j.id, j.state, CASE WHEN j.state = 'done' THEN spoolq.outcome_of(j.record) END
$$;
