"""`spoolq work -j N` (N > 1) as N worker processes, each a ``-j 1`` worker.

Why processes, not threads: a worker spends a few hundred microseconds of
Python on each job, and threads of one process take turns on Python's
lock, switching ~10 times per job; with short jobs, ``-j 2`` in threads
ran barely faster than ``-j 1``. Worker processes need nothing new from
the protocol, which is built for many workers on one spool (locks and
renames); each has its own registration, so recovery and ``status`` see
them as the workers they are. (``Spool.work(jobs=N)`` keeps to threads
unless given ``processes=True``: it runs in the caller's process, whose
handlers may share its state.)

Signals go to the parent, which passes them on: the first SIGTERM or
SIGINT as SIGUSR1 (stop claiming, let running jobs finish), a second as
SIGUSR2 (kill them), SIGHUP as SIGHUP (reread config.json). The parent logs
each stop with the signal it was sent, once for all its workers; SIGUSR1
and SIGUSR2 sent to the parent itself are ignored. The workers
leave SIGTERM and SIGINT that reach them directly (a terminal's Ctrl-C
reaches the whole process group, systemd's stop the whole control group)
to the parent, so one signal never counts twice. A worker whose parent
dies stops claiming and finishes what it runs (its death signal is
SIGUSR1).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Callable

from .procs import DIRECT_SIGNALS, HANDLED_SIGNALS
from .runner import die_with_parent
from .output import Log
from .worker import RELAYED_SIGNALS, STOPPING, STOPPING_NOW, Worker

PASSED_ON = DIRECT_SIGNALS  # a worker process handles these and RELAYED_SIGNALS: HANDLED_SIGNALS
# Blocked in the parent for the whole run and taken with sigtimedwait: a
# handler runs only once Python runs again, so a signal that came just
# before the parent went to sleep in waitid() would be handled by nobody
# until a worker ended.
WAITED = PASSED_ON + RELAYED_SIGNALS + (signal.SIGCHLD,)


def shares(max_jobs: int | None, processes: int) -> list[int | None]:
    """Split a ``--max-jobs`` budget between the worker processes: each
    claims at most its share, so together they claim at most ``max_jobs``."""
    if max_jobs is None:
        return [None] * processes
    return [max_jobs // processes + (1 if i < max_jobs % processes else 0) for i in range(processes)]


def run_workers(make_worker: Callable[..., Worker], processes: int, max_jobs: int | None, log: Log) -> tuple[int, bool]:
    """Run ``processes`` workers on one spool until each has drained it (or,
    watching, until told to stop). ``make_worker(max_jobs=, relayed=,
    pool_parent=, processes=)`` makes one in a worker process. Returns how
    many jobs they ran, and True when every worker ended cleanly.

    A worker process that fails (it could not record an outcome, or was
    killed) stops the others, as a failing worker stops itself: the command
    then exits 1, and whoever restarts it (systemd's Restart=on-failure, the
    next cron run) recovers the job the failed one left in cur/."""
    relay = _Relay(processes, log)
    # Each worker process writes how many jobs it ran here as it ends (one
    # short line: a single write, whole); read once all have ended.
    ran_reader, ran_writer = os.pipe()
    os.set_blocking(ran_reader, False)
    # Blocked before the first fork: a child starts with them blocked and
    # unblocks them once its own handlers are in place. SIGCHLD at its
    # default, not ignored (as whoever started us may have left it), or
    # the kernel would send none.
    old_handlers = {sig: signal.signal(sig, relay.on_signal) for sig in PASSED_ON + RELAYED_SIGNALS}
    old_handlers[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)
    try:
        _start_workers(relay, make_worker, max_jobs, ran_reader, ran_writer)
        if relay.stop_signals:  # (a handler may have run before the last child was added; telling again is harmless)
            relay.tell(signal.SIGUSR1 if relay.stop_signals == 1 else signal.SIGUSR2)
        _wait_for_workers(relay)
    finally:
        # Signals that came after the last worker ended have nobody to go to.
        while signal.sigtimedwait(WAITED, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        reports = _read_reports(ran_reader, ran_writer)
    return sum(int(line) for line in reports.split()), relay.clean


class _Relay:
    """The parent's side of a run: its worker processes, the stop signals it
    was sent, and whether every worker has ended cleanly so far."""

    def __init__(self, processes: int, log: Log) -> None:
        self.parent = os.getpid()
        self.processes = processes
        self.log = log
        self.children: set[int] = set()
        self.stop_signals = 0
        self.clean = True

    def tell(self, relay: int) -> None:
        for pid in list(self.children):
            try:
                os.kill(pid, relay)
            except ProcessLookupError:
                pass

    def pass_on(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            self.tell(signal.SIGHUP)
            return
        if signum in RELAYED_SIGNALS:
            self.log.line(f"signal={name} ignored: spoolq work -j {self.processes} stops on SIGTERM or SIGINT", 0,
                          logging.WARNING)
            return
        self.stop_signals += 1
        if self.stop_signals == 1:
            self.log.line(f"stopping on {name}: {STOPPING}", 1)
        elif self.stop_signals == 2:
            self.log.line(f"stopping now on {name}: {STOPPING_NOW}", 0, logging.WARNING)
        self.tell(signal.SIGUSR1 if self.stop_signals == 1 else signal.SIGUSR2)

    def reap(self) -> None:
        """Reap every worker that has ended (without blocking)."""
        while self.children:
            # Learn which child ended before reaping it: until it is reaped
            # its pid cannot be reused, so a signal passed on meanwhile never
            # reaches a stranger.
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if info is None:
                return
            pid = info.si_pid
            self.children.discard(pid)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                if self.clean:
                    self.tell(signal.SIGUSR1)  # the others finish what they run, then exit
                self.clean = False
                if code < 0:
                    self.log.line(f"a worker process (pid {pid}) was killed by {signal.Signals(-code).name}; the "
                                  "others stop, and its job is recovered when spoolq work next starts", 0)

    def on_signal(self, signum: int, frame: Any) -> None:
        # Only for a signal the kernel gave another thread of this process
        # (one an --app module started, where the signals are not blocked):
        # the main thread runs this once its wait below times out.
        if os.getpid() == self.parent:  # (not in a child before its own handlers are in place)
            self.pass_on(signum)


def _start_workers(relay: _Relay, make_worker: Callable[..., Worker], max_jobs: int | None,
                   ran_reader: int, ran_writer: int) -> None:
    """Fork one worker process per nonzero share, passing on the signals
    that come meanwhile; none more once told to stop."""
    for share in shares(max_jobs, relay.processes):
        if share == 0:
            continue
        while (info := signal.sigtimedwait(PASSED_ON, 0)) is not None:
            relay.pass_on(info.si_signo)
        if relay.stop_signals:  # told to stop while starting: start no more
            break
        for stream in (sys.stdout, sys.stderr):  # or a child would print what the parent buffered
            _flush(stream)
        pid = os.fork()
        if pid == 0:
            os.close(ran_reader)
            _worker_process(make_worker, share, relay.log, relay.parent, relay.processes, ran_writer)
        relay.children.add(pid)


def _wait_for_workers(relay: _Relay) -> None:
    """Pass signals on and reap workers until every one has ended."""
    while True:
        relay.reap()
        if not relay.children:
            break
        # A signal to pass on, or a worker ended; at least every second
        # a look (the backstop for a signal that went to another thread).
        info = signal.sigtimedwait(WAITED, 1.0)
        if info is not None and info.si_signo != signal.SIGCHLD:
            relay.pass_on(info.si_signo)


def _read_reports(ran_reader: int, ran_writer: int) -> bytes:
    """What the worker processes wrote as they ended; closes both ends."""
    os.close(ran_writer)
    reports = b""
    try:
        while chunk := os.read(ran_reader, 65536):
            reports += chunk
    except BlockingIOError:  # all read: a forked handler may still hold the other end
        pass
    os.close(ran_reader)
    return reports


def _flush(stream: Any) -> None:
    try:
        stream.flush()
    except (OSError, ValueError, AttributeError):  # closed, or None when started without it
        pass


def _worker_process(make_worker, share, log, parent, processes, ran_writer) -> None:
    """The body of one worker process (its signals blocked until its
    handlers are in place); never returns."""
    code = 1
    try:
        worker = make_worker(max_jobs=share, relayed=True, pool_parent=parent, processes=processes)
        # Until run() puts them in place (the same ones). SIGCHLD was
        # blocked for the parent's sake only.
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, worker._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED_SIGNALS + (signal.SIGCHLD,))
        die_with_parent(signal.SIGUSR1)  # stop claiming when the command dies
        if os.getppid() != parent:  # the parent died before that took hold: as if it had come
            worker._on_signal(signal.SIGUSR1, None)
        worker.run()
        code = 1 if worker.failed_to_record else 0
        os.write(ran_writer, f"{worker.ran}\n".encode())
    except BaseException as e:  # a worker process must never return into the parent's code
        try:
            log.line(f"worker process {os.getpid()} failed: {type(e).__name__}: {e}", 0)
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):  # what in-process handlers printed
            _flush(stream)
        os._exit(code)
