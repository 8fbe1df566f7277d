"""Recording a run's outcome: the job finished through the backend (or
put back, when it never started), its registration entry let go, its line
logged once the backend's commit has made it durable (``Recorder`` is the
commit's ``CommitHooks``); and what happens when an outcome cannot be
recorded (the job stays for recovery, the worker claims no more) or the
claim was lost (another worker recovered the job: the run is not counted).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .backend import Claim, Finished
from .errors import ForcedStop
from .output import quoted, wants
from .record import Outcome
from .runner import STOPPED_NOW


class Recorder:
    """Records the outcomes of one worker's runs (``worker``: its backend,
    registration, group commit, log and stop flags)."""

    def __init__(self, worker: Any):
        self.w = worker

    def record(self, claim: Claim, out: Outcome) -> None:
        """Finish a job by its outcome (pending until the backend's commit),
        to be logged once durable."""
        job_id = claim.job_id
        reg = self.w.registration
        backend = self.w.backend
        if out.not_started and self._put_back(claim, out):
            return
        try:
            if not out.ok:  # a failed run's record must be known as this run's (a success needs no telling)
                try:
                    reg.ensure_noted(job_id)
                except OSError:
                    pass  # only a crash right after the record would count the run twice
            finished = backend.finish(claim, out, reg.worker_id)
        except (Exception, ForcedStop) as e:
            # The job stays claimed and its registration entry stays too, so
            # recovery knows which run it was.
            backend.release(claim)
            self.cannot_record(job_id, f"cannot record the outcome: {type(e).__name__}: {e}", backend.where(claim))
            return
        if finished.lost:
            self.forget_run(job_id)
            self.w.log.line(f"worker={self.w.wid} job={job_id} outcome=lost error={quoted('the claim was lost: another worker recovered the job')} "
                            "(this run is not counted)", 0, logging.WARNING)
            return
        self.w.commit.add(finished, out)

    def _put_back(self, claimed: Claim, out: Outcome) -> bool:
        """A job claimed but stopped before it began (a second stop signal
        between the two, or a worker that can no longer start it) goes back
        where it came from, as it was: no run happened, so none is counted.
        False if it cannot (then it is finished as a failed run)."""
        try:
            folder = self.w.backend.unclaim(claimed)
        except Exception as e:
            where = self.w.backend.where(claimed)
            if where == "cur":
                return False  # not moved: finished as an interrupted run
            # Moved back, but a sync after failed: as for any record that
            # cannot be made durable, claim no more.
            self.w.backend.release(claimed)
            self.forget_run(claimed.job_id)
            self.cannot_record(claimed.job_id, f"{type(e).__name__}: {e}", where, back=True)
            return True
        self.forget_run(claimed.job_id)
        why = "the worker was told to stop now" if out.error == STOPPED_NOW else out.error
        self.w.log.line(f"worker={self.w.wid} job={claimed.job_id} not started: {why}; back in {folder}/", 1)
        return True

    def cannot_record(self, job_id: str | None, why: str, where: str, back: bool = False) -> None:
        """An outcome (or a sync of many) cannot be made durable: the job
        stays where it is for recovery, and this worker claims no more."""
        w = self.w
        w.failed_to_record = True
        w.stopping = True
        if job_id is None:
            tail = ""
        elif back:
            tail = f"back in {where}/ but not synced; "
        elif where == "cur":
            tail = "it stays in cur/ for recovery; "
        else:
            tail = f"it is in {where}/, not synced; "  # the move was made, only its sync failed
        job = f" job={job_id}" if job_id is not None else ""
        w.log.line(f"worker={w.wid}{job} error={quoted(why)} {tail}the worker stops claiming", 0)

    # -- the commit's hooks (backend.CommitHooks) ---------------------------------

    def left(self, claim: Claim, completed: bool) -> None:
        """A job has left this worker's hands (``completed``: moved on by
        the commit, which counts as a finish for the dispatcher: a failed
        job may be due again at once, and it could not see it before)."""
        self.forget_run(claim.job_id)
        self.w.moved(completed)

    def forget(self, job_id: str) -> None:
        self.forget_run(job_id)

    def failed(self, job_id: str | None, why: str, where: str) -> None:
        self.cannot_record(job_id, why, where)

    def forget_run(self, job_id: str) -> None:
        try:
            self.w.registration.end_run(job_id)
        except OSError:
            pass

    def durable(self, finished: Finished, out: Outcome) -> None:
        """The outcome's line (the commit calls this once it is durable)."""
        claim = finished.claim
        self.log_outcome(claim.job, out, claim.attempt, finished.state, finished.due)

    def log_outcome(self, job: dict, out: Outcome, attempt: int, dest: str, due: float | None) -> None:
        level, severity = (0, None) if dest == "dead" else (1, logging.WARNING if dest == "failed" else None)
        if not wants(self.w.log, level, severity):
            return  # (not worth building a line that would be dropped)
        outcome = {"done": "succeeded", "failed": "failed", "dead": "dead"}[dest]
        max_attempts = job.get("max_attempts") or self.w.settings["max_attempts"]
        parts = [
            f"worker={self.w.wid}",
            f"job={job['id']}",
            f"outcome={outcome}",
            f"attempt={attempt}/{max_attempts}",
            f"duration={max(0.0, out.end - out.start):.3f}s",
            f"exit={out.exit_code if out.exit_code is not None else '-'}",
        ]
        if due is not None:
            parts.append(f"retry_in={max(0.0, due - time.time()):.1f}s")
        if out.error:
            parts.append(f"error={quoted(out.error)}")
        self.w.log.line(" ".join(parts), level, severity)
