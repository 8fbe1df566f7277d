"""`spoolq logs`: a running job's output while it runs (followed with -f
until the job ends, then wait's exit code), a finished job's stored
tails, a waiting job followed from its start; the live output bounded by
log_limit and gone once a killed worker's job is recovered. Each job here
prints, then waits for a file the test makes, so "while it runs" is the
test's to say, not a race."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time

import pytest

from conftest import wait_for

pytest_plugins = ["pgserver"]

GATED = 'echo "first line"; while [ ! -e "$GATE" ]; do sleep 0.05; done; echo "second line"; exit "${CODE:-0}"'


@pytest.fixture
def cspool(sq):
    sq.config("backoff_initial", "1h")
    return sq


def _gated(s, tmp_path, code: int = 0, name: str = "gate") -> tuple[str, str]:
    gate = str(tmp_path / name)
    job = s.enqueue("--max-attempts", "1", "--env", f"GATE={gate}", "--env", f"CODE={code}", GATED)
    return job, gate


def _watching(s):
    proc = s.popen("work", "--watch", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: s.status()["workers"], what="the worker to start")
    return proc


def _read_line(proc, timeout: float) -> str:
    """One line of ``proc``'s stdout within ``timeout`` seconds (else "")."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().decode() if ready else ""


def _gated_and_running(s, tmp_path):
    """A gated job, a watching worker running it, its first line pushed."""
    job, gate = _gated(s, tmp_path)
    worker = _watching(s)
    wait_for(lambda: s.run("logs", job).stdout == "first line\n", what="the running job's output")
    return job, gate, worker


def _running(s, job):
    return s.show(job)["state"] == "cur"


def _stored_output(s):
    """The live output the spool holds, however it holds it."""
    if s.kind == "dir":
        out = os.path.join(s.location, "out")
        return sorted(os.listdir(out)) if os.path.isdir(out) else []
    import psycopg

    with psycopg.connect(s.location) as conn:
        return conn.execute("SELECT id, stream FROM spoolq.outputs ORDER BY 1, 2").fetchall()


@pytest.mark.parametrize("code", [0, 3])
def test_follow_shows_a_line_the_job_printed_while_it_still_runs_then_exits_as_wait(cspool, tmp_path, code):
    s = cspool
    job, gate = _gated(s, tmp_path, code)
    worker = _watching(s)
    logs = s.popen("logs", "-f", job, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert _read_line(logs, 30) == "first line\n"
    assert _running(s, job) and logs.poll() is None  # shown while the job still waits for its gate
    open(gate, "w").close()
    rest, err = logs.communicate(timeout=60)
    assert (rest.decode(), err.decode()) == ("second line\n", "")
    assert logs.returncode == (0 if code == 0 else 1)
    worker.terminate()


def test_follow_shows_new_lines_within_a_second(cspool, tmp_path):
    s = cspool
    gate = str(tmp_path / "gate")
    job = s.enqueue("--max-attempts", "1", "--env", f"GATE={gate}",
                    'for i in 1 2 3 4 5; do date +%s.%N; sleep 0.7; done; while [ ! -e "$GATE" ]; do sleep 0.05; done')
    worker = _watching(s)
    logs = s.popen("logs", "-f", job, stdout=subprocess.PIPE)
    delays = []
    for _ in range(5):
        line = _read_line(logs, 30)
        delays.append(time.time() - float(line))
    open(gate, "w").close()
    logs.communicate(timeout=60)
    # Each line is pushed within a quarter second and read on its event;
    # the median leaves room for a loaded machine's odd slow one.
    assert sorted(delays)[2] < 1.0, delays
    worker.terminate()


def test_logs_of_a_running_job_prints_its_output_so_far_and_returns(cspool, tmp_path):
    s = cspool
    job, gate, worker = _gated_and_running(s, tmp_path)
    assert _running(s, job)
    assert s.api().output(job)[0] == b"first line\n"
    assert s.api().output(job, "stderr") == (b"", 0)
    open(gate, "w").close()
    wait_for(lambda: s.show(job)["state"] == "done", what="the job to finish")
    assert s.api().output(job) is None  # not running
    worker.terminate()


def test_logs_of_a_finished_job_prints_its_stored_tails_and_says_when_they_were_cut(cspool):
    s = cspool
    s.config("output_limit", 100)
    short = s.enqueue("echo out; echo err >&2")
    long = s.enqueue("seq 1 20000")
    s.work()
    run = s.run("logs", short)
    assert (run.stdout, run.stderr) == ("out\n", "")
    assert s.run("logs", "--stderr", short).stdout == "err\n"
    both = s.run("logs", "--both", short)
    assert (both.stdout, both.stderr) == ("out\n", "err\n")
    run = s.run("logs", long)
    assert run.stdout.endswith("19999\n20000\n") and len(run.stdout) <= 100
    assert "earlier bytes are not shown (only its tail is kept)" in run.stderr
    run = s.run("logs", "-f", long)  # a finished job: its tails, at once, and wait's exit code
    assert run.returncode == 0 and run.stdout.endswith("20000\n")


def test_follow_of_a_waiting_job_waits_for_it_to_start(cspool, tmp_path):
    s = cspool
    job, gate = _gated(s, tmp_path)
    logs = s.popen("logs", "-f", job, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert _read_line(logs, 1.5) == "" and logs.poll() is None  # no worker yet: nothing, still following
    assert s.run("logs", job).stderr.startswith(f"spoolq: job {job} has not started yet")
    worker = _watching(s)
    assert _read_line(logs, 30) == "first line\n"
    open(gate, "w").close()
    rest, _ = logs.communicate(timeout=60)
    assert rest.decode() == "second line\n" and logs.returncode == 0
    worker.terminate()


def test_a_running_jobs_live_output_is_bounded_by_log_limit(cspool, tmp_path):
    s = cspool
    s.config("log_limit", 8192)
    gate = str(tmp_path / "gate")
    job = s.enqueue("--max-attempts", "1", "--env", f"GATE={gate}",
                    'seq 1 2000000; echo last; while [ ! -e "$GATE" ]; do sleep 0.05; done')
    worker = _watching(s)
    spool = s.api()

    def tail():
        got = spool.output(job)
        return got if got and got[0].endswith(b"\nlast\n") else None

    data, after = wait_for(tail, what="the end of the job's output to be pushed")
    assert len(data) <= 8192 + 4096 and after - len(data) > 10_000_000  # the rest was let go
    if s.kind == "dir":
        st = os.stat(os.path.join(s.location, "out", f"{job}.stdout"))
        assert st.st_size == after and st.st_blocks * 512 <= 8192 + 2 * 4096 + 65536  # (a filesystem's block)
    run = s.run("logs", job)
    assert run.stdout.endswith("last\n") and "earlier bytes are not shown" in run.stderr
    open(gate, "w").close()
    wait_for(lambda: s.show(job)["state"] == "done", what="the job to finish")
    assert _stored_output(s) == []
    worker.terminate()


def test_recovery_removes_the_live_output_of_a_killed_workers_job(cspool, tmp_path):
    s = cspool
    job, gate, worker = _gated_and_running(s, tmp_path)
    assert _stored_output(s)
    os.killpg(worker.pid, signal.SIGKILL)  # the worker and its job's shell alike
    worker.wait(60)
    s.run("sweep")
    assert s.show(job)["state"] in ("failed", "dead")
    assert _stored_output(s) == []
    assert s.api().output(job) is None


def test_logs_of_an_unknown_job_exits_2_with_one_line(cspool):
    run = cspool.run("logs", "no-such-job", check=False)
    assert (run.returncode, run.stdout, run.stderr) == (2, "", "spoolq: no job no-such-job in this spool\n")
    run = cspool.run("logs", "-f", "no-such-job", check=False)
    assert (run.returncode, run.stderr) == (2, "spoolq: no job no-such-job in this spool\n")
