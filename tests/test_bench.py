"""`spoolq bench` runs and reports (figures are measured, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess


def test_bench_reports_figures_with_baselines_and_cleans_up(fast_spool):
    s = fast_spool
    proc = s.run("bench", "--jobs", "1000", "--no-fsync", "--section", "enqueue", "--section", "drain",
                 "--section", "sqlite", "--json", timeout=600)
    report = json.loads(proc.stdout)
    figures = report["figures"]
    for name in ("bare_enqueue", "enqueue", "enqueue_many", "enqueue_jsonl", "bare_claim", "bare_drain", "drain_handlers",
                 "drain_handlers_2w", "drain_handlers_forked", "sqlite_normal_enqueue", "sqlite_normal_drain",
                 "sqlite_full_drain", "sqlite_normal_drain_2w"):
        assert figures[name]["jobs"] > 0 and figures[name]["jobs_per_s"] > 0, name
    assert figures["enqueue"]["baseline"] == "bare_enqueue" and figures["enqueue"]["ratio"] > 0
    # The bare loop creates its files in the enqueue's own folders, around it.
    assert figures["bare_enqueue"]["jobs"] == 1000 and "half before it and half after" in figures["bare_enqueue"]["note"]
    assert "vs_sqlite_normal_drain" in figures["drain_handlers"]
    # Two worker processes share the jobs of one spool, and one SQLite table, between them.
    assert figures["drain_handlers_2w"]["jobs"] == 1000 and figures["sqlite_normal_drain_2w"]["jobs"] == 1000
    assert figures["drain_handlers_2w"]["baseline"] == "drain_handlers"
    assert "vs_sqlite_normal_drain_2w" in figures["drain_handlers_2w"]
    assert figures["drain_handlers"]["baseline"] == "bare_drain" and figures["bare_drain"]["jobs"] == 1000
    assert report["fsync"] is False and report["machine"]["cpus"] >= 1
    assert not [n for n in os.listdir(s.path) if n.startswith(".bench-")]  # the scratch spool is gone
    table = s.run("bench", "--jobs", "1000", "--section", "enqueue", timeout=600).stdout
    assert "bare_enqueue" in table and "vs baseline" in table


def test_bench_true_section_drains_whole_commands_beside_the_bare_loop(fast_spool):
    proc = fast_spool.run("bench", "--no-fsync", "--section", "true", "--true-jobs", "20", "--json", timeout=600)
    figures = json.loads(proc.stdout)["figures"]
    assert figures["bare_true"]["jobs"] == 20  # four quarters of 5 around the two drains
    for name in ("drain_true_j1", "drain_true_j2"):
        assert figures[name]["jobs"] == 20 and figures[name]["baseline"] == "bare_true" and figures[name]["ratio"] > 0
    assert not [n for n in os.listdir(fast_spool.path) if n.startswith(".bench-")]


def test_bench_scale_reports_the_bare_drain_next_to_the_drain_at_each_size(fast_spool):
    s = fast_spool
    # In any order, repeated or not, the smallest size is the baseline.
    proc = s.run("bench", "--no-fsync", "--section", "scale", "--scale", "2000,200,200", "--json", timeout=600)
    figures = json.loads(proc.stdout)["figures"]
    # A tenth (at least 100) of each size goes through the bare system calls, the rest through spoolq work.
    assert figures["scale_bare_drain_200"]["jobs"] == 100 and figures["scale_drain_200"]["jobs"] == 100
    assert figures["scale_bare_drain_2k"]["jobs"] == 200 and figures["scale_drain_2k"]["jobs"] == 1800
    for kind in ("enqueue", "bare_drain", "drain"):
        assert figures[f"scale_{kind}_2k"]["cost_ratio"] > 0, kind
    assert figures["scale_drain_2k"]["peak_rss_mb"] > 0
    # The smallest size, a fraction of a second, is the median of runs before and after the larger sizes.
    assert figures["scale_drain_200"]["runs"] == 5 and "runs" not in figures["scale_drain_2k"]
    assert figures["scale_status_200"]["runs"] == 5 and figures["scale_status_2k"]["waiting"] == 2000
    assert "median of 5 runs, 3 before the larger sizes and 2 after" in figures["scale_drain_200"]["note"]


def test_bench_refuses_scale_sizes_it_cannot_split(fast_spool):
    s = fast_spool
    for bad in ("50", "1000,0", "x", ""):
        proc = s.run("bench", "--section", "scale", "--scale", bad, check=False)
        assert proc.returncode == 2, bad
        assert proc.stderr.strip().count("\n") == 0 and "--scale" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_bench_on_a_file_says_so_in_one_line(tmp_path):
    from conftest import SPOOLQ

    path = tmp_path / "not-a-folder"
    path.write_text("x")
    proc = subprocess.run(SPOOLQ + ["-s", str(path), "bench", "--section", "scale", "--scale", "100"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == f"spoolq: {path} exists and is not a directory\n"
    assert path.read_text() == "x"


def test_a_drains_peak_memory_is_its_own_not_the_bench_that_started_it():
    """Linux's ru_maxrss counts the memory of the process a child was forked
    from: a drain started by a bench holding 150 MB would report 150 MB."""
    import sys

    held = bytearray(150 * 1024 * 1024)
    held[::4096] = b"\1" * len(held[::4096])  # touched: resident
    code = "from spoolq.bench import peak_rss_kb; print(peak_rss_kb())"
    child_kb = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0 < child_kb < 100 * 1024, child_kb
    del held
