"""The relay: moves the jobs of one spool (the producer's local one) into
another (a PostgreSQL spool), through the storage port only.

The local spool stays the producers' interface and is a durable outbox:
the relay claims its due jobs as a worker would, sends them in one batch
with ``enqueue(existing_ok=True)`` (keyed by the job id: the same id with
the same content already there counts as sent), and only then finishes
them locally as done, with ``relayed_to`` in the record. A relay killed
between the two leaves its claims for recovery, as any dead worker's, and
the next relay sends them again harmlessly.

While the destination is out of reach (``Unavailable``) the claimed jobs
go back where they were, no attempt used, and the relay backs off. A job
that cannot be sent (the destination refuses it, or holds a different job
under its id) goes to the local dead/ with the reason.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import config, record
from .output import as_log
from .backend import Claim, Finished, Unavailable
from .errors import DuplicateId, InvalidJob, SpoolError
from .record import Outcome

BATCH = 100  # jobs sent in one transaction
BACKOFF_FIRST = 0.5  # seconds before the first retry once the destination is out of reach
BACKOFF_MAX = 10.0
RESCAN = 5.0  # a watching relay looks at the local spool at least this often


@dataclass
class RelayResult:
    """What a relay did: jobs sent, jobs set aside as dead, and why it
    stopped early (the destination out of reach in drain mode), if it did."""

    sent: int = 0
    dead: int = 0
    unavailable: str | None = None
    problems: list[str] = field(default_factory=list)


class _Hooks:
    """The local commit's hooks: the relay only needs to know it is durable."""

    def __init__(self, reg: Any, problems: list[str]):
        self.reg = reg
        self.problems = problems

    def left(self, claim: Claim, completed: bool) -> None:
        self.forget(claim.job_id)

    def forget(self, job_id: str) -> None:
        try:
            self.reg.end_run(job_id)
        except OSError:
            pass

    def durable(self, finished: Finished, outcome: Outcome) -> None:
        pass

    def failed(self, job_id: str | None, why: str, where: str) -> None:
        self.problems.append(f"{job_id or 'a batch'}: {why}")


def forwarded(job: dict, job_id: str) -> tuple[str, bytes]:
    """The record sent on: the producer's fields as they were given, with
    the local id and creation time (no runs: the destination starts afresh).
    Raises InvalidJob."""
    fields = {k: v for k, v in job.items() if k not in record.SPOOLQ_FIELDS}
    fresh = record.new_job(fields, job_id, time.time())
    if job.get("created_at"):
        fresh["created_at"] = job["created_at"]
    return job_id, record.serialise(fresh)


class Relay:
    """One relay from ``source`` to ``dest`` (two open backends)."""

    def __init__(self, source: Any, dest: Any, watch: bool = False, poll: float | None = None,
                 log: Any = None, stop: threading.Event | None = None):
        self.source = source
        self.dest = dest
        self.watch = watch
        self.poll = poll
        self.log = as_log(log)
        self.stop = stop or threading.Event()
        self.result = RelayResult()
        self._backoff = 0.0

    def run(self) -> RelayResult:
        """Relay until nothing is due (or, watching, until stopped: the
        ``stop`` event, or SIGTERM/SIGINT when run in the main thread)."""
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                old[sig] = signal.signal(sig, lambda *_: self.stop.set())
        try:
            return self._run()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _run(self) -> RelayResult:
        source = self.source
        source.open(create=False)
        reg = source.register(None)
        commit = source.committer(_Hooks(reg, self.result.problems), 0.0)
        waker = source.waker(self.poll, self.log) if self.watch else None
        try:
            if waker is not None:
                waker.start()
            recovered: float | None = None
            while not self.stop.is_set():
                if recovered is None or time.monotonic() - recovered >= RESCAN:  # (not at every wake-up: it walks the claims)
                    source.recover()
                    recovered = time.monotonic()
                moved = self._pass(reg, commit)
                if self.result.unavailable and not self.watch:
                    break
                if moved:
                    continue
                if not self.watch:
                    break
                if self._backoff:  # (not the waker: putting the jobs back woke it)
                    self.stop.wait(self._backoff)
                    waker.clear()
                    continue
                look = source.next_look()
                wait = RESCAN if self.poll is None else self.poll
                if look.due is not None:
                    wait = max(0.0, min(wait, look.due - time.time()))
                waker.wait(wait)
                waker.clear()
        finally:
            commit.commit()
            if waker is not None:
                waker.stop()
            source.stop_work()
            reg.close()
        self.log.line(f"relay={self.dest.location} sent={self.result.sent} dead={self.result.dead}", 1)
        return self.result

    def _pass(self, reg: Any, commit: Any) -> int:
        """Send what is due now, a batch at a time; returns how many moved."""
        moved = 0
        while not self.stop.is_set():
            claims = []
            while len(claims) < BATCH and (claim := self.source.claim_next()) is not None:
                reg.note_run(claim.job_id, claim.attempt)
                claims.append(claim)
            if not claims:
                return moved
            if not self._send(claims, reg, commit):
                return moved
            moved += len(claims)
        return moved

    def _send(self, claims: list[Claim], reg: Any, commit: Any) -> bool:
        """Send one batch and finish it locally; False when the destination
        is out of reach (every claim is put back as it was)."""
        try:
            ready, refused = self._sent(claims)
        except Unavailable as e:
            for claim in claims:
                self.source.unclaim(claim)
                self._forget(reg, claim)
            if self.result.unavailable is None:
                self._say(f"unavailable: {e}; {len(claims)} job(s) wait here, retrying")
            self.result.unavailable = str(e)
            self._backoff = min(BACKOFF_MAX, max(BACKOFF_FIRST, self._backoff * 2))
            return False
        if self.result.unavailable:
            self._say("reachable again")
        self.result.unavailable = None
        self._backoff = 0.0
        now = time.time()
        for claim in ready:
            done = Outcome(start=now, end=now, result={"relayed_to": self.dest.location})
            commit.add(self.source.finish(claim, done, reg.worker_id), done)
        for claim, why in refused:
            dead = Outcome(start=now, end=now, error=f"cannot relay to {self.dest.location}: {why}", permanent=True)
            commit.add(self.source.finish(claim, dead, reg.worker_id), dead)
            self._say(f"id={claim.job_id} set aside as dead: {why}")
        commit.commit()
        self.result.sent += len(ready)
        self.result.dead += len(refused)
        return True

    def _sent(self, claims: list[Claim]) -> tuple[list[Claim], list[tuple[Claim, str]]]:
        """Send a batch: the claims sent (or there already) and those refused, with why."""
        items, ready, refused = [], [], []
        self.dest.open(create=False)
        limit = int(self.dest.settings["max_job_bytes"])
        for claim in claims:
            try:
                job_id, data = forwarded(claim.job, claim.job_id)
                problem = config.refusal(self.dest.settings, claim.job)
                if problem is None and len(data) > limit:
                    problem = f"the job is {len(data)} bytes, larger than the destination's max_job_bytes ({limit})"
            except InvalidJob as e:
                problem = str(e)
            if problem:
                refused.append((claim, problem))
            else:
                items.append((job_id, data, None))
                ready.append(claim)
        if items:
            try:
                self.dest.enqueue(items, existing_ok=True)
            except DuplicateId:  # one of them differs from the job under its id there: find which
                ready, more = self._one_by_one(ready, items)
                refused += more
        return ready, refused

    def _one_by_one(self, claims: list[Claim], items: list) -> tuple[list[Claim], list[tuple[Claim, str]]]:
        sent, refused = [], []
        for claim, item in zip(claims, items):
            try:
                self.dest.enqueue([item], existing_ok=True)
                sent.append(claim)
            except DuplicateId as e:
                refused.append((claim, f"{e}, with different content"))
            except (InvalidJob, SpoolError) as e:
                if isinstance(e, Unavailable):
                    raise
                refused.append((claim, str(e)))
        return sent, refused

    def _say(self, text: str) -> None:
        self.log.line(f"relay={self.dest.location} {text}", 0)

    @staticmethod
    def _forget(reg: Any, claim: Claim) -> None:
        try:
            reg.end_run(claim.job_id)
        except OSError:
            pass
