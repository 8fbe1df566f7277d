"""`spoolq bench` runs and reports (figures are measured, never asserted)."""

from __future__ import annotations

import json
import os


def test_bench_reports_figures_with_baselines_and_cleans_up(fast_spool):
    s = fast_spool
    proc = s.run("bench", "--jobs", "1000", "--no-fsync", "--section", "enqueue", "--section", "drain",
                 "--section", "sqlite", "--json", timeout=600)
    report = json.loads(proc.stdout)
    figures = report["figures"]
    for name in ("bare_enqueue", "enqueue", "enqueue_many", "enqueue_jsonl", "bare_claim", "drain_handlers",
                 "drain_handlers_forked", "sqlite_normal_enqueue", "sqlite_normal_drain", "sqlite_full_drain"):
        assert figures[name]["jobs"] > 0 and figures[name]["jobs_per_s"] > 0, name
    assert figures["enqueue"]["baseline"] == "bare_enqueue" and figures["enqueue"]["ratio"] > 0
    assert "vs_sqlite_normal_drain" in figures["drain_handlers"]
    assert report["fsync"] is False and report["machine"]["cpus"] >= 1
    assert not [n for n in os.listdir(s.path) if n.startswith(".bench-")]  # the scratch spool is gone
    table = s.run("bench", "--jobs", "1000", "--section", "enqueue", timeout=600).stdout
    assert "bare_enqueue" in table and "vs baseline" in table
