"""The statements of a PostgreSQL spool's hot path and of its moves: claim,
finish, put back, set aside, enqueue, wake. Every change after a claim
carries the claim's token (``AND token = ... AND state = 'running'``), so
a worker that lost its claim changes nothing; due times are the
database's clock (``now()``), never a host's.
"""

from __future__ import annotations

from .waker import CHANNEL

# The first due job, in order (due time, then id), taken by this worker
# under a fresh token, unless recovery has found this worker's session
# gone. Jobs other claims hold are skipped, not waited for.
CLAIM = """
UPDATE spoolq.jobs j SET state = 'running', worker = %(worker)s, token = %(token)s, claimed_at = now()
FROM (SELECT id, state FROM spoolq.jobs
      WHERE state IN ('new', 'failed') AND at <= now()
      ORDER BY at, id LIMIT 1 FOR UPDATE SKIP LOCKED) c
WHERE j.id = c.id
  AND NOT EXISTS (SELECT 1 FROM spoolq.workers w WHERE w.id = %(worker)s AND w.lost_at IS NOT NULL)
RETURNING j.id, c.state, j.record, extract(epoch FROM j.at)::float8
"""

# Seconds from the database's now until the next waiting job is due
# (negative: due already; NULL: none waits).
NEXT_DUE = "SELECT extract(epoch FROM min(at) - now())::float8 FROM spoolq.jobs WHERE state IN ('new', 'failed')"

# A run's outcome: the new record, and where the job goes (a failed job
# due again ``delay`` seconds from now). Returns its due time; no row when
# the claim had been lost.
FINISH = """
UPDATE spoolq.jobs SET state = %(state)s, record = %(record)s, target = %(target)s,
       at = now() + make_interval(secs => coalesce(%(delay)s::float8, 0)), worker = NULL, token = NULL
WHERE id = %(id)s AND token = %(token)s AND state = 'running'
RETURNING extract(epoch FROM at)::float8
"""

# A finish sent again after a reconnect that found no running row: whether
# it had been committed after all (the record is the one it wrote).
FINISHED_ALREADY = "SELECT record = %(record)s AND state = %(state)s FROM spoolq.jobs WHERE id = %(id)s"

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

# One batch of new jobs, all or none (a duplicate id fails the statement),
# and one notification for the lot.
ENQUEUE = f"""
WITH ins AS (
    INSERT INTO spoolq.jobs (id, record, at)
    SELECT u.id, u.record, coalesce(to_timestamp(u.due), now())
    FROM unnest(%(ids)s::text[], %(records)s::text[], %(dues)s::float8[]) AS u(id, record, due)
    {{conflict}}
    RETURNING id
)
SELECT ins.id FROM ins, (SELECT pg_notify('{CHANNEL}', '')) AS n(x)
"""

EXISTING = "SELECT id, state, record FROM spoolq.jobs WHERE id = ANY(%s)"
