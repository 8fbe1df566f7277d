"""A worker's live output: what a running job's process writes to its
stdout and stderr, pushed every ``PUMP_EVERY`` seconds to where other
processes read it (the backend's ``LiveSink``: named files of a directory
spool, rows of a PostgreSQL spool), so that ``spoolq logs`` shows a job's
output while it runs.

A job's output is captured in memory files as ever (runner.py); one pump
thread per worker copies what is new of the runs that have lasted
``PUBLISH_AFTER`` seconds, at most ``log_limit`` bytes of each stream (the
latest). A short job is never pushed: it costs a dict entry and an
uncontended lock. When a pushed run ends its last bytes are pushed and its
live output removed, before its outcome is recorded.

Output of an in-process handler (no timeout, no process of its own) is
not pushed: it is seen once the job ends.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from .backend import LiveSink
from .runner import kept_from

PUMP_EVERY = 0.25  # seconds between two pushes of a running job's new output
PUBLISH_AFTER = 0.1  # a run is pushed only once it has run this long
STREAMS = ("stdout", "stderr")




class _Run:
    __slots__ = ("job_id", "handle", "began", "sent", "published", "ended", "lock")

    def __init__(self, job_id: str, handle: Any):
        self.job_id = job_id
        self.handle = handle
        self.began = time.monotonic()
        self.sent = [0, 0]
        self.published = False
        self.ended = False
        self.lock = threading.Lock()


class Pump:
    """One worker's pump thread (see the module's docstring)."""

    def __init__(self, sink: Callable[[], LiveSink | None], settings: Any,
                 log: Callable[[str], None], blocking: Callable[[], Any]):
        """``sink()``: the backend's LiveSink (made at the first push);
        ``settings``: read for log_limit at each push; ``blocking()``: a
        context in which the thread is started with the worker's signals
        blocked."""
        self._make_sink = sink
        self._sink: LiveSink | None = None
        self._settings = settings
        self._log = log
        self._blocking = blocking
        self._lock = threading.Lock()
        self._runs: dict[int, _Run] = {}
        self._wake = threading.Event()
        self._sleep = threading.Event()  # set only to stop
        self._idle = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="spoolq-output", daemon=True)
        with self._blocking():
            self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._sleep.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sink is not None:
            try:
                self._sink.close()
            except Exception:
                pass

    # -- the worker's calls, once a run's process started and once it is reaped

    def start_run(self, job_id: str, handle: Any) -> None:
        run = _Run(job_id, handle)
        with self._lock:
            self._runs[id(handle)] = run
            wake, self._idle = self._idle, False
        if wake:
            self._wake.set()

    def end_run(self, handle: Any) -> None:
        with self._lock:
            run = self._runs.pop(id(handle), None)
        if run is None:
            return
        with run.lock:
            run.ended = True
            if not run.published:
                return
            try:
                self._push(run)
                self._sink.told([run.job_id])
            except Exception as e:
                self._trouble(e)
            try:
                self._sink.remove(run.job_id)
            except Exception as e:
                self._trouble(e)

    # -- the thread ------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                busy = bool(self._runs)
                self._idle = not busy
            if not busy:  # asleep until a run starts (start_run sets _wake once _idle)
                self._wake.wait()
                self._wake.clear()
                continue
            self._sleep.wait(PUMP_EVERY)
            with self._lock:
                runs = list(self._runs.values())
            self._round(runs)

    def _round(self, runs: list[_Run]) -> None:
        now = time.monotonic()
        told = []
        for run in runs:
            if now - run.began < PUBLISH_AFTER:
                continue
            with run.lock:
                if run.ended or self._stopping:
                    continue
                try:
                    if self._push(run):
                        told.append(run.job_id)
                except Exception as e:
                    self._trouble(e)
        if told:
            try:
                self._sink.told(told)
            except Exception as e:
                self._trouble(e)

    def _push(self, run: _Run) -> bool:
        """Push what is new of ``run``'s output; True when anything was put."""
        outputs = run.handle.outputs
        if outputs is None:
            return False
        limit = int(self._settings["log_limit"])
        if limit <= 0:
            return False
        if self._sink is None:
            self._sink = self._make_sink()
        put = False
        for i, fd in enumerate(outputs):
            size = os.fstat(fd).st_size
            sent = run.sent[i]
            if size <= sent and run.published:
                continue
            start = max(sent, size - limit, kept_from(size, run.handle.keep))
            data = os.pread(fd, size - start, start) if start < size else b""
            self._sink.put(run.job_id, STREAMS[i], start, data)
            run.sent[i] = start + len(data)
            put = True
        run.published = True
        return put

    def _trouble(self, e: Exception) -> None:
        """A push that failed is said once; the runs go on (their outcome
        does not depend on it)."""
        if not self._failed:
            self._failed = True
            self._log(f"cannot keep running jobs' output for `spoolq logs`: {type(e).__name__}: {e}")
