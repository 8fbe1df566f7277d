"""The command line on a PostgreSQL spool, through the same ``Spool`` and
worker as a directory's: ``spoolq -s postgresql://...`` enqueues, lists,
shows, counts, runs (drain and watch, -j 1 and -j N, commands and
handlers), cancels, retries, compacts, purges, sweeps and sets its
settings; what only a directory has is refused in one line; a URL's
password is never shown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest_plugins = ["pgserver"]

if os.environ.get("SPOOLQ_CI"):
    import psycopg  # noqa: F401 - under CI a missing psycopg fails the run
else:
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spoolq(url: str, *args: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("SPOOLQ_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "spoolq", "-s", url, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)
    assert not check or proc.returncode == 0, (args, proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_a_drain_runs_command_jobs_and_the_read_side_shows_them(pg_url, tmp_path):
    assert spoolq(pg_url, "init").returncode == 0
    ok = spoolq(pg_url, "enqueue", f"echo hi > {tmp_path}/ran").stdout.strip()
    bad = spoolq(pg_url, "enqueue", "--max-attempts", "1", "exit 3").stdout.strip()
    later = spoolq(pg_url, "enqueue", "--in", "1h", "true").stdout.strip()
    assert spoolq(pg_url, "list").stdout.count("\n") == 3
    work = spoolq(pg_url, "work")
    assert (tmp_path / "ran").read_text() == "hi\n"
    assert f"job={ok} outcome=succeeded" in work.stderr and f"job={bad} outcome=dead" in work.stderr, work.stderr
    status = json.loads(spoolq(pg_url, "status", "--json").stdout)
    assert (status["new"], status["done"], status["dead"]) == (1, 1, 1), status
    shown = json.loads(spoolq(pg_url, "show", "--json", ok).stdout)
    assert shown["state"] == "done" and shown["attempts"] == 1
    assert spoolq(pg_url, "cancel", later).returncode == 0
    assert spoolq(pg_url, "retry", bad).returncode == 0
    assert json.loads(spoolq(pg_url, "show", "--json", bad).stdout)["state"] == "new"
    assert "TOTAL" in spoolq(pg_url, "stats").stdout
    assert "spoolq_jobs" in spoolq(pg_url, "status", "--prometheus").stdout
    spoolq(pg_url, "sweep")
    spoolq(pg_url, "compact", "--keep", "1d")
    spoolq(pg_url, "purge", "--dead", "--older-than", "1d")


def test_handler_jobs_and_several_workers(pg_url, tmp_path):
    app = tmp_path / "pgapp.py"
    app.write_text("HANDLERS = {'noop': lambda payload: None}\n")
    spoolq(pg_url, "init")
    jobs = "\n".join(json.dumps({"kind": "noop"}) for _ in range(40)) + "\n"
    spoolq(pg_url, "enqueue", "--jsonl", "-", input=jobs)
    work = spoolq(pg_url, "work", "-j", "2", "--app", "pgapp:HANDLERS", cwd=tmp_path)
    assert work.stderr.count("outcome=succeeded") == 40, work.stderr
    assert json.loads(spoolq(pg_url, "status", "--json").stdout)["done"] == 40


def test_a_watching_worker_picks_up_a_new_job(pg_url, tmp_path):
    spoolq(pg_url, "init")
    env = dict(os.environ, PYTHONPATH=ROOT)
    worker = subprocess.Popen([sys.executable, "-m", "spoolq", "-s", pg_url, "work", "--watch"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        spoolq(pg_url, "enqueue", f"touch {tmp_path}/seen")
        deadline = time.monotonic() + 60
        while not (tmp_path / "seen").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "seen").exists()
    finally:
        worker.terminate()
        _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0 and "Traceback" not in err, err


def test_settings_and_what_only_a_directory_has(pg_url):
    spoolq(pg_url, "init")
    spoolq(pg_url, "config", "set", "max-attempts", "7")
    assert "7" in spoolq(pg_url, "config", "get", "max_attempts").stdout
    refused = spoolq(pg_url, "init", "--group", "users", check=False)
    assert refused.returncode != 0 and "roles and grants" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_the_password_is_never_shown(pg_server):
    url = pg_server.url("nosuchdb") + "&password=s3cret"
    proc = spoolq(url, "status", check=False)
    assert proc.returncode != 0 and "s3cret" not in proc.stdout + proc.stderr
