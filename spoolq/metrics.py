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


def _family(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]]) -> list[str]:
    """One metric family: HELP, TYPE, then a line per (extra labels, value)."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{labels}}} {value}" for labels, value in samples]
    return lines


def prometheus_text(spool: Any) -> str:
    data = collect(spool)
    spool_label = f'spool="{_escape(spool.path)}"'

    def labelled(key: str, values: dict[str, Any]) -> list[tuple[str, Any]]:
        return [(f'{spool_label},{key}="{k}"', v) for k, v in values.items()]

    out: list[str] = []
    out += _family("spoolq_jobs", "gauge", "Jobs in each state folder (done: files not yet compacted).",
                   labelled("state", data["states"]))
    out += _family("spoolq_jobs_compacted", "gauge", "Finished jobs folded into index.db.",
                   [(spool_label, data["compacted"])])
    out += _family("spoolq_oldest_due_job_age_seconds", "gauge",
                   "How long the oldest due job in new/ or failed/ has been due (0: none).",
                   [(spool_label, f"{data['oldest_due_age']:.3f}")])
    out += _family("spoolq_workers", "gauge", "Live workers on this spool.", [(spool_label, len(data["workers"]))])
    out += _family("spoolq_running_jobs", "gauge", "Jobs the live workers are running.",
                   [(spool_label, sum(len(w.get("jobs") or {}) for w in data["workers"]))])
    out += _family("spoolq_finished_jobs_total", "counter", "Jobs finished in done/ and index.db, by outcome.",
                   labelled("outcome", data["finished"]))
    out += _family("spoolq_runs_total", "counter", "Runs of finished jobs, by result.", labelled("result", data["runs"]))
    return "\n".join(out) + "\n"
