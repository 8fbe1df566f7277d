"""The worker's half of the directory backend (``WorkerSide``, a part of
``DirBackend``): what the worker loop asks of a spool directory: register,
recover, claim the next job (the passes, read-ahead and -j 1 look-ahead
are passes.py's), finish, commit (commit.py's group commit), housekeeping
(automatic compaction, in a process beside the worker: autocompact.py).

The moves are transitions.py's, the files and syncs protocol.py's.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from .. import procs
from ..backend import Claim, CommitHooks, Finished, Look, Report
from ..record import Outcome
from ..waker import Waker

if TYPE_CHECKING:
    from . import transitions
    from .autocompact import Beside
    from .commit import GroupCommit
    from .passes import Pass
    from .registry import Registration

# The worker's modules (the moves, recovery, the passes, the watcher) are
# imported where they are first needed: start-up speed of the commands that
# run no worker (an enqueue, a status), which load this module too.

SCAN_LIMIT = 200_000  # due entries kept per pass (see Pass; Tuning.scan_limit)
COMPACT_CHECK_JOBS = 1000  # count done/ for auto-compaction in line after this many jobs ...
COMPACT_CHECK_SECONDS = 60.0  # ... or this long

# The program of a worker's compaction process: isolated (-I), so that
# neither the current folder nor PYTHON* variables choose the code it runs,
# with this very spoolq first on its path.
_COMPACT_BESIDE = ("import sys; sys.path.insert(0, sys.argv[1]); "
                   "from spoolq.dirspool.backend import compact_beside; compact_beside(sys.argv[2])")
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _quiet(text: str, level: int = 0, severity: int | None = None) -> None:
    pass


class WorkerSide:
    """The worker verbs of the port over a spool directory. It relies on
    what ``DirBackend`` gives: ``dir``, ``settings``, ``context()``,
    ``compact()``, ``order`` and ``_history``."""

    def _init_worker_side(self) -> None:
        self.log = _quiet
        self.ctx: transitions.Context | None = None  # the worker's (made once, at register)
        self._kinds: list[str] | None = []
        self._scan_limit = SCAN_LIMIT
        self._reg: Registration | None = None
        self._pass: Pass | None = None
        self._finished = 0
        self._next_compact_finished = 0
        self._next_compact_time = 0.0
        self._beside: Beside | None = None
        self._compacts_in_line = False

    @property
    def durable(self) -> bool:
        return self.dir.fsync  # (follows the settings on reload)

    def stop_work(self) -> None:
        """The worker is done: let its prepared job go, leave what it passed
        over to the next worker, remove its spare files. The folders stay
        open for the spool's other users (a program's own enqueue). Its
        compaction process stops after the batch in hand."""
        beside, self._beside = self._beside, None
        if beside is not None:
            beside.close()
        if self._pass is not None:
            self._pass.end()
            self._pass = None
        self.dir.drop_spares()

    def live_output(self) -> "DirLiveSink":
        """out/'s files, written by this worker's pump (see LiveOutputs)."""
        return DirLiveSink(self.dir.outputs, self.settings)

    # -- the worker --------------------------------------------------------------

    def register(self, kinds: list[str] | None, tuning: Any = None) -> Registration:
        """This worker's registration (a file in workers/ under its lock),
        saying which handler kinds it runs; claims pass over the others
        (``kinds`` None: claims take every kind, as a relay does)."""
        self.ctx = self.context()
        self._kinds = None if kinds is None else list(kinds)
        self._scan_limit = getattr(tuning, "scan_limit", SCAN_LIMIT)
        from .registry import Registration

        registration = Registration(self.dir, kinds=self._kinds)
        registration.open()
        registration.start_flusher()
        self._reg = registration
        return registration

    def waker(self, poll: float | None, log: Any) -> Waker:
        """What wakes a watching worker when jobs arrive: the folder watcher
        (or polling); a lock let go wakes it too."""
        from .watcher import make_waker

        waker = make_waker(self.dir, poll=poll, log=log)
        self._walk().locks.wake = waker.wake
        return waker

    def recover(self) -> Report:
        """Recover dead workers' jobs and remove stale tmp/ files."""
        from . import recovery, waits

        ctx = self.ctx or self.context()
        report = recovery.recover(ctx)
        waits.recover_waiting(ctx, self.order, self._history)
        report.tmp_removed = self.dir.remove_tmp()
        self.dir.remove_stale_spares()
        if self.dir.shared:
            report.tmp_removed += self.dir.drops.remove_stale()
        return report

    def _walk(self) -> Pass:
        if self._pass is None:
            worker_id = self._reg.worker_id if self._reg is not None else "-"
            from .passes import Pass

            self._pass = Pass(self.ctx, self._kinds, worker_id, self._scan_limit, self.log, self.order)
        return self._pass

    def claim_next(self, now: float | None = None) -> Claim | None:
        """The next due job of the pass, now this worker's; None once the
        pass is used up (the next call begins a new one)."""
        claimed = self._walk().claim_next()
        if claimed is None:
            return None
        return Claim(claimed.job, claimed.job_id, claimed.attempt, claimed.due_ns / 1e9, claimed,
                     tuple(claimed.locks) if claimed.locks else ())

    def next_look(self) -> Look:
        return self._walk().look()

    def look_ahead(self) -> None:
        self._walk().look_ahead()

    def drop_ahead(self) -> None:
        if self._pass is not None:
            self._pass.drop_ahead()

    def release(self, claim: Claim) -> None:
        _let_go(claim)
        claim.held.held.release()

    def unclaim(self, claim: Claim) -> str:
        from . import transitions

        _let_go(claim)
        return transitions.unclaim(claim.held)

    def where(self, claim: Claim) -> str:
        return claim.held.held.folder

    def finish(self, claim: Claim, outcome: Outcome, worker_id: str) -> Finished:
        """Record the outcome. With fsync on the new record is staged beside
        the job in cur/ (moved on by the group commit) or, with no spare to
        stage into, the job moves at once with its folders' sync deferred:
        pending either way until the commit."""
        defer = self.dir.fsync
        from . import transitions  # (already loaded by the claim: a look-up in sys.modules)

        dest, due = transitions.finish(self.ctx, claim.held, outcome, worker_id, defer_sync=defer, stage=defer)
        _let_go(claim)  # the run is over: the next holder of its locks may start
        if claim.held.held.staged is None:
            self._left(claim, dest)
        self._finished += 1
        return Finished(dest, due, pending=defer, claim=claim)

    def _left(self, claim: Claim, dest: str) -> None:
        """A job has moved on: a finished one's dependents waiting are
        released or sent to dead/ (its move is the one they wait for)."""
        if dest != "failed" and self.order.any_dependents():
            from . import waits

            waits.dependency_ended(self.ctx, self.order, claim.job_id, dest, self._history)

    def committer(self, hooks: CommitHooks, seconds: float) -> GroupCommit:
        # Each staged job holds two descriptors; a commit comes once a
        # sixteenth of the open-file limit are synced, or twice that staged,
        # so at most ~a quarter of the limit is theirs.
        from .commit import COMMIT_JOBS, GroupCommit

        return GroupCommit(self, max(1, min(COMMIT_JOBS, procs.open_file_limit() // 16)), seconds, hooks)

    def commit(self, finished: list[Finished] | None = None) -> None:
        self.dir.sync_deferred()

    def housekeeping(self, settle: Callable[[], None]) -> None:
        """Fold done/ into the index when it holds more than compact_after
        files, in a process beside the worker (see autocompact.py: its
        thread counts done/ and starts the process by itself; this check,
        between passes, starts it at once). Where no process can be
        started, the worker folds in line (after ``settle``). done/ is
        counted here at most every COMPACT_CHECK_JOBS finishes or
        COMPACT_CHECK_SECONDS, so the check costs nothing per job."""
        limit = int(self.settings["compact_after"])
        if limit <= 0:
            return
        if self._beside is None and not self._compacts_in_line:
            self._beside = self._start_beside()
            self._compacts_in_line = self._beside is None
        now = time.monotonic()
        if self._finished < self._next_compact_finished and now < self._next_compact_time:
            return
        self._next_compact_finished = self._finished + max(1, min(COMPACT_CHECK_JOBS, limit // 10))
        self._next_compact_time = now + COMPACT_CHECK_SECONDS
        try:
            if self.dir.count("done") <= limit:
                return
            if self._beside is not None:
                self._beside.now()
                return
            settle()
            result = self.compact()
        except Exception as e:  # the index is history: never stop the worker for it
            self.log(f"compaction failed: {e}", 0, None)
            return
        self.log(f"compacted {result['folded']} jobs into index.db in {result['seconds']}s", 1, None)

    def _start_beside(self) -> Beside | None:
        """The compaction beside this worker, started; None when no process
        can be started. The process ends when this one closes its end of
        the pipe (stop_work), or exits."""
        from .autocompact import Beside

        def report(result: dict[str, Any]) -> None:
            if "error" in result:
                self.log(f"compaction failed: {result['error']}", 0, None)
            elif result.get("folded"):
                self.log(f"compacted {result['folded']} jobs into index.db in {result['seconds']}s", 1, None)

        beside = Beside([sys.executable, "-I", "-c", _COMPACT_BESIDE, _PACKAGE_PARENT, self.path],
                        lambda: self.dir.count_apart("done"), lambda: int(self.settings["compact_after"]), report)
        return beside if beside.start() else None

    def count_workers(self) -> int:
        return self.dir.count("workers")

    # -- the group commit's syncs and moves (commit.py) ----------------------------

    def is_staged(self, claim: Claim) -> bool:
        return claim.held.held.staged is not None

    def sync_staged(self, staged: list[Claim]) -> None:
        self.dir.sync_data([claim.held.held.staged[1] for claim in staged])

    def complete(self, claim: Claim, dest: str, due: float | None) -> None:
        from . import transitions

        transitions.complete(claim.held.held, dest, due)
        self._left(claim, dest)

    def drop_staged(self, claim: Claim) -> None:
        claim.held.held.drop_staged()

    def has_deferred(self) -> bool:
        return self.dir.has_deferred

    def unsynced_since(self) -> float:
        return self.dir.unsynced_since

    def sync_deferred(self) -> None:
        self.dir.sync_deferred()


class DirLiveSink:
    """backend.LiveSink over out/ (protocol.LiveOutputs): readers follow
    the files' growth (inotify), so nothing is told."""

    def __init__(self, outputs: Any, settings: Any):
        self.outputs = outputs
        self.settings = settings

    def put(self, job_id: str, stream: str, start: int, data: bytes) -> None:
        self.outputs.put(job_id, stream, start, data, int(self.settings["log_limit"]))

    def told(self, job_ids: list[str]) -> None:
        pass

    def remove(self, job_id: str) -> None:
        self.outputs.remove(job_id)

    def close(self) -> None:
        self.outputs.close()


def _let_go(claim: Claim) -> None:
    """Let a claim's lock slots go (none when the job holds no lock)."""
    if claim.held.locks:
        from .ordering import release

        release(claim.held.locks)
        claim.held.locks = None
