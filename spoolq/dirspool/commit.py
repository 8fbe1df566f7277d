"""Group commit, the directory spool's way from pending to durable:
finished jobs are made durable many at a time, and each outcome is told
only once it is durable (``GroupCommit`` is the port's ``Commit``).

With fsync on, a finished job passes through these stages, all owned here:
its new record is *staged* beside it in cur/ (``DirBackend.finish``), made
durable by one data sync for many jobs (*synced*), swapped in and moved on
(``DirBackend.complete``), then its folders' sync (``sync_deferred``)
makes the move durable, and only then is its outcome *told*. A job
finished without staging (no spare file to stage into) joins at the last
two steps. With fsync off nothing waits: an outcome is logged as the job
moves. A sync that fails leaves the jobs it covers in cur/ for recovery and
tells the worker to claim no more.

The worker hands finished jobs in (``add``); the dispatcher commits when
``full()`` or before it waits; a -j 1 worker moves a few synced jobs on
beside each job's run (``beside_run``); a committer thread (``run``)
commits what has waited the commit interval, even while a long job runs.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from ..backend import CommitHooks, Finished
from ..errors import ForcedStop
from ..record import Outcome

COMMIT_JOBS = 64  # at most this many finished jobs share one folder fsync ...
COMMIT_SECONDS = 0.05  # ... and none waits longer than this for it

COMPLETE_PER_JOB = 2  # synced jobs moved on beside each job's run (see beside_run)

# A finished job on its way: what its finish did, and the run's outcome.
Item = tuple[Finished, Outcome]


class GroupCommit:
    """The staged, synced and moved-but-unsynced finished jobs of one
    worker, and the syncs that make them durable."""

    def __init__(self, store: Any, stage_max: int, commit_seconds: float, hooks: CommitHooks):
        """``store``: the directory backend's syncs and moves (``sync_staged``,
        ``complete``, ``drop_staged``, ``release``, ``sync_deferred`` ...);
        ``stage_max``: how many synced jobs may wait to be moved on (each
        holds two descriptors); ``hooks``: the worker's ears (a job left
        cur/, its outcome may be told, a job or a sync cannot be recorded)."""
        self.store = store
        self.stage_max = stage_max
        self.commit_seconds = commit_seconds
        self.hooks = hooks
        self._lock = threading.Lock()  # the lists only: held for no system call
        self._commit_lock = threading.Lock()  # one commit at a time (held across its syncs)
        self._staged: list[Item] = []
        self._staged_since = 0.0
        self._synced: collections.deque = collections.deque()  # (when staged, Item), to move on
        self._moved: list[Item] = []  # moved, its folder sync pending
        self.sync_wanted = threading.Event()  # asks the committer thread to sync the staged records

    # -- jobs coming in ------------------------------------------------------

    def add(self, finished: Finished, out: Outcome) -> None:
        """A finished job: staged beside its file in cur/ (moved on by a
        later commit), or moved already."""
        item = (finished, out)
        if finished.claim is not None and self.store.is_staged(finished.claim):
            # A success or a dead end lets its registration entry go now, or
            # every registration save would carry the staged jobs too:
            # recovery knows those records by their state. A failed run keeps
            # it until the move: its record swapped in but not moved on looks
            # like the one it replaced, and the entry tells recovery which
            # run it was.
            if finished.state != "failed":
                self.hooks.forget(finished.claim.job_id)
            self.staged(item)
            return
        self.moved(item)

    def staged(self, item: Item) -> None:
        """A finished job whose new record is staged beside it in cur/."""
        with self._lock:
            if not self._staged:
                self._staged_since = time.monotonic()
            self._staged.append(item)

    def moved(self, item: Item, completed: bool = False) -> None:
        """A finished job has left cur/: tell it now (fsync off) or once
        the next commit has synced its folders."""
        self.hooks.left(item[0].claim, completed)
        if self.store.durable:
            with self._lock:  # not the commit lock: a slot never waits for an fsync here
                self._moved.append(item)
        else:
            self.hooks.durable(*item)

    def full(self, staged_factor: int = 1) -> bool:
        """Whether enough waits that the dispatcher commits before its next claim."""
        return (len(self._moved) >= COMMIT_JOBS or len(self._staged) >= self.stage_max * staged_factor
                or len(self._synced) >= self.stage_max)

    def busy(self) -> bool:
        """Whether any finished job is staged or synced (waits to be moved on)."""
        return bool(self._staged or self._synced)

    def beside_run(self) -> None:
        """While a job's process starts up and runs, move a few synced jobs
        on and ask for the next sync: that work then costs no time of its
        own. The sync is the committer thread's: it blocks without using a
        CPU. The moves are the dispatcher's, a few per job: in the committer
        they would take Python's lock from it at each of their many calls."""
        if self.busy():
            self.complete_synced(COMPLETE_PER_JOB)
            self.want_sync()

    # -- commits -------------------------------------------------------------

    def commit(self, staged_age: float = 0.0) -> None:
        """Sync and move on the staged jobs (those staged at least
        ``staged_age`` seconds ago), sync the folders of the deferred moves,
        then log the finishes they cover: an outcome is durable before
        anyone is told about it."""
        with self._commit_lock:
            if not self._moved and not self._staged and not self._synced and not self.store.has_deferred():
                return
            if self._staged and time.monotonic() - self._staged_since >= staged_age:
                self.sync_staged()
            self.complete_synced(older_than=staged_age)
            # Take the outcomes first: every one of them already has its
            # moves deferred, which the sync below covers.
            with self._lock:
                pending, self._moved = self._moved, []
            try:
                self.store.sync_deferred()
            except OSError as e:
                self.hooks.failed(None, f"cannot sync finished jobs: {e}", "")
                return
        for item in pending:
            self.hooks.durable(*item)

    def sync_staged(self) -> None:
        """Make the staged records durable, one sync for all of them; they
        then wait to be moved on."""
        with self._lock:
            staged, since, self._staged = self._staged, self._staged_since, []
        if not staged:
            return
        try:
            self.store.sync_staged([item[0].claim for item in staged])
        except BaseException as e:
            for item in staged:
                self._cannot_record(item, f"cannot sync finished jobs: {type(e).__name__}: {e}")
            if isinstance(e, (Exception, ForcedStop)):
                return
            raise  # (Ctrl-C in a program that calls Spool.work: the jobs are let go first)
        with self._lock:
            self._synced.extend((since, item) for item in staged)

    def complete_synced(self, limit: int | None = None, older_than: float = 0.0) -> None:
        """Swap in the synced records and move their jobs on: up to
        ``limit``, of those staged at least ``older_than`` seconds ago."""
        done = 0
        while limit is None or done < limit:
            with self._lock:
                if not self._synced or time.monotonic() - self._synced[0][0] < older_than:
                    return
                item = self._synced.popleft()[1]
            finished = item[0]
            try:
                self.store.complete(finished.claim, finished.state, finished.due)
            except BaseException as e:
                self._cannot_record(item, f"cannot record the outcome: {type(e).__name__}: {e}")
                if isinstance(e, (Exception, ForcedStop)):
                    continue
                raise
            self.moved(item, completed=True)
            done += 1

    def _cannot_record(self, item: Item, why: str) -> None:
        """A staged job that cannot be moved on stays in cur/ with its
        staged record, unlocked, for recovery to complete."""
        claim = item[0].claim
        self.store.drop_staged(claim)
        self.store.release(claim)
        self.hooks.failed(claim.job_id, why, "cur")

    def want_sync(self) -> None:
        """Ask the committer thread for a sync of the staged records once
        there are enough, they have waited the commit interval, or the last
        one ran that long itself (such jobs gain little from sharing one)."""
        if self.sync_wanted.is_set():
            return
        with self._lock:
            staged, since = self._staged, self._staged_since
        if staged and (len(staged) >= self.stage_max or staged[-1][1].end - staged[-1][1].start >= self.commit_seconds
                       or time.monotonic() - since >= self.commit_seconds):
            self.sync_wanted.set()

    # -- the committer thread ------------------------------------------------

    def run(self, stop: threading.Event, staged_age: float, on_error: Callable[[Exception], Any]) -> None:
        """The committer thread: sync the staged records when asked to, and
        commit whatever has waited the commit interval (jobs staged
        ``staged_age`` ago), even while the next job runs: a long job must
        not hold back the outcome of the one before."""
        wanted, store = self.sync_wanted, self.store
        while not stop.is_set():
            wanted.wait(self.commit_seconds / 2)
            if stop.is_set():
                break
            if wanted.is_set():
                try:
                    with self._commit_lock:  # a last commit waits for it, then sees what it synced
                        self.sync_staged()
                finally:
                    wanted.clear()
            # Outcomes may wait with nothing deferred: a slot's move that
            # another commit synced just before the slot listed its outcome.
            now = time.monotonic()
            with self._lock:
                synced_since = self._synced[0][0] if self._synced else now
            if ((store.has_deferred() or self._moved) and now - store.unsynced_since() >= self.commit_seconds) or (
                    self._staged and now - self._staged_since >= staged_age) or now - synced_since >= staged_age:
                try:
                    self.commit(staged_age)
                except Exception as e:
                    on_error(e)

    def stop(self, stop: threading.Event) -> None:
        """End the committer thread."""
        stop.set()
        self.sync_wanted.set()  # (wakes it)
