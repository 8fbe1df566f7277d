"""What a finish, a recovery, a cancel and a retry write into a job's
record in the PostgreSQL spool: the record's shaping is record.py's, the
directory spool's too; here are what the table keeps of it (the record's
text, trimmed to max_job_bytes) and a failed job's delay until it is due
again (the database's clock decides when that is). Pure: it returns the
record's new text and where the job goes; the backend writes them.
"""

from __future__ import annotations

import random
import time
from typing import Any

from .. import config, record
from ..record import Outcome

INTERRUPTED_FENCED = "interrupted: the worker lost its database session and killed the run"


def interrupted(start: float) -> Outcome:
    """A run whose worker died under it, as its recovery records it."""
    return Outcome(start=start, end=time.time(), error=record.INTERRUPTED, interrupted=True)


def text(job: dict, limit: int | None = None) -> str:
    """The record as the table keeps it: a job file's line without its
    newline, trimmed to ``limit`` (max_job_bytes) when given."""
    data = record.fitted(job, limit) if limit is not None else record.dumps(job)
    return data.decode("utf-8").rstrip("\n")


def finished(settings: dict, job: dict, attempt: int, due: float, out: Any, worker_id: str,
             due_now: bool = False) -> tuple[str, float | None, str]:
    """Record run ``attempt`` of ``job`` (due at ``due``, epoch seconds)
    with outcome ``out``: returns (state, delay, record text). ``delay``:
    for a failed job, seconds from now (the database's now) until it is due
    again (0 when ``due_now`` or the run was interrupted), else None."""
    dest = record.add_finish(job, out, attempt, due, worker_id, settings["max_attempts"])
    delay: float | None = None
    if dest == "failed":
        delay = 0.0 if (due_now or out.interrupted) else config.backoff(settings, attempt, random.uniform(-0.1, 0.1))
    return dest, delay, text(job, int(settings["max_job_bytes"]))


def fenced(out: Any) -> Outcome:
    """A run this worker killed when it lost its database session, as the
    interrupted run it was (its output kept)."""
    return Outcome(start=out.start, end=out.end or time.time(), error=INTERRUPTED_FENCED, interrupted=True,
                   exit_code=out.exit_code, stdout=out.stdout, stderr=out.stderr)


def cancelled(job: dict) -> str:
    """A waiting job's record once cancelled: done, outcome cancelled."""
    record.cancel(job)
    return text(job)


def retried(job: dict) -> str:
    """A dead job's record once retried: waiting, a fresh round of
    attempts, its history kept."""
    record.retry(job)
    return text(job)
