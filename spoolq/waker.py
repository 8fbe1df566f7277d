"""``Waker``: what a sleeping worker waits on. The base class wakes only
when told to (a finished job, a signal); the watchers in ``watcher`` add
filesystem events and timed rescans.
"""

from __future__ import annotations

import threading


class Waker:
    """Wakes a sleeping dispatcher. The base class only reacts to wake()
    calls (finished jobs, signals); watchers add filesystem events.

    Like threading.Event, but on a re-entrant lock: wake() is called from
    signal handlers, which may interrupt the main thread inside this lock."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._flag = False
        self.rescan_interval: float | None = None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def wake(self) -> None:
        with self._cond:
            self._flag = True
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._flag = False

    def wait(self, timeout: float | None) -> bool:
        with self._cond:
            if not self._flag:
                self._cond.wait(timeout)
            return self._flag

    def check(self) -> None:
        """Called on each rescan: restart a failed watch (watchers override)."""
