"""The worker loop: recover, then claim and run due jobs.

One dispatcher asks the spool for the next job (``Backend.claim_next``:
which job comes next, and how, is the backend's business) until it has
none for now: that is the end of a pass. With ``jobs=1`` the dispatcher
runs each job itself (no threads, the cheapest path); with ``jobs=N`` it
hands claimed jobs to N slot threads and claims only when a slot is free.
(``spoolq work -j N`` runs N processes of ``jobs=1`` instead: see pool.py.)

The worker is in parts: this module's dispatcher (passes, claims, waits,
signals); strategies.py's Serial (-j 1, with its pipelining) and Slots
(-j N); outcomes.py's Recorder (a run's outcome into the spool, told once
the backend's commit made it durable); and the spool itself only through
the storage port (backend.py). ``Tuning`` holds the timings of the
pipelining and the commit, passed in.

A drain ends when a pass claims nothing and no job finished since it began
(a job held a moment by another worker cannot make it spin). In watch mode the
dispatcher sleeps instead, until the watcher, the next due time, a finished
job or the periodic rescan wakes it.

Signals (when run from the main thread): the first SIGTERM or SIGINT stops
claiming and lets running jobs finish; a second kills them (they go back to
failed/, due now, the run counted). SIGHUP rereads config.json. SIGUSR1 and
SIGUSR2 mean something only to a worker process of a pool (see pool.py);
any other worker ignores them (if they were at their default, which would
end the process and leave its registration and jobs behind).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import config, linux, procs
from .backend import Backend, Claim, Unavailable, WorkerReg
from .control import Listener
from .errors import ForcedStop, ForkServerGone
from .forkserver import ForkServer
from .liveout import Pump
from .outcomes import Recorder
from .output import Log, as_log  # noqa: F401 - Log: importable from here too
from .record import Outcome
from .runner import STOPPED_NOW, Limits, RunHandle, cancelled_error, RunPlan, call_handler, fork_handler, inheritable_fds, run_process
from .strategies import Serial, Slots
from .waker import Waker

# Due entries a directory spool keeps per pass: memory stays bounded
# (~50 MB) however many files wait; a larger backlog takes more passes.
SCAN_LIMIT = 200_000
# Finished jobs wait at most this long to be made durable together.
COMMIT_SECONDS = 0.05
# -j 1 prepares the next job while the current one's process runs; a job
# still running after this long lets the next one go again.
LOOK_AHEAD_HOLD = 0.005
# A pass that found due jobs held a moment by another worker looks again
# this soon, up to this many times in a row, before it sleeps or ends a drain.
BUSY_RETRY_DELAY = 2 * LOOK_AHEAD_HOLD
BUSY_RETRIES = 100
# -j 1 waits for a short job's exit by polling (yielding the CPU between
# polls) for up to this long after the spawn, instead of sleeping: on a VM a
# worker whose CPU went idle takes tens of microseconds to wake, and the job
# and the worker then trade CPUs on every job. It is done only while the
# last job ran shorter than this (from before its spawn to its reaping, the
# worker's work beside it included), and only when every worker process on
# the spool and its job can have a CPU of their own (of those it may use)
# and the machine's load average is below its CPU count; else polling
# would take the CPU from a job.
SPIN_WINDOW = 0.002
RELAYED_SIGNALS = procs.RELAYED_SIGNALS  # stop, stop now: from the parent of a worker pool
STOPPING = "no new jobs; running jobs finish (a second SIGTERM or SIGINT kills them)"
STOPPING_NOW = "running jobs are killed and go back to failed/"
PAUSED = object()  # what _claim_next gives when a pause came before the claim
UNAVAILABLE_BACKOFF = (0.1, 5.0)  # the first and the longest wait before trying an unreachable spool again


def _run_as(job: dict) -> Any:
    """The password entry of the user a root worker runs a command job as
    (the user who enqueued it, which the claim keeps in ``run_as``), or None:
    run it as the worker. Raises KeyError for a uid without an entry."""
    uid = job.get("run_as")
    if not uid or os.geteuid() != 0:  # (geteuid only for a job that names a uid)
        return None
    import pwd

    return pwd.getpwuid(uid)


#: The PATH of a job a root worker runs as another user (unless its env sets one).
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


def job_env(base: dict[str, str], job: dict, attempt: int, spool: str, worker_id: str,
            user: Any = None) -> dict[str, str]:
    """A command job's environment: the worker's, or, when a root worker
    runs it as ``user`` (a password entry), none of root's: that user's
    home and shell variables and a safe PATH; then the job's own ``env``;
    and spoolq's variables, last, since recovery finds a run's processes
    by them."""
    if user is None:
        env = dict(base)
    else:
        env = {"PATH": SAFE_PATH, "HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name,
               "SHELL": user.pw_shell or "/bin/sh"}
    extra = job.get("env")
    if extra:
        env.update(extra)
    env["SPOOLQ_JOB_ID"] = job["id"]
    env["SPOOLQ_ATTEMPT"] = str(attempt)
    env["SPOOLQ_SPOOL"] = spool
    env["SPOOLQ_WORKER"] = worker_id
    # The run's captured stdout, named from whichever process of it opens
    # it: touching it counts as output for idle_timeout.
    env["SPOOLQ_HEARTBEAT"] = HEARTBEAT
    return env


#: What $SPOOLQ_HEARTBEAT names (see job_env).
HEARTBEAT = "/proc/self/fd/1"


def _load_average() -> float:
    return os.getloadavg()[0]


@dataclass
class Tuning:
    """The timings of a worker's pipelining and group commit, passed in
    (``Spool.work(tuning=Tuning(...))``) so that a test can stretch them
    however slow its host is; the defaults are what every worker uses."""

    # -j 1 prepares the next job while the current one's process runs; a
    # job still running after this long lets the next one go again.
    look_ahead_hold: float = LOOK_AHEAD_HOLD
    # Finished jobs wait at most this long for their group sync.
    commit_seconds: float = COMMIT_SECONDS
    # -j 1 polls for a short job's exit this long after the spawn (see SPIN_WINDOW).
    spin_window: float = SPIN_WINDOW
    # The machine's load average, which decides whether polling may take a CPU.
    load_average: Callable[[], float] = _load_average
    # Due entries kept per pass (see SCAN_LIMIT).
    scan_limit: int = SCAN_LIMIT


class Worker:
    """Runs jobs from one spool until it is drained (or stopped, in watch mode)."""

    def __init__(
        self,
        backend: Backend,
        handlers: dict[str, Callable[[Any], Any]] | None = None,
        jobs: int = 1,
        max_jobs: int | None = None,
        max_time: float | None = None,
        watch: bool = False,
        poll: float | None = None,
        log: Log | None = None,
        signals: bool = True,
        waker: Waker | None = None,
        recover: bool = True,
        relayed: bool = False,
        pool_parent: int | None = None,
        processes: int = 1,
        tuning: Tuning | None = None,
    ):
        """``backend``: the spool (the jobs, and their settings: a
        config.Settings-like mapping, reloaded in place on SIGHUP).
        (Long: one attribute a line, each with why it is kept.)"""
        if jobs < 1:
            raise ValueError("jobs must be at least 1")
        self.backend = backend
        self.settings = backend.settings
        self.handlers = dict(handlers or {})
        self.jobs = jobs
        self.max_jobs = max_jobs
        self.max_time = max_time
        self.watch = watch
        self.poll = poll
        self.log = as_log(log)
        self.signals = signals
        # One of several worker processes behind `spoolq work -j N` (see
        # pool.py): the parent passes stop signals on as SIGUSR1 (stop
        # claiming) and SIGUSR2 (kill running jobs); SIGTERM and SIGINT that
        # reach this process directly (a terminal's whole process group,
        # systemd's whole control group) are left to the parent, so that one
        # signal never counts twice.
        self.relayed = relayed
        # ... unless that parent is gone (killed with -9; the worker processes
        # finish their jobs): then signals sent to this one are its own.
        self._pool_parent = (pool_parent or os.getppid()) if relayed else None
        self.processes = processes  # worker processes of the same command, this one included
        self.recover = recover
        self.waker = waker
        self.tuning = tuning or Tuning()
        self.ran = 0
        self.registration: WorkerReg | None = None
        self.forks: ForkServer | None = None  # while it runs with handlers: where their processes are forked
        self.failed_to_record = False
        self.stopping = False
        self.active = 0
        self._claimed = 0
        self._finished_since_scan = 0
        self._forced = False
        self._stop_signals = 0
        self._deadline: float | None = None
        self._lock = threading.RLock()  # re-entrant: the signal handler takes it too
        self._running: dict[int, RunHandle] = {}  # thread id -> the run it is doing
        self._jobs: dict[str, tuple[RunHandle, int, int]] = {}  # job id -> (its run, thread id, attempt)
        self.listener: Listener | None = None  # carries out stop, pause and kill requests
        self.pump: Pump | None = None  # pushes running jobs' output where `spoolq logs` reads it
        self.paused = False
        self._claiming = threading.Lock()  # a claim, and the pause that must not overtake it
        self.strategy: Serial | Slots = Serial(self, self.tuning) if jobs == 1 else Slots(self, jobs)
        self.recorder = Recorder(self)
        self.record = self.recorder.record
        self.commit = backend.committer(self.recorder, self.tuning.commit_seconds)
        self._spawn_closes: list[int] = []
        self._default_limits: tuple[int, Limits] | None = None
        self._base_env = dict(os.environ)
        self._base_env["SPOOLQ_SPOOL"] = backend.location

    # -- control -----------------------------------------------------------

    def stop(self, force: bool = False) -> None:
        """Stop claiming; with ``force`` also kill the running jobs."""
        self.stopping = True
        if force:
            self._forced = True
            self._kill_running()
        if self.waker:
            self.waker.wake()

    def set_paused(self, paused: bool) -> None:
        """Claim nothing while paused (the control listener says so). A
        claim under way ends first: once this returns, none begins."""
        if paused == self.paused:
            return
        with self._claiming:
            if paused == self.paused:
                return
            self.paused = paused
        self.log.line(f"worker={self.wid} {'paused: claims nothing until resumed' if paused else 'resumed'}", 1)
        if self.waker:
            self.waker.wake()

    def kill_job(self, job_id: str, attempt: int | None, sig: int | None, by: str) -> bool:
        """Signal a run of this worker: ``sig`` to its process group, or
        (None) cancel it for good. Only runs this worker started are
        signalled; False when it runs no such run."""
        with self._lock:
            entry = self._jobs.get(job_id)
        if entry is None or (attempt is not None and entry[2] != attempt):
            return False
        handle, thread_id, _ = entry
        if sig is not None:
            handle.send(sig)
            return True
        handle.cancel(by, float(self.settings["timeout_grace"]))
        with handle._lock:
            if handle.inline:  # an in-process handler: stopped as a forced stop stops it
                linux.raise_in_thread(thread_id, ForcedStop)
        return True

    def _control_line(self, text: str, level: int, severity: Any) -> None:
        self.log.line(f"worker={self.wid} {text}", level, severity)

    def _kill_running(self) -> None:
        with self._lock:
            running = list(self._running.items())
        main = threading.main_thread().ident
        for thread_id, handle in running:
            handle.kill()  # process jobs: the whole group; no-op for in-process ones
            with handle._lock:
                if handle.inline and thread_id != main:
                    # An in-process handler in a slot thread: raise into it.
                    # (In the main thread the signal handler raises itself.)
                    linux.raise_in_thread(thread_id, ForcedStop)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            self.reload()
            return
        name = signal.Signals(signum).name
        # The stop lines name the signal the user sent: the pool's parent
        # says it for all its workers (see pool.py), so what one of them is
        # passed on is told only in verbose logs.
        verbosity, stopping = 1, STOPPING
        if signum in RELAYED_SIGNALS:
            if not self.relayed:
                self.log.line(f"worker={self.wid} signal={name} ignored: this worker stops on SIGTERM or SIGINT", 0, logging.WARNING)
                return
            level = 1 if signum == signal.SIGUSR1 else 2
            verbosity = 2
            if level == 1 and os.getppid() != self._pool_parent:
                name, verbosity = "the exit of its pool's parent process", 1
                stopping = stopping.replace("a second", "a")
            else:
                name = f"{name} passed on by the pool"
        elif self.relayed and os.getppid() == self._pool_parent:
            return  # the parent passes it on
        else:
            level = self._stop_signals + 1
        if level <= self._stop_signals:
            return
        # Count first: Python may run a second signal's handler nested inside
        # this one (in the middle of the log line below), and that one must
        # know it is the second.
        self._stop_signals = level
        if level == 1:
            self.stop()
            self.log.line(f"worker={self.wid} stopping on {name}: {stopping}", verbosity)
            return
        self.stop(force=True)
        self.log.line(f"worker={self.wid} stopping now on {name}: {STOPPING_NOW}", 0 if verbosity == 1 else verbosity,
                      logging.WARNING)
        handle = self._running.get(threading.main_thread().ident)
        if handle is not None and handle.inline:
            raise ForcedStop()

    def reload(self) -> None:
        """Reread config.json (SIGHUP)."""
        try:
            self.settings.reload()  # the holder every reader shares (the spool's fsync flag follows it)
        except (config.ConfigError, OSError) as e:  # e.g. config.json made unreadable
            self.log.line(f"worker={self.wid} reload failed: {e}", 0)
            return
        if self.waker:
            self.waker.rescan_interval = self._rescan_interval()
            self.waker.wake()
        self.log.line(f"worker={self.wid} reloaded config.json", 1)

    @property
    def wid(self) -> str:
        return self.registration.worker_id if self.registration else "-"

    def _rescan_interval(self) -> float:
        if self.poll:
            return float(self.poll)
        return float(self.settings["rescan_interval"])

    # -- main --------------------------------------------------------------

    def run(self) -> int:
        """Recover, then run jobs; returns how many ran."""
        # Before any thread of the worker's (the first is the registration's
        # flusher) and before the worker holds any lock or file of the spool.
        self.forks = ForkServer(self.handlers) if self.handlers else None
        try:
            return self._run()
        finally:
            if self.forks is not None:
                self.forks.close()

    def _run(self) -> int:
        backend = self.backend
        # The handlers come before the registration: once a worker can be
        # seen (a file in workers/), a stop or a reload must find them.
        old_handlers = {}
        if self.signals and threading.current_thread() is threading.main_thread():
            for sig in procs.DIRECT_SIGNALS + RELAYED_SIGNALS:
                if self.relayed or sig not in RELAYED_SIGNALS or signal.getsignal(sig) == signal.SIG_DFL:
                    old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            backend.log = self._backend_line
            backend.open(create=True)
            self.registration = backend.register(sorted(self.handlers), self.tuning)
            self.registration.on_lost(self._lost)
            self.listener = Listener(backend.control(), self, self._control_line, procs.signals_to_main_thread)
            self.listener.start()
            self.pump = Pump(backend.live_output, self.settings, self._pump_line, procs.signals_to_main_thread)
            self.pump.start()
        except BaseException:
            for sig, old in old_handlers.items():
                signal.signal(sig, old)
            raise
        committer_stop = threading.Event()
        try:
            if self.max_time is not None:
                self._deadline = time.monotonic() + self.max_time
            if self.recover:
                self._recover()
            if self.waker is None:
                self.waker = backend.waker(self.poll, self.log) if self.watch else Waker()
            self.waker.rescan_interval = self._rescan_interval()
            self.waker.start()
            # With -j 1 the dispatcher moves staged jobs on between its jobs;
            # the committer takes them only once they were staged twice the
            # interval ago (the dispatcher is then busy with a long job).
            staged_age = self.tuning.commit_seconds * self.strategy.staged_factor
            with procs.signals_to_main_thread():
                threading.Thread(target=self.commit.run, args=(committer_stop, staged_age, self._commit_failed),
                                 name="spoolq-commit", daemon=True).start()
            self.strategy.start()
            self._dispatch()
        finally:
            # Whether the dispatcher returned or failed (an exception, Ctrl-C
            # in a program that calls Spool.work): let the prepared job go,
            # let the slots finish what they run, then record and commit the
            # last outcomes (the slots' too, when the dispatcher failed).
            try:
                self.strategy.drain()
                self.commit.commit()
            except Exception as e:
                self.log.line(f"worker={self.wid} cannot record the last outcome: {e}", 0)
            self.commit.stop(committer_stop)
            if self.listener:
                self.listener.stop()
            if self.pump:
                self.pump.stop()
            if self.waker:
                self.waker.stop()
            for sig, old in old_handlers.items():
                signal.signal(sig, old)
            backend.stop_work()
            self.strategy.close()
            self.registration.close()
        return self.ran

    def _commit_failed(self, e: Exception) -> None:
        self.log.line(f"worker={self.wid} commit failed: {e}", 0)

    def _lost(self, why: str) -> None:
        """The registration's liveness was lost (a database session cut):
        its runs' processes are killed already, and their claims are
        another worker's to recover; the backend registers again."""
        self.log.line(f"worker={self.wid} lost its registration: {why}; its running jobs were killed "
                      "and are recovered as a dead worker's", 0, logging.ERROR)

    def _pump_line(self, text: str) -> None:
        self.log.line(f"worker={self.wid} {text}", 0, logging.WARNING)

    def _backend_line(self, text: str, level: int = 0, severity: int | None = None) -> None:
        """What the backend tells (a job set aside, a pickup, a compaction), as this worker's."""
        self.log.line(f"worker={self.wid} {text}", level, severity)

    def _recover(self) -> None:
        try:
            report = self.backend.recover()
        except Exception as e:  # recovery failing must not keep jobs from running
            self.log.line(f"worker={self.wid} recovery failed: {type(e).__name__}: {e}", 0)
            return
        if report.recovered or report.dead or report.completed or report.quarantined or report.killed:
            self.log.line(
                f"worker={self.wid} recovered: failed={report.recovered} dead={report.dead} "
                f"completed={report.completed} quarantined={report.quarantined} killed={report.killed}",
                0, logging.ERROR if report.dead else logging.WARNING,
            )
        if report.left_running:
            self.log.line(f"worker={self.wid} left {report.left_running} jobs of dead workers running: "
                          "their processes still run and are another user's to kill (recovered by the first recovery after they end)", 0,
                          logging.WARNING)
        if report.tmp_removed:
            self.log.line(f"worker={self.wid} removed {report.tmp_removed} stale half-written jobs", 1)

    def may_claim(self) -> bool:
        if self.stopping:
            return False
        if self.max_jobs is not None and self._claimed >= self.max_jobs:
            return False
        if self._deadline is not None and time.monotonic() >= self._deadline:
            return False
        return True

    # -- the dispatcher ----------------------------------------------------

    def _dispatch(self) -> None:
        """Claim the next job and hand it to the strategy, until the
        backend has none for now (a pass ends); between passes, wait or end
        (see _between_passes)."""
        backend, strategy, commit = self.backend, self.strategy, self.commit
        self._pass_claims = 0
        self._busy_rounds = 0
        fresh = self.may_claim() and self._between_passes(True)
        while fresh and self.may_claim():
            if self.paused:  # the pass ends here; the next begins once resumed
                fresh = self._between_passes(False)
                continue
            if commit.full(strategy.staged_factor):
                commit.commit()
            if not strategy.ready():
                break
            claim = self._claim_next()
            if claim is PAUSED:
                strategy.unused()
                continue
            if claim is None:
                strategy.unused()
                fresh = self._between_passes(False)
                continue
            self._pass_claims += 1
            self._claimed += 1
            with self._lock:
                self.active += 1
            strategy.execute(claim)
        commit.commit()
        strategy.wait_running()
        commit.commit()

    def _claim_next(self) -> Any:
        """The next claim, None, or PAUSED when a pause came first."""
        try:
            with self._claiming:
                if self.paused:
                    return PAUSED
                return self.backend.claim_next()
        except Unavailable as e:  # (a database out of reach) wait, then look again
            self._unreachable(e)
            return None

    def _unreachable(self, e: Exception) -> None:
        wait = getattr(self, "_backoff", UNAVAILABLE_BACKOFF[0])
        self.log.line(f"worker={self.wid} the spool cannot be reached: {e} (trying again in {wait:.1f}s)", 0,
                      logging.WARNING)
        self.waker.wait(wait)
        self._backoff = min(UNAVAILABLE_BACKOFF[1], wait * 2)

    def _between_passes(self, first: bool) -> bool:
        """At the end of a pass: commit, then wait for something to change
        (or a moment, when another worker held a due job); False when a
        drain is over or the worker stops. Then the backend's upkeep, and a
        new pass begins."""
        self.strategy.idle()  # before pausing, compacting or looking again
        if self.paused:
            self.backend.drop_ahead()  # a job held ahead goes back for other workers
            self._wait_paused()
            if not self.may_claim():
                return False
            self._new_pass()  # resumed: look again at once
            return True
        if self._pass_claims:
            self._busy_rounds = 0
            self._backoff = UNAVAILABLE_BACKOFF[0]
        if not first and self._pass_claims == 0 and self._finished_since_scan == 0:
            try:
                look = self.backend.next_look()
            except Unavailable as e:  # (a database out of reach) wait, then look again
                look = None
                self._unreachable(e)
            if look is not None and not look.more and not self._wait(look):
                return False
        try:
            self.backend.housekeeping(self.commit.commit)
        except Unavailable as e:
            self._unreachable(e)
        self._new_pass()
        return True

    def _wait_paused(self) -> None:
        """Sleep while the spool is paused (the listener wakes us); running
        jobs finish and are recorded meanwhile."""
        while self.paused and not self.stopping:
            self.commit.commit()
            self.registration.flush()
            self.waker.clear()
            if self.paused and not self.stopping:
                self.waker.wait(self._rescan_interval() if self.watch else 1.0)

    def _wait(self, look: Any) -> bool:
        """Nothing changed since the last look: wait (or end a drain)."""
        committed = self.commit.commit()
        if self._finished_since_scan or committed:
            pass  # finished jobs moved on since (a retry, a dependent may be due at once): look again
        elif look.busy and self._busy_rounds < BUSY_RETRIES:
            # Another worker held a due job for a moment: it was claiming
            # it, or prepared it ahead and may let it go. No event will say
            # so; look again soon, rather than sleep or end the drain with
            # it still waiting.
            self._busy_rounds += 1
            self.waker.wait(BUSY_RETRY_DELAY)
        elif not self.watch and self.active == 0 and look.later is None:
            return False
        else:
            self.registration.flush()
            self.waker.wait(self._sleep_for(look.due, look.later))
        return self.may_claim()

    def _new_pass(self) -> None:
        """Before the backend lists the due jobs anew."""
        waker = self.waker
        waker.clear()
        waker.check()
        with self._lock:
            self._finished_since_scan = 0
        self._pass_claims = 0
        # Jobs inherit stdin, stdout and stderr only: whatever else is
        # open without close-on-exec (from whoever started us, or
        # watchdog's inotify descriptor) is closed in every job's
        # process. Looked up once a pass, not once a job.
        self._spawn_closes = inheritable_fds()

    def _sleep_for(self, next_due: float | None, later: float | None = None) -> float | None:
        """How long the dispatcher may sleep: until the next due time (watch
        mode) or the time a job left waiting is to be looked at again (a
        drain waits for that too, so the job runs or is given up on before
        it ends)."""
        timeout = self.waker.rescan_interval if self.watch else None
        if not self.watch:
            next_due = None
        if later is not None and (next_due is None or later < next_due):
            next_due = later
        if next_due is not None:
            until_due = max(0.0, next_due - time.time()) + 0.001
            timeout = until_due if timeout is None else min(timeout, until_due)
        if self._deadline is not None:
            left = max(0.0, self._deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        return timeout

    # -- one job -----------------------------------------------------------

    def execute(self, claimed: Claim) -> None:
        """Run a claimed job and record its outcome (by the strategy)."""
        try:
            self._run_one(claimed)
        finally:
            with self._lock:
                self.active -= 1
                self._finished_since_scan += 1

    def _limits(self, job: dict) -> Limits:
        """A job's limits: its own timeout, else the settings' (built once
        per settings generation: most jobs use them as they are)."""
        s = self.settings
        generation = getattr(s, "generation", 0)
        if self._default_limits is None or self._default_limits[0] != generation:
            self._default_limits = (generation, Limits(float(s["timeout"]), float(s["timeout_grace"]), int(s["output_limit"]),
                                                       float(s["idle_timeout"])))
        limits = self._default_limits[1]
        timeout, idle = job.get("timeout"), job.get("idle_timeout")
        if timeout is None and idle is None:
            return limits
        return Limits(limits.timeout if timeout is None else float(timeout), limits.grace, limits.output_limit,
                      limits.idle if idle is None else float(idle))

    def _run_one(self, claimed: Claim) -> None:
        job = claimed.job
        job_id = claimed.job_id
        reg = self.registration
        thread_id = threading.get_ident()
        handle = RunHandle()
        limits = self._limits(job)
        kind = job.get("kind")
        inline = kind is not None and limits.timeout <= 0 and limits.idle <= 0
        try:
            reg.note_run(job_id, claimed.attempt)
        except OSError as e:
            self.log.line(f"worker={self.wid} job={job_id} cannot register the run: {e}", 0)
        with self._lock:
            self._running[thread_id] = handle
            self._jobs[job_id] = (handle, thread_id, claimed.attempt)
        if self.listener is not None:
            self.listener.started(job_id, claimed.attempt)
        run_began = time.time()  # what a stopped run's record says it started at
        out: Outcome
        try:
            if self._forced:
                handle.interrupted = True
            if kind is not None and self._forced:
                out = Outcome(start=run_began, end=run_began, error=STOPPED_NOW, interrupted=True, not_started=True)
            elif inline:
                self.strategy.before_inline()
                out = call_handler(self.handlers.get(kind), job, limits, handle)
            else:
                out = self._spawn(claimed, limits, handle)
        except ForcedStop:
            if handle.cancelled:
                out = Outcome(start=run_began, end=time.time(), error=cancelled_error(handle.cancelled),
                              cancelled=handle.cancelled)
            else:
                out = Outcome(start=run_began, end=time.time(), error=STOPPED_NOW, interrupted=True)
        except Exception as e:  # spoolq's own failure to run it: a failed run, not a dead worker
            out = Outcome(start=run_began, end=time.time(), error=f"internal error running the job: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._running.pop(thread_id, None)
                self._jobs.pop(job_id, None)
        self.strategy.finished(claimed, out, inline)

    def _spawn(self, claimed: Claim, limits: Limits, handle: RunHandle) -> Outcome:
        """Run a job in a process of its own: a forked handler, or a
        command. The one place that builds the runner's arguments."""
        job, job_id = claimed.job, claimed.job_id
        reg, strategy = self.registration, self.strategy

        pump = self.pump

        def spawned(pid: int, window: tuple[int, int]) -> None:
            try:
                if pump is not None:
                    pump.start_run(job_id, handle)
                reg.note_run(job_id, claimed.attempt, pid, window)
            finally:
                strategy.beside_spawn()

        plan = RunPlan(limits, handle, spawned, strategy.on_slow())
        if pump is not None:
            plan.on_exit = pump.end_run
        kind = job.get("kind")
        if kind is not None:
            if kind not in self.handlers:
                return call_handler(None, job, limits, handle)  # (its error, without a process)
            try:
                return fork_handler(self.forks, job, plan)
            except ForkServerGone as e:
                self.recorder.cannot_record(None, f"{e.strerror}: no handler job with a timeout can start", "")
                now = time.time()
                return Outcome(start=now, end=now, error=e.strerror, not_started=True)
        try:
            plan.user = _run_as(job)
        except KeyError:  # the owner's password entry went away since the claim checked it
            now = time.time()
            return Outcome(start=now, end=now, error=f"cannot start: uid {job['run_as']} has no entry in the password database")
        plan.env = job_env(self._base_env, job, claimed.attempt, self.backend.location, self.registration.worker_id, plan.user)
        plan.close = self._spawn_closes
        plan.keep = claimed.keep
        for name, value in strategy.process_options().items():
            setattr(plan, name, value)
        out = run_process(job, plan)
        strategy.ran()
        return out

    def moved(self, completed: bool) -> None:
        """A job has left this worker's hands (``completed``: moved on by the commit,
        which counts as a finish for the dispatcher: a failed job may be due
        again at once, and it could not see it before)."""
        self.ran += 1
        if completed:
            with self._lock:
                self._finished_since_scan += 1
