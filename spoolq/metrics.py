"""``spoolq status --prometheus``: the text exposition format, for
node_exporter's textfile collector (see contrib/cron/spoolq-metrics.crontab).

The counters count every run and finished job of the spool's life (the
backend's ``metrics``: from the records wherever they are, each job once,
plus the history's cumulative counters, which compaction and ``--keep``
never lower), so a counter never goes down (Prometheus would read that as
a reset). This module only formats them.
"""

from __future__ import annotations

from typing import Any, Callable

from .record import RUN_SECONDS_BUCKETS


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]], suffix: str = "") -> list[str]:
    """One metric family: HELP, TYPE, then a line per (extra labels, value)."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{suffix}{{{labels}}} {value}" for labels, value in samples]
    return lines


def prometheus_text(spool: Any, on_problem: Callable[[str], None] | None = None) -> str:
    """The metrics. A broken config.json does not stop them: it is reported
    as ``spoolq_config_ok 0`` (and to ``on_problem``), the rest read with
    the default settings."""
    problem = spool.backend.settings_problem()
    if problem is not None and on_problem is not None:
        on_problem(f"{problem} (metrics read with the default settings)")
    data = spool.metrics(on_problem)
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
