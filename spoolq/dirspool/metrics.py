"""The numbers behind ``spoolq status --prometheus`` for a spool directory
(the backend's ``metrics``): every job in the folders read once, at its
copy with the most runs, plus index.db's cumulative counters, which
compaction and ``--keep`` never lower, so a counter never goes down.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .. import record
from .index import histogram_counts, run_counts, run_summary
from .protocol import STATES, NotRegular, id_of

# The order folders are read in: a job moves new -> cur -> failed/dead/done
# (and failed -> cur, dead -> new), so most moves during a scrape go to a
# folder not yet read. A job a move hid is found by listing again.
_SCAN_ORDER = ("new", "failed", "cur", "dead", "done")
_RESCANS = 3


def _read_jobs(backend: Any, limit: int, now_ns: int) -> tuple[dict[str, tuple], int | None]:
    """Every job in the folders once: id -> (folder, outcome, run_summary),
    at its copy with the most runs; and the oldest due time in new/ or
    failed/ (ns)."""
    jobs: dict[str, tuple] = {}
    oldest_due: int | None = None

    def read(state: str, name: str) -> bool:
        try:
            data, st = backend.dir.read(state, name, record.read_size(limit))
        except (FileNotFoundError, NotRegular, OSError):
            return False
        nonlocal oldest_due
        if state in ("new", "failed") and st.st_mtime_ns <= now_ns and (oldest_due is None or st.st_mtime_ns < oldest_due):
            oldest_due = st.st_mtime_ns
        job_id = id_of(name)
        try:
            job = record.parse_sized(data, job_id, limit)
        except (record.InvalidJob, ValueError, RecursionError):
            job = {"id": job_id}  # no runs to count
        summary = run_summary(job)
        outcome = record.as_done(job).get("outcome") if state == "done" else None
        seen = jobs.get(job_id)
        if seen is None or sum(summary[:2]) > sum(seen[2][:2]) or (state == "done" and seen[0] != "done"):
            jobs[job_id] = (state, outcome, summary)
        return True

    for state in _SCAN_ORDER:
        for name in backend.dir.names(state):
            read(state, name)
    for _ in range(_RESCANS):
        found = False
        for state in _SCAN_ORDER:
            for name in backend.dir.names(state):
                if id_of(name) not in jobs:
                    found = read(state, name) or found
        if not found:
            break
    return jobs, oldest_due


def collect(backend: Any, on_problem: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The numbers behind the metrics, straight from the folders and index."""
    st = backend.counts(on_problem)
    now_ns = time.time_ns()
    jobs, oldest_due = _read_jobs(backend, int(backend.settings["max_job_bytes"]), now_ns)
    finished = {"succeeded": 0, "cancelled": 0}
    runs = dict.fromkeys(run_counts({}), 0)
    succeeded = failed = 0
    durations: list[float] = []
    index = backend.index()
    folded: dict[str, dict] = {}
    if index is not None:
        with index.snapshot():  # read after the folders: a job being folded is in one or the other, or both
            counters = index.counters()
            folded = index.records(jobs) if jobs else {}
        for outcome in finished:
            finished[outcome] += counters.get(f"jobs_{outcome}", 0)
        for name in runs:
            runs[name] += counters.get(name, 0)
    for job_id, (state, outcome, summary) in jobs.items():
        stored = folded.get(job_id)
        if stored is not None:
            # Counted in the index already: only what this copy adds (a
            # later copy of the job, left by a compaction killed part way).
            stored_counts = run_counts(stored)
            for name, n in histogram_counts(*summary).items():
                runs[name] += max(0, n - stored_counts.get(name, 0))
            continue
        if outcome in finished:
            finished[outcome] += 1
        succeeded += summary[0]
        failed += summary[1]
        durations += summary[2]
    for name, n in histogram_counts(succeeded, failed, durations).items():
        runs[name] += n
    return {
        "states": {s: (st["done_files"] if s == "done" else st[s]) for s in STATES},
        "compacted": st["compacted"],
        "oldest_due_age": max(0.0, (now_ns - oldest_due) / 1e9) if oldest_due is not None else 0.0,
        "workers": st["workers"],
        "finished": finished,
        "runs": {"succeeded": runs["runs_succeeded"], "failed": runs["runs_failed"]},
        "run_seconds": runs,
    }
