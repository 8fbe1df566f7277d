"""Wake-ups for ``spoolq work --watch``: filesystem events are hints only.

The folder listing is the truth. An event only wakes the dispatcher, which
then lists the waiting folders itself; so does the timer for the next due
time and a periodic full rescan (``rescan_interval``, or ``--poll``). A lost,
late, duplicated or overflowed event therefore costs at most one rescan
interval, never a job.

Claims must not stall pickup. watchdog holds each IN_MOVED_FROM for half a
second, hoping to pair it with its IN_MOVED_TO, and its queue delivers
events in order: every event behind a held one waits too. A claim (new/ ->
cur/) is such a move. Watching the whole spool is not enough: when the two
halves of a move arrive in separate reads, watchdog's queue sleeps out the
whole half second even after pairing them (``spoolq bench --section
latency`` shows the difference: "paired" against "new"). spoolq never needs pairs (a file arriving in
new/ is all it wants to know), so its observer uses a grouper with no delay:
an unpaired move into new/ comes through at once as a created event. The
watch covers only new/ and failed/, filtered to created and moved events,
and the handler only sets a flag.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from .. import procs
from .protocol import SpoolDir
from ..output import Log
from ..waker import Waker

WAKING_FOLDERS = ("new", "failed")
DEGRADED_RESCAN = 2.0  # seconds between rescans when inotify cannot be had


class PollWaker(Waker):
    """No events: rescan every ``interval`` seconds (network filesystems)."""

    def __init__(self, interval: float):
        super().__init__()
        self.rescan_interval = interval


class _Overflow(logging.Handler):
    """watchdog >= 7.1 reports an inotify queue overflow only as a log line."""

    def __init__(self, waker: "InotifyWaker"):
        super().__init__(logging.WARNING)
        self.waker = waker

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            self.waker.overflows += 1
            self.waker.wake()


class InotifyWaker(Waker):
    """Wakes on files renamed, linked or created into new/ or failed/."""

    def __init__(self, spool: SpoolDir, log: Log, scope: str = "new"):
        super().__init__()
        self.spool = spool
        self.log = log
        self.scope = scope  # "new" (default), "paired" (stock watchdog), "root" (whole spool)
        self.events = 0
        self.overflows = 0
        self._observer: Any = None
        self._identity: tuple[int, int] | None = None
        self._unavailable = False
        self._overflow_handler = _Overflow(self)
        self._lock = threading.Lock()
        # In a shared spool drop/ too: a member's job is picked up at once.
        self._folders = WAKING_FOLDERS + (("drop",) if spool.shared else ())
        self._paths = tuple(os.path.join(spool.root, f) + os.sep for f in self._folders)

    def _identity_now(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.spool.root, "new"))
            return st.st_dev, st.st_ino
        except OSError:
            return None

    def start(self) -> None:
        logging.getLogger("watchdog.observers.inotify_c").addHandler(self._overflow_handler)
        self._start_observer()

    def _start_observer(self) -> None:
        from watchdog.events import FileCreatedEvent, FileMovedEvent, FileSystemEventHandler

        waker = self
        paths = self._paths

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event) -> None:  # runs on the observer thread: O(1)
                target = getattr(event, "dest_path", "") or event.src_path
                if isinstance(target, bytes):
                    target = os.fsdecode(target)
                if target.startswith(paths) and not os.path.basename(target).startswith("."):
                    waker.events += 1
                    waker.wake()

        observer = _make_observer(no_delay=self.scope != "paired")
        try:
            # (watchdog starts a thread as it schedules, and more as it starts.)
            with procs.signals_to_main_thread():
                if self.scope == "root":
                    observer.schedule(Handler(), self.spool.root, recursive=True,
                                      event_filter=[FileCreatedEvent, FileMovedEvent])
                else:
                    for folder in self._folders:
                        observer.schedule(Handler(), os.path.join(self.spool.root, folder), recursive=False,
                                          event_filter=[FileCreatedEvent, FileMovedEvent])
                observer.start()
        except OSError as e:
            # No inotify here (watch limit, instance limit, unsupported
            # filesystem): degrade to frequent timed rescans, do not die.
            self.rescan_interval = min(self.rescan_interval or DEGRADED_RESCAN, DEGRADED_RESCAN)
            self.log.line(f"watch unavailable ({e}); rescanning every {self.rescan_interval:g}s instead", 0, logging.WARNING)
            self._observer = None
            self._unavailable = True
            return
        self._observer = observer
        self._identity = self._identity_now()
        self.wake()  # scan at once after (re)starting: events before it were missed

    def check(self) -> None:
        """On every rescan: restart a watch that died or whose folder was replaced."""
        with self._lock:
            observer = self._observer
            if self._unavailable:
                return
            if observer is not None and observer.is_alive() and self._identity == self._identity_now():
                return
            if observer is not None:
                self.log.line("watch lost (observer died or new/ replaced); restarting it", 0, logging.WARNING)
                self._stop_observer()
            self._start_observer()

    def _stop_observer(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            try:
                observer.stop()
                observer.join(5)
            except Exception:
                pass

    def stop(self) -> None:
        logging.getLogger("watchdog.observers.inotify_c").removeHandler(self._overflow_handler)
        with self._lock:
            self._stop_observer()


def _make_observer(no_delay: bool):
    """A watchdog observer; with ``no_delay``, one whose inotify emitters hand
    on move events at once instead of holding them to pair them."""
    from watchdog.observers import Observer

    if not no_delay:
        return Observer()
    try:
        from watchdog.observers.api import DEFAULT_OBSERVER_TIMEOUT, BaseObserver
        from watchdog.observers.inotify import InotifyEmitter
        from watchdog.observers.inotify_move_event_grouper import InotifyMoveEventGrouper
    except ImportError:  # not Linux: the platform's own observer
        return Observer()

    class NoDelayGrouper(InotifyMoveEventGrouper):
        delay = 0

    class NoDelayEmitter(InotifyEmitter):
        def on_thread_start(self) -> None:
            super().on_thread_start()
            group = getattr(self, "_inotify", None)
            if group is not None and hasattr(group, "_move_event_grouper"):
                # Swapped before the emitter thread reads anything; events in
                # this instant are lost, and the scan after start finds them.
                group._move_event_grouper = NoDelayGrouper()

    class NoDelayObserver(BaseObserver):
        def __init__(self) -> None:
            super().__init__(NoDelayEmitter, timeout=DEFAULT_OBSERVER_TIMEOUT)

    return NoDelayObserver()


def make_waker(spool: SpoolDir, poll: float | None, log: Log, scope: str = "new") -> Waker:
    """The waker for a watching worker: polling if asked, else inotify.
    ``scope`` other than "new" is for the benchmark's comparisons: "paired"
    is watchdog's stock pairing behaviour on new/ and failed/, "root" a
    no-delay watch of the whole spool."""
    if poll:
        return PollWaker(poll)
    return InotifyWaker(spool, log, scope=scope)
