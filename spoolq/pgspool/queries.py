"""The statements of a PostgreSQL spool's hot path and of its moves: claim,
finish, put back, set aside, enqueue, wake. Every change after a claim
carries the claim's token (``AND token = ... AND state = 'running'``), so
a worker that lost its claim changes nothing; due times are the
database's clock (``now()``), never a host's.
"""

from __future__ import annotations

from .waker import CHANNEL

# The jobs a worker with the handler kinds ``%(kinds)s`` (NULL: every kind) may run.
KINDS = "AND (kind IS NULL OR %(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))"

# The first due job, in order (priority, highest first, then due time,
# then id), taken by this worker under a fresh token, unless recovery has
# found this worker's session gone. Jobs other claims hold are skipped,
# not waited for; so are handler jobs of kinds the worker has no handler
# for (``kinds``: NULL runs every kind), which stay waiting for a worker
# that has one, and jobs holding a lock name with as many holders running
# as its limit (``limits``: name -> limit), which wait for one to finish.
# Held jobs and jobs waiting for dependencies are in states of their own.
CLAIM = """
UPDATE spoolq.jobs j SET state = 'running', worker = %(worker)s, token = %(token)s, claimed_at = now()
FROM (SELECT id, state FROM spoolq.jobs
      WHERE state IN ('new', 'failed') AND at <= now() {KINDS}
        AND (locks IS NULL OR spoolq.locks_free(locks, %(limits)s::jsonb))
      ORDER BY priority DESC, at, id LIMIT 1 FOR UPDATE SKIP LOCKED) c
WHERE j.id = c.id
  AND NOT EXISTS (SELECT 1 FROM spoolq.workers w WHERE w.id = %(worker)s AND w.lost_at IS NOT NULL)
RETURNING j.id, c.state, j.record, extract(epoch FROM j.at)::float8
""".replace("{KINDS}", KINDS)

# Whether the last claim passed over a job because another claim was
# counting the holders of one of its lock names (look again at once); reset.
LOCK_BUSY = ("SELECT coalesce(current_setting('spoolq.lock_busy', true), '') = 'on', "
             "set_config('spoolq.lock_busy', 'off', false)")

# Seconds from the database's now until the next waiting job this worker
# can run is due (negative: due already; NULL: none waits): the earliest
# due time of each priority (a walk over the priorities in use, each one
# step of the claims' index). A due job holding a lock is left out: the
# finish of a holder wakes the workers (ordering.sql's trigger).
NEXT_DUE = """
WITH RECURSIVE p(pr) AS (
    SELECT max(priority) FROM spoolq.jobs WHERE state IN ('new', 'failed')
    UNION ALL
    SELECT (SELECT max(priority) FROM spoolq.jobs WHERE state IN ('new', 'failed') AND priority < p.pr)
    FROM p WHERE p.pr IS NOT NULL
)
SELECT extract(epoch FROM min((SELECT min(at) FROM spoolq.jobs WHERE state IN ('new', 'failed') AND priority = p.pr
                                  AND (locks IS NULL OR at > now()) {KINDS})) - now())::float8
FROM p WHERE p.pr IS NOT NULL
""".replace("{KINDS}", KINDS)

# Runs' outcomes, many at once (a JSON array of [id, token, state, record,
# target, delay]: one parameter, far cheaper to send than six arrays): the
# new records, and where the jobs go (a failed job due again ``delay``
# seconds from now). Returns (id, due time)
# of each job written; a job whose claim was lost is not. One notification
# when a failed job is among them.
FINISH_MANY = f"""
WITH u AS (
    SELECT r ->> 0 AS id, (r ->> 1)::bigint AS token, r ->> 2 AS state, r ->> 3 AS record, r ->> 4 AS target,
           (r ->> 5)::float8 AS delay
    FROM json_array_elements(%s::json) AS r
), done AS (
    UPDATE spoolq.jobs j SET state = u.state, record = u.record, target = u.target,
           at = now() + make_interval(secs => coalesce(u.delay, 0)), worker = NULL, token = NULL
    FROM u WHERE j.id = u.id AND j.token = u.token AND j.state = 'running'
    RETURNING j.id, j.state, extract(epoch FROM j.at)::float8 AS due
)
SELECT id, due, (SELECT pg_notify('{CHANNEL}', '') WHERE EXISTS (SELECT 1 FROM done WHERE state = 'failed'))
FROM done
"""

# One run's outcome, as recovery writes it (FINISH_MANY's columns, one row).
FINISH = """
UPDATE spoolq.jobs SET state = %(state)s, record = %(record)s, target = %(target)s,
       at = now() + make_interval(secs => coalesce(%(delay)s::float8, 0)), worker = NULL, token = NULL
WHERE id = %(id)s AND token = %(token)s AND state = 'running'
"""

# A finish sent again after a reconnect that found no running row: whether
# it had been committed after all (the record is the one it wrote), and the due time.
FINISHED_ALREADY = """SELECT record = %(record)s AND state = %(state)s, extract(epoch FROM at)::float8
FROM spoolq.jobs WHERE id = %(id)s"""

# A claimed job that never started, back where it was, as it was.
UNCLAIM = """
UPDATE spoolq.jobs SET state = %(origin)s, worker = NULL, token = NULL
WHERE id = %(id)s AND token = %(token)s AND state = 'running'
"""

# A claimed job that can never run, to dead with the reason (its record as it was).
QUARANTINE = """
UPDATE spoolq.jobs SET state = 'dead', at = now(), worker = NULL, token = NULL,
       reason = %(reason)s, valid = %(valid)s, target = %(target)s
WHERE id = %(id)s AND token = %(token)s AND state = 'running'
"""

# A job seen for the first time with a run_at still ahead (a row a
# producer inserted by hand): its record marked, due then.
POSTPONE = """
UPDATE spoolq.jobs SET state = 'new', record = %(record)s, at = to_timestamp(%(due)s), worker = NULL, token = NULL
WHERE id = %(id)s AND token = %(token)s AND state = 'running'
"""

NOTIFY = f"SELECT pg_notify('{CHANNEL}', '')"

# The rows of new jobs, from a JSON array of [id, record, due epoch or
# null, state, priority, after, unique key, locks, origin, reason,
# has_dependents] (see ordering.py).
_ROWS = """
    SELECT r ->> 0, r ->> 1, coalesce(to_timestamp((r ->> 2)::float8), now()), r ->> 3, (r ->> 4)::int,
           CASE WHEN json_typeof(r -> 5) = 'array' THEN ARRAY(SELECT json_array_elements_text(r -> 5)) END,
           r ->> 6,
           CASE WHEN json_typeof(r -> 7) = 'array' THEN ARRAY(SELECT json_array_elements_text(r -> 7)) END,
           r ->> 8, r ->> 9, (r ->> 10)::boolean"""
_COLUMNS = "(id, record, at, state, priority, after, unique_key, locks, origin, reason, has_dependents)"

# One batch of new jobs, all or none (a duplicate id fails the
# statement), and one notification for the lot.
ENQUEUE = f"""
WITH ins AS (
    INSERT INTO spoolq.jobs {_COLUMNS}
    {_ROWS} FROM json_array_elements(%(jobs)s::json) AS r
    {{conflict}}
    RETURNING id
)
SELECT ins.id FROM ins, (SELECT pg_notify('{CHANNEL}', '')) AS n(x)
"""

# One new job (one such row), unless an unfinished job holds its unique
# key: then no row (the index waits for an insert under way to commit or
# roll back, so of racing inserts exactly one goes in).
ENQUEUE_ONE = f"""
INSERT INTO spoolq.jobs {_COLUMNS}
{_ROWS} FROM (SELECT %s::json AS r) AS x
ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL AND state IN ('new', 'failed', 'running', 'held', 'waiting')
DO NOTHING
RETURNING id
"""

EXISTING = "SELECT id, state, record FROM spoolq.jobs WHERE id = ANY(%s)"
