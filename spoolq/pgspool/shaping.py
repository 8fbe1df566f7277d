"""What a finish, a recovery, a cancel and a retry write into a job's
record in the PostgreSQL spool: the same history entries, attempts,
outcome words, backoff and trimming as the directory spool's moves, built
from record.py and config.py. Pure: it returns the record's new text and
where the job goes; the backend writes them.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from .. import config, record
from ..record import rfc3339

INTERRUPTED_DIED = "interrupted: the worker running it died"
INTERRUPTED_FENCED = "interrupted: the worker lost its database session and killed the run"


@dataclass
class Interrupted:
    """A run that ended without an outcome of its own: its worker died,
    or killed it when it lost its database session. Reads as a run's
    outcome does (runner.Outcome's fields)."""

    start: float
    end: float
    error: str = INTERRUPTED_DIED
    exit_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    permanent: bool = False
    interrupted: bool = True
    cancelled: str | None = None
    ok: bool = False
    has_result: bool = False
    result: Any = None


def text(job: dict, limit: int | None = None) -> str:
    """The record as the table keeps it: a job file's line without its
    newline, trimmed to ``limit`` (max_job_bytes) when given."""
    data = record.fitted(job, limit) if limit is not None else record.dumps(job)
    return data.decode("utf-8").rstrip("\n")


def decide(settings: dict, job: dict, out: Any, attempt: int) -> str:
    """Where a job goes after a run: done, failed or dead (a cancelled
    run: done, never retried)."""
    if out.ok or out.cancelled:
        return "done"
    if out.permanent:
        return "dead"
    max_attempts = job.get("max_attempts") or settings["max_attempts"]
    return "dead" if attempt >= max_attempts else "failed"


def finished(settings: dict, job: dict, attempt: int, due: float, out: Any, worker_id: str,
             due_now: bool = False) -> tuple[str, float | None, str]:
    """Record run ``attempt`` of ``job`` (due at ``due``, epoch seconds)
    with outcome ``out``: returns (state, delay, record text). ``delay``:
    for a failed job, seconds from now (the database's now) until it is due
    again (0 when ``due_now`` or the run was interrupted), else None."""
    now = time.time()
    end = rfc3339(out.end or now)
    error = record.capped_error(out.error)
    entry: dict[str, Any] = {"attempt": attempt, "worker": worker_id, "due": rfc3339(due),
                             "start": rfc3339(out.start), "end": end}
    results: dict[str, Any] = {}
    if out.exit_code is not None:
        entry["exit_code"] = results["exit_code"] = out.exit_code
    if error is not None:
        entry["error"] = results["error"] = error
    if out.stdout:
        results["stdout"] = out.stdout
    if out.stderr:
        results["stderr"] = out.stderr
    if out.has_result:
        results["result"] = out.result
    record.add_run(job, entry, results)
    dest = decide(settings, job, out, attempt)
    delay: float | None = None
    if dest == "done":
        job["outcome"] = "cancelled" if out.cancelled else "succeeded"
    elif dest == "failed":
        delay = 0.0 if (due_now or out.interrupted) else config.backoff(settings, attempt, random.uniform(-0.1, 0.1))
    job["state"] = dest
    job["finished_at" if dest != "failed" else "failed_at"] = end
    return dest, delay, text(job, int(settings["max_job_bytes"]))


def fenced(out: Any) -> Interrupted:
    """A run this worker killed when it lost its database session, as the
    interrupted run it was (its output kept)."""
    return Interrupted(start=out.start, end=out.end or time.time(), error=INTERRUPTED_FENCED,
                       exit_code=out.exit_code, stdout=out.stdout, stderr=out.stderr)


def cancelled(job: dict) -> str:
    """A waiting job's record once cancelled: done, outcome cancelled."""
    record.clear_run_fields(job)
    job["state"] = "done"
    job["outcome"] = "cancelled"
    job["finished_at"] = rfc3339()
    return text(job)


def retried(job: dict) -> str:
    """A dead job's record once retried: waiting, a fresh round of
    attempts, its history kept."""
    record.clear_run_fields(job)
    record.fresh_round(job)
    return text(job)

