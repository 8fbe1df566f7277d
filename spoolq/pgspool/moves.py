"""The moves a producer or an operator makes in a PostgreSQL spool: enqueue
(a batch, all or none; the relay's "already there" for the same id and the
same job), cancel, retry, retry everything dead, purge dead jobs into the
history, and retention. Each is one transaction; a row a worker is changing
is waited for (briefly), never changed under it.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from .. import config, record
from ..errors import DuplicateId, InvalidJob, JobNotFound, NotPossible
from . import queries, shaping
from .connect import psycopg_module
from .reads import SHOWN, run_counts_sql

LOCK_WAIT = "1s"  # how long cancel and retry wait for a worker's hold on a row


def producer_fields(job: dict) -> dict:
    """What the producer wrote of a record (spoolq's own fields left out):
    two records with the same are the same job."""
    return {k: v for k, v in job.items() if k not in record.SPOOLQ_FIELDS}


def enqueue(conn, items: list[tuple[str, Any, float | None]], existing_ok: bool = False) -> list[str]:
    """Insert new jobs in one transaction. ``items``: (id, record as bytes
    or a dict, due time in epoch seconds or None for now). An id already
    in the spool is DuplicateId and nothing is enqueued, unless
    ``existing_ok`` and the job there is the same job (as the relay
    resends what it may have sent before): then it counts as enqueued."""
    psycopg = psycopg_module()
    ids = [job_id for job_id, _, _ in items]
    texts = [_text(data) for _, data, _ in items]
    params = {"jobs": json.dumps([[job_id, text, due] for job_id, text, (_, _, due) in zip(ids, texts, items)])}
    try:
        conn.execute(queries.ENQUEUE.format(conflict=""), params)
        return ids
    except psycopg.errors.UniqueViolation:
        pass  # (a statement in autocommit: nothing of it stayed)
    new = dict(zip(ids, texts))
    with conn.transaction():
        there = set()
        for job_id, state, text in conn.execute(queries.EXISTING, (ids,)):
            if not (existing_ok and _same_job(text, new[job_id])):
                raise DuplicateId(f"id {job_id} is already in the spool ({SHOWN[state]})")
            there.add(job_id)
        inserted = {row[0] for row in conn.execute(queries.ENQUEUE.format(conflict="ON CONFLICT (id) DO NOTHING"),
                                                    params)}
        taken = set(ids) - there - inserted
        if taken:  # enqueued by someone else since we looked: refused, all of the batch with it
            raise DuplicateId(f"id {min(taken)} is already in the spool")
    return ids


def _text(data: Any) -> str:
    if isinstance(data, dict):
        return shaping.text(data)
    if isinstance(data, bytes):
        data = data.decode("utf-8")
    return data.rstrip("\n")


def _same_job(stored: str, sent: str) -> bool:
    try:
        return producer_fields(record.loads(stored)) == producer_fields(record.loads(sent))
    except (ValueError, AttributeError):
        return stored == sent


def _held_row(conn, job_id: str, busy: str) -> tuple | None:
    """Lock a job's row for this transaction: (state, record, valid,
    purged), None if there is none; NotPossible(``busy``) when a worker
    holds it longer than LOCK_WAIT."""
    psycopg = psycopg_module()
    conn.execute(f"SET LOCAL lock_timeout = '{LOCK_WAIT}'")
    try:
        return conn.execute("SELECT state, record, valid, purged FROM spoolq.jobs WHERE id = %s FOR UPDATE",
                            (job_id,)).fetchone()
    except psycopg.errors.LockNotAvailable:
        raise NotPossible(busy) from None


def _parsed(job_id: str, text: str, valid: bool) -> dict:
    if not valid:
        raise InvalidJob("its record is not a job")
    return record.parse(text.encode("utf-8"), job_id)


def cancel(conn, job_id: str) -> None:
    """A waiting job (new or failed) to done, outcome cancelled. Raises
    JobNotFound, or NotPossible for a running or finished job."""
    with conn.transaction():
        row = _held_row(conn, job_id, f"job {job_id} is running (a worker holds it); it cannot be cancelled")
        if row is None:
            raise JobNotFound(f"no job {job_id} in this spool")
        state, text, valid, _ = row
        if state == "running":
            raise NotPossible(f"job {job_id} is running; it cannot be cancelled")
        if state == "done":
            raise NotPossible(f"job {job_id} has finished (done); nothing to cancel")
        if state == "dead":
            raise NotPossible(f"job {job_id} is dead, not waiting; nothing to cancel")
        try:
            job = _parsed(job_id, text, valid)
        except InvalidJob as e:
            raise NotPossible(f"job {job_id} is not a valid job ({e}); a worker will move it to dead") from None
        conn.execute("UPDATE spoolq.jobs SET state = 'done', record = %s, target = %s, at = now() WHERE id = %s",
                     (shaping.cancelled(job), record.target_label(job), job_id))


def retry(conn, job_id: str, settings: dict) -> None:
    """A dead job back to new, due now, with a fresh round of attempts (its
    history kept). Raises JobNotFound or NotPossible."""
    with conn.transaction():
        row = _held_row(conn, job_id, f"job {job_id} is busy (another command holds it); try again")
        if row is None:
            raise JobNotFound(f"no job {job_id} in dead")
        state, text, valid, purged = row
        if state != "dead":
            raise NotPossible(f"job {job_id} is {SHOWN[state]}, not dead")
        try:
            job = _parsed(job_id, text, valid)
            problem = config.refusal(settings, job)
            if problem:
                raise InvalidJob(problem)
        except InvalidJob as e:
            raise NotPossible(f"cannot retry {job_id}: {e}; enqueue a fixed job instead") from None
        conn.execute("UPDATE spoolq.jobs SET state = 'new', record = %s, at = now(), reason = NULL, target = NULL, "
                     "purged = false WHERE id = %s", (shaping.retried(job), job_id))
        conn.execute(queries.NOTIFY)


def retry_all(conn, settings: dict, on_problem: Callable[[str], None] | None = None) -> list[str]:
    """Every dead job not purged into the history back to new (as the
    directory spool's ``retry --all`` takes dead/); returns the ids moved. One
    that cannot go stays dead, and ``on_problem(message)`` says why."""
    moved = []
    ids = [r[0] for r in conn.execute(
        "SELECT id FROM spoolq.jobs WHERE state = 'dead' AND NOT purged ORDER BY at, id")]
    for job_id in ids:
        try:
            retry(conn, job_id, settings)
            moved.append(job_id)
        except JobNotFound:
            continue  # gone meanwhile
        except NotPossible as e:
            if "not dead" not in str(e) and on_problem:  # (not dead: retried meanwhile)
                on_problem(str(e))
    return moved


def purge_dead(conn, older_than: float) -> dict[str, int]:
    """Dead jobs that died more than ``older_than`` seconds ago become
    history: still dead (``show``, ``list``, ``stats`` and ``retry`` see
    them, marked purged), and deleted by retention as done jobs are."""
    n = conn.execute("UPDATE spoolq.jobs SET purged = true WHERE state = 'dead' AND NOT purged "
                     "AND at < now() - make_interval(secs => %s::float8)", (older_than,)).rowcount
    return {"purged": n, "left": 0}


def compact(conn, keep: float | None) -> dict[str, Any]:
    """Retention: delete the history (done jobs, purged dead ones) that
    finished more than ``keep`` seconds ago, adding what it counted to the
    cumulative counters first, so that no counter goes down."""
    started = time.monotonic()
    dropped = 0
    if keep is not None:
        gone = ("gone AS (DELETE FROM spoolq.jobs WHERE (state = 'done' OR (state = 'dead' AND purged)) "
                "AND at < now() - make_interval(secs => %(keep)s::float8) RETURNING state, valid, record)")
        query = run_counts_sql("gone", before=gone, extra="(SELECT count(*) FROM gone)")
        with conn.transaction():
            names, values, dropped = conn.execute(query, {"keep": keep}).fetchone()
            conn.execute("INSERT INTO spoolq.counters (name, value) SELECT * FROM unnest(%s::text[], %s::bigint[]) "
                         "AS c(name, value) WHERE value <> 0 "
                         "ON CONFLICT (name) DO UPDATE SET value = spoolq.counters.value + EXCLUDED.value",
                         (names, values))
    return {"folded": 0, "left": 0, "dropped": dropped, "tmp_removed": 0,
            "seconds": round(time.monotonic() - started, 3)}
