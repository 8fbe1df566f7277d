"""A worker's automatic compaction, run in a process of its own beside the
worker: the directory backend's housekeeping starts a thread that counts
done/ and starts the process; the process folds done/ into the index as
``spoolq compact`` does, on another CPU.

Folding a finished job costs about what running a no-op job does (locking,
reading and checking its file, its rows, and removing the file, which on
some filesystems waits for the disk), so a worker that folded in line would
spend close to half its time on history. Beside it, the worker's process
only counts done/ now and then and starts the compaction process when
done/ holds more than ``compact_after`` files.

The process is told to stop by the end of its standard input: the backend
closes its end when the worker stops work (or the kernel does, when the
worker dies), and the process then stops once the batch in hand is
committed and its files removed (a crash of either at any instant is a
killed compaction: nothing lost, nothing counted twice). What it did not
reach stays in done/ for the next compaction. It writes what it did as one
JSON line on its standard output.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from .. import procs

RESULT_WAIT = 600.0  # seconds an ending worker waits for its compaction's batch in hand at most
CHECK_SECONDS = 0.5  # how often done/ is counted beside the worker
# History waits for CPU time that jobs leave over: on a busy machine the
# worker keeps its pace and done/ grows until the compaction catches up.
NICENESS = 10
RETRY_SECONDS = 60.0  # after a failed compaction, the thread starts the next one no sooner


class Beside:
    """The worker's side. A thread counts done/ every CHECK_SECONDS (the
    worker's housekeeping comes only between its passes, and one pass of a
    large backlog takes minutes) and starts the process when done/ holds
    more than ``limit()`` files and none runs; ``close`` stops the thread
    and the process. What each process did, or why it failed, goes to
    ``report(result)`` as it ends (a dict with ``folded`` and ``seconds``,
    or with ``error``). ``program``: the command that runs ``serve`` for
    this spool; ``count``: the files in done/ (on descriptors of its own:
    the worker's are not shared across threads)."""

    def __init__(self, program: list[str], count: Callable[[], int], limit: Callable[[], int],
                 report: Callable[[dict[str, Any]], None]):
        self.program = program
        self.report = report
        self.count = count
        self.limit = limit
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._retry_at = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start the counting thread; False when no process can be started
        (an embedded Python has no interpreter to start): the caller then
        compacts in line."""
        if not (self.program and self.program[0]):
            return False
        self._thread = threading.Thread(target=self._watch, name="spoolq-compact", daemon=True)
        with procs.signals_to_main_thread():  # a stop signal must reach the worker's main thread
            self._thread.start()
        return True

    def now(self) -> None:
        """Start the process now, unless one runs (the caller found done/
        over the limit)."""
        with self._lock:
            self._reap()
            if self._proc is None:
                self._spawn()

    def close(self) -> None:
        """Stop the thread, tell the process to stop after the batch in
        hand, and wait for it."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            proc = self._proc
            if proc is not None:
                stdin, proc.stdin = proc.stdin, None  # (communicate would flush it)
                try:
                    stdin.close()
                except OSError:
                    pass
                try:
                    proc.wait(RESULT_WAIT)
                except subprocess.TimeoutExpired:
                    # Waiting for a lock of the index (another compaction's):
                    # left to finish by itself, as a compaction run by hand.
                    self._proc = None
                self._reap()

    def _watch(self) -> None:
        while not self._closing.wait(CHECK_SECONDS):
            try:
                with self._lock:
                    self._reap()
                    if self._proc is None and time.monotonic() >= self._retry_at and 0 < self.limit() < self.count():
                        self._spawn()
            except Exception as e:  # the thread goes on, and tries again later
                self._retry_at = time.monotonic() + RETRY_SECONDS
                self.report({"error": f"{type(e).__name__}: {e}"})

    def _spawn(self) -> None:
        self._proc = subprocess.Popen(self.program, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, close_fds=True, start_new_session=True)

    def _reap(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is None:
            return
        self._proc = None
        out, err = proc.communicate()
        try:
            result = json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])
        except (ValueError, IndexError):
            if proc.returncode < 0:  # killed: a compaction cut short, as by hand
                return
            said = err.decode("utf-8", "replace").strip().splitlines()
            result = {"error": said[-1] if said else f"the compaction process ended with status {proc.returncode}"}
        if "error" in result:  # (a broken index.db would fail every half second)
            self._retry_at = time.monotonic() + RETRY_SECONDS
        self.report(result)


def stop_asked() -> bool:
    """Whether standard input has ended: the worker has asked this process
    to stop (or has died)."""
    try:
        readable, _, _ = select.select([0], [], [], 0)
    except (OSError, ValueError):
        return True
    if not readable:
        return False
    try:
        return os.read(0, 1) == b""
    except OSError:
        return True


def serve(compact: Callable[[Callable[[], bool]], dict[str, Any]]) -> None:
    """The process's body: ``compact(stop)``, then what it did (or why it
    failed) on standard output."""
    started = time.monotonic()
    # Started from the worker's counting thread, which blocks the stop
    # signals (see start): this process answers them as any other does.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, procs.HANDLED_SIGNALS)
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    try:
        result = dict(compact(stop_asked))
    except Exception as e:  # told to the worker, which logs it and goes on
        result = {"error": str(e) or type(e).__name__, "seconds": round(time.monotonic() - started, 3)}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
