"""Output a person reads: a header row on a terminal, a job moved back by
hand shown as waiting, every job named the same way in the worker's log,
and throughput over a window that means something."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess

from conftest import SPOOLQ


def _on_a_terminal(s, *args: str) -> str:
    """spoolq's stdout when it is a terminal (a pseudo-terminal)."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "SPOOLQ_DIR"}
    proc = subprocess.Popen(SPOOLQ + ["-s", str(s.path), *args], stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other side is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_list_prints_a_header_row_on_a_terminal_only(fast_spool):
    s = fast_spool
    job = s.enqueue("true")
    lines = _on_a_terminal(s, "list").splitlines()
    assert lines[0].split() == ["STATE", "ID", "DUE", "OR", "FINISHED", "TRY", "JOB"] and job in lines[1]
    assert lines[0].index("ID") == lines[1].index(job) and len(lines) == 2
    assert _on_a_terminal(s, "list", "--no-header").splitlines()[0].startswith("new")
    assert _on_a_terminal(s, "dlq", "list").splitlines()[0].startswith("STATE")
    assert _on_a_terminal(s, "list", "--json").startswith("{")
    assert s.run("list").stdout.startswith("new ")  # a pipe gets the jobs only


def test_a_job_moved_back_by_hand_shows_as_waiting_not_as_failing(fast_spool):
    s = fast_spool
    s.enqueue("--id", "again", "--max-attempts", "1", "sh -c 'exit 3'")
    s.work()
    shutil.move(str(s.path / "dead" / "again.json"), str(s.path / "new" / "again.json"))
    [line] = s.run("list").stdout.splitlines()
    assert line.startswith("new ") and line.endswith(
        "[moved back to new/ from dead/ by hand; it waits for a fresh run; its last run: exit status 3]")
    shown = s.run("show", "again").stdout
    assert "state: new\n" in shown and "history:\n" in shown and shown.rstrip().endswith(
        "note: moved back to new/ from dead/ by hand; it waits for a fresh run: error, exit_code, stdout and stderr "
        "are of its last run, before the move (history has every run)")
    assert s.show("again")["moved_back_from"] == "dead"
    s.work()
    assert s.show("again")["attempts"] == 1 and "moved_back_from" not in s.show("again")


def test_the_worker_log_names_each_job_by_its_id_and_other_files_by_their_name(fast_spool):
    s = fast_spool
    s.drop("broken.json", "[1]")
    s.drop("bad name.json", '{"command": "true"}')
    s.drop("fine.json", '{"command": "true"}')
    log = s.work().stderr
    lines = [line.split(" ", 2)[2] for line in log.splitlines() if " worker=" in line]
    assert any(line.startswith("job=broken outcome=dead") for line in lines), log
    assert any(line.startswith('file="bad name.json" outcome=dead') for line in lines), log
    assert any(line.startswith("job=fine outcome=succeeded") for line in lines), log
    assert ".json" not in log.replace('"bad name.json"', "")


def test_stats_rates_are_over_a_window_that_means_something(fast_spool):
    s = fast_spool
    s.enqueue("true")
    s.enqueue("true")
    s.work()
    total = json.loads(s.run("stats", "--json").stdout)["total"]
    assert total["jobs"] == 2 and total["throughput_per_s"] <= 2 / 60  # not 2 jobs over the milliseconds between them
    hour = json.loads(s.run("stats", "--since", "1h", "--json").stdout)["total"]
    assert hour["throughput_per_s"] == round(2 / 3600, 3)
