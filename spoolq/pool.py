"""`spoolq work -j N` (N > 1) as N worker processes, each a ``-j 1`` worker.

Why processes, not threads: a worker spends a few hundred microseconds of
Python on each job, and threads of one process take turns on Python's
lock, switching ~10 times per job; with short jobs, ``-j 2`` in threads
ran barely faster than ``-j 1``. Worker processes need nothing new from
the protocol, which is built for many workers on one spool (locks and
renames); each has its own registration, so recovery and ``status`` see
them as the workers they are. (``Spool.work(jobs=N)`` keeps to threads:
it runs in the caller's process, whose handlers may share its state.)

Signals go to the parent, which passes them on: the first SIGTERM or
SIGINT as SIGUSR1 (stop claiming, let running jobs finish), a second as
SIGUSR2 (kill them), SIGHUP as SIGHUP (reread config.json). The workers
leave SIGTERM and SIGINT that reach them directly (a terminal's Ctrl-C
reaches the whole process group, systemd's stop the whole control group)
to the parent, so one signal never counts twice. A worker whose parent
dies stops claiming and finishes what it runs (its death signal is
SIGUSR1).
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable

from .worker import Log, Worker

PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def shares(max_jobs: int | None, processes: int) -> list[int | None]:
    """Split a ``--max-jobs`` budget between the worker processes: each
    claims at most its share, so together they claim at most ``max_jobs``."""
    if max_jobs is None:
        return [None] * processes
    return [max_jobs // processes + (1 if i < max_jobs % processes else 0) for i in range(processes)]


def run_workers(make_spool: Callable[[], Any], processes: int, handlers: dict, max_jobs: int | None,
                max_time: float | None, watch: bool, poll: float | None, log: Log) -> bool:
    """Run ``processes`` workers on one spool until each has drained it (or,
    watching, until told to stop). True when every worker ended cleanly."""
    parent = os.getpid()
    children: set[int] = set()
    stop_signals = 0

    def pass_on(signum: int, frame: Any) -> None:
        nonlocal stop_signals
        if os.getpid() != parent:  # a child that has not yet put its own handlers in place
            return
        if signum == signal.SIGHUP:
            relay = signal.SIGHUP
        else:
            stop_signals += 1
            relay = signal.SIGUSR1 if stop_signals == 1 else signal.SIGUSR2
        for pid in list(children):
            try:
                os.kill(pid, relay)
            except ProcessLookupError:
                pass

    old = {sig: signal.signal(sig, pass_on) for sig in PASSED_ON}
    clean = True
    try:
        for share in shares(max_jobs, processes):
            if share == 0:
                continue
            pid = os.fork()
            if pid == 0:
                _worker_process(make_spool, handlers, share, max_time, watch, poll, log, parent)
            children.add(pid)
        if stop_signals:  # told to stop while starting: the later workers have not heard it
            for pid in children:
                try:
                    os.kill(pid, signal.SIGUSR1 if stop_signals == 1 else signal.SIGUSR2)
                except ProcessLookupError:
                    pass
        while children:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid not in children:
                continue
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                clean = False
                if code < 0:
                    log.line(f"a worker process (pid {pid}) was killed by {signal.Signals(-code).name}; "
                             "its jobs are recovered by the next worker to start", 0)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return clean


def _worker_process(make_spool, handlers, share, max_time, watch, poll, log, parent) -> None:
    """The body of one worker process; never returns."""
    code = 1
    try:
        worker = Worker(make_spool(), handlers=handlers, jobs=1, max_jobs=share, max_time=max_time,
                        watch=watch, poll=poll, log=log, relayed=True)
        # Until run() puts them in place (the same ones): a relayed stop that
        # arrives while this process starts must not kill it.
        for sig in PASSED_ON + (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, worker._on_signal)
        _stop_with_parent()
        if os.getppid() != parent:  # the parent died before that took hold
            worker.stop()
        worker.run()
        code = 1 if worker.failed_to_record else 0
    except BaseException as e:  # a worker process must never return into the parent's code
        try:
            log.line(f"worker process {os.getpid()} failed: {type(e).__name__}: {e}", 0)
        except BaseException:
            pass
    finally:
        os._exit(code)


def _stop_with_parent() -> None:
    """Be sent SIGUSR1 (stop claiming) when the parent dies (Linux)."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
