"""The integration files in contrib/: systemd units that systemd accepts, and
a crontab line that really runs jobs."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess

import pytest

from conftest import ROOT, SPOOLQ, wait_for

UNITS = ROOT / "contrib" / "systemd"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_units_verify(tmp_path):
    for unit in UNITS.iterdir():
        text = unit.read_text().replace("/usr/local/bin/spoolq", "/bin/true")
        text = text.replace("User=app", "User=root").replace("Group=app", "Group=root")
        (tmp_path / unit.name).write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.iterdir())],
                          capture_output=True, text=True)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines()
                if "spoolq" in line or "Unknown" in line or "Failed" in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


def test_units_stop_jobs_gracefully():
    worker = (UNITS / "spoolq-worker.service").read_text()
    # SIGTERM must reach only the worker (which lets jobs finish), not every job.
    assert "KillMode=mixed" in worker and "ExecReload=/bin/kill -HUP $MAINPID" in worker
    drain = (UNITS / "spoolq-drain.service").read_text()
    assert "--max-time" in drain and "Type=oneshot" in drain
    path = (UNITS / "spoolq-drain.path").read_text()
    assert "DirectoryNotEmpty=/var/spool/app/new" in path



def test_the_on_demand_units_say_that_a_job_due_later_keeps_them_running():
    """DirectoryNotEmpty= fires for a job due next week as for one due now,
    so the drain service runs for as long as such a job waits: the units
    say so where they are set up, and name the unit to run instead."""
    for unit in ("spoolq-drain.path", "spoolq-drain.service"):
        comments = " ".join(line.lstrip("# ") for line in (UNITS / unit).read_text().splitlines() if line.startswith("#"))
        assert "spoolq-worker.service" in comments and "due" in comments, unit


@pytest.mark.parametrize("unit", ["spoolq-worker.service", "spoolq-drain.service"])
def test_service_units_bound_the_tasks_and_memory_of_their_jobs(unit):
    """Jobs run inside the unit: a fork bomb or a leak in one must meet a
    limit of the unit, and an OOM kill of one job must not stop the worker."""
    settings = dict(line.split("=", 1) for line in (UNITS / unit).read_text().splitlines()
                    if "=" in line and not line.startswith("#"))
    assert settings.get("TasksMax", "infinity") != "infinity"
    assert settings.get("MemoryMax", "infinity") != "infinity"
    assert settings.get("OOMPolicy") == "continue"

@pytest.mark.parametrize("unit", ["spoolq-worker.service", "spoolq-drain.service"])
def test_each_units_command_runs_jobs_and_stops_on_sigterm(unit, fast_spool, tmp_path):
    """Audit: the drain unit's `--max-time 10min` was refused (exit 2) on
    every start, so it never ran a job; a test only looked for the option.
    Now each unit's ExecStart runs for real: it takes a job, and stops
    cleanly on the SIGTERM systemd sends."""
    exec_start = next(line.split("=", 1)[1] for line in (UNITS / unit).read_text().splitlines()
                      if line.startswith("ExecStart="))
    command = shlex.split(exec_start)
    assert command[0] == "/usr/local/bin/spoolq"
    done = tmp_path / "done"
    job_id = fast_spool.enqueue(f"touch {done}")
    env = dict(os.environ, SPOOLQ_DIR=str(fast_spool.path))
    proc = subprocess.Popen(SPOOLQ + command[1:], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: done.exists() or proc.poll() is not None, what="the job to run")
        assert proc.poll() is None, proc.communicate()  # still watching, not refused
        wait_for(lambda: fast_spool.where(job_id) == ["done"], what="the job to be recorded")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _crontab_command(spool_path) -> list[str]:
    """The crontab's one active line, run against ``spool_path`` and for 1 s."""
    lines = [line for line in (ROOT / "contrib" / "cron" / "spoolq.crontab").read_text().splitlines()
             if line.strip() and not line.startswith("#") and "=" not in line.split()[0]]
    assert len(lines) == 1
    fields = lines[0].split(None, 5)
    assert len(fields) == 6 and fields[:5] == ["*"] * 5
    command = [a.replace("/var/spool/app", str(spool_path)) for a in shlex.split(fields[5])]
    command = ["1s" if a == "55s" else a for a in command]
    spoolq_at = command.index("spoolq")
    command[spoolq_at:spoolq_at + 1] = SPOOLQ
    return command


@pytest.mark.skipif(shutil.which("flock") is None, reason="flock(1) is not installed")
def test_the_crontab_line_runs_jobs(fast_spool, tmp_path):
    command = _crontab_command(fast_spool.path)
    done = tmp_path / "done"
    job_id = fast_spool.enqueue(f"touch {done}")
    fast_spool.drop("dropped.json", '{"command": "pwd -P"}')  # no cwd: the crontab's user's home, as its comment says
    env = dict(os.environ, SPOOLQ_DIR=str(fast_spool.path), HOME=str(tmp_path))
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""  # cron mails nothing
    assert done.exists() and fast_spool.where(job_id) == ["done"]
    import pwd

    home = pwd.getpwuid(os.geteuid()).pw_dir
    assert fast_spool.show("dropped")["stdout"] == os.path.realpath(home if os.path.isdir(home) else "/") + "\n"



@pytest.mark.skipif(shutil.which("flock") is None, reason="flock(1) is not installed")
def test_the_crontab_lock_skips_a_second_worker_and_follows_no_symlink_a_member_plants(fast_spool, tmp_path):
    """A member of a shared spool's group can write in the spool folder. A
    symlink planted under any name there must not lead the cron user's flock
    to open or create a file elsewhere, and the lock still keeps a second
    worker from starting while one runs."""
    target = tmp_path / "made-by-cron"
    for name in (".cron.lock", ".lock", "cron.lock", "lock"):
        (fast_spool.path / name).symlink_to(target)
    command = _crontab_command(fast_spool.path)
    env = dict(os.environ, SPOOLQ_DIR=str(fast_spool.path), HOME=str(tmp_path))
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert not target.exists()
    # While a worker holds the lock, the next minute's line starts nothing.
    flock_at = command.index("flock")
    lock = command[flock_at + 2]
    # Without -n: the probe below holds the lock for a moment, and a holder
    # that tried then would give up and leave it free for good.
    holder = subprocess.Popen(["flock", lock, "sleep", "30"])
    try:
        wait_for(lambda: subprocess.run(["flock", "-n", lock, "true"]).returncode != 0, what="the lock to be held")
        job_id = fast_spool.enqueue("true")
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
        assert proc.returncode != 0 and fast_spool.where(job_id) == ["new"]
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("script, args", [("big-folder.py", ["300"]), ("lean-drain.py", ["300", "1"]),
                                          ("pickup.py", ["300", "1"]), ("drain-cost.py", ["50"]),
                                          ("chain.py", ["20"]), ("cpu-per-job.py", ["300"])])
def test_the_bench_scripts_run_and_report(tmp_path, script, args):
    """contrib/bench scripts behind README figures still run (tiny sizes;
    their figures are only printed, never asserted)."""
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "contrib" / "bench" / script), str(tmp_path / "scratch"), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert ("us" in proc.stdout or " ms" in proc.stdout) and proc.stdout.strip()
    if script == "lean-drain.py":
        # Both drains ran every job: nothing left waiting in either spool.
        assert os.listdir(tmp_path / "scratch" / "lean-0" / "new") == []
        assert os.listdir(tmp_path / "scratch" / "worker-0" / "new") == []
        assert len(os.listdir(tmp_path / "scratch" / "lean-0" / "done")) == 300
        # ...and so did the SQLite-table queue beside them.
        import sqlite3

        db = sqlite3.connect(tmp_path / "scratch" / "sqlite-0.db")
        assert db.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall() == [("done", 300)]
        assert "SQLite-table queue (NORMAL)" in proc.stdout
    if script == "pickup.py":
        # Every dropped job was taken in, and then ran.
        for tag in ("nosync-0", "sync-0"):
            assert os.listdir(tmp_path / "scratch" / f"drop-{tag}" / "drop") == []
            assert len(os.listdir(tmp_path / "scratch" / f"drop-{tag}" / "done")) == 300
