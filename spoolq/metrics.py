"""``spoolq status --prometheus``: the text exposition format, for
node_exporter's textfile collector (see contrib/cron/spoolq-metrics.crontab).
"""

from __future__ import annotations

import time
from typing import Any

from .protocol import STATES


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def collect(spool: Any) -> dict[str, Any]:
    """The numbers behind the metrics, straight from the folders and index."""

    st = spool.status()
    now_ns = time.time_ns()
    oldest_due: int | None = None
    for state in ("new", "failed"):
        for _, entry in spool.dir.entries(state):
            if entry.st_mtime_ns <= now_ns and (oldest_due is None or entry.st_mtime_ns < oldest_due):
                oldest_due = entry.st_mtime_ns
    finished = {"succeeded": 0, "cancelled": 0}
    runs = {"succeeded": 0, "failed": 0}
    index = spool.index()
    if index is not None:
        counters = index.counters()
        for outcome in finished:
            finished[outcome] += counters.get(f"jobs_{outcome}", 0)
        for result in runs:
            runs[result] += counters.get(f"runs_{result}", 0)
    for name, stat_ in spool.dir.entries("done"):
        job = spool._read_record("done", name, stat_)
        if job.get("outcome") in finished:
            finished[job["outcome"]] += 1
        for h in job.get("history") or []:
            if isinstance(h, dict):
                runs["failed" if h.get("error") else "succeeded"] += 1
    return {
        "states": {s: (st["done_files"] if s == "done" else st[s]) for s in STATES},
        "compacted": st["compacted"],
        "oldest_due_age": max(0.0, (now_ns - oldest_due) / 1e9) if oldest_due is not None else 0.0,
        "workers": st["workers"],
        "finished": finished,
        "runs": runs,
    }


def prometheus_text(spool: Any) -> str:
    data = collect(spool)
    label = f'spool="{_escape(spool.path)}"'
    out = [
        "# HELP spoolq_jobs Jobs in each state folder (done: files not yet compacted).",
        "# TYPE spoolq_jobs gauge",
    ]
    out += [f'spoolq_jobs{{{label},state="{s}"}} {n}' for s, n in data["states"].items()]
    out += [
        "# HELP spoolq_jobs_compacted Finished jobs folded into index.db.",
        "# TYPE spoolq_jobs_compacted gauge",
        f"spoolq_jobs_compacted{{{label}}} {data['compacted']}",
        "# HELP spoolq_oldest_due_job_age_seconds How long the oldest due job in new/ or failed/ has been due (0: none).",
        "# TYPE spoolq_oldest_due_job_age_seconds gauge",
        f"spoolq_oldest_due_job_age_seconds{{{label}}} {data['oldest_due_age']:.3f}",
        "# HELP spoolq_workers Live workers on this spool.",
        "# TYPE spoolq_workers gauge",
        f"spoolq_workers{{{label}}} {len(data['workers'])}",
        "# HELP spoolq_running_jobs Jobs the live workers are running.",
        "# TYPE spoolq_running_jobs gauge",
        f"spoolq_running_jobs{{{label}}} {sum(len(w.get('jobs') or {}) for w in data['workers'])}",
        "# HELP spoolq_finished_jobs_total Jobs finished in done/ and index.db, by outcome.",
        "# TYPE spoolq_finished_jobs_total counter",
    ]
    out += [f'spoolq_finished_jobs_total{{{label},outcome="{o}"}} {n}' for o, n in data["finished"].items()]
    out += [
        "# HELP spoolq_runs_total Runs of finished jobs, by result.",
        "# TYPE spoolq_runs_total counter",
    ]
    out += [f'spoolq_runs_total{{{label},result="{r}"}} {n}' for r, n in data["runs"].items()]
    return "\n".join(out) + "\n"
