"""The storage port: ``Backend``, what the facade, the read side, the CLI,
metrics and the worker loop ask of a spool, and the neutral values it
hands back (``Claim``, ``Finished``, ``Look``, ``Report``, ``WorkerReg``,
``Commit``, ``Unavailable``, ``LiveSink``).

A backend is one object per open spool: the directory spool
(spoolq/dirspool/) or the PostgreSQL spool (spoolq/pgspool/). Nothing here
names a folder, a file, a table or a sync: which job comes next, how a
claim is held and how a finish becomes durable are each backend's
business. Only the facade (spool.py) knows which backend it has.

A finish is *pending* until the backend's commit makes it durable; the
worker tells an outcome only once it is durable. ``PlainCommit`` is that
pipeline for a backend whose commit is one call (a database COMMIT); the
directory spool has its own (many finishes share one folder sync).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from .errors import SpoolError
from .record import Outcome
from .waker import Waker

#: How a backend tells the worker what it met on the way (a job set aside
#: as dead, a job left for its writer, a pickup that failed): (text,
#: verbosity, logging severity or None). The worker puts its id in front.
Log = Callable[[str, int, "int | None"], None]
Note = Callable[[str], None]


class Unavailable(SpoolError):
    """The spool cannot be reached now (a database out of reach, or a
    worker that lost its liveness session and is registering again): try
    again later; nothing was changed."""


@dataclass
class Claim:
    """A job this worker holds: its record, its id, the run number this
    claim is and when it was due (epoch seconds). ``held`` is the backend's
    own, opaque above the port (a locked file; a row and its token).
    ``keep``: descriptors the job's processes must hold for as long as any
    of them lives (what the backend ties to the run, such as a lock that
    must outlive a worker killed while they run)."""

    job: dict
    job_id: str
    attempt: int
    due: float
    held: Any = None
    keep: tuple[int, ...] = ()


@dataclass
class Finished:
    """What ``finish`` did: the state the job went to (done, failed or
    dead) and when a failed one is due again (epoch seconds). ``pending``:
    its outcome may be told only after ``commit``. ``lost``: the claim had
    been lost (another worker recovered the job), so the finish changed
    nothing and the run is not counted."""

    state: str | None
    due: float | None = None
    pending: bool = False
    lost: bool = False
    claim: Claim | None = None


@dataclass
class Look:
    """What a worker learns when ``claim_next`` has nothing more for now:
    when the next waiting job is due (``due``, epoch seconds: a watching
    worker sleeps until then); ``busy``: another worker held a due job for
    a moment (look again very soon); ``later``: a job that is neither
    runnable nor given up on yet is to be looked at again then, even by a
    draining worker; ``more``: more is ready at once (look again now)."""

    due: float | None = None
    busy: bool = False
    later: float | None = None
    more: bool = False


@dataclass
class Report:
    """What a recovery (or a sweep) did; what does not apply stays 0."""

    recovered: int = 0  # jobs back to failed, due now, their interrupted run counted
    dead: int = 0  # jobs out of attempts
    completed: int = 0  # runs that had finished whose finish was not complete
    quarantined: int = 0  # unreadable jobs set aside as dead
    killed: int = 0  # leftover processes of dead workers' runs killed
    left_running: int = 0  # jobs whose runs' processes live on and are not ours to kill
    left_for_root: int = 0  # jobs only root may recover
    workers: int = 0  # registrations of dead workers removed
    tmp_removed: int = 0  # half-written jobs removed
    picked_up: int = 0  # jobs other users handed in, taken in
    dropped_dead: int = 0  # of those, set aside as dead
    waiting: int = 0  # jobs of workers lost just now: taken by a later recovery


class WorkerReg(Protocol):
    """A worker's liveness and the runs it has under way, so that recovery
    tells a dead worker's jobs (and kills their processes) from a live one's."""

    worker_id: str

    def note_run(self, job_id: str, attempt: int, pgid: int | None = None,
                 window: tuple[int, int] | None = None) -> None:
        """A run begins (no ``pgid``), or its process group is started
        (``pgid`` and the boot-clock ``window`` it was started in)."""
    def ensure_noted(self, job_id: str) -> None:
        """Make sure the run is known before its failure is recorded."""
    def end_run(self, job_id: str) -> None: ...
    def flush(self) -> None:
        """Before the worker sleeps: what is noted lazily, noted now."""
    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(why)`` if the liveness is lost while the worker
        lives (its runs' processes killed first); a backend whose liveness
        cannot be lost so never calls it."""
    def close(self) -> None: ...


class CommitHooks(Protocol):
    """What a commit pipeline tells the worker."""

    def left(self, claim: Claim, completed: bool) -> None:
        """The job has left this worker's hands (``completed``: by the
        pipeline, later than its finish: a failed one may be due at once)."""
    def forget(self, job_id: str) -> None:
        """The run's registration entry may go (its finish is safe without it)."""
    def durable(self, finished: Finished, outcome: Outcome) -> None:
        """The outcome is durable: it may be told."""
    def failed(self, job_id: str | None, why: str, where: str) -> None:
        """A finish (or, with job_id None, a commit) cannot be made
        durable; the job stays where ``where`` says, for recovery."""


class Commit(Protocol):
    """One worker's finished jobs on their way from pending to durable."""

    def add(self, finished: Finished, outcome: Outcome) -> None: ...
    def full(self, factor: int = 1) -> bool:
        """Whether the dispatcher should commit before its next claim."""
    def beside_run(self) -> None:
        """A little of the pending work, done while a job's process runs."""
    def commit(self, age: float = 0.0) -> Any:
        """Make durable what waits (what was finished ``age`` seconds ago
        at least, where that matters), then tell the hooks. Returns
        whether it made finishes durable that the hooks' ``left`` has not
        told of as completed (then other jobs may run now: a dependent)."""
    def run(self, stop: threading.Event, age: float, on_error: Callable[[Exception], Any]) -> None:
        """A committer thread's body: commit what has waited long enough."""
    def stop(self, stop: threading.Event) -> None: ...


class LiveSink(Protocol):
    """Where a worker's pump (liveout.py) keeps its running jobs' output
    for ``Backend.output`` readers (``Backend.live_output``)."""

    def put(self, job_id: str, stream: str, start: int, data: bytes) -> None:
        """Bytes ``start`` to ``start + len(data)`` of ``stream`` ("stdout",
        "stderr") of the job's run (a first put, even of nothing, makes its
        live output exist); what lies more than log_limit bytes before the
        end may be let go."""
    def told(self, job_ids: list[str]) -> None:
        """After a round of puts: wake the readers of these jobs."""
    def remove(self, job_id: str) -> None:
        """The run ended: its live output goes (the job's finish, and
        recovery of a dead worker's job, remove it too)."""
    def close(self) -> None: ...


class Backend(Protocol):
    """One open spool, whatever it is stored in."""

    location: str  # for messages and SPOOLQ_SPOOL; a URL never carries a password
    settings: Any  # a config.Settings-like mapping, reloaded in place
    durable: bool  # whether finishes are pending until commit
    log: Log  # where the backend tells what it met (the worker sets it)

    # -- lifecycle and settings --------------------------------------------
    def open(self, create: bool = False) -> None: ...
    def close(self) -> None: ...
    def exists(self) -> bool: ...
    def missing(self) -> str | None:
        """Why there is no spool here, in one line (None when there is one)."""
    def init(self, group: str | None = None) -> list[str]: ...
    def config_set(self, key: str, value: Any, on_dropped: Note | None = None) -> Any: ...
    def config_unset(self, key: str, on_dropped: Note | None = None) -> tuple[bool, str]: ...
    def config_list(self) -> dict[str, Any]: ...
    def settings_problem(self) -> str | None:
        """Why the stored settings cannot be used (the defaults are used then), or None."""
    def require_runner(self, action: str, command: str) -> None:
        """Refuse (SpoolError) a user who may not run, recover or signal jobs here."""
    def require_shared_locks(self, forced: bool) -> str | None:
        """Refuse (SpoolError) to run workers or recovery where workers on
        two machines could hold one job at once, unless ``forced``; returns
        a caution to log once, or None."""

    # -- producers ---------------------------------------------------------
    def enqueue(self, jobs: list[tuple[str, Any, float | None]], existing_ok: bool = False,
                on_existing: Callable[[str, str], None] | None = None) -> list[str]:
        """One durable batch of (id, record, due epoch seconds or None). A
        job whose unique key an unfinished job holds is not added: that
        job's id stands in for it, told to ``on_existing(id, holder)``."""
    def has_id(self, job_id: str) -> Any:
        """Whether a job has this id, in any state or the history (a true
        value may say where, for the message)."""
    def due_now(self) -> None:
        """Make every job waiting for a later time due now (testing.run_jobs)."""

    # -- reading -----------------------------------------------------------
    def get(self, job_id: str) -> dict | None: ...
    def resolve(self, given: str) -> str:
        """The id ``given`` stands for (itself, or the one id it begins)."""
    def list(self, state: str | None = None, limit: int | None = None,
             since: float | None = None) -> Iterator[dict]: ...
    def counts(self, on_problem: Note | None = None) -> dict[str, Any]: ...
    def recent(self, state: str, limit: int) -> list[dict]:
        """The ``limit`` records that came to ``state`` last, newest first
        (a failed job's time is when it is due again); only those records
        are read, whatever else waits there."""
    def live_workers(self) -> list[dict]: ...
    def stats(self, since: float | None = None) -> dict[str, Any]: ...
    def metrics(self, on_problem: Note | None = None) -> dict[str, Any]: ...
    def leftovers(self) -> dict[str, Any]:
        """As a worker ends: failed (with next_retry) and dead counts."""
    def complete_ids(self, states: tuple[str, ...], prefix: str) -> list[str]:
        """Ids for shell completion (cheap; may be empty)."""

    # -- operator moves ----------------------------------------------------
    def cancel(self, job_id: str, on_note: Note | None = None) -> None: ...
    def retry(self, job_id: str, on_note: Note | None = None) -> None: ...
    def retry_all(self, on_problem: Note | None = None, on_note: Note | None = None) -> list[str]: ...
    def compact(self, keep: float | None = None) -> dict[str, Any]: ...
    def purge_dead(self, older_than: float) -> dict[str, int]: ...
    def sweep(self) -> Report: ...
    def hold(self, job_id: str) -> None:
        """A waiting job held: never claimed until released (JobNotFound, NotPossible)."""
    def release_held(self, job_id: str, now: bool = False) -> str:
        """A held job waiting again, due as it was (or ``now``); returns its state."""

    # -- the worker --------------------------------------------------------
    def register(self, kinds: list[str], tuning: Any = None) -> WorkerReg:
        """This worker's registration; ``kinds``: the handler kinds it runs
        (a claim passes over other handler jobs, no attempt counted; None:
        it takes every kind, as a relay does);
        ``tuning``: the worker's Tuning, read for what applies."""
    def waker(self, poll: float | None, log: Any) -> Waker: ...
    def recover(self) -> Report: ...
    def claim_next(self, now: float | None = None) -> Claim | None: ...
    def next_look(self) -> Look: ...
    def look_ahead(self) -> None: ...
    def drop_ahead(self) -> None: ...
    def release(self, claim: Claim) -> None: ...
    def unclaim(self, claim: Claim) -> str: ...
    def where(self, claim: Claim) -> str: ...
    def finish(self, claim: Claim, outcome: Outcome, worker_id: str) -> Finished: ...
    def committer(self, hooks: CommitHooks, seconds: float) -> Commit: ...
    def commit(self, finished: list[Finished] | None = None) -> None: ...
    def housekeeping(self, settle: Callable[[], None]) -> None: ...
    def count_workers(self) -> int: ...

    # -- job control -------------------------------------------------------
    def control(self) -> Any:
        """The control channel (control.Channel): requests into live
        workers, the pause state, events of finished jobs and of workers."""
    def paused(self) -> dict | None:
        """Who paused the spool and when (``by``, ``at``), or None."""
    def stop_work(self) -> None:
        """The worker is done with the spool (the spool stays open for its other users)."""

    # -- running jobs' output ----------------------------------------------
    def live_output(self) -> LiveSink:
        """Where this worker's running jobs' output goes (one per worker)."""
    def output(self, job_id: str, stream: str, offset: int, hold: bool = False) -> tuple[bytes, int] | None:
        """What is kept of ``stream`` of a running job from ``offset`` on
        (bytes let go are skipped: the bytes begin at ``next - len``) and
        the offset after them; None when it has no live output (not
        running, not yet pushed, or not the caller's to read). ``hold``:
        a follower, which may be given the last bytes pushed as the run
        ended after its live output was removed."""


class PlainCommit:
    """``Commit`` for a backend whose commit is one call (``backend.commit()``):
    finishes wait in a list, at most ``seconds``, and are told once it returns."""

    def __init__(self, backend: Any, hooks: CommitHooks, seconds: float, most: int = 64):
        self.backend = backend
        self.hooks = hooks
        self.seconds = seconds
        self.most = most
        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self._pending: list[tuple[Finished, Outcome]] = []
        self._since = 0.0

    def add(self, finished: Finished, outcome: Outcome) -> None:
        if finished.claim is not None:
            self.hooks.left(finished.claim, False)
        if not finished.pending:
            self.hooks.durable(finished, outcome)
            return
        with self._lock:
            if not self._pending:
                self._since = time.monotonic()
            self._pending.append((finished, outcome))

    def full(self, factor: int = 1) -> bool:
        return len(self._pending) >= self.most

    def beside_run(self) -> None:
        pass

    def commit(self, age: float = 0.0) -> bool:
        with self._commit_lock:
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                return False
            try:
                self.backend.commit([finished for finished, _ in pending])
            except Exception as e:
                self.hooks.failed(None, f"cannot commit finished jobs: {type(e).__name__}: {e}", "")
                return False
        for finished, outcome in pending:
            self.hooks.durable(finished, outcome)
        return True

    def run(self, stop: threading.Event, age: float, on_error: Callable[[Exception], Any]) -> None:
        while not stop.wait(self.seconds / 2):
            if self._pending and time.monotonic() - self._since >= self.seconds:
                try:
                    self.commit()
                except Exception as e:
                    on_error(e)

    def stop(self, stop: threading.Event) -> None:
        stop.set()
