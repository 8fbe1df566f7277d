"""Recovery in a PostgreSQL spool: the running jobs of dead workers go back
to failed (due now, the interrupted run counted) or to dead when no
attempts are left, and the dead workers' rows go.

A worker is dead when the session advisory lock of its row is free: its
session has ended. Never before: a live worker's jobs are never taken,
however long they run or however stopped the worker is. The first recovery
that finds a lock free notes the time (``lost_at``, the database's clock);
the jobs are taken only RECOVERY_GRACE seconds later, by which time a
worker whose session merely broke has killed its runs (see liveness.py).
On the worker's own host the processes its runs left are killed first, as
the directory spool's recovery does; a run whose processes live on and are
not this user's to kill stays running until they end.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .. import procs, record
from ..errors import InvalidJob
from . import outputs, queries, shaping
from .liveness import RECOVERY_GRACE
from .reads import LIVE
from .types import Report

MARK_LOST = f"UPDATE spoolq.workers w SET lost_at = now() WHERE lost_at IS NULL AND NOT {LIVE}"

# Running jobs whose worker's session is gone (or whose row is: a worker
# never leaves one while it runs jobs), with what recovery needs of the
# worker, and whether the grace has passed.
ABANDONED = f"""
SELECT j.id, j.token, j.record, extract(epoch FROM j.at)::float8, extract(epoch FROM j.claimed_at)::float8,
       w.worker, w.host, w.boot_id, w.proc_start, w.uid, w.runs -> j.id,
       w.id IS NULL OR w.lost_at <= now() - make_interval(secs => {RECOVERY_GRACE})
FROM spoolq.jobs j LEFT JOIN spoolq.workers w ON w.id = j.worker
WHERE j.state = 'running' AND (w.id IS NULL OR w.lost_at IS NOT NULL)
ORDER BY j.claimed_at, j.id
"""

FORGET = """DELETE FROM spoolq.workers w WHERE lost_at IS NOT NULL
    AND NOT EXISTS (SELECT 1 FROM spoolq.jobs j WHERE j.state = 'running' AND j.worker = w.id)"""


def recover(conn, settings: dict, wait: bool = False) -> Report:
    """Recover what dead workers left. With ``wait``, jobs of workers lost
    less than the grace ago are waited for (at most the grace) rather
    than left to a later recovery."""
    report = Report()
    deadline = time.monotonic() + RECOVERY_GRACE + 1
    while True:
        waiting = _once(conn, settings, report)
        if not (wait and waiting and time.monotonic() < deadline):
            report.waiting = waiting
            return report
        time.sleep(0.2)


def _once(conn, settings: dict, report: Report) -> int:
    """One pass; returns how many jobs wait for their worker's grace."""
    conn.execute(MARK_LOST)
    waiting = 0
    notify = False
    for row in conn.execute(ABANDONED).fetchall():
        if not row[-1]:
            waiting += 1
            continue
        outcome = _recover_job(conn, settings, row, report)
        notify = notify or outcome == "failed"
    report.workers += conn.execute(FORGET).rowcount
    conn.execute(outputs.ORPHANS)
    if notify:
        conn.execute(queries.NOTIFY)
    return waiting


def _recover_job(conn, settings: dict, row: tuple, report: Report) -> str | None:
    job_id, token, text, due, claimed_at, worker, host, boot, proc_start, uid, run, _ = row
    if worker is not None and host == os.uname().nodename and boot and boot == procs.boot_id() \
            and isinstance(proc_start, int):
        killed, refused = procs.kill_run(worker, boot, proc_start, uid, _run_of(job_id, run))
        report.killed += killed
        if refused:
            report.left_running += 1
            return None
    limit = int(settings["max_job_bytes"])
    try:
        job = record.parse_sized(text.encode("utf-8"), job_id, limit)
    except InvalidJob as e:
        changed = conn.execute(queries.QUARANTINE, {"id": job_id, "token": token, "reason": str(e), "valid": False,
                                                    "target": None}).rowcount
        report.quarantined += changed
        return "dead" if changed else None
    attempt = int(job.get("attempts") or 0) + 1
    start = claimed_at if claimed_at is not None else time.time()
    out = shaping.interrupted(start)
    state, delay, new_text = shaping.finished(settings, job, attempt, due, out, worker or "unknown", due_now=True)
    changed = conn.execute(queries.FINISH, {"id": job_id, "token": token, "state": state, "record": new_text,
                                            "target": record.target_label(job), "delay": delay}).rowcount
    if not changed:
        return None  # finished or recovered meanwhile
    if state == "dead":
        report.dead += 1
    else:
        report.recovered += 1
    return state


def _run_of(job_id: str, run: Any) -> tuple[str, int | None, tuple[int, int] | None]:
    """(job id, process group, spawn window) of a run as its worker's row
    lists it, for procs.kill_run; the group only when the row says one."""
    pgid = window = None
    if isinstance(run, dict):
        if isinstance(run.get("pgid"), int):
            pgid = run["pgid"]
        spawned = run.get("spawned")
        if isinstance(spawned, list) and len(spawned) == 2 and all(isinstance(t, int) for t in spawned):
            window = (spawned[0], spawned[1])
    return job_id, pgid, window
