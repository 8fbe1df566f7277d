"""One worker's walk over the due jobs of a spool directory: the passes
behind ``DirBackend.claim_next``.

A pass lists the waiting folders once (after taking in what members
dropped, in a shared spool) and claims from that sorted list, so a drain
never lists a folder once per job; a new pass begins only once the list is
used up. Around the claims: the read-ahead of files gone cold (``ReadAhead``),
the -j 1 look-ahead (the next job prepared -- locked, read, validated --
while the current one runs, so that only its rename is left), the handler
jobs of kinds this worker has no handler for (``PassedOver``: read once,
then passed over), and what a pass learns for the worker's wait: the next
due time, files another worker held a moment, files left for their writer.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable

from .. import record
from ..backend import Look
from ..output import field, quoted
from . import transitions, waits
from .ordering import Locks, Order
from .pickup import Pickup
from .protocol import Entry, SpoolDir, id_of, id_problem
from .registry import read_passed, write_passed, write_unhandled
from .transitions import WRITER_GRACE, Claimed, Context

Log = Callable[[str, int, "int | None"], None]
READ_AHEAD = 256  # a pass whose files went cold is read ahead by up to this many files ...
PROBE_CLAIMS = 64  # ... once an eighth of this many claims in a row waited for the disk
FOREIGN_AHEAD = 64  # entries the look-ahead may pass over as handler jobs this worker cannot run
LOCK_RECHECK = 2.0  # seconds: a due job waiting for a lock is looked at again at least this often (a drain; a watching worker is woken at once)


def _by_priority(order: Order, entries: list[Entry], marks: dict[str, int]) -> list[Entry]:
    """A pass's entries ordered by priority (highest first), then as the
    scan ordered them (due time, name); markers whose jobs are gone are
    removed now and then."""
    first, plain, last = [], [], []
    seen = set()
    for entry in entries:
        p = marks.get(entry.name, 0)
        if p:
            seen.add(entry.name)
            (first if p > 0 else last).append((-p, entry))
        else:
            plain.append(entry)
    if len(seen) < len(marks) and random.random() < 0.05:
        order.drop_stale_priorities(marks, seen)
    first.sort()
    last.sort()
    return [e for _, e in first] + plain + [e for _, e in last]


def named(name: str) -> str:
    """A file in a log line: ``job=ID`` when its name is an id's file (as
    every line about a job names it), else ``file=NAME``."""
    job_id = id_of(name)
    return f"job={job_id}" if id_problem(job_id) is None else f"file={field(name)}"


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

    def __init__(self, spool: SpoolDir, entries: list[Entry]):
        self.spool = spool
        self.entries = entries
        self.on = False
        self.read_to = 0  # entries before this index were handed to prefetch
        self.slow_seen = spool.slow_reads
        self.next_probe = PROBE_CLAIMS

    def before(self, pos: int) -> None:
        """Called before ``entries[pos]`` is claimed."""
        if not self.on:
            if pos < self.next_probe:
                return
            reads = self.spool.slow_reads
            slow, self.slow_seen = reads - self.slow_seen, reads
            self.next_probe = pos + PROBE_CLAIMS
            if slow * 8 < PROBE_CLAIMS:
                return
            self.on = True
        if self.read_to - pos < READ_AHEAD // 2:
            start = max(self.read_to, pos)
            self.read_to = min(len(self.entries), pos + READ_AHEAD)
            self.spool.prefetch(self.entries[start:self.read_to])




class PassedOver:
    """The due handler jobs a worker has no handler for, left waiting,
    untouched, for a worker that has one: each is read once, then passed
    over by its (folder, name, due time) without a read. A pass keeps the
    ones it met for the next; any change of the file (a rewrite, ``touch
    -d``) changes its due time, and it is read again. workers/.passed keeps them
    from one worker to the next (``load``, ``save``): a worker a minute
    from cron reads each such file once, not once a minute."""

    def __init__(self) -> None:
        self.now: dict[tuple[str, str, int], str] = {}  # this pass's, by key: their kind
        self.before: dict[tuple[str, str, int], str] = {}  # the pass before's not met again yet
        self.told: set[str] = set()  # the kinds logged already
        self.loaded: dict[tuple[str, str, int], str] = {}  # what the last worker left

    def load(self, spool: SpoolDir, kinds: list[str]) -> None:
        """Take what the last worker passed over, but the kinds this one runs."""
        try:
            self.loaded = read_passed(spool)
        except Exception:  # (only a cache: every file is read again)
            self.loaded = {}
        self.now.update((key, kind) for key, kind in self.loaded.items() if kind not in kinds)

    def save(self, spool: SpoolDir) -> None:
        """Leave the ones met (or loaded and not yet met) to the next worker."""
        passed = {**self.before, **self.now}
        if passed != self.loaded:
            try:
                write_passed(spool, passed)
            except Exception:
                pass  # the next worker reads them again

    def __bool__(self) -> bool:
        return bool(self.now or self.before)

    def new_pass(self) -> None:
        self.before, self.now = self.now, {}

    def known(self, entry: Entry) -> bool:
        key = (entry.state, entry.name, entry.due_ns)
        kind = self.now.get(key) or self.before.pop(key, None)
        if kind is None:
            return False
        self.now[key] = kind
        return True

    def unknown(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` but the ones known to be passed over (kept as met)."""
        before, now = self.before, self.now
        kept = []
        for entry in entries:
            key = (entry.state, entry.name, entry.due_ns)
            kind = before.pop(key, None)
            if kind is None:
                kept.append(entry)
            else:
                now[key] = kind
        return kept

    def add(self, entry: Entry, kind: str) -> None:
        self.now[(entry.state, entry.name, entry.due_ns)] = kind

    def waiting(self) -> dict[str, int]:
        """This pass's, counted by kind."""
        counts: dict[str, int] = {}
        for kind in self.now.values():
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def tell(self, spool: SpoolDir, log: Log, wid: str, kinds: list[str]) -> None:
        """After a pass: log each kind left waiting (once per worker), and
        leave the counts in workers/ for status, list and show."""
        waiting = self.waiting()
        for kind in sorted(set(waiting) - self.told):
            self.told.add(kind)
            log(f"kind={field(kind)} waiting={waiting[kind]} left waiting: this worker has no "
                "handler for that kind (spoolq work --app MODULE:ATTR, or spoolq config set app MODULE)", 1,
                logging.WARNING)
        try:
            write_unhandled(spool, wid, kinds, waiting)
        except Exception as e:  # only a note for status: never stop the worker for it
            log(f"cannot write workers/.unhandled: {e}", 2, None)




class Pass:
    """A worker's passes over the due jobs: ``claim_next`` claims the next
    one of the current pass, or returns None once the pass is used up (the
    next call begins a new one); ``look`` says what the pass learnt for the
    worker's wait. Logs through ``log`` (the worker puts its id in front)."""

    def __init__(self, ctx: Context, kinds: list[str] | None, worker_id: str, scan_limit: int, log: Log,
                 order: Order | None = None):
        self.ctx = ctx
        self.dir: SpoolDir = ctx.spool
        self.kinds = kinds
        self.worker_id = worker_id
        self.scan_limit = scan_limit
        self.log = log
        self.entries: list[Entry] = []
        self.pos = 0
        self.read_ahead = ReadAhead(self.dir, self.entries)
        self.fresh = True  # the next claim begins a new pass
        # The next entry of the pass, prepared while the current job runs.
        self._ahead: tuple[Entry, Claimed | None] | None = None
        self._next_due: int | None = None
        self._busy = 0  # due files another process held when we tried them
        # When the first file this pass left for its writer to finish (see
        # transitions.WRITER_GRACE) is to be looked at again: no event may
        # come to say so. And the (name, time) already logged, to log each once.
        self._later_ns: int | None = None
        self._later_logged: set[tuple[str, int]] = set()
        self._pickup: Pickup | None = None
        self._pickup_more = False  # the last pickup left entries of drop/ for the next pass
        self._pickup_failures: set[str] = set()  # told once per run each (a full disk would fail every pass)
        self.passed_over = PassedOver()  # handler jobs of kinds it has no handler for
        if kinds is not None:
            self.passed_over.load(self.dir, kinds)
        self.order = order if order is not None else Order(self.dir)
        self.locks = Locks(self.order, ctx.settings)
        self._lock_waits = False  # a due job waits for a lock: a drain waits for it too
        self._marks: dict[str, int] = {}  # the priorities of this pass (file name -> priority)
        self._busy_priority: int | None = None  # the priority of a job another worker held this pass
        self._reorder = False  # a job met with a priority it was not ordered by: a new pass at once

    # -- claims ----------------------------------------------------------------

    def claim_next(self) -> Claimed | None:
        if self.fresh:
            self.fresh = False
            self._scan()
        entries = self.entries
        marks = self._marks
        while self.pos < len(entries):
            self.read_ahead.before(self.pos)
            entry = entries[self.pos]
            if marks and self._busy_priority is not None and marks.get(entry.name, 0) < self._busy_priority:
                # A job of a higher priority is held by another worker (its
                # look-ahead): look again soon rather than start this one first.
                break
            self.pos += 1
            busy = self._busy
            claimed = self._claim(entry)
            if claimed is not None:
                return claimed
            if self._busy > busy and marks:
                self._busy_priority = marks.get(entry.name, 0)
        self.fresh = True
        if self.kinds is not None:  # (a relay takes every kind: it leaves no note of kinds)
            self.passed_over.tell(self.dir, self.log, self.worker_id, self.kinds)
        return None

    def look(self) -> Look:
        later = None if self._later_ns is None else self._later_ns / 1e9
        if self._lock_waits:  # woken by Locks the moment a lock is let go; this is only a backstop
            later = min(later, time.time() + LOCK_RECHECK) if later is not None else time.time() + LOCK_RECHECK
        return Look(due=None if self._next_due is None else self._next_due / 1e9, busy=self._busy > 0,
                    later=later, more=self._pickup_more or self._reorder)

    def _scan(self) -> None:
        """List the due entries for a new pass."""
        self._busy = 0
        self._later_ns = None
        self._pick_up()
        self.passed_over.new_pass()
        scan = self.dir.scan(time.time_ns(), self.scan_limit)
        self._next_due = scan.next_due_ns
        self.log(f"scan due={len(scan.due)}", 2, None)
        self._lock_waits = False
        entries = self.passed_over.unknown(scan.due) if self.passed_over.before else scan.due
        marks = self._marks = self.order.priorities()  # (an empty order/prio/, or none: priorities unused)
        self._busy_priority = None
        self._reorder = False
        self.entries = _by_priority(self.order, entries, marks) if marks else entries
        self.pos = 0
        self.read_ahead = ReadAhead(self.dir, self.entries)

    def _claim(self, entry: Entry) -> Claimed | None:
        if self.passed_over and self.passed_over.known(entry):
            return None  # (the look-ahead may have passed over it to the next job)
        try:
            ahead = self._ahead
            if ahead is not None and ahead[0] is entry:  # prepared while the last job ran
                self._ahead = None
                ready = ahead[1]
            else:
                self.drop_ahead()
                ready = self._prepare(entry)
            if ready is not None and not record.ORDERING_FIELDS.isdisjoint(ready.job):
                ready = self._gate(ready)
            return transitions.take(ready, time.time_ns(), self.on_quarantine) if ready is not None else None
        except Exception as e:  # a claim never takes the worker down; the file stays put
            self.log(f"{named(entry.name)} cannot claim it from {entry.state}/: {type(e).__name__}: {e}", 0, None)
            return None

    def _prepare(self, entry: Entry) -> Claimed | None:
        """A due entry locked, read and validated, or None; a handler job of
        a kind this worker has no handler for is let go at once, before any
        attempt counts (see PassedOver)."""
        if self.passed_over.known(entry):
            return None
        ready = transitions.prepare(self.ctx, entry, time.time_ns(), self.on_quarantine, self.on_busy, self.on_later)
        if ready is not None:
            kind = ready.job.get("kind")
            if kind is not None and self.kinds is not None and kind not in self.kinds:
                ready.held.release()
                self.passed_over.add(entry, kind)
                return None
        return ready

    def _gate(self, ready: Claimed) -> Claimed | None:
        """A job whose record says held, names dependencies or holds locks:
        held ones (a file dropped so) go to held/; one with a dependency
        unfinished goes to waiting/ (one unknown, dead or cancelled: to
        dead/); one whose lock is taken is let go for now (no attempt), the
        lock waited for without polling. Else ready, its lock slots taken."""
        job = ready.job
        priority = record.priority_of(job)
        if priority and self._marks.get(ready.held.name) != priority:
            # Dropped by hand with a priority and no marker: marked now,
            # and the pass ends here so that the next orders it by it.
            self.order.mark_priority(ready.job_id, priority)
            ready.held.release()
            self.pos = len(self.entries)
            self._reorder = True
            return None
        if job.get("held") is True and ready.origin == "new":
            ready.held.move("held", keep_name=True)
            ready.held.release()
            return None
        if job.get("unique") is not None and job.get("state") in (None, "new"):
            # A file dropped by hand takes its key here (an enqueued job holds it already).
            holder = self.order.with_key(job["unique"], ready.job_id, lambda: None)
            if holder is not None:
                reason = f"its unique key is held by job {holder}, which has not finished"
                transitions.quarantine(self.ctx, ready.held, reason)
                self.on_quarantine(ready.held.name, reason)
                return None
        if job.get("after") is not None:
            parked = waits.park(self.ctx, self.order, ready, self._history)
            if parked is not None:
                self.log(f"{named(ready.held.name)} {parked}", 1, None)
                return None
        names = record.locks_of(job)
        if names:
            fds, taken = self.locks.acquire(names, ready.job_id)
            if fds is None:
                ready.held.release()
                self._lock_waits = True
                self.locks.wait_for(taken)
                return None
            ready.locks = fds
        return ready

    def _history(self, job_id: str) -> dict | None:
        return self.ctx.index_get(job_id)

    # -- the -j 1 look-ahead ------------------------------------------------------

    def look_ahead(self) -> None:
        """Prepare the next entry of the pass (lock, read, validate) so
        that only its rename is left once the running job ends. Nothing
        changes on disk, so a crash leaves nothing to recover; a slow job
        lets it go after the hold (``drop_ahead``). Handler jobs this worker
        cannot run are passed over (a few at a time), so that the next job
        it can run is the one prepared."""
        if self._ahead is not None or self.fresh:
            return
        for entry in self.entries[self.pos:self.pos + FOREIGN_AHEAD]:
            try:
                ready = self._prepare(entry)
            except Exception:
                return  # claimed the usual way, which says what failed
            if ready is None and self.passed_over.known(entry):
                continue
            self._ahead = (entry, ready)
            return

    def drop_ahead(self) -> None:
        """Let the prepared job go: only its lock, nothing was moved."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[1] is not None:
            ahead[1].held.release()

    # -- what a pass meets -----------------------------------------------------

    def on_busy(self) -> None:
        self._busy += 1

    def on_later(self, name: str, when_ns: int) -> None:
        if self._later_ns is None or when_ns < self._later_ns:
            self._later_ns = when_ns
        if (name, when_ns) in self._later_logged:
            return
        if len(self._later_logged) > 1000:
            self._later_logged.clear()
        self._later_logged.add((name, when_ns))
        wait = max(0.0, when_ns / 1e9 - time.time())
        self.log(f"{named(name)} not a whole job yet and changed less than {WRITER_GRACE:g}s ago: left in new/ "
                 f"for its writer to finish, looked at again in {wait:.1f}s (a file written in tmp/ and renamed "
                 "into new/ never waits)", 1, None)

    def on_quarantine(self, name: str, reason: str) -> None:
        self.log(f"{named(name)} outcome=dead state=dead error={quoted(reason)}", 0, None)

    def _pick_up(self) -> None:
        """Take in a batch of what members dropped (shared spools), before
        the scan that then finds those jobs."""
        self._pickup_more = False
        if not self.dir.shared:
            return
        try:
            if self._pickup is None:
                self._pickup = Pickup(self.ctx, self.log)
            report = self._pickup.run()
        except Exception as e:  # the dropped files stay where they are, for the next pass
            said = f"{type(e).__name__}: {e}"
            if said not in self._pickup_failures and len(self._pickup_failures) < 100:
                self._pickup_failures.add(said)
                self.log(f"pickup failed: {said} (the files stay in drop/; told once per run)", 0, None)
            return
        self._pickup_more = report.more
        if report.later_ns is not None and (self._later_ns is None or report.later_ns < self._later_ns):
            self._later_ns = report.later_ns
        if report.picked or report.dead or report.answered:
            self.log(f"picked up {report.picked} jobs from drop/, moved {report.dead} to dead/, "
                     f"answered {report.answered} requests", 2, None)

    def end(self) -> None:
        """As the worker ends: let the prepared job go; leave what it passed over to the next worker."""
        self.drop_ahead()
        if self.kinds is not None:
            self.passed_over.save(self.dir)
