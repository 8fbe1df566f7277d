"""The live view behind ``spoolq top``: looks at a spool taken as it
changes, through the port alone (counts, the workers' registrations, the
running jobs, the latest failures), with enqueue and finish rates worked
out from how the counts move. Printing it is output.py's.

A look reads no waiting job's file: the waiting jobs are counted by name
(as ``status`` counts them); the records read are the running jobs' and
the few latest failures'. A look is taken when the spool's events say it changed
(inotify; LISTEN on PostgreSQL), at most once per ``interval``, and on a
slow ``tick`` without events, so that ages and rates move on.
"""

from __future__ import annotations

import collections
import select
import time
from typing import Any, Iterable

from .record import parse_time

#: Seconds of counts the rates are taken over.
RATE_WINDOW = 60.0
#: A look without events at least this often (seconds), for the ages.
TICK = 5.0
FAILURES = 5


def last_line(spool: Any, job_id: str, tails: dict[str, tuple[int, str | None]]) -> str | None:
    """The last line a running job has written to its stdout so far, read
    on from where the previous look left off (``tails``: job id ->
    (offset, line))."""
    offset, line = tails.get(job_id, (0, None))
    try:
        got = spool.output(job_id, "stdout", offset)
    except Exception:  # (the job ended meanwhile; output not this user's to read) nothing new to say
        return line
    if got:
        data, offset = got
        lines = [text for text in data.decode("utf-8", "replace").replace("\r", "\n").split("\n") if text.strip()]
        line = lines[-1] if lines else line
    tails[job_id] = (offset, line)
    return line


def _epoch(value: Any) -> float | None:
    try:
        return parse_time(value) if value is not None else None
    except (ValueError, TypeError):
        return None


def _what(job: dict[str, Any]) -> str:
    """What a job runs, in a few words."""
    if job.get("command"):
        return str(job["command"])
    if isinstance(job.get("argv"), list):
        return " ".join(str(a) for a in job["argv"])
    if job.get("kind"):
        return f"kind={job['kind']}"
    return ""


def _failed_at(job: dict[str, Any]) -> float | None:
    """When a job's last run failed (or it was set aside as dead)."""
    history = job.get("history")
    last = history[-1] if isinstance(history, list) and history and isinstance(history[-1], dict) else {}
    return _epoch(last.get("end")) or _epoch(job.get("finished_at")) or _epoch(job.get("mtime"))


class View:
    """A spool's live view (``Spool.view``): ``look()`` takes one;
    ``wait(also)`` returns when the next is due (None), or the first of the
    descriptors ``also`` that became readable (a terminal's keys)."""

    def __init__(self, spool: Any, interval: float = 1.0, rows: int = 20, failures: int = FAILURES,
                 tick: float = TICK):
        self.spool = spool
        self.interval = interval
        self.tick = max(tick, interval)
        self.rows = rows
        self.failures = failures
        self._samples: collections.deque = collections.deque()
        self._tails: dict[str, tuple[int, str | None]] = {}
        self._watch: Any = None
        self._looked = 0.0

    # -- events ------------------------------------------------------------------

    def open(self) -> "View":
        """Watch the spool (what cannot be watched is seen on the tick)."""
        try:
            self._watch = self.spool.backend.control().watch("view")
        except Exception:  # (no inotify left; a database out of reach) the tick alone
            self._watch = None
        return self

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def __enter__(self) -> "View":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait(self, also: Iterable[int] = ()) -> int | None:
        """Sleep until a look is due: an event (no sooner than ``interval``
        after the last look) or the tick. Returns None then, or a
        descriptor of ``also`` as soon as it is readable."""
        also = list(also)
        changed = False
        while True:
            now = time.monotonic()
            due = self._looked + (self.interval if changed else self.tick)
            if now >= due:
                return None
            watching = [] if changed or self._watch is None else [self._watch.fileno()]
            ready = select.select(also + watching, [], [], due - now)[0]
            for fd in also:
                if fd in ready:
                    return fd
            if watching and watching[0] in ready:
                changed = self._changed()

    def _changed(self) -> bool:
        try:
            named = self._watch.read(0)
        except Exception:  # the watch broke (a database restarted): the tick alone until a new one works
            self.close()
            self.open()
            return True
        return named is None or bool(named)

    # -- a look ------------------------------------------------------------------

    def look(self) -> dict[str, Any]:
        """The spool as of now (see output.top_lines for what is shown)."""
        spool, now = self.spool, time.time()
        self._looked = time.monotonic()
        counts = spool.status()
        purged = counts.get("dead_purged") or 0
        finished = counts["done"] + counts["dead"] + purged
        total = finished + counts["new"] + counts["cur"] + counts["failed"] + (counts.get("dropped") or 0)
        left = spool.backend.leftovers()
        return {
            "at": now, "location": spool.location, "counts": counts, "paused": counts.get("paused"),
            "rates": self._rates(self._looked, total, finished),
            "workers": counts.get("workers") or [], "workers_seen": counts.get("workers_seen", True),
            "running": self._running(counts.get("workers") or [], now),
            "next_retry": left.get("next_retry"),
            "failures": self._failures(),
        }

    def _rates(self, at: float, total: int, finished: int) -> dict[str, float | None]:
        """Jobs enqueued and finished per second over the last RATE_WINDOW
        seconds of looks (None until two looks a second apart)."""
        samples = self._samples
        samples.append((at, total, finished))
        while len(samples) > 2 and at - samples[1][0] >= RATE_WINDOW:
            samples.popleft()
        first = samples[0]
        span = at - first[0]
        if span < 1.0:
            return {"enqueued": None, "finished": None, "over": None}
        # A count that goes down (history dropped, a dead job retried) adds nothing.
        return {"enqueued": max(0, total - first[1]) / span, "finished": max(0, finished - first[2]) / span,
                "over": span}

    def _running(self, workers: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
        runs = {job_id: (w.get("worker"), entry) for w in workers for job_id, entry in (w.get("jobs") or {}).items()}
        running = []
        for job in self.spool.list("cur", limit=self.rows):
            job_id = job.get("id")
            worker, entry = runs.get(job_id, (job.get("worker"), {}))
            started = _epoch((entry or {}).get("started_at"))
            running.append({"id": job_id, "worker": worker, "age": None if started is None else max(0.0, now - started),
                            "attempt": (entry or {}).get("attempt"), "what": _what(job),
                            "abandoned": bool(job.get("abandoned")), "line": last_line(self.spool, job_id, self._tails)})
        shown = {r["id"] for r in running}
        for job_id in [j for j in self._tails if j not in shown]:
            del self._tails[job_id]
        return running

    def _failures(self) -> list[dict[str, Any]]:
        """The latest jobs to go dead or fail a run, newest first."""
        found = []
        for state in ("dead", "failed"):
            for job in self.spool.backend.recent(state, self.failures):
                found.append({"id": job.get("id"), "state": state, "at": _failed_at(job),
                              "error": job.get("error"), "attempts": job.get("attempts"),
                              "due": _epoch(job.get("due_at")) if state == "failed" else None})
        found.sort(key=lambda f: f["at"] or 0.0, reverse=True)
        return found[:self.failures]
