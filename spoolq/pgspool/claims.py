"""A worker's claims and finishes in a PostgreSQL spool: ``claim_next``
(the first due job, skipping what other workers hold; a record that can
never run goes to dead with the reason), ``finish`` (the record shaped as
the directory spool shapes it, kept until the commit), ``commit`` (one
statement writes every pending finish under its claim's token and commits:
the worker's group commit) and ``unclaim``.

Claims are committed at once and not waited on for durability (a claim a
server crash loses only means the job runs again, as a claim lost to a
power cut does in the directory spool); finishes are durable when
``fsync`` is on. Should the connection break during a commit, the pending
finishes are sent again on a new one: each carries its token, so one that
had been committed after all, or whose job was recovered meanwhile,
changes nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable

from .. import config, record
from ..errors import InvalidJob
from . import ordering, queries, shaping
from .connect import first_line, psycopg_module
from .types import Claim, Finished, Unavailable

REPLAY_FOR = 30.0  # seconds a commit keeps trying to reach the database before it gives up


class Claims:
    """The worker side of one PostgreSQL spool."""

    def __init__(self, conn: Callable[[str], Any], settings: Any, reg: Callable[[], Any],
                 on_quarantine: Callable[[str, str], None] | None = None):
        self._conn = conn  # conn("claim") / conn("finish") / conn("finish", fresh=True)
        self.settings = settings
        self._reg = reg
        self.on_quarantine = on_quarantine
        self._pending: list[Finished] = []
        self._lock = threading.Lock()
        self.busy = False  # the last empty claim passed over a job whose lock another claim was counting

    # -- claims ------------------------------------------------------------

    def claim_next(self) -> Claim | None:
        """The first due job, now this worker's; None when none is due.
        Raises Unavailable while this worker has no live session (it is
        registering again) or the database cannot be reached."""
        reg = self._reg()
        if reg is None or not reg.live.is_set() or reg.id is None:
            raise Unavailable("this worker has no live database session (registering again)")
        psycopg = psycopg_module()
        limits = json.dumps(self.settings["lock_limits"] or {})
        while True:
            token = int.from_bytes(os.urandom(8), "big") >> 1
            try:
                conn = self._conn("claim")
                row = conn.execute(queries.CLAIM, {"worker": reg.id, "token": token, "kinds": reg.kinds,
                                                   "limits": limits}).fetchone()
                if row is None:
                    self.busy = conn.execute(queries.LOCK_BUSY).fetchone()[0]
            except psycopg.OperationalError as e:
                raise Unavailable(first_line(e)) from None
            if row is None:
                return None
            claim = self._checked(row, token, reg.id)
            if claim is not None:
                return claim

    def _checked(self, row: tuple, token: int, worker: int) -> Claim | None:
        """The claim of a row, or None when its job cannot run now: a record
        that can never run (to dead, with the reason) or one seen for the
        first time with a run_at still ahead (postponed to it)."""
        job_id, origin, text, due = row
        limit = int(self.settings["max_job_bytes"])
        params = {"id": job_id, "token": token}
        try:
            job = record.parse_sized(text.encode("utf-8"), job_id, limit)
            problem = config.refusal(self.settings, job)
            if problem:
                raise InvalidJob(problem)
        except InvalidJob as e:
            valid = _is_object(text)
            self._conn("claim").execute(queries.QUARANTINE, dict(params, reason=str(e), valid=valid,
                                                                 target=_target(text) if valid else None))
            if self.on_quarantine:
                self.on_quarantine(job_id, str(e))
            return None
        if job.get("state") is None:
            job.setdefault("created_at", record.rfc3339())
            job["state"] = "new"
            job.setdefault("attempts", 0)
            when = record.time_or_none(job.get("run_at"))
            if ordering.needs_care(job) or job.get("priority") or job.get("lock") is not None:
                # A row inserted by hand with ordering fields: its columns
                # set from them, and back in line by them.
                self._conn("claim").execute(queries.UNCLAIM, dict(params, origin="new"))
                ordering.place(self._conn("claim"), job_id, job, shaping.text(job), when)
                return None
            if when is not None and when > time.time():
                self._conn("claim").execute(queries.POSTPONE, dict(params, record=shaping.text(job), due=when))
                return None
        if job.get("state") == "dead":
            record.fresh_round(job)  # a dead record put back by hand: a fresh round, as a retry gives
        return Claim(job=job, job_id=job_id, attempt=int(job.get("attempts") or 0) + 1, due=due, token=token,
                     origin=origin, worker=worker)

    def next_due(self) -> float | None:
        """Seconds until the next waiting job is due (<= 0: due now), by the
        database's clock; None when no job waits."""
        psycopg = psycopg_module()
        try:
            reg = self._reg()
            kinds = reg.kinds if reg is not None else None
            return self._conn("claim").execute(queries.NEXT_DUE, {"kinds": kinds}).fetchone()[0]
        except psycopg.OperationalError as e:
            raise Unavailable(first_line(e)) from None

    def unclaim(self, claim: Claim) -> str:
        """A claimed job that never started back where it was, as it was
        (no run counted). Returns that state."""
        conn = self._conn("claim")
        conn.execute(queries.UNCLAIM, {"id": claim.job_id, "token": claim.token, "origin": claim.origin})
        conn.execute(queries.NOTIFY)
        return claim.origin

    # -- finishes ------------------------------------------------------------

    def finish(self, claim: Claim, out: Any, worker_id: str) -> Finished:
        """Record a run's outcome, pending until ``commit`` (nothing is sent
        before). A run that a fence killed is recorded as the interrupted
        run it was."""
        reg = self._reg()
        if reg is not None and reg.was_fenced(claim.job_id):
            out = shaping.fenced(out)
        state, delay, text = shaping.finished(self.settings, claim.job, claim.attempt, claim.due, out, worker_id)
        params = {"id": claim.job_id, "token": claim.token, "state": state, "record": text,
                  "target": record.target_label(claim.job), "delay": delay}
        done = Finished(state=state, due=time.time() + delay if delay is not None else None, claim=claim,
                        params=params)
        with self._lock:
            self._pending.append(done)
        return done

    def commit(self) -> None:
        """Make every pending finish durable: one statement, one commit. A
        finish whose claim was lost comes back ``lost``. Raises Unavailable
        when the database stays out of reach for REPLAY_FOR seconds: those
        finishes are not recorded (their jobs stay running under this
        worker, for recovery once it is gone)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        psycopg = psycopg_module()
        rows = json.dumps([[done.params[key] for key in ("id", "token", "state", "record", "target", "delay")]
                           for done in pending])
        deadline = time.monotonic() + REPLAY_FOR
        delay, again = 0.1, False
        while True:
            try:
                conn = self._conn("finish", fresh=again)
                written = {row[0]: row[1] for row in conn.execute(queries.FINISH_MANY, (rows,))}
                if again and len(written) < len(pending):
                    written.update(self._written_before(conn, pending, written))
                break
            except (psycopg.OperationalError, Unavailable) as e:
                if time.monotonic() + delay > deadline:
                    raise Unavailable(f"cannot record {len(pending)} outcomes: {first_line(e)}") from None
                time.sleep(delay)
                delay, again = min(2.0, delay * 2), True
        for done in pending:
            done.pending = False
            if done.claim.job_id not in written:
                done.lost, done.state, done.due = True, None, None
            elif done.state == "failed":
                done.due = written[done.claim.job_id]

    def _written_before(self, conn, pending: list[Finished], written: dict) -> dict:
        """The finishes a statement sent before the connection broke had
        committed after all (the job's record is the one it wrote)."""
        found = {}
        for done in pending:
            if done.claim.job_id not in written:
                row = conn.execute(queries.FINISHED_ALREADY, done.params).fetchone()
                if row and row[0]:
                    found[done.claim.job_id] = row[1]
        return found


def _is_object(text: str) -> bool:
    try:
        return isinstance(record.loads(text), dict)
    except ValueError:
        return False


def _target(text: str) -> str:
    try:
        return record.target_label(record.loads(text))
    except (ValueError, AttributeError, TypeError):
        return ""
