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
from . import ordering, queries, shaping
from .connect import psycopg_module
from .reads import SHOWN, run_counts_sql

LOCK_WAIT = "1s"  # how long cancel and retry wait for a worker's hold on a row


def producer_fields(job: dict) -> dict:
    """What the producer wrote of a record (spoolq's own fields left out):
    two records with the same are the same job."""
    return {k: v for k, v in job.items() if k not in record.SPOOLQ_FIELDS}


def enqueue(conn, items: list[tuple[str, Any, float | None]], existing_ok: bool = False,
            on_existing: Callable[[str, str], None] | None = None) -> list[str]:
    """Insert new jobs in one transaction. ``items``: (id, record as bytes
    or a dict, due time in epoch seconds or None for now). An id already
    in the spool is DuplicateId and nothing is enqueued, unless
    ``existing_ok`` and the job there is the same job (as the relay
    resends what it may have sent before): then it counts as enqueued.
    A batch with dependencies, unique keys or held jobs goes through
    ordering.enqueue_careful (``on_existing``: a unique key's holder
    stands in for a job)."""
    psycopg = psycopg_module()
    ids = [job_id for job_id, _, _ in items]
    texts = [_text(data) for _, data, _ in items]
    jobs = [_record(text) for text in texts]
    if any(ordering.needs_care(job) for job in jobs):
        try:
            return ordering.enqueue_careful(
                conn, [(job_id, text, due, job) for job_id, text, (_, _, due), job in zip(ids, texts, items, jobs)],
                on_existing)
        except psycopg.errors.UniqueViolation as e:
            raise DuplicateId(f"id {_violating_id(e, ids)} is already in the spool") from None
    rows = []
    for job_id, text, (_, _, due), job in zip(ids, texts, items, jobs):
        cols = ordering.columns(job)
        rows.append([job_id, text, due, "new", cols["priority"], None, None, cols["locks"], None, None, False])
    params = {"jobs": json.dumps(rows)}
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


def _record(text: str) -> dict:
    """A record's fields as far as ordering goes ({} for what is no object:
    a worker sends it to dead; {} without parsing for a record that
    names no ordering field, as most do)."""
    if not record.may_order(text):
        return {}
    try:
        job = record.loads(text)
    except ValueError:
        return {}
    if not isinstance(job, dict):
        return {}
    try:
        record.validate(job, job.get("id") if isinstance(job.get("id"), str) else None)
    except InvalidJob:
        return {}
    return job


def _violating_id(e: Exception, ids: list[str]) -> str:
    detail = getattr(getattr(e, "diag", None), "message_detail", None) or ""
    return next((job_id for job_id in ids if f"=({job_id})" in detail), ids[0])


def _same_job(stored: str, sent: str) -> bool:
    try:
        return producer_fields(record.loads(stored)) == producer_fields(record.loads(sent))
    except (ValueError, AttributeError):
        return stored == sent


def held_row(conn, job_id: str, busy: str) -> tuple | None:
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
        row = held_row(conn, job_id, f"job {job_id} is running (a worker holds it); it cannot be cancelled")
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
        row = held_row(conn, job_id, f"job {job_id} is busy (another command holds it); try again")
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
        state = ordering.retry_state(conn, job_id, job)
        holder = ordering.key_holder(conn, job.get("unique"))
        if holder is not None:
            raise NotPossible(f"cannot retry {job_id}: its unique key is held by job {holder}")
        conn.execute("UPDATE spoolq.jobs SET state = %s, record = %s, at = now(), reason = NULL, target = NULL, "
                     "purged = false WHERE id = %s", (state, shaping.retried(job), job_id))
        conn.execute(queries.NOTIFY)


def retry_all(conn, settings: dict, on_problem: Callable[[str], None] | None = None) -> list[str]:
    """Every dead job not purged into the history back to new (as the
    directory spool's ``retry --all`` takes dead/); returns the ids moved. One
    that cannot go stays dead, and ``on_problem(message)`` says why."""
    moved: list[str] = []
    ids = [r[0] for r in conn.execute(
        "SELECT id FROM spoolq.jobs WHERE state = 'dead' AND NOT purged ORDER BY at, id")]
    while ids:  # again while some moved: a dependent waits for its dependency's retry
        later = []
        for job_id in ids:
            try:
                retry(conn, job_id, settings)
                moved.append(job_id)
            except JobNotFound:
                continue  # gone meanwhile
            except ordering.DependencyEnded as e:
                later.append((job_id, str(e)))
            except NotPossible as e:
                if "not dead" not in str(e) and on_problem:  # (not dead: retried meanwhile)
                    on_problem(str(e))
        if len(later) == len(ids) or not later:
            for _, problem in later:
                if on_problem:
                    on_problem(problem)
            break
        ids = [job_id for job_id, _ in later]
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
