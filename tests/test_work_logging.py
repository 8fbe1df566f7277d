"""What a worker writes to stderr: outcome lines, their time or journal
priority prefix, and the closing note on what waits in failed/ and dead/."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from conftest import SPOOLQ, wait_for


def test_outcome_log_lines(fast_spool):
    s = fast_spool
    ok = s.enqueue("true")
    bad = s.enqueue("--max-attempts", "1", "exit 3")
    err = s.work().stderr
    lines = err.splitlines()
    assert any(f"job={ok} outcome=succeeded attempt=1/5" in line and "exit=0" in line for line in lines)
    assert any(f"job={bad} outcome=dead attempt=1/1" in line and "exit=3" in line for line in lines)
    s.enqueue("true")
    # Quiet (cron, every minute): no success, and no closing note about the
    # dead job, which was told once, when it died.
    assert s.work("--quiet").stderr == ""


def _work_logging_to_a_pipe(s, journal: str | None, *args: str) -> str:
    """``spoolq work ARGS`` with stderr a pipe and $JOURNAL_STREAM naming
    that pipe ("match"), another file ("other") or unset (None): its stderr."""
    import re

    r, w = os.pipe()
    env = dict(os.environ)
    env.pop("SPOOLQ_DIR", None)
    env.pop("JOURNAL_STREAM", None)
    if journal:
        st = os.fstat(w) if journal == "match" else os.stat(os.devnull)
        env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
    try:
        proc = subprocess.Popen(SPOOLQ + ["-s", str(s.path), "work", *args], stderr=w, env=env)
    finally:
        os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    assert proc.wait(timeout=120) == 0, err
    if journal == "match":
        assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", err) is None, err  # the journal has the time
    return err


def test_under_systemds_journal_log_lines_carry_syslog_priorities_and_no_time(fast_spool):
    """With stderr connected to the journal ($JOURNAL_STREAM names it), a
    worker prefixes its lines with sd-daemon priorities instead of a time
    (the journal stamps lines itself): <3> for a job gone dead, so that
    `journalctl -p err` finds it, <4> for a failed run, <6> for the rest."""
    s = fast_spool
    s.config("backoff_initial", 0)
    ok = s.enqueue("true")
    bad = s.enqueue("--max-attempts", "2", "exit 3")
    lines = _work_logging_to_a_pipe(s, "match").splitlines()
    assert any(line.startswith(f"<6>worker=") and f"job={ok} outcome=succeeded attempt=1/5" in line for line in lines), lines
    assert any(line.startswith(f"<4>worker=") and f"job={bad} outcome=failed attempt=1/2" in line for line in lines), lines
    assert any(line.startswith(f"<3>worker=") and f"job={bad} outcome=dead attempt=2/2" in line for line in lines), lines
    assert all(line[:3] in ("<3>", "<4>", "<6>") for line in lines), lines


@pytest.mark.parametrize("journal", [None, "other"])
def test_log_lines_begin_with_the_time_unless_stderr_is_the_journal(fast_spool, journal):
    """A time, as always, when $JOURNAL_STREAM is unset, or set (inherited
    from a service) while stderr goes somewhere else."""
    import re

    s = fast_spool
    job_id = s.enqueue("--max-attempts", "1", "exit 3")
    lines = _work_logging_to_a_pipe(s, journal).splitlines()
    assert lines and all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (worker=|stopped: )", line) for line in lines), lines
    assert any(f"job={job_id} outcome=dead attempt=1/1" in line for line in lines), lines


@pytest.mark.parametrize("args", [[], ["-j", "2"], ["--max-jobs", "3"]])
def test_work_ends_saying_how_many_jobs_wait_in_failed_and_are_dead(fast_spool, args):
    """A worker run from cron exits 0 whatever its jobs did: its last
    stderr line says how many jobs wait for a retry, when the first is
    due, and how many are dead. Nothing when there are none."""
    import calendar

    s = fast_spool
    s.config("backoff_initial", "300")
    failing = [s.enqueue("--max-attempts", "3", "exit 3") for _ in range(2)]
    s.enqueue("--max-attempts", "1", "exit 4")
    proc = s.work(*args)
    assert sorted(s.ids("failed")) == sorted(failing) and len(s.ids("dead")) == 1
    first_due = min(os.stat(s.path / "failed" / f"{i}.json").st_mtime for i in failing)
    last = proc.stderr.splitlines()[-1]
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(first_due))
    assert last.endswith(f" stopped: 2 jobs wait in failed/ (next retry at {when}), 1 dead (spoolq list --state dead)"), last
    assert 200 < calendar.timegm(time.strptime(when, "%Y-%m-%dT%H:%M:%SZ")) - time.time() < 400
    for job_id in failing:
        s.run("cancel", job_id)
    assert s.work(*args).stderr.splitlines()[-1].endswith(" stopped: 1 job dead (spoolq list --state dead)")


def test_a_quiet_worker_ends_without_the_note(fast_spool):
    """-q is for cron's mail: each dead job is told once, when it dies, not
    again by every run a minute after."""
    s = fast_spool
    s.enqueue("--max-attempts", "1", "exit 4")
    first = s.work("-q").stderr.splitlines()
    assert len(first) == 1 and "outcome=dead" in first[0], first
    s.enqueue("--max-attempts", "3", "exit 3")
    assert s.work("-q").stderr == ""


def test_a_stopped_watcher_says_what_waits_and_exits_0(fast_spool):
    s = fast_spool
    job_id = s.enqueue("--max-attempts", "1", "exit 3")
    worker = s.popen("work", "--watch", stderr=subprocess.PIPE, text=True)
    wait_for(lambda: s.where(job_id) == ["dead"], what="the job to go dead")
    s.enqueue("--max-attempts", "2", "--in", "1h", "true")
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert err.splitlines()[-1].endswith(" stopped: 1 job dead (spoolq list --state dead)"), err


def test_work_with_nothing_failed_or_dead_ends_without_a_note(fast_spool):
    s = fast_spool
    s.enqueue("true")
    s.enqueue("--in", "1h", "true")
    assert "stopped" not in s.work().stderr
