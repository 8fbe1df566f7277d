"""Running a job with ``spoolq work``: what a job's process gets (its
environment, payload, cwd, descriptors, signal dispositions), what is kept
of its output, and how its end is seen (exit codes, timeouts, programs
that cannot start)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import SPOOLQ, alive, needs_tuning, tuned_worker, wait_for


def test_a_job_sees_its_environment_payload_and_cwd(fast_spool, tmp_path):
    s = fast_spool
    out = tmp_path / "seen.json"
    script = (
        "import json, os, sys; "
        "json.dump({'id': os.environ['SPOOLQ_JOB_ID'], 'attempt': os.environ['SPOOLQ_ATTEMPT'], "
        "'spool': os.environ['SPOOLQ_SPOOL'], 'extra': os.environ.get('EXTRA'), 'cwd': os.getcwd(), "
        "'stdin': sys.stdin.read()}, open(sys.argv[1], 'w'))"
    )
    import sys

    job_id = s.enqueue("--argv", "--env", "EXTRA=yes", "--cwd", str(tmp_path), "--payload", '{"n": 5}',
                       "--", sys.executable, "-c", script, str(out))
    s.work()
    seen = json.loads(out.read_text())
    assert seen == {"id": job_id, "attempt": "1", "spool": str(s.path), "extra": "yes",
                    "cwd": str(tmp_path), "stdin": '{"n": 5}'}
    assert s.where(job_id) == ["done"]


def test_a_job_without_payload_reads_empty_stdin(fast_spool):
    job_id = fast_spool.enqueue("wc -c")
    fast_spool.work()
    assert fast_spool.show(job_id)["stdout"].strip() == "0"


def test_output_tails_are_kept_up_to_output_limit(fast_spool):
    s = fast_spool
    s.config("output_limit", 100)
    job_id = s.enqueue("seq 1 10000; seq 1 5000 >&2")
    s.work()
    job = s.show(job_id)
    assert len(job["stdout"]) == 100 and job["stdout"].endswith("9999\n10000\n")
    assert len(job["stderr"]) == 100 and job["stderr"].endswith("5000\n")


def test_a_background_child_does_not_hold_the_worker(fast_spool, tmp_path):
    """Output goes to files, not pipes: `sleep 300 &` must not keep the run open."""
    s = fast_spool
    job_id = s.enqueue(f"sleep 300 & echo $! > {tmp_path}/bg.pid; echo started")
    started = time.monotonic()
    s.work(timeout=60)
    assert time.monotonic() - started < 30
    assert s.show(job_id)["stdout"] == "started\n"
    os.kill(int((tmp_path / "bg.pid").read_text()), 9)


def test_exit_100_fails_permanently(fast_spool):
    job_id = fast_spool.enqueue("exit 100")
    fast_spool.work()
    job = fast_spool.show(job_id)
    assert job["state"] == "dead" and job["attempts"] == 1 and "permanently" in job["error"]


def test_a_missing_program_or_cwd_is_a_failure_not_a_crash(fast_spool, tmp_path):
    s = fast_spool
    s.config("max_attempts", 1)
    a = s.enqueue("--argv", "--", "/no/such/program")
    b = "nowhere"  # (enqueue refuses a cwd that is not there: dropped by hand)
    s.drop("nowhere.json", json.dumps({"command": "true", "cwd": str(tmp_path / "nowhere")}))
    proc = s.work()
    assert "Traceback" not in proc.stderr
    assert "cannot start" in s.show(a)["error"] and "/no/such/program" in s.show(a)["error"]
    assert "nowhere" in s.show(b)["error"]
    assert s.where(a) == ["dead"] and s.where(b) == ["dead"]


def test_timeout_kills_the_whole_process_group(fast_spool, tmp_path):
    s = fast_spool
    s.config("timeout_grace", 1)
    pids = tmp_path / "pids"
    # The shell ignores TERM, and leaves a grandchild behind: both must die.
    job_id = s.enqueue("--timeout", "1", "--max-attempts", "1",
                       f"trap '' TERM; sleep 300 & echo $! >> {pids}; echo $$ >> {pids}; while :; do sleep 1; done")
    started = time.monotonic()
    s.work(timeout=60)
    took = time.monotonic() - started
    job = s.show(job_id)
    assert job["state"] == "dead" and job["error"] == "timed out after 1s"
    assert took < 20
    for pid in map(int, pids.read_text().split()):
        wait_for(lambda: not alive(pid), timeout=10, what=f"pid {pid} to die")


@pytest.mark.skipif(shutil.which("setsid") is None, reason="setsid (util-linux) is not installed")
def test_a_timeout_or_a_second_signal_also_kills_what_left_the_process_group(fast_spool, tmp_path):
    """Audit: a job's process that left its process group (setsid) outlived
    a timeout and a second stop signal, so it ran on beside the job's
    retry. The run's own variables (SPOOLQ_WORKER, SPOOLQ_JOB_ID,
    SPOOLQ_ATTEMPT) find it, as recovery finds a dead worker's."""
    s = fast_spool
    s.config("backoff_initial", 0)
    pids = tmp_path / "pids"
    escaping = f"setsid sh -c 'echo $$ >> {pids}; exec sleep 300' & wait"
    timed_out = s.enqueue("--timeout", "3", "--max-attempts", "1", escaping)  # (time to start it, on a busy machine)
    s.work(timeout=60)
    assert s.show(timed_out)["error"] == "timed out after 3s"
    pid = int(pids.read_text())
    wait_for(lambda: not alive(pid), timeout=10, what="the escaped process to die")
    pids.unlink()
    stopped = s.enqueue(escaping)
    worker = s.popen("work", stderr=subprocess.PIPE, text=True)
    wait_for(lambda: pids.exists() and pids.read_text(), what="the job to start")
    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping on SIGTERM: no new jobs" in worker.stderr.readline(), what="the first signal to be handled")
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=60)
    assert s.where(stopped) == ["failed"]
    pid = int(pids.read_text())
    wait_for(lambda: not alive(pid), timeout=10, what="the escaped process to die")


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_a_run_that_spoolq_itself_failed_to_run_keeps_a_real_start_time(fast_spool):
    """Review: a command job whose run failed inside spoolq (here the write
    of its payload, made to fail by strace) was recorded with a start time
    from the monotonic clock: 1970 in its history, a duration of 56 years
    in the log and in stats. Each of the worker's writes fails in turn:
    every run recorded has a start and an end of this year."""
    s = fast_spool
    failed_inside = 0
    for k in range(1, 40):
        job_id = s.enqueue("--payload", '{"a": 1}', "cat > /dev/null")
        proc = subprocess.run(["strace", "-qq", "-o", os.devnull, "-e", "trace=write,pwrite64,writev",
                               "-e", f"inject=write,pwrite64,writev:error=EIO:when={k}",
                               *SPOOLQ, "-s", str(s.path), "work"], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
        assert "Traceback" not in proc.stderr, proc.stderr
        assert len(s.where(job_id)) == 1, (k, s.where(job_id))
        for state in ("failed", "done", "dead"):
            for other in s.ids(state):
                for run in s.record(state, other).get("history", []):
                    assert run["start"][:4] == run["end"][:4] == time.strftime("%Y", time.gmtime()), (k, run)
                    failed_inside += run.get("error", "").startswith("internal error running the job: OSError")
    assert failed_inside >= 1  # some write was the payload's


def test_a_job_inherits_only_stdin_stdout_and_stderr(fast_spool, tmp_path):
    """Whatever else the worker has open (descriptors passed down by
    whoever started it, watchdog's inotify descriptor in watch mode) is
    closed in the job: with posix_spawn and with Popen (a job with a cwd)."""
    s = fast_spool
    listing = ["--argv", "--", "sh", "-c", "ls /proc/$$/fd"]
    plain = s.enqueue(*listing)
    in_cwd = s.enqueue("--cwd", str(tmp_path), *listing)
    leaked_r, leaked_w = os.pipe()
    os.set_inheritable(leaked_r, True)
    try:
        worker = s.popen("work", pass_fds=(leaked_r,), stderr=subprocess.DEVNULL)
        assert worker.wait(timeout=60) == 0
        watched = s.enqueue(*listing)
        watcher = s.popen("work", "--watch", pass_fds=(leaked_r,), stderr=subprocess.DEVNULL)
        wait_for(lambda: s.where(watched) == ["done"], what="the watcher to run the job")
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=60) == 0
    finally:
        os.close(leaked_r)
        os.close(leaked_w)
    for job_id in (plain, in_cwd, watched):
        assert s.show(job_id)["stdout"].split() == ["0", "1", "2"], job_id


def test_a_descriptor_above_the_open_file_limit_is_closed_too(fast_spool):
    """A worker started with a soft limit of 64 but holding descriptor 200
    (inherited from a parent with a higher limit): the C library refuses a
    close action for it, which made every job fail to start ("Bad file
    descriptor") and go dead. The job runs, and without descriptor 200."""
    s = fast_spool
    job_id = s.enqueue("--argv", "--", "sh", "-c", "ls /proc/$$/fd")
    start = ("import os, resource, sys; os.dup2(0, 200, inheritable=True); "
             "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
             "os.execvp(sys.argv[1], sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", start, *SPOOLQ, "-s", str(s.path), "work"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = s.show(job_id)
    assert job["state"] == "done", job.get("error")
    assert job["stdout"].split() == ["0", "1", "2"]


def test_a_program_is_found_on_the_jobs_own_path(fast_spool, tmp_path):
    s = fast_spool
    s.config("max_attempts", 1)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "mytool"
    tool.write_text("#!/bin/sh\necho from mytool\n")
    tool.chmod(0o755)
    path = f"/nonexistent:{bin_dir}:/usr/bin:/bin"
    found = s.enqueue("--env", f"PATH={path}", "--argv", "--", "mytool")
    missing = s.enqueue("--env", f"PATH={path}", "--argv", "--", "no-such-tool")
    on_ours = s.enqueue("--argv", "--", "true")
    s.work()
    assert s.show(found)["stdout"] == "from mytool\n"
    assert s.show(missing)["error"] == "cannot start: No such file or directory: no-such-tool"
    assert s.show(on_ours)["state"] == "done"


def test_a_job_gets_sigpipe_and_sigxfsz_at_their_defaults(fast_spool):
    """Python ignores both; a job must not inherit that (`yes | head` would
    complain of a broken pipe, and writers that ignore EPIPE can loop)."""
    s = fast_spool
    job_id = s.enqueue("grep SigIgn /proc/self/status; yes | head -1")
    s.work()
    job = s.show(job_id)
    ignored = int(job["stdout"].split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1)) and not ignored & (1 << (signal.SIGXFSZ - 1))
    assert job["stdout"].split()[2:] == ["y"] and "stderr" not in job and job["state"] == "done"


def test_a_timeout_holds_while_the_worker_waits_for_the_job(fast_spool):
    """However the worker waits for a job's exit (asleep, or polling on a
    spare CPU), the job's timeout kills it on time."""
    job_id = fast_spool.enqueue("--timeout", "0.3", "--argv", "--", "sleep", "30")
    started = time.monotonic()
    fast_spool.work()
    assert time.monotonic() - started < 15  # the job's 30 s sleep was cut short
    job = fast_spool.show(job_id)
    assert job["error"] == "timed out after 0.3s" and job["exit_code"] == -15


@needs_tuning
def test_a_timeout_holds_while_the_worker_polls_for_the_jobs_exit(fast_spool):
    """A polling window (Tuning seam) longer than a job's timeout does not
    delay the kill."""
    job_id = fast_spool.enqueue("--timeout", "0.3", "--argv", "--", "sleep", "30")
    started = time.monotonic()
    worker = tuned_worker(fast_spool, {"spin_window": 20.0, "load_average": 0.0})
    assert worker.wait(timeout=60) == 0
    assert time.monotonic() - started < 15
    job = fast_spool.show(job_id)
    assert job["error"] == "timed out after 0.3s" and job["exit_code"] == -15
