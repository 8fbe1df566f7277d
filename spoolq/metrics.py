"""``spoolq status --prometheus``: the text exposition format, for
node_exporter's textfile collector (see contrib/cron/spoolq-metrics.crontab).

The counters count every run and finished job of the spool's life, from
the records wherever they are (each job's history of runs) plus index.db's
cumulative counters, which compaction and ``--keep`` never lower: each job
counts once, at the most runs any of its copies shows, so a counter never
goes down (Prometheus would read that as a reset).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from . import config, record
from .dirspool.index import RUN_SECONDS_BUCKETS, histogram_counts, run_counts, run_summary
from .dirspool.protocol import STATES, NotRegular, id_of

# The order folders are read in: a job moves new -> cur -> failed/dead/done
# (and failed -> cur, dead -> new), so most moves during a scrape go to a
# folder not yet read. A job a move hid is found by listing again.
_SCAN_ORDER = ("new", "failed", "cur", "dead", "done")
_RESCANS = 3


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _read_jobs(spool: Any, limit: int, now_ns: int) -> tuple[dict[str, tuple], int | None]:
    """Every job in the folders once: id -> (folder, outcome, run_summary),
    at its copy with the most runs; and the oldest due time in new/ or
    failed/ (ns)."""
    jobs: dict[str, tuple] = {}
    oldest_due: int | None = None

    def read(state: str, name: str) -> bool:
        try:
            data, st = spool.dir.read(state, name, record.read_size(limit))
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
        for name in spool.dir.names(state):
            read(state, name)
    for _ in range(_RESCANS):
        found = False
        for state in _SCAN_ORDER:
            for name in spool.dir.names(state):
                if id_of(name) not in jobs:
                    found = read(state, name) or found
        if not found:
            break
    return jobs, oldest_due


def collect(spool: Any, on_problem: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The numbers behind the metrics, straight from the folders and index."""

    st = spool.status(on_problem)
    now_ns = time.time_ns()
    jobs, oldest_due = _read_jobs(spool, int(spool.settings["max_job_bytes"]), now_ns)
    finished = {"succeeded": 0, "cancelled": 0}
    runs = dict.fromkeys(run_counts({}), 0)
    succeeded = failed = 0
    durations: list[float] = []
    index = spool.index()
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


def _family(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]], suffix: str = "") -> list[str]:
    """One metric family: HELP, TYPE, then a line per (extra labels, value)."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{suffix}{{{labels}}} {value}" for labels, value in samples]
    return lines


def _settings_problem(spool: Any) -> str | None:
    """Why config.json cannot be used (None when it can); the spool is then
    read with the default settings, so the metrics still come."""
    try:
        spool.settings  # noqa: B018 - loads config.json
    except config.ConfigError as e:
        spool._settings.use(dict(config.DEFAULTS))
        return str(e)
    return None


def prometheus_text(spool: Any, on_problem: Callable[[str], None] | None = None) -> str:
    """The metrics. A broken config.json does not stop them: it is reported
    as ``spoolq_config_ok 0`` (and to ``on_problem``), the rest read with
    the default settings."""
    problem = _settings_problem(spool)
    if problem is not None and on_problem is not None:
        on_problem(f"{problem} (metrics read with the default settings)")
    data = collect(spool, on_problem)
    spool_label = f'spool="{_escape(spool.path)}"'

    def labelled(key: str, values: dict[str, Any]) -> list[tuple[str, Any]]:
        return [(f'{spool_label},{key}="{k}"', v) for k, v in values.items()]

    out: list[str] = []
    out += _family("spoolq_config_ok", "gauge", "1 if config.json is valid (or absent), 0 if it is not (defaults used).",
                   [(spool_label, 0 if problem else 1)])
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
    out += _family("spoolq_finished_jobs_total", "counter", "Jobs finished (in done/ or index.db), by result.",
                   labelled("result", data["finished"]))
    out += _family("spoolq_runs_total", "counter", "Runs that ended, by result, whatever folder their job is in now.",
                   labelled("result", data["runs"]))
    seconds = data["run_seconds"]
    buckets = [(f'{spool_label},le="{b:g}"', seconds[f"run_seconds_le_{b:g}"]) for b in RUN_SECONDS_BUCKETS]
    buckets.append((f'{spool_label},le="+Inf"', seconds["run_seconds_count"]))
    out += _family("spoolq_run_duration_seconds", "histogram", "How long runs took (start to end).", buckets, "_bucket")
    out.append(f"spoolq_run_duration_seconds_sum{{{spool_label}}} {seconds['run_seconds_sum_us'] / 1e6:.6f}")
    out.append(f"spoolq_run_duration_seconds_count{{{spool_label}}} {seconds['run_seconds_count']}")
    return "\n".join(out) + "\n"
