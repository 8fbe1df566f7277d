"""The storage a worker runs jobs from: ``Store``, the narrow interface the
worker loop and its group commit use, and ``DirStore``, the spool
directory's implementation of it.

The worker sees jobs only through these operations: list the due ones,
claim one (prepare it, then take it), record a run's outcome (finish it,
staged or at once; complete a staged one; put a never-started one back),
make outcomes durable (sync staged records, sync the deferred moves), and
keep its registration (the runs it has under way, for recovery). What a
claim holds is opaque to the worker: it reads the job, its id and its
attempt, and hands the claim back to the store for everything else. Another
kind of spool (a database table) implements the same operations.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from . import recovery, transitions
from .pickup import Pickup, PickupReport
from .protocol import Entry, Scan
from .registry import Registration, read_passed, write_passed, write_unhandled
from .runner import Outcome
from .waker import Waker
from .watcher import make_waker

Claimed = transitions.Claimed
WRITER_GRACE = transitions.WRITER_GRACE  # how long a file cut short in new/ is left for its writer (see on_later)
OnQuarantine = Callable[[str, str], None]
OnBusy = Callable[[], None]
OnLater = Callable[[str, int], None]
_NOTHING = PickupReport()


class Store(Protocol):
    """What the worker loop needs of a spool."""

    settings: Any  # the shared config.Settings (reloaded in place on SIGHUP)
    root: str  # where the spool is, for a job's environment (SPOOLQ_SPOOL)
    durable: bool  # whether outcomes wait for a sync before they are logged (fsync on)

    def open(self) -> None: ...
    def register(self, kinds: list[str]) -> Registration: ...
    def note_unhandled(self, worker_id: str, kinds: list[str], waiting: dict[str, int]) -> None: ...
    def passed_over(self) -> dict[tuple[str, str, int], str]: ...
    def note_passed(self, passed: dict[tuple[str, str, int], str]) -> None: ...
    def waker(self, poll: float | None, log: Any) -> Waker: ...
    def recover(self) -> tuple[recovery.RecoveryReport, int]: ...
    def pickup(self, log: Callable[[str, int, Any], None]) -> PickupReport: ...
    def scan(self, now_ns: int, limit: int) -> Scan: ...
    def prefetch(self, entries: list[Entry]) -> None: ...
    def slow_reads(self) -> int: ...
    def count_workers(self) -> int: ...
    def count_done(self) -> int: ...
    def prepare(self, entry: Entry, now_ns: int, on_quarantine: OnQuarantine, on_busy: OnBusy,
                on_later: OnLater) -> Claimed | None: ...
    def take(self, ready: Claimed, now_ns: int, on_quarantine: OnQuarantine) -> Claimed | None: ...
    def release(self, claimed: Claimed) -> None: ...
    def where(self, claimed: Claimed) -> str: ...
    def finish(self, claimed: Claimed, out: Outcome, worker_id: str) -> tuple[str, float | None, bool]: ...
    def unclaim(self, claimed: Claimed) -> str: ...
    def sync_staged(self, staged: list[Claimed]) -> None: ...
    def complete(self, claimed: Claimed, dest: str, due: float | None) -> None: ...
    def drop_staged(self, claimed: Claimed) -> None: ...
    def has_deferred(self) -> bool: ...
    def unsynced_since(self) -> float: ...
    def sync_deferred(self) -> None: ...
    def control(self) -> Any: ...
    def close(self) -> None: ...


class DirStore:
    """``Store`` over a spool directory: the moves are transitions.py's,
    the files and syncs protocol.py's."""

    def __init__(self, ctx: transitions.Context):
        self.ctx = ctx
        self.dir = ctx.spool
        self.settings = ctx.settings
        self.root = ctx.spool.root
        self._pickup: Pickup | None = None

    @property
    def durable(self) -> bool:
        return self.dir.fsync  # (follows the settings on reload)

    def open(self) -> None:
        self.dir.open(create=True)

    def register(self, kinds: list[str]) -> Registration:
        """This worker's registration, saying which handler kinds it runs."""
        registration = Registration(self.dir, kinds=kinds)
        registration.open()
        return registration

    def note_unhandled(self, worker_id: str, kinds: list[str], waiting: dict[str, int]) -> None:
        """Tell status, list and show which due handler jobs wait for a
        worker with a handler (see registry.write_unhandled)."""
        write_unhandled(self.dir, worker_id, kinds, waiting)

    def passed_over(self) -> dict[tuple[str, str, int], str]:
        """The due handler jobs the last worker left waiting for want of a
        handler, by (folder, name, due time): their kinds."""
        return read_passed(self.dir)

    def note_passed(self, passed: dict[tuple[str, str, int], str]) -> None:
        write_passed(self.dir, passed)

    def waker(self, poll: float | None, log: Any) -> Waker:
        """What wakes a watching worker when jobs arrive: the folder watcher (or polling)."""
        return make_waker(self.dir, poll=poll, log=log)

    def recover(self) -> tuple[recovery.RecoveryReport, int]:
        """Recover dead workers' jobs; returns the report and how many stale tmp/ files went."""
        report = recovery.recover(self.ctx)
        removed = self.dir.remove_tmp()
        self.dir.remove_stale_spares()
        if self.dir.shared:
            removed += self.dir.drops.remove_stale()
        return report, removed

    def pickup(self, log: Callable[[str, int, Any], None]) -> PickupReport:
        """Take in what members dropped (a shared spool's drop/), a batch
        per call; nothing to do in a private spool."""
        if not self.dir.shared:
            return _NOTHING
        if self._pickup is None:
            self._pickup = Pickup(self.ctx, log)
        return self._pickup.run()

    def scan(self, now_ns: int, limit: int) -> Scan:
        return self.dir.scan(now_ns, limit)

    def prefetch(self, entries: list[Entry]) -> None:
        self.dir.prefetch(entries)

    def slow_reads(self) -> int:
        return self.dir.slow_reads

    def count_workers(self) -> int:
        return self.dir.count("workers")

    def count_done(self) -> int:
        return self.dir.count("done")

    def prepare(self, entry: Entry, now_ns: int, on_quarantine: OnQuarantine, on_busy: OnBusy,
                on_later: OnLater) -> Claimed | None:
        return transitions.prepare(self.ctx, entry, now_ns, on_quarantine, on_busy, on_later)

    def take(self, ready: Claimed, now_ns: int, on_quarantine: OnQuarantine) -> Claimed | None:
        return transitions.take(ready, now_ns, on_quarantine)

    def release(self, claimed: Claimed) -> None:
        claimed.held.release()

    def where(self, claimed: Claimed) -> str:
        return claimed.held.folder

    def finish(self, claimed: Claimed, out: Outcome, worker_id: str) -> tuple[str, float | None, bool]:
        """Record the outcome; returns (state, due time, staged). Staged
        (fsync on): the new record waits beside the job in cur/ for
        sync_staged and complete; else the job has moved on, its folders'
        sync deferred when fsync is on."""
        defer = self.dir.fsync
        dest, due = transitions.finish(self.ctx, claimed, out, worker_id, defer_sync=defer, stage=defer)
        return dest, due, claimed.held.staged is not None

    def unclaim(self, claimed: Claimed) -> str:
        return transitions.unclaim(claimed)

    def sync_staged(self, staged: list[Claimed]) -> None:
        self.dir.sync_data([claimed.held.staged[1] for claimed in staged])

    def complete(self, claimed: Claimed, dest: str, due: float | None) -> None:
        transitions.complete(claimed.held, dest, due)

    def drop_staged(self, claimed: Claimed) -> None:
        claimed.held.drop_staged()

    def has_deferred(self) -> bool:
        return self.dir.has_deferred

    def unsynced_since(self) -> float:
        return self.dir.unsynced_since

    def sync_deferred(self) -> None:
        self.dir.sync_deferred()

    def control(self) -> Any:
        """The control channel's transport (see control.Channel)."""
        from .dircontrol import ControlDir  # imported here: start-up speed (as the watcher)

        answering: Pickup | None = None

        def answer() -> None:
            nonlocal answering
            answering = answering or Pickup(self.ctx)
            answering.answer_requests()

        return ControlDir(self.dir, answer)

    def close(self) -> None:
        self.dir.drop_spares()
