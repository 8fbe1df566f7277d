"""How a worker runs the jobs its dispatcher claims: ``Serial`` (``jobs=1``:
the dispatcher runs each job itself, and pipelines the work around it) or
``Slots`` (``jobs=N``: N slot threads take claimed jobs from a hand-off).

Both answer the same calls of the dispatcher: ``ready()`` before a claim
(a free slot), ``unused()`` when the claim got nothing, ``execute(claimed)``,
``idle()`` before it pauses or scans, ``drain()`` as the worker ends; and
the worker's calls around one run (``beside_spawn``, ``process_options``,
``ran``, ``finished``).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

from . import procs
from .backend import Claim
from .record import Outcome
from .runner import close_all, make_outputs

SPIN_RECOUNT_SECONDS = 1.0  # how often the live workers on the spool are counted again for polling


class Serial:
    """``jobs=1``: one job at a time, in the dispatcher's thread, with the
    work around it done while a job's process runs: the last job's outcome
    is recorded, the commit does a little of its work, the backend prepares
    the next job (its look-ahead) and the next run's output files are made,
    so that a short job's turnaround is little more than its own run."""

    staged_factor = 2  # the dispatcher moves staged jobs on between jobs: let twice as many wait

    def __init__(self, worker: Any, tuning: Any):
        self.w = worker
        self.tuning = tuning
        # The outcome of the last process job, recorded once the next job's
        # process has started, or when the dispatcher pauses or stops.
        self._unrecorded: tuple[Claim, Outcome] | None = None
        # The next process job's output files, made while the current one
        # runs, and the last one's, closed once the next has started.
        self._spare_outputs: tuple[int, int] | None = None
        self._spent_fds: list[int] = []
        # Whether there is a CPU to spare for polling (see Tuning.spin_window),
        # counted again every SPIN_RECOUNT_SECONDS, and whether the last job was short.
        self._cpus = procs.usable_cpus()
        self._spin_ok = False
        self._spin_counted = -SPIN_RECOUNT_SECONDS
        self._last_short = True
        self._began = 0.0

    def start(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def unused(self) -> None:
        pass

    def execute(self, claimed: Claim) -> None:
        self.w.execute(claimed)

    def idle(self) -> None:
        """Before the dispatcher pauses, compacts or scans."""
        self.record_unrecorded()
        close_all(self._spent_fds)

    def drain(self) -> None:
        """As the worker ends: let the prepared job go, record the last outcome."""
        self.w.backend.drop_ahead()
        self.record_unrecorded()

    def close(self) -> None:
        close_all(self._spent_fds)
        if self._spare_outputs is not None:
            close_all(list(self._spare_outputs))
            self._spare_outputs = None

    def wait_running(self) -> None:
        pass  # nothing runs once the dispatcher's own call returned

    # -- around one run --------------------------------------------------------

    def before_inline(self) -> None:
        self.record_unrecorded()  # not held back while a handler runs

    def beside_spawn(self) -> None:
        """While a job's process starts up and runs, record the job before
        it, let the commit do a little of its work and have the next job
        prepared (the backend's look-ahead): that work then costs no time
        of its own."""
        self.record_unrecorded()
        w = self.w
        w.commit.beside_run()
        if w.may_claim():
            w.backend.look_ahead()
        close_all(self._spent_fds)
        if self._spare_outputs is None:
            try:
                self._spare_outputs = make_outputs()
            except OSError:
                pass  # the next job makes its own (and reports why it cannot)

    def on_slow(self) -> tuple[float, Any] | None:
        """A job still running after the hold must not keep the next one locked."""
        return (self.tuning.look_ahead_hold, self.w.backend.drop_ahead)

    def process_options(self) -> dict[str, Any]:
        outputs, self._spare_outputs = self._spare_outputs, None
        spin = self.tuning.spin_window if self._last_short and self._may_spin() else 0.0
        self._began = time.monotonic()
        return dict(threaded=False, outputs=outputs, spent=self._spent_fds, spin=spin)

    def ran(self) -> None:
        """A process job has been reaped."""
        self._last_short = time.monotonic() - self._began < self.tuning.spin_window

    def finished(self, claimed: Claim, out: Outcome, inline: bool) -> None:
        """A process job's outcome waits for the next job's start (see beside_spawn)."""
        self.record_unrecorded()
        if not inline and not self.w.stopping:
            self._unrecorded = (claimed, out)
        else:
            self.w.record(claimed, out)

    def record_unrecorded(self) -> None:
        waiting, self._unrecorded = self._unrecorded, None
        if waiting is not None:
            self.w.record(*waiting)

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
                workers = max(self.w.processes, self.w.backend.count_workers())
                load = self.tuning.load_average()
            except OSError:
                workers, load = self._cpus, float("inf")  # unknown: do not poll
            # The load average is the whole machine's, so against all its CPUs.
            self._spin_ok = self._cpus >= 2 * workers and load < (os.cpu_count() or 1)
        return self._spin_ok


class Slots:
    """``jobs=N``: N slot threads run the claimed jobs; the dispatcher
    claims only when a slot is free."""

    staged_factor = 1

    def __init__(self, worker: Any, jobs: int):
        self.w = worker
        self.jobs = jobs
        self._threads: list[threading.Thread] = []
        # A token per free slot, and claimed jobs on their way to a slot:
        # SimpleQueue, written in C, hands over with far fewer switches
        # between threads than Semaphore and Queue (Python on a Condition).
        self._slot_free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(jobs):
            self._slot_free.put(True)
        self._handoff: queue.SimpleQueue = queue.SimpleQueue()

    def start(self) -> None:
        for i in range(self.jobs):
            t = threading.Thread(target=self._slot, name=f"spoolq-slot-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def ready(self) -> bool:
        """Wait for a free slot; False if the worker stops meanwhile."""
        while True:
            try:
                self._slot_free.get(timeout=0.2)
                break
            except queue.Empty:
                if self.w.stopping:
                    return False
        if not self.w.may_claim():
            self._slot_free.put(True)
            return False
        return True

    def unused(self) -> None:
        self._slot_free.put(True)

    def execute(self, claimed: Claim) -> None:
        self._handoff.put(claimed)

    def idle(self) -> None:
        pass

    def drain(self) -> None:
        """Let the slots finish what they run, then end them."""
        for _ in self._threads:
            self._handoff.put(None)
        for t in self._threads:
            while t.is_alive():
                t.join(0.5)

    def close(self) -> None:
        pass

    def wait_running(self) -> None:
        """Let the running jobs end (killed ones too, after a second signal)."""
        waker = self.w.waker
        while self.w.active > 0 and any(t.is_alive() for t in self._threads):
            waker.wait(0.2)
            waker.clear()

    def _slot(self) -> None:
        while True:
            claimed = self._handoff.get()
            if claimed is None:
                return
            try:
                self.w.execute(claimed)
            except BaseException as e:  # e.g. a ForcedStop delivered late: keep the slot alive
                self.w.log.line(f"worker={self.w.wid} slot error: {type(e).__name__}: {e}", 0)
            finally:
                self._slot_free.put(True)
                self.w.waker.wake()  # the dispatcher may be waiting for a finish

    # -- around one run --------------------------------------------------------

    def before_inline(self) -> None:
        pass

    def beside_spawn(self) -> None:
        pass

    def on_slow(self) -> None:
        return None

    def process_options(self) -> dict[str, Any]:
        return dict(threaded=True, outputs=None, spent=None, spin=0.0)

    def ran(self) -> None:
        pass

    def finished(self, claimed: Claim, out: Outcome, inline: bool) -> None:
        self.w.record(claimed, out)
