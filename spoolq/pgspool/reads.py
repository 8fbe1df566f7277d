"""The read side of a PostgreSQL spool, in SQL: one job's record as ``show``
gives it, listings oldest first, the counts per state, the live workers,
``stats`` and the numbers behind ``status --prometheus``, each in the
shape the directory spool gives (the state of a running job is ``cur``,
as everywhere a user sees it).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from .. import record
from ..record import RUN_SECONDS_BUCKETS, rfc3339
from .schema import LOCK_CLASS

# The state names users see (the directory spool's), by the table's.
SHOWN = {"new": "new", "running": "cur", "failed": "failed", "dead": "dead", "done": "done", "held": "held",
         "waiting": "waiting"}
STORED = {shown: stored for stored, shown in SHOWN.items()}


PAGE = 500  # rows a listing fetches at a time
MIN_WINDOW = 60.0  # seconds: the shortest window a throughput is taken over (as index.MIN_WINDOW)

# Whether the worker of a workers row ``w`` holds its lock: its session lives.
LIVE = f"""EXISTS (SELECT 1 FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid = {LOCK_CLASS}::oid AND l.objid = w.id::oid AND l.objsubid = 2 AND l.granted)"""

# Kinds no worker has a handler for: not among those the last worker to
# start ran (spoolq.notes), nor among a live worker's. NULL: the job is no
# handler job, or no worker said which kinds it runs.
UNHANDLED = f"""(j.kind IS NOT NULL AND j.state IN ('new', 'failed')
    AND (SELECT NOT (n.value ? j.kind) FROM spoolq.notes n WHERE n.name = 'kinds' AND jsonb_typeof(n.value) = 'array')
    AND NOT EXISTS (SELECT 1 FROM spoolq.workers w WHERE {LIVE} AND (w.kinds IS NULL OR w.kinds ? j.kind)))"""

ROW = f"""SELECT j.id, j.state, j.record, j.at, j.valid, j.reason, j.purged, w.worker,
       CASE WHEN j.state = 'running' THEN w.id IS NOT NULL AND {LIVE} END AS live,
       {UNHANDLED} AS unhandled,
       CASE WHEN j.state = 'waiting' THEN ARRAY(SELECT d.id FROM spoolq.jobs d
           WHERE d.id = ANY(j.after) AND d.state <> 'done' ORDER BY d.id) END AS waits_for,
       CASE WHEN j.state IN ('new', 'failed') AND j.locks IS NOT NULL THEN (SELECT json_agg(json_build_array(n,
           ARRAY(SELECT r.id FROM spoolq.jobs r WHERE r.state = 'running' AND r.locks @> ARRAY[n] ORDER BY r.id)))
           FROM unnest(j.locks) AS n) END AS lock_holders,
       j.priority
FROM spoolq.jobs j LEFT JOIN spoolq.workers w ON w.id = j.worker AND j.state = 'running'"""


def shaped(row: tuple, limits: dict | None = None) -> dict[str, Any]:
    """A row as ``show`` prints a job: its record, with ``state`` set from
    where it is, and what else the row says (the due time of a waiting job,
    the worker of a running one, the reason a dead one can never run, why
    a waiting one does not run; ``limits``: the lock_limits setting)."""
    job_id, state, text, at, valid, reason, purged, worker, live, unhandled, waits_for, lock_holders, _ = row
    job: dict[str, Any] | None = None
    problem = reason
    if valid:
        try:
            parsed = record.loads(text)
            if isinstance(parsed, dict):
                job = parsed
            else:
                problem = problem or "not a JSON object"
        except ValueError as e:
            problem = problem or f"not valid JSON: {e}"
    if job is None:
        job = {"id": job_id, "error": problem or "unreadable", "valid": False}
    elif reason and (state == "dead" and job.get("error") is None or not valid):
        job["error"] = reason
    job["id"] = job_id
    if state == "done" and job.get("valid") is not False:
        job = record.as_done(job)
    if state == "running":
        if live:
            job["worker"] = worker
        else:
            job["abandoned"] = True  # its worker died: the next recovery takes it
    if purged:
        job["purged"] = True
    if unhandled:
        job["waits_for_handler"] = True  # no worker of this spool has a handler for its kind
    job["state"] = SHOWN[state]
    if state in ("new", "failed"):
        job["due_at"] = rfc3339(at.timestamp())
        if at.timestamp() > time.time():
            job["why"] = f"not due until {job['due_at']}"
        else:
            for name, holders in lock_holders or ():
                if len(holders) >= int((limits or {}).get(name, 1)):
                    job["why"] = f"lock {name} held by job {', '.join(holders)}"
                    break
    elif state == "held":
        job["why"] = f"held (spoolq release {job_id})"
    elif state == "waiting":
        job["why"] = (f"waiting for job {', '.join(waits_for)}" if waits_for
                      else "its dependencies have finished: released soon")
    return job


def get(conn, job_id: str, limits: dict | None = None) -> dict[str, Any] | None:
    row = conn.execute(ROW + " WHERE j.id = %s", (job_id,)).fetchone()
    return shaped(row, limits) if row is not None else None


def ids_with_prefix(conn, prefix: str, states: tuple[str, ...] | None, limit: int) -> list[str]:
    """Up to ``limit`` ids that begin with ``prefix`` (in ``states``, the
    shown names; None: any), in order: a range of the primary key."""
    stored = [STORED[s] for s in states] if states is not None else list(SHOWN)
    after = prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else None
    return [row[0] for row in conn.execute(
        "SELECT id FROM spoolq.jobs WHERE id >= %s AND (%s::text IS NULL OR id < %s) AND state = ANY(%s) "
        "ORDER BY id LIMIT %s", (prefix, after, after, stored, limit))]


def listing(conn, state: str | None = None, limit: int | None = None,
            since: float | None = None, limits: dict | None = None) -> Iterator[dict[str, Any]]:
    """Records oldest first, by (due or finish time, id); ``state`` is one
    of the shown names (dead includes those purged into the history,
    marked ``purged``). The jobs of new or failed alone are listed in the
    order a worker takes them: the highest priority first. Read a page at
    a time: a long listing holds no transaction open."""
    # The states written out (they are STORED's, never the caller's text):
    # the planner then sees which partial index covers them.
    states = ", ".join(f"'{s}'" for s in ([STORED[state]] if state else list(SHOWN)))
    # The claims' order, (-priority, at, id), for the waiting states alone.
    ranked = state in ("new", "failed")
    rank = "-j.priority" if ranked else "(0)"
    after: tuple | None = None
    left = limit
    while left is None or left > 0:
        page = PAGE if left is None else min(PAGE, left)
        params: dict[str, Any] = {"since": since if since is not None else 0.0, "page": page}
        keyset = ""
        if after is not None:
            keyset = f"AND ({rank}, j.at, j.id) > (%(rank)s, %(at)s, %(id)s)"
            params.update(rank=after[0], at=after[1], id=after[2])
        rows = conn.execute(ROW + f""" WHERE j.state IN ({states}) AND j.at >= to_timestamp(%(since)s) {keyset}
              ORDER BY {"-j.priority, " if ranked else ""}j.at, j.id LIMIT %(page)s""", params).fetchall()
        for row in rows:
            yield shaped(row, limits)
        if len(rows) < page:
            return
        after = (-rows[-1][-1] if ranked else 0, rows[-1][3], rows[-1][0])
        if left is not None:
            left -= len(rows)


def recent(conn, state: str, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` rows of ``state`` (a shown name) newest first by their
    time (a finish; a failed job's due time), purged dead jobs left out."""
    return [shaped(row) for row in conn.execute(
        ROW + " WHERE j.state = %s AND NOT j.purged ORDER BY j.at DESC, j.id DESC LIMIT %s", (STORED[state], limit))]


def live_workers(conn) -> list[dict[str, Any]]:
    """The live workers: who, where, since when, and the jobs they run
    (with the attempt, start and process group of each run)."""
    workers = conn.execute(f"""SELECT w.id, w.worker, w.host, w.pid, w.started_at, w.runs, w.db_user, w.kinds
        FROM spoolq.workers w WHERE {LIVE} ORDER BY w.started_at, w.id""").fetchall()
    running: dict[int, list] = {}
    if workers:
        for job_id, worker, claimed_at, text in conn.execute(
                "SELECT id, worker, claimed_at, record FROM spoolq.jobs WHERE state = 'running' AND worker = ANY(%s) "
                "ORDER BY claimed_at, id", ([w[0] for w in workers],)):
            running.setdefault(worker, []).append((job_id, claimed_at, text))
    out = []
    for row_id, worker, host, pid, started_at, runs, db_user, kinds in workers:
        jobs = {}
        for job_id, claimed_at, text in running.get(row_id, []):
            entry = dict(runs.get(job_id) or {}) if isinstance(runs, dict) else {}
            entry.setdefault("attempt", _attempts(text) + 1)
            entry.setdefault("started_at", rfc3339(claimed_at.timestamp()) if claimed_at else None)
            jobs[job_id] = entry
        out.append({"worker": worker, "host": host, "pid": pid, "started_at": rfc3339(started_at.timestamp()),
                    "jobs": jobs, "db_user": db_user, "kinds": kinds})
    return out


def _attempts(text: str) -> int:
    try:
        value = record.loads(text).get("attempts")
    except (ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def counts(conn) -> dict[str, Any]:
    """Jobs per state (the directory spool's keys: ``cur`` the running
    ones, ``abandoned`` those of them whose worker died, ``dead_purged``
    the dead jobs purged into the history), and the live workers."""
    found = {(state, purged): n for state, purged, n in conn.execute(
        "SELECT state, purged, count(*) FROM spoolq.jobs GROUP BY state, purged")}
    out: dict[str, Any] = {SHOWN[s]: found.get((s, False), 0) for s in ("new", "running", "failed", "dead", "done")}
    out["done_files"] = out["done"]  # every finished job is a row: nothing waits to be compacted
    out["compacted"] = 0
    out["dead_purged"] = found.get(("dead", True), 0)
    out["held"] = found.get(("held", False), 0)
    out["waiting"] = found.get(("waiting", False), 0)
    out["abandoned"] = conn.execute(f"""SELECT count(*) FROM spoolq.jobs j LEFT JOIN spoolq.workers w ON w.id = j.worker
        WHERE j.state = 'running' AND NOT (w.id IS NOT NULL AND {LIVE})""").fetchone()[0]
    out["workers"] = [{k: w.get(k) for k in ("worker", "host", "pid", "started_at", "jobs", "kinds")}
                      for w in live_workers(conn)]
    out["unhandled"] = dict(conn.execute(f"""SELECT j.kind, count(*) FROM spoolq.jobs j
        WHERE j.state IN ('new', 'failed') AND j.at <= now() AND {UNHANDLED} GROUP BY j.kind ORDER BY j.kind"""))
    return out


# -- statistics --------------------------------------------------------------

STAT_FIELDS = ("jobs", "succeeded", "failed_runs", "dead", "cancelled", "runs", "first_finish", "last_finish",
               "wait_p50", "wait_p95", "wait_max", "run_p50", "run_p95", "run_max")

STATS_SQL = """
WITH j AS (
    SELECT state, coalesce(target, '') AS grp, record, extract(epoch FROM at)::float8 AS fin,
           CASE WHEN state = 'done' THEN coalesce(record::json ->> 'outcome', 'succeeded') END AS outcome
    FROM spoolq.jobs WHERE state IN ('done', 'dead') AND valid AND at >= to_timestamp(%(since)s)
),
r AS (
    SELECT j.grp, greatest(0, x.start - x.due) AS wait, greatest(0, x.finish - x.start) AS duration, x.failed
    FROM j, spoolq.runs_of(j.record) AS x WHERE x.finish >= %(since)s
),
ja AS (
    SELECT grp, grouping(grp) AS total, count(*) AS jobs,
           count(*) FILTER (WHERE outcome = 'succeeded') AS succeeded,
           count(*) FILTER (WHERE state = 'dead') AS dead,
           count(*) FILTER (WHERE outcome = 'cancelled') AS cancelled,
           min(fin) AS first_finish, max(fin) AS last_finish
    FROM j GROUP BY GROUPING SETS ((grp), ())
),
ra AS (
    SELECT grp, grouping(grp) AS total, count(*) AS runs, count(*) FILTER (WHERE failed) AS failed_runs,
           percentile_disc(0.5) WITHIN GROUP (ORDER BY wait) AS wait_p50,
           percentile_disc(0.95) WITHIN GROUP (ORDER BY wait) AS wait_p95, max(wait) AS wait_max,
           percentile_disc(0.5) WITHIN GROUP (ORDER BY duration) AS run_p50,
           percentile_disc(0.95) WITHIN GROUP (ORDER BY duration) AS run_p95, max(duration) AS run_max
    FROM r GROUP BY GROUPING SETS ((grp), ())
)
SELECT coalesce(ja.grp, ra.grp), coalesce(ja.total, ra.total),
       coalesce(ja.jobs, 0), coalesce(ja.succeeded, 0), coalesce(ra.failed_runs, 0), coalesce(ja.dead, 0),
       coalesce(ja.cancelled, 0), coalesce(ra.runs, 0), ja.first_finish, ja.last_finish,
       ra.wait_p50, ra.wait_p95, ra.wait_max, ra.run_p50, ra.run_p95, ra.run_max
FROM ja FULL JOIN ra ON ja.total = ra.total AND ja.grp IS NOT DISTINCT FROM ra.grp
"""


def stats(conn, since: float | None) -> dict[str, Any]:
    """Finished jobs, throughput, wait (due to start) and run time (p50,
    p95, max, nearest-rank) in total and per kind or program, as
    ``Spool.stats`` gives them."""
    params = {"since": since if since is not None else -1.0}
    groups, total = [], None
    for row in conn.execute(STATS_SQL, params):
        entry = dict(zip(STAT_FIELDS, row[2:]))
        if row[1]:
            total = entry
        elif entry["jobs"] or entry["runs"]:
            entry["group"] = row[0]
            groups.append(entry)
    if total is None:
        total = {**dict.fromkeys(STAT_FIELDS[:6], 0), **dict.fromkeys(STAT_FIELDS[6:])}
    # One window for every group, as the directory spool takes it: the
    # --since period, else from the first finish counted to now; never
    # under a minute, so that a burst of two jobs is not "2000 jobs/s".
    start = since if since is not None else total["first_finish"]
    window = max(MIN_WINDOW, time.time() - start) if start is not None else None
    for entry in groups + [total]:
        entry.pop("first_finish"), entry.pop("last_finish")
        entry["throughput_per_s"] = round(entry["jobs"] / window, 3) if window and entry["jobs"] else None
    groups.sort(key=lambda g: (-g["jobs"], g["group"]))
    return {"total": total, "groups": groups}


# -- counters (status --prometheus) ---------------------------------------------

def run_counts_sql(source: str, before: str = "", extra: str = "") -> str:
    """SQL for the counters the runs and jobs of ``source`` (rows with
    ``state``, ``valid`` and ``record``) add: one row of (name, value)
    pairs as two arrays, the names index.py's counters use. ``before``: a
    CTE ``source`` may name; ``extra``: one more column."""
    buckets = ", ".join(f"count(*) FILTER (WHERE duration <= {b:g}) AS le{i}" for i, b in enumerate(RUN_SECONDS_BUCKETS))
    names = ", ".join(f"'run_seconds_le_{b:g}'" for b in RUN_SECONDS_BUCKETS)
    return f"""
WITH {before + "," if before else ""} s AS (SELECT state, record FROM {source} WHERE valid),
r AS (SELECT x.failed, CASE WHEN x.finish IS NOT NULL AND x.start IS NOT NULL
                            THEN greatest(0, x.finish - x.start) END AS duration
      FROM s, spoolq.runs_of(s.record) AS x),
jr AS (SELECT count(*) FILTER (WHERE state = 'done' AND coalesce(record::json ->> 'outcome', 'succeeded') = 'succeeded') AS ok,
              count(*) FILTER (WHERE state = 'done' AND record::json ->> 'outcome' = 'cancelled') AS cancelled,
              count(*) FILTER (WHERE state = 'dead') AS dead,
              coalesce(sum(spoolq.dropped_runs(record)), 0) AS dropped FROM s),
rr AS (SELECT count(*) FILTER (WHERE NOT failed) AS ok, count(*) FILTER (WHERE failed) AS failed,
              count(duration) AS n, coalesce(sum(round(duration * 1e6)), 0)::bigint AS sum_us, {buckets} FROM r)
SELECT ARRAY['jobs_succeeded', 'jobs_cancelled', 'jobs_dead', 'runs_succeeded', 'runs_failed',
             'run_seconds_count', 'run_seconds_sum_us', {names}],
       ARRAY[jr.ok, jr.cancelled, jr.dead, rr.ok, rr.failed + jr.dropped, rr.n, rr.sum_us, {", ".join(f"rr.le{i}" for i in range(len(RUN_SECONDS_BUCKETS)))}]::bigint[]
       {", " + extra if extra else ""}
FROM jr, rr"""


def metrics(conn) -> dict[str, Any]:
    """The numbers behind ``status --prometheus``, as metrics.collect gives
    them: every run in every record, plus what retention deleted."""
    with conn.transaction():  # the rows and the counters as of one instant
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        names, values = conn.execute(run_counts_sql("spoolq.jobs")).fetchone()
        totals = dict(zip(names, values))
        for name, value in conn.execute("SELECT name, value FROM spoolq.counters"):
            totals[name] = totals.get(name, 0) + value
        st = counts(conn)
        oldest = conn.execute("SELECT extract(epoch FROM now() - min(at))::float8 FROM spoolq.jobs "
                              "WHERE state IN ('new', 'failed') AND at <= now()").fetchone()[0]
    runs = {name: totals.get(name, 0) for name in ("runs_succeeded", "runs_failed", "run_seconds_count",
                                                   "run_seconds_sum_us")}
    runs.update((f"run_seconds_le_{b:g}", totals.get(f"run_seconds_le_{b:g}", 0)) for b in RUN_SECONDS_BUCKETS)
    return {
        "states": {s: st[s] for s in ("new", "cur", "failed", "dead", "done")},
        "compacted": 0,
        "oldest_due_age": max(0.0, oldest or 0.0),
        "workers": st["workers"],
        "finished": {"succeeded": totals.get("jobs_succeeded", 0), "cancelled": totals.get("jobs_cancelled", 0)},
        "runs": {"succeeded": runs["runs_succeeded"], "failed": runs["runs_failed"]},
        "run_seconds": runs,
    }
