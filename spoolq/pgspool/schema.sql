-- The spoolq schema, version 1: one PostgreSQL database is one spool.
-- Applied by `spoolq init` in one transaction (see schema.py); later
-- versions add migrations, recorded in spoolq.schema_version.

CREATE SCHEMA spoolq;

CREATE TABLE spoolq.schema_version (
    version     integer PRIMARY KEY,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- The kind of a handler job's record (NULL: a command or argv job, or a
-- record that is no job), so that a claim passes over the kinds its
-- worker has no handler for.
CREATE FUNCTION spoolq.kind_of(record text) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN CASE WHEN json_typeof(record::json -> 'kind') = 'string' THEN record::json ->> 'kind' END;
EXCEPTION WHEN others THEN
    RETURN NULL;
END $$;

-- Every job, whatever its state: one row per id, so an id is taken while
-- its job (or its history) is here, and free again once retention has
-- deleted it. States: new, running, failed (waiting to run again), dead,
-- done. A job file's mtime is `at`: when it is due (new, failed; running:
-- when it was due) or when it finished (dead, done).
CREATE TABLE spoolq.jobs (
    id          text COLLATE "C" PRIMARY KEY       -- "C": ids sort as the directory spool sorts names
                CHECK (id ~ '^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$' AND position('..' IN id) = 0),
    state       text NOT NULL DEFAULT 'new'
                CHECK (state IN ('new', 'running', 'failed', 'dead', 'done')),
    at          timestamptz NOT NULL DEFAULT now(),
    record      text NOT NULL,                  -- the JSON record, as a job file holds it
    worker      bigint,                         -- spoolq.workers.id of the claim (running)
    token       bigint,                         -- the claim's fencing token (running)
    claimed_at  timestamptz,                    -- when the run under way (or the last) was claimed
    created_at  timestamptz NOT NULL DEFAULT now(),
    enqueued_by text NOT NULL DEFAULT current_user,
    target      text,                           -- what stats group by (kind, else program), set as it finishes
    valid       boolean NOT NULL DEFAULT true,  -- false: the record is no job at all (dead, with the reason)
    reason      text,                           -- why a job that can never run is dead
    purged      boolean NOT NULL DEFAULT false, -- a dead job cleared into the history (still dead: retry takes it)
    kind        text GENERATED ALWAYS AS (spoolq.kind_of(record)) STORED,
    CHECK ((state = 'running') = (token IS NOT NULL AND worker IS NOT NULL))
);
-- Claims walk this one: the due jobs in order.
CREATE INDEX jobs_due ON spoolq.jobs (at, id) WHERE state IN ('new', 'failed');
-- Recovery and status: who runs what.
CREATE INDEX jobs_running ON spoolq.jobs (worker) WHERE state = 'running';
-- Listings of finished jobs, stats and retention. (No index covers the
-- running state and the waiting ones at once: a claim and a finish each
-- add entries only to the primary key and to the one index of the state
-- the job goes to.)
CREATE INDEX jobs_finished ON spoolq.jobs (at, id) WHERE state IN ('done', 'dead');

-- One row per worker registration. Its worker holds the session advisory
-- lock (1397772113, id) on a connection of its own for as long as it lives:
-- a row whose lock is free belongs to a dead worker.
CREATE TABLE spoolq.workers (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY CHECK (id < 2147483648),
    worker      text NOT NULL,                  -- the worker id (host.pid.random), as job histories name it
    host        text NOT NULL,
    pid         integer NOT NULL,
    uid         integer NOT NULL,
    boot_id     text NOT NULL,
    proc_start  bigint,                         -- the worker process's start, in clock ticks since boot
    started_at  timestamptz NOT NULL DEFAULT now(),
    session_pid integer NOT NULL DEFAULT pg_backend_pid(),
    db_user     text NOT NULL DEFAULT current_user,
    runs        jsonb NOT NULL DEFAULT '{}',    -- job id -> {attempt, started_at, pgid, spawned}
    kinds       jsonb,                          -- the handler kinds it runs (a list; NULL: every kind)
    lost_at     timestamptz                     -- when a recovery first found its lock free
);

-- What the last worker to start said of itself: the kinds it has
-- handlers for (name 'kinds'), so that status, list and show can say a
-- waiting handler job waits for a worker with a handler for its kind
-- after that worker has gone.
CREATE TABLE spoolq.notes (
    name        text PRIMARY KEY,
    value       jsonb NOT NULL,
    at          timestamptz NOT NULL DEFAULT now()
);

-- Settings stored with `spoolq config set` (the defaults are spoolq's).
CREATE TABLE spoolq.settings (
    key         text PRIMARY KEY,
    value       jsonb NOT NULL
);

-- Cumulative counts of what retention deleted, so that counters never go down.
CREATE TABLE spoolq.counters (
    name        text PRIMARY KEY,
    value       bigint NOT NULL
);

-- Epoch seconds of a JSON string holding an RFC 3339 time with an offset;
-- NULL for anything else (a record's history may hold anything).
CREATE FUNCTION spoolq.epoch(v json) RETURNS double precision
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    t text;
BEGIN
    IF v IS NULL OR json_typeof(v) <> 'string' THEN
        RETURN NULL;
    END IF;
    t := btrim(v::text, '"');
    IF t !~ '^\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d(:\d\d(\.\d+)?)?([Zz]|[+-]\d\d:?\d\d)$' THEN
        RETURN NULL;
    END IF;
    RETURN extract(epoch FROM t::timestamptz);
EXCEPTION WHEN others THEN
    RETURN NULL;
END $$;

-- The runs in a record's history, as the directory spool's index reads
-- them: failed when the entry has an error; times as epoch seconds.
CREATE FUNCTION spoolq.runs_of(record text)
RETURNS TABLE (failed boolean, due double precision, start double precision, finish double precision)
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(json_typeof(h -> 'error') = 'string', false),
           spoolq.epoch(h -> 'due'), spoolq.epoch(h -> 'start'), spoolq.epoch(h -> 'end')
    FROM json_array_elements(CASE WHEN json_typeof(record::json -> 'history') = 'array'
                                  THEN record::json -> 'history' ELSE '[]'::json END) AS h
    WHERE json_typeof(h) = 'object'
$$;

-- How many history entries trimming dropped from a record (failed runs all).
CREATE FUNCTION spoolq.dropped_runs(record text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN json_typeof(record::json -> 'history_dropped') = 'number'
                 AND (record::json ->> 'history_dropped') ~ '^[0-9]{1,15}$'
                THEN (record::json ->> 'history_dropped')::bigint ELSE 0 END
$$;
