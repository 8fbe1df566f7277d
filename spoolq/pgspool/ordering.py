"""What decides when a job of a PostgreSQL spool may run, on the way in
and for the operator: the columns a record's priority, after, unique,
lock and held fields become; an enqueue that checks dependencies and
keeps one unfinished job per unique key (a partial unique index and
``ON CONFLICT``, race-free); hold and release; the dependency check of a
retry. The claim side is SQL (queries.CLAIM, ordering.sql's functions and
trigger).

Which states hold a unique key: new, failed (waiting for a retry), running,
held and waiting (for dependencies); done and dead free it.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from .. import record
from ..errors import InvalidJob, JobNotFound, NotPossible, UnmetDependency
from . import queries
from .reads import SHOWN

# Stored states a job waits in (as the unique index lists them, running aside).
WAITING = ("new", "failed", "held", "waiting")


class DependencyEnded(NotPossible):
    """A retry refused while a dependency of the job is dead or cancelled."""


def columns(job: dict) -> dict[str, Any]:
    """The ordering columns of a valid record."""
    return {"priority": record.priority_of(job), "after": record.after_of(job) or None,
            "unique_key": job.get("unique"), "locks": record.locks_of(job) or None}


def needs_care(job: dict) -> bool:
    """Whether enqueueing the record takes more than the one-statement batch."""
    return job.get("after") is not None or job.get("unique") is not None or job.get("held") is True


def dependencies(conn, job_id: str, after: list[str], batch: dict[str, dict]) -> tuple[str, str | None]:
    """Mark each dependency as having dependents (its row locked till the
    commit, so it cannot finish unseen) and say where the job starts:
    ("new", None) or ("waiting", None). Raises UnmetDependency for an id
    the spool does not hold (nor the batch), or one that ended dead or
    cancelled."""
    outside = [dep for dep in after if dep not in batch]
    found = {row[0]: row[1:] for row in conn.execute("SELECT * FROM spoolq.depend_on(%s)", (outside,))}
    for dep in after:
        if dep not in batch and dep not in found:
            raise UnmetDependency(f"after: no job {dep} in this spool")
    for dep in after:
        if dep in found:
            state, outcome = found[dep]
            if state == "dead" or outcome == "cancelled":
                raise UnmetDependency(f"after: job {dep} ended {'dead' if state == 'dead' else 'cancelled'}; "
                                      "retry it, or enqueue without it")
    if any(dep in batch or found[dep][0] != "done" for dep in after):
        return "waiting", None
    return "new", None


def enqueue_careful(conn, items: list[tuple[str, str, float | None, dict]],
                    on_existing: Callable[[str, str], None] | None) -> list[str]:
    """One transaction for a batch with dependencies, unique keys or held
    jobs: each job's dependencies checked, each unique job inserted
    unless an unfinished job holds its key (then that job's id stands in
    for it and ``on_existing(asked id, existing id)`` is told)."""
    batch = {job_id: job for job_id, _, _, job in items}
    depended = {dep for _, _, _, job in items for dep in record.after_of(job)}
    ids = []
    with conn.transaction():
        for job_id, text, due, job in items:
            cols = columns(job)
            state, reason = ("new", None)
            if cols["after"]:
                state, reason = dependencies(conn, job_id, cols["after"], batch)
            origin = None
            if job.get("held") is True and state != "dead":
                state, origin = "held", state
            row = json.dumps([job_id, text, due, state, cols["priority"], cols["after"], cols["unique_key"],
                              cols["locks"], origin, reason, job_id in depended])
            got = _insert_unique(conn, row, cols["unique_key"])
            if got != job_id:  # the key's holder
                batch.pop(job_id)
                if on_existing:
                    on_existing(job_id, got)
            ids.append(got)
        conn.execute(queries.NOTIFY)
    return ids


def place(conn, job_id: str, job: dict, text: str, when: float | None) -> None:
    """A row inserted by hand, seen for the first time: its ordering
    columns and state set from its record, as enqueue sets them."""
    cols = columns(job)
    with conn.transaction():
        state, reason = ("new", None)
        if cols["after"]:
            try:
                state, reason = dependencies(conn, job_id, cols["after"], {})
            except InvalidJob as e:
                state, reason = "dead", str(e)
        origin = None
        if job.get("held") is True and state != "dead":
            state, origin = "held", state
        holder = key_holder(conn, cols["unique_key"])
        if holder is not None and holder != job_id:
            state, reason, cols["unique_key"] = "dead", f"its unique key is held by job {holder}", None
        conn.execute("""UPDATE spoolq.jobs SET state = %(state)s, record = %(record)s, priority = %(priority)s,
                after = %(after)s, unique_key = %(unique_key)s, locks = %(locks)s, origin = %(origin)s,
                reason = %(reason)s, at = coalesce(to_timestamp(%(when)s), at)
            WHERE id = %(id)s AND state = 'new'""",
                     dict(cols, state=state, record=text, origin=origin, reason=reason, when=when, id=job_id))


def key_holder(conn, key: str | None) -> str | None:
    """The unfinished job that holds unique key ``key``, if any."""
    if key is None:
        return None
    row = conn.execute("SELECT id FROM spoolq.jobs WHERE unique_key = %s "
                       "AND state IN ('new', 'failed', 'running', 'held', 'waiting')", (key,)).fetchone()
    return row[0] if row else None


def _insert_unique(conn, row: str, key: str | None) -> str:
    """Insert one job's row; the id of the unfinished job that holds its
    unique key instead, when one does. A statement of its own looks the
    holder up, so it sees the one that beat this insert; should that one
    have finished meanwhile, the insert is tried again."""
    while True:
        got = conn.execute(queries.ENQUEUE_ONE, (row,)).fetchone()
        if got is not None:
            return got[0]
        holder = key_holder(conn, key)
        if holder is not None:
            return holder


def hold(conn, job_id: str, lock_row: Callable) -> None:
    """A waiting job (new, failed or waiting) to held: never claimed until released."""
    with conn.transaction():
        row = lock_row(conn, job_id, f"job {job_id} is busy (a worker holds it); try again")
        if row is None:
            raise JobNotFound(f"no job {job_id} in this spool")
        state = row[0]
        if state == "held":
            return
        if state not in WAITING:
            raise NotPossible(f"job {job_id} is {_shown(state)}; only a waiting job can be held")
        conn.execute("UPDATE spoolq.jobs SET state = 'held', origin = state WHERE id = %s", (job_id,))


def release(conn, job_id: str, now: bool, lock_row: Callable) -> str:
    """A held job back to where it was held from (waiting again if a
    dependency is still unfinished), keeping its due time unless ``now``.
    Returns the state it is in now, as users see it."""
    with conn.transaction():
        row = lock_row(conn, job_id, f"job {job_id} is busy (another command holds it); try again")
        if row is None:
            raise JobNotFound(f"no job {job_id} in this spool")
        if row[0] != "held":
            raise NotPossible(f"job {job_id} is {_shown(row[0])}, not held")
        # A statement of its own, after the lock: a dependency finishing
        # meanwhile is either seen done here or releases the job itself.
        state = conn.execute("""UPDATE spoolq.jobs j SET state = CASE
                WHEN EXISTS (SELECT 1 FROM spoolq.jobs d WHERE d.id = ANY(j.after) AND d.state <> 'done') THEN 'waiting'
                WHEN j.origin = 'failed' THEN 'failed' ELSE 'new' END,
              origin = NULL, at = CASE WHEN %s THEN now() ELSE at END
            WHERE id = %s RETURNING state""", (now, job_id)).fetchone()[0]
        conn.execute(queries.NOTIFY)
    return _shown(state)


def retry_state(conn, job_id: str, job: dict) -> str:
    """Where a retried job goes: new, or waiting while a dependency is
    unfinished. NotPossible while one is dead or cancelled."""
    after = record.after_of(job)
    if not after:
        return "new"
    waiting = False
    for dep, state, outcome in conn.execute(
            "SELECT id, state, CASE WHEN state = 'done' THEN spoolq.outcome_of(record) END FROM spoolq.jobs "
            "WHERE id = ANY(%s) ORDER BY id FOR SHARE", (after,)):
        if state == "dead" or outcome == "cancelled":
            raise DependencyEnded(f"job {job_id} waits for job {dep}, which ended "
                              f"{'dead' if state == 'dead' else 'cancelled'}: retry {dep} first")
        waiting = waiting or state != "done"
    return "waiting" if waiting else "new"


def release_stuck(conn) -> None:
    """Waiting jobs whose dependencies have all finished, released (what
    the finishing trigger does; here for a row changed by hand)."""
    conn.execute("SELECT spoolq.release_waiting(ARRAY(SELECT id FROM spoolq.jobs WHERE state = 'waiting'))")


def _shown(state: str) -> str:
    return SHOWN[state]
