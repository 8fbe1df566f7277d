"""The worker loop: recover, then claim and run due jobs.

One dispatcher lists the waiting folders once per pass and claims jobs from
that sorted list; it lists again only when the list is used up, so a drain
never lists a folder once per job. With ``jobs=1`` the dispatcher runs each
job itself (no threads, the cheapest path); with ``jobs=N`` it hands claimed
jobs to N slot threads and claims only when a slot is free. (``spoolq work
-j N`` runs N processes of ``jobs=1`` instead: see pool.py.)

A drain ends when a pass claims nothing and no job finished since it began
(a file locked by someone else cannot make it spin). In watch mode the
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

import collections
import logging
import os
import queue
import signal
import threading
import time
from typing import Any, Callable

from . import config, linux, procs, recovery, transitions
from .errors import ForcedStop
from .output import Log, as_log, log_what_waits, quoted  # noqa: F401 - Log, log_what_waits: importable from here too
from .protocol import Entry
from .registry import Registration
from .runner import STOPPED_NOW, Limits, Outcome, RunHandle, RunPlan, call_handler, close_all, fork_handler, inheritable_fds, make_outputs, run_process
from .waker import Waker
from .watcher import make_waker

# Due entries kept per pass: memory stays bounded (~50 MB) however many
# files wait; a backlog larger than this takes a pass per SCAN_LIMIT jobs.
SCAN_LIMIT = 200_000
COMMIT_JOBS = 64  # group commit: at most this many finished jobs share one folder fsync ...
COMMIT_SECONDS = 0.05  # ... and none waits longer than this for it
COMPLETE_PER_JOB = 2  # -j 1: synced jobs moved on beside each job's run (see _side_commit_work)
# -j 1 prepares the next job while the current one's process runs; a job
# still running after this long lets the next one go again.
LOOK_AHEAD_HOLD = 0.005
# A pass that found due files locked by another process looks again this
# soon, up to this many times in a row, before it sleeps or ends a drain.
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
SPIN_RECOUNT_SECONDS = 1.0  # how often the live workers on the spool are counted again for that
COMPACT_CHECK_JOBS = 1000  # count done/ for auto-compaction after this many jobs ...
COMPACT_CHECK_SECONDS = 60.0  # ... or this long
READ_AHEAD = 256  # a pass whose files went cold is read ahead by up to this many files ...
PROBE_CLAIMS = 64  # ... once an eighth of this many claims in a row waited for the disk
RELAYED_SIGNALS = procs.RELAYED_SIGNALS  # stop, stop now: from the parent of a worker pool
STOPPING = "no new jobs; running jobs finish (a second SIGTERM or SIGINT kills them)"
STOPPING_NOW = "running jobs are killed and go back to failed/"


class ReadAhead:
    """Reads a pass's waiting files into memory ahead of their claims, once
    claims are seen waiting for the disk.

    A job that waited long enough for the kernel to drop its file from the
    page cache (some machines reclaim pages untouched for a minute, without
    any memory pressure) costs its claim one synchronous disk read: 100 us
    or more, where the rest of a no-op job's claim and finish take ~150 us.
    A large backlog is exactly that case. Reading ahead costs an open,
    ``posix_fadvise`` and close per file (~8 us), so it starts only once
    an eighth of PROBE_CLAIMS claims were slow reads, and a pass with a
    warm cache never pays it; a new pass (a new scan) decides anew."""

    def __init__(self, spool_dir: Any, entries: list[Entry]):
        self.dir = spool_dir
        self.entries = entries
        self.on = False
        self.read_to = 0  # entries before this index were handed to prefetch
        self.slow_seen = spool_dir.slow_reads
        self.next_probe = PROBE_CLAIMS

    def before(self, pos: int) -> None:
        """Called before ``entries[pos]`` is claimed."""
        if not self.on:
            if pos < self.next_probe:
                return
            slow, self.slow_seen = self.dir.slow_reads - self.slow_seen, self.dir.slow_reads
            self.next_probe = pos + PROBE_CLAIMS
            if slow * 8 < PROBE_CLAIMS:
                return
            self.on = True
        if self.read_to - pos < READ_AHEAD // 2:
            start = max(self.read_to, pos)
            self.read_to = min(len(self.entries), pos + READ_AHEAD)
            self.dir.prefetch(self.entries[start:self.read_to])


class Worker:
    """Runs jobs from one spool until it is drained (or stopped, in watch mode)."""

    def __init__(
        self,
        ctx: transitions.Context,
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
        compact: Callable[[], dict[str, Any]] | None = None,
    ):
        """``ctx``: the spool directory and its settings (a config.Settings,
        reloaded in place on SIGHUP); ``compact``: folds done/ into the
        index with those settings (automatic compaction; None: never)."""
        if jobs < 1:
            raise ValueError("jobs must be at least 1")
        self.ctx = ctx
        self.dir = ctx.spool
        self.settings = ctx.settings
        self.compact = compact
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
        self.ran = 0
        self.registration: Registration | None = None
        self.failed_to_record = False
        self._claimed = 0
        self._active = 0
        self._finished_since_scan = 0
        self._stopping = False
        self._forced = False
        self._stop_signals = 0
        self._threads: list[threading.Thread] = []
        self._deadline: float | None = None
        self._lock = threading.RLock()  # re-entrant: the signal handler takes it too
        self._running: dict[int, RunHandle] = {}  # thread id -> the run it is doing
        # A token per free slot, and claimed jobs on their way to a slot:
        # SimpleQueue, written in C, hands over with far fewer switches
        # between threads than Semaphore and Queue (Python on a Condition).
        self._slot_free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(jobs):
            self._slot_free.put(True)
        self._handoff: queue.SimpleQueue = queue.SimpleQueue()
        # Group commit (fsync on, any -j): outcomes whose folder fsyncs are
        # deferred, logged only once synced. At most COMMIT_JOBS jobs or
        # COMMIT_SECONDS wait for a sync.
        self._uncommitted: list[tuple] = []
        self._uncommitted_lock = threading.Lock()  # the lists only: held for no system call
        # Finished jobs whose new record is staged beside them in cur/, not
        # yet synced (transitions.finish(stage=True)): a commit syncs all of
        # them at once, then moves them on. Each holds two descriptors; a
        # commit comes once _stage_max (a sixteenth of the open-file limit)
        # are synced, or twice that staged, so at most ~a quarter of the
        # limit is theirs.
        self._staged: list[tuple[transitions.Claimed, Outcome, int, str, float | None]] = []
        self._staged_since = 0.0
        self._synced: collections.deque = collections.deque()  # (when staged, staged item), to move on
        self._sync_wanted = threading.Event()  # -j 1 asks the committer thread to sync the staged records
        self._stage_max = max(1, min(COMMIT_JOBS, procs.open_file_limit() // 16))
        self._commit_lock = threading.Lock()  # one commit at a time (held across its fsyncs)
        # -j 1: the outcome of the last process job, recorded once the next
        # job's process has started (see _run_one), or when the dispatcher
        # pauses or stops.
        self._unrecorded: tuple[transitions.Claimed, Outcome] | None = None
        # -j 1: the next entry of the pass, prepared (locked and read, not
        # yet renamed into cur/) while the current job's process runs.
        self._pass: tuple[list[Entry], int] = ([], 0)
        self._ahead: tuple[Entry, transitions.Claimed | None] | None = None
        self._spawn_closes: list[int] = []
        # -j 1: the next process job's output files, made while the current
        # one runs, and the last one's, closed once the next has started.
        self._spare_outputs: tuple[int, int] | None = None
        self._spent_fds: list[int] = []
        # -j 1: whether there is a CPU to spare for polling (see SPIN_WINDOW),
        # counted again every SPIN_RECOUNT_SECONDS, and whether the last job was short.
        self._cpus = procs.usable_cpus()
        self._spin_ok = False
        self._spin_counted = -SPIN_RECOUNT_SECONDS
        self._last_short = True
        self._busy_this_pass = 0  # due files another process held when we tried them
        # When the first file this pass left for its writer to finish (see
        # transitions.WRITER_GRACE) is to be looked at again: no event may
        # come to say so. And the (name, time) already logged, to log each once.
        self._later_ns: int | None = None
        self._later_logged: set[tuple[str, int]] = set()
        # (Tests lengthen the hold to catch a worker killed while it holds one.)
        self._look_ahead_hold = float(os.environ.get("SPOOLQ_TEST_LOOK_AHEAD_HOLD") or LOOK_AHEAD_HOLD)
        # (And lengthen the commit interval, to count the syncs jobs share however slow the host.)
        self._commit_seconds = float(os.environ.get("SPOOLQ_TEST_COMMIT_SECONDS") or COMMIT_SECONDS)
        # (And widen the polling window, to see it used however slow the host.)
        self._spin_window = float(os.environ.get("SPOOLQ_TEST_SPIN_WINDOW") or SPIN_WINDOW)
        # (And stand in for the load average, which the test suite itself raises.)
        self._test_load = os.environ.get("SPOOLQ_TEST_LOADAVG")
        self._next_compact_ran = 0
        self._next_compact_time = 0.0
        self._base_env = dict(os.environ)
        self._base_env["SPOOLQ_SPOOL"] = self.dir.root

    # -- control -----------------------------------------------------------

    def stop(self, force: bool = False) -> None:
        """Stop claiming; with ``force`` also kill the running jobs."""
        self._stopping = True
        if force:
            self._forced = True
            self._kill_running()
        if self.waker:
            self.waker.wake()

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
                self.log.line(f"worker={self._wid} signal={name} ignored: this worker stops on SIGTERM or SIGINT", 0, logging.WARNING)
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
            self.log.line(f"worker={self._wid} stopping on {name}: {stopping}", verbosity)
            return
        self.stop(force=True)
        self.log.line(f"worker={self._wid} stopping now on {name}: {STOPPING_NOW}", 0 if verbosity == 1 else verbosity,
                      logging.WARNING)
        handle = self._running.get(threading.main_thread().ident)
        if handle is not None and handle.inline:
            raise ForcedStop()

    def reload(self) -> None:
        """Reread config.json (SIGHUP)."""
        try:
            self.settings.reload()  # the holder every reader shares (the spool's fsync flag follows it)
        except (config.ConfigError, OSError) as e:  # e.g. config.json made unreadable
            self.log.line(f"worker={self._wid} reload failed: {e}", 0)
            return
        if self.waker:
            self.waker.rescan_interval = self._rescan_interval()
            self.waker.wake()
        self.log.line(f"worker={self._wid} reloaded config.json", 1)

    @property
    def _wid(self) -> str:
        return self.registration.worker_id if self.registration else "-"

    def _rescan_interval(self) -> float:
        if self.poll:
            return float(self.poll)
        return float(self.ctx.settings["rescan_interval"])

    # -- main --------------------------------------------------------------

    def run(self) -> int:
        """Recover, then run jobs; returns how many ran."""
        sp_dir = self.dir
        sp_dir.open(create=True)
        self.registration = Registration(sp_dir)
        self.registration.open()
        self.registration.start_flusher()
        old_handlers = {}
        if self.signals and threading.current_thread() is threading.main_thread():
            for sig in procs.DIRECT_SIGNALS + RELAYED_SIGNALS:
                if self.relayed or sig not in RELAYED_SIGNALS or signal.getsignal(sig) == signal.SIG_DFL:
                    old_handlers[sig] = signal.signal(sig, self._on_signal)
        threads: list[threading.Thread] = []
        try:
            if self.max_time is not None:
                self._deadline = time.monotonic() + self.max_time
            if self.recover:
                self._recover()
            if self.waker is None:
                if self.watch:
                    self.waker = make_waker(sp_dir, poll=self.poll, log=self.log)
                else:
                    self.waker = Waker()
            self.waker.rescan_interval = self._rescan_interval()
            self.waker.start()
            committer_stop = threading.Event()
            with procs.signals_to_main_thread():
                threading.Thread(target=self._committer, args=(committer_stop,), name="spoolq-commit", daemon=True).start()
            if self.jobs > 1:
                for i in range(self.jobs):
                    t = threading.Thread(target=self._slot, name=f"spoolq-slot-{i}", daemon=True)
                    t.start()
                    threads.append(t)
                self._threads = threads
            self._dispatch()
        finally:
            # Whether the dispatcher returned or failed (an exception, Ctrl-C
            # in a program that calls Spool.work): let the prepared job go,
            # let the slots finish what they run, then record and commit the
            # last outcomes (the slots' too, when the dispatcher failed).
            self._drop_ahead()
            for _ in threads:
                self._handoff.put(None)
            for t in threads:
                while t.is_alive():
                    t.join(0.5)
            try:
                self._record_unrecorded()
                self._commit()
            except Exception as e:
                self.log.line(f"worker={self._wid} cannot record the last outcome: {e}", 0)
            if "committer_stop" in locals():
                committer_stop.set()
                self._sync_wanted.set()  # (wakes it)
            if self.waker:
                self.waker.stop()
            for sig, old in old_handlers.items():
                signal.signal(sig, old)
            sp_dir.drop_spares()
            close_all(self._spent_fds)
            if self._spare_outputs is not None:
                close_all(list(self._spare_outputs))
                self._spare_outputs = None
            self.registration.close()
        return self.ran

    def _recover(self) -> None:
        try:
            report = recovery.recover(self.ctx)
            removed = self.dir.remove_tmp()
            self.dir.remove_stale_spares()
        except Exception as e:  # recovery failing must not keep jobs from running
            self.log.line(f"worker={self._wid} recovery failed: {type(e).__name__}: {e}", 0)
            return
        if report.recovered or report.dead or report.completed or report.quarantined or report.killed:
            self.log.line(
                f"worker={self._wid} recovered: failed={report.recovered} dead={report.dead} "
                f"completed={report.completed} quarantined={report.quarantined} killed={report.killed}",
                0, logging.ERROR if report.dead else logging.WARNING,
            )
        if report.left_running:
            self.log.line(f"worker={self._wid} left {report.left_running} jobs of dead workers in cur/: "
                          "their processes still run and are another user's to kill (recovered by the first recovery after they end)", 0,
                          logging.WARNING)
        if removed:
            self.log.line(f"worker={self._wid} removed {removed} stale tmp/ files", 1)

    def _may_claim(self) -> bool:
        if self._stopping:
            return False
        if self.max_jobs is not None and self._claimed >= self.max_jobs:
            return False
        if self._deadline is not None and time.monotonic() >= self._deadline:
            return False
        return True

    def _dispatch(self) -> None:
        sp = self.dir
        waker = self.waker
        entries: list[Entry] = []
        read_ahead = ReadAhead(sp, entries)
        pos = 0
        claimed_this_pass = 0
        next_due: int | None = None
        first = True
        busy_rounds = 0
        while self._may_claim():
            if pos >= len(entries):
                self._record_unrecorded()  # before pausing, compacting or scanning
                close_all(self._spent_fds)
                if claimed_this_pass:
                    busy_rounds = 0
                if not first and claimed_this_pass == 0 and self._finished_since_scan == 0:
                    # Nothing changed since the last look.
                    self._commit()
                    if self._finished_since_scan:
                        pass  # staged jobs moved on since (a retry may be due at once): look again
                    elif self._busy_this_pass and busy_rounds < BUSY_RETRIES:
                        # Another worker held a due file for a moment: it was
                        # claiming it, or prepared it ahead and may let it go.
                        # No event will say so; look again soon, rather than
                        # sleep or end the drain with it still waiting.
                        busy_rounds += 1
                        waker.wait(BUSY_RETRY_DELAY)
                    elif not self.watch and self._active == 0 and self._later_ns is None:
                        break
                    else:
                        self.registration.flush()
                        waker.wait(self._sleep_for(next_due, self._later_ns))
                    if not self._may_claim():
                        break
                self._maybe_compact()
                waker.clear()
                waker.check()
                with self._lock:
                    self._finished_since_scan = 0
                self._busy_this_pass = 0
                self._later_ns = None
                # Jobs inherit stdin, stdout and stderr only: whatever else is
                # open without close-on-exec (from whoever started us, or
                # watchdog's inotify descriptor) is closed in every job's
                # process. Looked up once a pass, not once a job.
                self._spawn_closes = inheritable_fds()
                scan = sp.scan(time.time_ns(), SCAN_LIMIT)
                entries, pos, next_due = scan.due, 0, scan.next_due_ns
                read_ahead = ReadAhead(sp, entries)
                claimed_this_pass = 0
                first = False
                self.log.line(f"worker={self._wid} scan due={len(entries)}", 2)
                continue
            read_ahead.before(pos)
            entry = entries[pos]
            pos += 1
            if (len(self._uncommitted) >= COMMIT_JOBS or len(self._staged) >= self._stage_max * (2 if self.jobs == 1 else 1)
                    or len(self._synced) >= self._stage_max):
                self._commit()
            if self.jobs > 1 and not self._acquire_slot():
                break
            ahead = self._ahead
            try:
                if ahead is not None and ahead[0] is entry:
                    self._ahead = None
                    ready = ahead[1]  # prepared while the last job ran
                    claimed = transitions.take(ready, time.time_ns(), self._on_quarantine) if ready else None
                else:
                    self._drop_ahead()
                    claimed = transitions.claim(self.ctx, entry, time.time_ns(), self._on_quarantine, self._on_busy,
                                                self._on_later)
            except Exception as e:  # a claim never takes the worker down; the file stays put
                self.log.line(f"worker={self._wid} cannot claim {entry.state}/{entry.name}: {type(e).__name__}: {e}", 0)
                claimed = None
            if claimed is None:
                if self.jobs > 1:
                    self._slot_free.put(True)
                continue
            claimed_this_pass += 1
            self._claimed += 1
            with self._lock:
                self._active += 1
            if self.jobs == 1:
                self._pass = (entries, pos)
                self._execute(claimed)
            else:
                self._handoff.put(claimed)
        self._commit()
        # Let the running jobs end (killed ones too, after a second signal).
        while self._active > 0 and any(t.is_alive() for t in self._threads):
            self.waker.wait(0.2)
            self.waker.clear()
        self._commit()

    def _maybe_compact(self) -> None:
        """Fold done/ into the index when it holds more than compact_after
        files. done/ is counted at most every COMPACT_CHECK_JOBS finished jobs
        or COMPACT_CHECK_SECONDS, so the check costs nothing per job."""
        limit = int(self.settings["compact_after"])
        if limit <= 0 or self.compact is None:
            return
        now = time.monotonic()
        if self.ran < self._next_compact_ran and now < self._next_compact_time:
            return
        self._next_compact_ran = self.ran + max(1, min(COMPACT_CHECK_JOBS, limit // 10))
        self._next_compact_time = now + COMPACT_CHECK_SECONDS
        try:
            if self.dir.count("done") <= limit:
                return
            self._commit()
            result = self.compact()
        except Exception as e:  # the index is history: never stop the worker for it
            self.log.line(f"worker={self._wid} compaction failed: {e}", 0)
            return
        self.log.line(f"worker={self._wid} compacted {result['folded']} jobs into index.db in {result['seconds']}s", 1)

    def _sleep_for(self, next_due: int | None, later: int | None = None) -> float | None:
        """How long the dispatcher may sleep: until the next due time (watch
        mode) or the end of a writer's grace (a drain waits for that too,
        so the file runs or goes to dead/ before it ends)."""
        timeout = self.waker.rescan_interval if self.watch else None
        if not self.watch:
            next_due = None
        if later is not None and (next_due is None or later < next_due):
            next_due = later
        if next_due is not None:
            until_due = max(0.0, next_due / 1e9 - time.time()) + 0.001
            timeout = until_due if timeout is None else min(timeout, until_due)
        if self._deadline is not None:
            left = max(0.0, self._deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        return timeout

    def _acquire_slot(self) -> bool:
        while True:
            try:
                self._slot_free.get(timeout=0.2)
                break
            except queue.Empty:
                if self._stopping:
                    return False
        if not self._may_claim():
            self._slot_free.put(True)
            return False
        return True

    def _slot(self) -> None:
        while True:
            claimed = self._handoff.get()
            if claimed is None:
                return
            try:
                self._execute(claimed)
            except BaseException as e:  # e.g. a ForcedStop delivered late: keep the slot alive
                self.log.line(f"worker={self._wid} slot error: {type(e).__name__}: {e}", 0)

    def _on_busy(self) -> None:
        self._busy_this_pass += 1

    def _on_later(self, name: str, when_ns: int) -> None:
        if self._later_ns is None or when_ns < self._later_ns:
            self._later_ns = when_ns
        if (name, when_ns) in self._later_logged:
            return
        if len(self._later_logged) > 1000:
            self._later_logged.clear()
        self._later_logged.add((name, when_ns))
        wait = max(0.0, when_ns / 1e9 - time.time())
        self.log.line(f"worker={self._wid} job={name} not a whole job yet and changed less than "
                      f"{transitions.WRITER_GRACE:g}s ago: left in new/ for its writer to finish, looked at again "
                      f"in {wait:.1f}s (a file written in tmp/ and renamed into new/ never waits)", 1)

    def _on_quarantine(self, name: str, reason: str) -> None:
        self.log.line(f"worker={self._wid} job={name} outcome=dead state=dead error={quoted(reason)}", 0)

    # -- one job -----------------------------------------------------------

    def _execute(self, claimed: transitions.Claimed) -> None:
        try:
            self._run_one(claimed)
        finally:
            with self._lock:
                self._active -= 1
                self._finished_since_scan += 1
            if self.jobs > 1:
                self._slot_free.put(True)
                self.waker.wake()  # the dispatcher may be waiting for a finish

    def _limits(self, job: dict) -> Limits:
        s = self.ctx.settings
        timeout = job.get("timeout")
        if timeout is None:
            timeout = s["timeout"]
        return Limits(float(timeout), float(s["timeout_grace"]), int(s["output_limit"]))

    def _run_one(self, claimed: transitions.Claimed) -> None:
        job = claimed.job
        job_id = claimed.job_id
        attempt = claimed.attempt
        reg = self.registration
        thread_id = threading.get_ident()
        handle = RunHandle()
        limits = self._limits(job)
        inline = job.get("kind") is not None and limits.timeout <= 0
        try:
            reg.job_started(job_id, attempt)
        except OSError as e:
            self.log.line(f"worker={self._wid} job={job_id} cannot register the run: {e}", 0)
        with self._lock:
            self._running[thread_id] = handle
        if inline:
            self._record_unrecorded()  # not held back while a handler runs

        def spawned(pid: int, window: tuple[int, int]) -> None:
            try:
                reg.job_spawned(job_id, pid, window)
            finally:
                # While this process starts up and runs, record the job before
                # it and prepare the one after: with -j 1 that work then costs
                # no time of its own.
                self._record_unrecorded()
                if self.jobs == 1:
                    self._side_commit_work()
                self._look_ahead()
                if self.jobs == 1:
                    close_all(self._spent_fds)
                    if self._spare_outputs is None:
                        try:
                            self._spare_outputs = make_outputs()
                        except OSError:
                            pass  # the next job makes its own (and reports why it cannot)

        # A job still running after the hold must not keep the next one locked.
        on_slow = (self._look_ahead_hold, self._drop_ahead) if self.jobs == 1 else None
        plan = RunPlan(limits, handle, spawned, on_slow)

        out: Outcome
        run_began = time.time()  # what a stopped run's record says it started at
        try:
            if self._forced:
                handle.interrupted = True
            if job.get("kind") is not None:
                handler = self.handlers.get(job["kind"])
                if self._forced:
                    out = Outcome(start=run_began, end=run_began, error=STOPPED_NOW, interrupted=True, not_started=True)
                elif inline:
                    out = call_handler(handler, job, limits, handle)
                else:
                    out = fork_handler(handler, job, plan)
            else:
                plan.env, plan.close, plan.threaded = self._env(job, attempt), self._spawn_closes, self.jobs > 1
                if self.jobs == 1:
                    plan.outputs, self._spare_outputs, plan.spent = self._spare_outputs, None, self._spent_fds
                    plan.spin = self._spin_window if self._last_short and self._may_spin() else 0.0
                began = time.monotonic()
                out = run_process(job, plan)
                self._last_short = time.monotonic() - began < self._spin_window
        except ForcedStop:
            out = Outcome(start=run_began, end=time.time(), error=STOPPED_NOW, interrupted=True)
        except Exception as e:  # spoolq's own failure to run it: a failed run, not a dead worker
            out = Outcome(start=run_began, end=time.time(), error=f"internal error running the job: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._running.pop(thread_id, None)
        self._record_unrecorded()
        if self.jobs == 1 and not inline and not self._stopping:
            self._unrecorded = (claimed, out)
        else:
            self._record(claimed, out)

    def _may_spin(self) -> bool:
        """Whether each worker process on the spool (of this command, or
        registered by any other) and each one's job can have a CPU of those
        this process may use, and the machine is not busier than its CPUs
        (the load average, which counts any other work): then polling for
        a short job's exit takes no CPU a job could use. (And it yields the
        CPU between polls, so other work that turns up goes first.)"""
        now = time.monotonic()
        if now - self._spin_counted >= SPIN_RECOUNT_SECONDS:
            self._spin_counted = now
            try:
                workers = max(self.processes, self.dir.count("workers"))
                load = float(self._test_load) if self._test_load else os.getloadavg()[0]
            except OSError:
                workers, load = self._cpus, float("inf")  # unknown: do not poll
            # The load average is the whole machine's, so against all its CPUs.
            self._spin_ok = self._cpus >= 2 * workers and load < (os.cpu_count() or 1)
        return self._spin_ok

    def _look_ahead(self) -> None:
        """-j 1: prepare the next entry of the pass (lock, read, validate;
        see transitions.prepare) so that only its rename is left once the
        running job ends. Nothing changes on disk, so a crash leaves nothing
        to recover; a slow job lets it go after LOOK_AHEAD_HOLD."""
        entries, pos = self._pass
        if self.jobs != 1 or self._ahead is not None or pos >= len(entries) or not self._may_claim():
            return
        entry = entries[pos]
        try:
            ready = transitions.prepare(self.ctx, entry, time.time_ns(), self._on_quarantine, self._on_busy, self._on_later)
        except Exception:
            return  # the dispatcher will claim it the usual way and say what failed
        self._ahead = (entry, ready)

    def _drop_ahead(self) -> None:
        """Let the prepared job go: only its lock, nothing was moved."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[1] is not None:
            ahead[1].held.release()

    def _record_unrecorded(self) -> None:
        """Record the outcome that waits for the next job's start (-j 1)."""
        waiting, self._unrecorded = self._unrecorded, None
        if waiting is not None:
            self._record(*waiting)

    def _record(self, claimed: transitions.Claimed, out: Outcome) -> None:
        """Move a job out of cur/ by its outcome, then log it (at once, or
        after the group commit has synced the move)."""
        job_id, attempt = claimed.job_id, claimed.attempt  # (finish counts the attempt into the job)
        reg = self.registration
        defer = self.dir.fsync
        if out.not_started and self._put_back(claimed):
            return
        try:
            if not out.ok:  # a failed run's record must be known as this run's (a success needs no telling)
                try:
                    reg.ensure_listed(job_id)
                except OSError:
                    pass  # only a crash right after the record would count the run twice
            dest, due = transitions.finish(self.ctx, claimed, out, reg.worker_id, defer_sync=defer, stage=defer)
        except (Exception, ForcedStop) as e:
            # The job stays in cur/ and its registration entry stays too, so
            # recovery knows which run it was; this worker claims no more.
            claimed.held.release()
            self.failed_to_record = True
            self._stopping = True
            where = claimed.held.folder  # cur/, unless the move was made and only its sync failed
            self.log.line(
                f"worker={self._wid} job={job_id} error={quoted(f'cannot record the outcome: {type(e).__name__}: {e}')} "
                + ("it stays in cur/ for recovery" if where == "cur" else f"it is in {where}/, not synced")
                + "; the worker stops claiming",
                0,
            )
            return
        if claimed.held.staged is not None:  # moved on by the next commit
            # A success or a dead end lets its registration entry go now, or
            # every registration save would carry the staged jobs too:
            # recovery knows those records by their state. A failed run keeps
            # it until the move: its record swapped in but not moved on looks
            # like the one it replaced, and the entry tells recovery which
            # run it was.
            if dest != "failed":
                self._forget_run(job_id)
            with self._uncommitted_lock:
                if not self._staged:
                    self._staged_since = time.monotonic()
                self._staged.append((claimed, out, attempt, dest, due))
            return
        self._ended(claimed, out, attempt, dest, due)

    def _put_back(self, claimed: transitions.Claimed) -> bool:
        """A job claimed but stopped before it began (a second stop signal
        between the two) goes back where it came from, as it was: no run
        happened, so none is counted. False if it cannot (then it is
        finished as an interrupted run, as before)."""
        try:
            folder = transitions.unclaim(claimed)
        except Exception as e:
            if claimed.held.folder == "cur":
                return False  # not moved: finished as an interrupted run
            # Moved back, but a sync after failed: as for any record that
            # cannot be made durable, claim no more.
            claimed.held.release()
            self._forget_run(claimed.job_id)
            self.failed_to_record = True
            self._stopping = True
            self.log.line(f"worker={self._wid} job={claimed.job_id} error={quoted(f'{type(e).__name__}: {e}')} "
                          f"back in {claimed.held.folder}/ but not synced; the worker stops claiming", 0)
            return True
        self._forget_run(claimed.job_id)
        self.log.line(f"worker={self._wid} job={claimed.job_id} not started: the worker was told to stop now; "
                      f"back in {folder}/", 1)
        return True

    def _ended(self, claimed: transitions.Claimed, out: Outcome, attempt: int, dest: str, due: float | None) -> None:
        """A job has left cur/: forget its run; log it now, or after the
        folder syncs of the group commit."""
        self._forget_run(claimed.job_id)
        self.ran += 1
        job = claimed.job
        if self.dir.fsync:
            with self._uncommitted_lock:  # not the commit lock: a slot never waits for an fsync here
                self._uncommitted.append((job, out, attempt, dest, due))
        else:
            self._log_outcome(job, out, attempt, dest, due)

    def _forget_run(self, job_id: str) -> None:
        try:
            self.registration.job_ended(job_id)
        except OSError:
            pass

    def _commit(self, staged_age: float = 0.0) -> None:
        """Sync and move on the staged jobs (those staged at least
        ``staged_age`` seconds ago), fsync the folders of the deferred moves,
        then log the finishes they cover: an outcome is durable before anyone
        is told about it. Called by the dispatcher and by the committer thread."""
        with self._commit_lock:
            if not self._uncommitted and not self._staged and not self._synced and not self.dir.has_deferred:
                return
            if self._staged and time.monotonic() - self._staged_since >= staged_age:
                self._sync_staged()
            self._complete_synced(older_than=staged_age)
            # Take the outcomes first: every one of them already has its moves
            # in the deferred sets, which the sync below covers.
            with self._uncommitted_lock:
                pending, self._uncommitted = self._uncommitted, []
            try:
                self.dir.sync_deferred()
            except OSError as e:
                self.failed_to_record = True
                self._stopping = True
                self.log.line(f"worker={self._wid} error={quoted(f'cannot sync finished jobs: {e}')} the worker stops claiming", 0)
                return
        for item in pending:
            self._log_outcome(*item)

    # -- staged finishes (fsync on) ------------------------------------------
    #
    # A finished job's new record is staged beside it in cur/ (see
    # transitions.finish), then made durable with one sync for many jobs,
    # then swapped in and moved on (transitions.complete); the folders are
    # fsynced and the outcomes logged by the next commit.

    def _side_commit_work(self) -> None:
        """-j 1, while the next job runs: move on a few synced jobs, and ask
        the committer thread for a sync of the staged ones once there are
        enough, they have waited the commit interval, or the last one ran
        that long itself (such jobs gain little from sharing a sync).

        The sync is the committer's: it blocks without using a CPU. The
        moves are this thread's, a few per job: in the committer they would
        take Python's lock from this thread at each of their many calls
        (measured: ~400 us a job, against ~70 here)."""
        if not self._staged and not self._synced:
            return  # (fsync off, or nothing waits: no lock taken)
        self._complete_synced(COMPLETE_PER_JOB)
        if self._sync_wanted.is_set():
            return
        with self._uncommitted_lock:
            staged, since = self._staged, self._staged_since
        if staged and (len(staged) >= self._stage_max or staged[-1][1].end - staged[-1][1].start >= self._commit_seconds
                       or time.monotonic() - since >= self._commit_seconds):
            self._sync_wanted.set()

    def _sync_staged(self) -> None:
        """Make the staged records durable, one sync for all of them; they
        then wait to be moved on."""
        with self._uncommitted_lock:
            staged, since, self._staged = self._staged, self._staged_since, []
        if not staged:
            return
        try:
            self.dir.sync_data([claimed.held.staged[1] for claimed, *_ in staged])
        except BaseException as e:
            for item in staged:
                self._cannot_record(item, f"cannot sync finished jobs: {type(e).__name__}: {e}")
            if isinstance(e, (Exception, ForcedStop)):
                return
            raise  # (Ctrl-C in a program that calls Spool.work: the jobs are let go first)
        with self._uncommitted_lock:
            self._synced.extend((since, item) for item in staged)

    def _complete_synced(self, limit: int | None = None, older_than: float = 0.0) -> None:
        """Swap in the synced records and move their jobs on: up to
        ``limit``, of those staged at least ``older_than`` seconds ago.
        Each counts as a finish for the dispatcher: a failed job may be due
        again at once, and it could not see it while it waited in cur/."""
        done = 0
        while limit is None or done < limit:
            with self._uncommitted_lock:
                if not self._synced or time.monotonic() - self._synced[0][0] < older_than:
                    return
                item = self._synced.popleft()[1]
            claimed, out, attempt, dest, due = item
            try:
                transitions.complete(claimed.held, dest, due)
            except BaseException as e:
                self._cannot_record(item, f"cannot record the outcome: {type(e).__name__}: {e}")
                if isinstance(e, (Exception, ForcedStop)):
                    continue
                raise
            self._ended(claimed, out, attempt, dest, due)
            done += 1
            with self._lock:
                self._finished_since_scan += 1

    def _cannot_record(self, item: tuple[transitions.Claimed, Outcome, int, str, float | None], why: str) -> None:
        """A staged job that cannot be moved on stays in cur/ with its staged
        record, unlocked, for recovery to complete; the worker stops."""
        claimed = item[0]
        claimed.held.drop_staged()
        claimed.held.release()
        self.failed_to_record = True
        self._stopping = True
        self.log.line(f"worker={self._wid} job={claimed.job_id} error={quoted(why)} "
                      "it stays in cur/ for recovery; the worker stops claiming", 0)

    def _committer(self, stop: threading.Event) -> None:
        """Sync the staged records when asked to (-j 1), and commit whatever
        has waited COMMIT_SECONDS, even while the next job runs (a long job
        must not hold back the outcome of the one before)."""
        # With -j 1 the dispatcher moves staged jobs on between its jobs; this
        # thread takes them only once they were staged twice the interval ago
        # (the dispatcher is then busy with a long job).
        staged_age = self._commit_seconds * (2 if self.jobs == 1 else 1)
        wanted = self._sync_wanted
        while not stop.is_set():
            wanted.wait(self._commit_seconds / 2)
            if stop.is_set():
                break
            if wanted.is_set():
                try:
                    with self._commit_lock:  # a last commit waits for it, then sees what it synced
                        self._sync_staged()
                finally:
                    wanted.clear()
            sp = self.dir
            # Outcomes may wait with nothing deferred: a slot's move that
            # another commit synced just before the slot listed its outcome.
            now = time.monotonic()
            with self._uncommitted_lock:
                synced_since = self._synced[0][0] if self._synced else now
            if ((sp.has_deferred or self._uncommitted) and now - sp.unsynced_since >= self._commit_seconds) or (
                    self._staged and now - self._staged_since >= staged_age) or now - synced_since >= staged_age:
                try:
                    self._commit(staged_age)
                except Exception as e:
                    self.log.line(f"worker={self._wid} commit failed: {e}", 0)

    def _env(self, job: dict, attempt: int) -> dict[str, str]:
        env = dict(self._base_env)
        extra = job.get("env")
        if extra:
            env.update(extra)
        env["SPOOLQ_JOB_ID"] = job["id"]
        env["SPOOLQ_ATTEMPT"] = str(attempt)
        env["SPOOLQ_SPOOL"] = self.dir.root
        env["SPOOLQ_WORKER"] = self.registration.worker_id
        return env

    def _log_outcome(self, job: dict, out: Outcome, attempt: int, dest: str, due: float | None) -> None:
        if getattr(self.log, "level", 2) < 1 and dest != "dead":  # (a line()-only object takes every line)
            return
        outcome = {"done": "succeeded", "failed": "failed", "dead": "dead"}[dest]
        max_attempts = job.get("max_attempts") or self.ctx.settings["max_attempts"]
        parts = [
            f"worker={self._wid}",
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
        self.log.line(" ".join(parts), 0 if dest == "dead" else 1, logging.WARNING if dest == "failed" else None)
