"""The facade's job control: ``wait`` for jobs to finish, ``kill`` or
cancel a running job, ``stop`` the spool's workers, ``pause`` and
``resume`` them (mixed into ``Spool``, over its read side and the spool's
control channel; the requests and the worker's side are control.py's).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable

from .control import ANSWER_WAIT, signal_name
from .errors import JobNotFound, NotPossible, RequestPending
from .owners import user_name

FINISHED = ("done", "dead")
#: How long ``stop`` and ``pause`` wait for the workers to take their requests (see _until_taken).
TAKEN_WITHIN = 10.0
#: A cancel waits for its job's end at most timeout_grace (capped at this)
#: plus STOPPING_SLACK seconds, then says the job is still stopping.
STOPPING_GRACE_CAP = 8.0
STOPPING_SLACK = 2.0


class WaitTimeout(Exception):
    """``Spool.wait`` ran out of time; ``.finished`` holds the records of
    the jobs that had finished by then."""

    def __init__(self, finished: dict[str, dict[str, Any]]):
        super().__init__("timed out")
        self.finished = finished


def finished(job: dict[str, Any]) -> bool:
    return job.get("state") in FINISHED


def succeeded(job: dict[str, Any]) -> bool:
    default = "finished" if job.get("readable") is False else "succeeded"
    return job.get("state") == "done" and job.get("outcome", default) == "succeeded"


class JobControl:
    """Mixed into Spool: needs its ``backend``, ``get`` and ``settings``."""

    backend: Any

    def _channel(self):
        self.backend.open()
        return self.backend.control()

    # -- wait ------------------------------------------------------------------

    def wait(self, ids: Iterable[str], timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Block until every job in ``ids`` has finished (done, dead, or in
        the history); returns their records by id. Raises JobNotFound for
        an unknown id, WaitTimeout when ``timeout`` seconds pass first.
        Sleeps on events (no polling) and holds no lock."""
        ids = list(dict.fromkeys(ids))
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[str, dict[str, Any]] = {}
        watch = self._channel().watch("finished")  # watch first, then look: nothing falls in between
        try:
            self._look(ids, results, first=True)
            while len(results) < len(ids):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeout(results)
                named = watch.read(left)
                if named is None:  # lost events: look at all again
                    self._look([i for i in ids if i not in results], results)
                    continue
                self._look([i for i in ids if i not in results and i in named], results)
        finally:
            watch.close()
        return {i: results[i] for i in ids}

    def _look(self, ids: list[str], results: dict[str, dict[str, Any]], first: bool = False) -> None:
        for job_id in ids:
            job = self.get(job_id)
            if job is None and not first:
                job = self.get(job_id)  # (a second look: a job between two states is seen in one)
            if job is None:
                if first:
                    raise JobNotFound(f"no job {job_id} in this spool")
                # Known when the wait began, gone now: it finished and
                # retention (compact --keep) dropped its history before it
                # was read. Finished, but not known to have succeeded.
                results[job_id] = {"id": job_id, "state": "done", "outcome": "finished", "readable": False,
                                   "error": "its history was dropped before it was read"}
                continue
            if finished(job):
                results[job_id] = job

    # -- kill ------------------------------------------------------------------

    def kill(self, job_id: str, sig: int | None = None, wait: float = ANSWER_WAIT) -> dict[str, Any]:
        """Cancel a running job (``sig`` None: SIGTERM to its process group,
        SIGKILL after timeout_grace; it ends ``cancelled``, not retried) or
        send it ``sig`` alone. The worker running it does the signalling.
        Returns its record once finished (a cancel: cancelled, or ended
        otherwise first), or as it is a few seconds on when the run is still
        stopping (``state`` cur), or once the signal went (``sig``). Raises
        JobNotFound, NotPossible (not running; not the caller's job), or
        RequestPending when no worker took the request within ``wait``
        seconds."""
        job = self.get(job_id)
        if job is None:
            raise JobNotFound(f"no job {job_id} in this spool")
        if job.get("state") != "cur":
            raise NotPossible(f"job {job_id} is not running (it is {job.get('state')}); nothing to kill")
        request = {"request": "kill", "id": job_id, "attempt": int(job.get("attempts") or 0) + 1,
                   "by": user_name(os.geteuid())}
        if sig is not None:
            request["signal"] = int(sig)
        channel = self._channel()
        if channel.member:
            return self._kill_by_owner(channel, request, wait)
        watch = channel.watch("control", "finished")
        try:
            token = channel.send(request)
            deadline = time.monotonic() + wait
            while channel.pending(token):
                if sig is None and finished(self.get(job_id) or {}):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    channel.done(token)
                    raise RequestPending(f"no worker took the request to kill job {job_id} within {wait:g}s "
                                         "(its worker died? `spoolq sweep` recovers its jobs)")
                watch.read(left)
        finally:
            watch.close()
        if sig is not None:
            return self.get(job_id) or job
        return self._outcome(job_id)

    def _kill_by_owner(self, channel: Any, request: dict[str, Any], wait: float) -> dict[str, Any]:
        """A member's kill: asked of the owner's side."""
        job_id = request["id"]
        channel.ask({k: v for k, v in request.items() if k != "by"}, f"kill job {job_id}")
        if "signal" in request:
            return self.get(job_id) or {"id": job_id}
        return self._outcome(job_id)

    def _outcome(self, job_id: str) -> dict[str, Any]:
        """A cancelled job's record once it has ended (cancelled, or ended
        otherwise before the cancel reached it), or, when it still runs a
        few seconds on (a run that ignores SIGTERM, before its SIGKILL), its
        record as it is then (``state`` cur: still stopping)."""
        grace = min(float(self.settings["timeout_grace"]), STOPPING_GRACE_CAP)
        try:
            return self.wait([job_id], timeout=grace + STOPPING_SLACK)[job_id]
        except WaitTimeout:
            return self.get(job_id) or {"id": job_id, "state": "cur"}

    # -- workers ---------------------------------------------------------------

    def stop_workers(self, now: bool = False, wait: float | None = None,
                     on_gone: Callable[[str], None] | None = None) -> list[str]:
        """Ask every live worker to stop claiming and exit after its running
        jobs (``now``: kill them, as a second signal does). With ``wait``
        (seconds; 0: for ever) return once they are gone, else at once.
        Returns the worker ids asked. Raises TimeoutError on ``wait``'s end."""
        channel = self._channel()
        channel.require_owner("stop its workers")
        watch = channel.watch("workers") if wait is not None else None
        try:
            workers = [w["worker"] for w in self.workers()]
            tokens = [channel.send({"request": "stop", "worker": worker_id, "now": bool(now),
                                    "by": user_name(os.geteuid())}) for worker_id in workers]
            _until_taken(channel, tokens)
            if watch is None:
                return workers
            deadline = None if not wait else time.monotonic() + wait
            left_ids = set(workers)
            while True:
                live = {w["worker"] for w in self.workers()}
                for gone in sorted(left_ids - live):
                    if on_gone:
                        on_gone(gone)
                left_ids &= live
                if not left_ids:
                    return workers
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{len(left_ids)} workers still running")
                watch.read(left)
        finally:
            if watch is not None:
                watch.close()

    def workers(self) -> list[dict[str, Any]]:
        self.backend.open()
        return self.backend.live_workers()

    def pause(self) -> bool:
        """Workers claim nothing until ``resume`` (they stay up; running jobs
        go on). Returns once every live worker has seen the pause (at most
        TAKEN_WITHIN seconds: a worker stopped by SIGSTOP is not waited
        for longer). False when it was paused already."""
        channel = self._channel()
        channel.require_owner("pause it")
        if not channel.set_paused({"by": user_name(os.geteuid()), "at": time.time()}):
            return False
        # Each live worker is asked to say it has seen the pause: one that
        # has claims nothing more, so none is claimed once this returns.
        _until_taken(channel, [channel.send({"request": "pause", "worker": w["worker"], "by": user_name(os.geteuid())})
                               for w in self.workers()])
        return True

    def resume(self) -> bool:
        """Let the workers claim again. False when it was not paused."""
        channel = self._channel()
        channel.require_owner("resume it")
        return channel.set_paused(None)

    def paused(self) -> dict[str, Any] | None:
        """Who paused the spool and when, or None."""
        self.backend.open()
        return self.backend.paused()


def describe(job: dict[str, Any]) -> tuple[str, str]:
    """A finished job's outcome word and what to say after it (exit code or error)."""
    state = job.get("state")
    if state == "dead":
        outcome = "dead"
    elif job.get("readable") is False:  # a member's view of the owner's record: the outcome is not its to read
        outcome = job.get("outcome") or "finished"
    else:
        outcome = job.get("outcome") or "succeeded"
    code = job.get("exit_code")
    error = job.get("error") or _last(job, "error")
    said = f"exit={code}" if code is not None else ""
    if error and outcome != "succeeded":
        said = (said + " " if said else "") + f"error={error}"
    return outcome, said


def _last(job: dict[str, Any], key: str) -> Any:
    history = job.get("history") or []
    return history[-1].get(key) if history and isinstance(history[-1], dict) else None


__all__ = ["JobControl", "WaitTimeout", "describe", "finished", "signal_name", "succeeded"]


def _until_taken(channel: Any, tokens: list[str]) -> None:
    """Return once every request is taken (a worker that took its stop
    claims nothing more), or after TAKEN_WITHIN seconds: a worker stopped
    by SIGSTOP, or gone, is asked all the same. A short poll: the sender
    waits only while requests are in flight."""
    deadline = time.monotonic() + TAKEN_WITHIN
    while tokens and time.monotonic() < deadline:
        tokens = [token for token in tokens if channel.pending(token)]
        if tokens:
            time.sleep(0.02)
