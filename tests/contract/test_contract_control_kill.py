"""`spoolq kill`, `cancel` of a running job, `stop`, `pause` and `resume`:
requests carried out by the live workers themselves. A killed job ends
cancelled, is not retried and leaves no process behind; only the worker
that started a run signals it; a member may kill only its own jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import alive, wait_for, watching


pytest_plugins = ["pgserver"]


@pytest.fixture
def cspool(sq):
    """The spool these tests run against: a directory's, then a database's."""
    sq.config("backoff_initial", "1h")
    return sq


def _where(s, job_id):
    return [s.show(job_id)["state"]]


def _ids(s, state):
    return [job["id"] for job in s.listing("--state", state)]


def _watching(s, *args, **kw):
    proc = s.popen("work", "--watch", *args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw)
    wait_for(lambda: len(s.status()["workers"]) >= 1 or proc.poll() is not None, what="the worker to start")
    return proc


def _pid_when_running(s, pidfile):
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the job to start")
    return int(pidfile.read_text())


APP = '''
import time
def hang(payload):
    print("started", flush=True)
    for _ in range(3000):  # (an in-process handler stops when it next runs Python code)
        time.sleep(0.1)
HANDLERS = {"hang": hang}
'''


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_kill_of_a_running_command_job_ends_it_cancelled_not_retried_and_leaves_no_process(cspool, jobs, tmp_path):
    s = cspool
    child = tmp_path / "child.pid"
    job = s.enqueue(f"sleep 300 & echo $! > {child}; wait")
    other = s.enqueue("sleep 1")
    worker = _watching(s, "-j", jobs)
    try:
        pid = _pid_when_running(s, child)
        run = s.run("kill", job, check=False)
        assert (run.returncode, run.stdout, run.stderr) == (0, f"cancelled {job}\n", "")
        record = s.show(job)
        assert (record["state"], record["outcome"]) == ("done", "cancelled")
        assert record["history"][-1]["error"] == f"cancelled by {os.environ.get('USER') or _me()}"
        assert not alive(pid)
        run = s.run("wait", other, check=False)
        assert run.returncode == 0  # the other job is untouched
        assert s.run("kill", job, check=False).returncode == 1  # not running any more: one line, refused
    finally:
        worker.terminate()
        worker.wait(60)
    assert s.show(job)["attempts"] == 1


def _me():
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_cancel_of_a_running_handler_job_stops_it_as_a_timeout_would(cspool, jobs, tmp_path):
    s = cspool
    (tmp_path / "hangapp.py").write_text(APP)
    forked = s.enqueue("--kind", "hang", "--timeout", "1h", "--payload", "{}")
    inline = s.enqueue("--kind", "hang", "--payload", "{}")
    worker = _watching(s, "-j", jobs, "--app", "hangapp:HANDLERS", cwd=str(tmp_path))
    try:
        for job in (forked, inline):
            wait_for(lambda: _where(s, job) == ["cur"], what=f"{job} to start")
            run = s.run("cancel", job, check=False)
            assert (run.returncode, run.stdout) == (0, f"cancelled {job}\n"), run.stderr
            assert s.show(job)["outcome"] == "cancelled"
    finally:
        worker.terminate()
        worker.wait(60)


def test_kill_with_a_signal_sends_only_that_signal(cspool, tmp_path):
    s = cspool
    got = tmp_path / "got"
    job = s.enqueue(f"trap 'echo hup >> {got}' HUP; echo $$ > {tmp_path}/pid; while ! test -e {tmp_path}/end; do sleep 0.05; done")
    worker = _watching(s)
    try:
        wait_for(lambda: (tmp_path / "pid").exists(), what="the job to start")
        run = s.run("kill", "--signal", "HUP", job, check=False)
        assert (run.returncode, run.stdout) == (0, f"sent SIGHUP to job {job}\n"), run.stderr
        wait_for(lambda: got.exists(), what="the signal")
        assert _where(s, job) == ["cur"]
        (tmp_path / "end").touch()
        assert s.run("wait", job, check=False).returncode == 0
        assert s.run("kill", "--signal", "NOPE", job, check=False).returncode == 2
    finally:
        worker.terminate()
        worker.wait(60)


def test_kill_of_a_job_that_is_not_running_is_refused_in_one_line(cspool):
    s = cspool
    job = s.enqueue("--in", "1h", "true")
    run = s.run("kill", job, check=False)
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "not running" in run.stderr
    run = s.run("kill", "no-such-job", check=False)
    assert run.returncode == 1 and "no job no-such-job" in run.stderr


def test_stop_ends_a_watching_worker_after_its_running_job(cspool, tmp_path):
    s = cspool
    job = s.enqueue(f"touch {tmp_path}/began; sleep 2")
    later = s.enqueue("--in", "2s", "true")
    worker = _watching(s)
    wait_for(lambda: (tmp_path / "began").exists(), what="the job to start")
    run = s.run("stop")
    assert run.stdout == "asked 1 workers to stop\n"
    assert worker.wait(60) == 0
    assert _where(s, job) == ["done"] and s.show(job)["outcome"] == "succeeded"
    assert _where(s, later) == ["new"]  # claimed no more
    assert s.status()["workers"] == []


def test_stop_now_wait_kills_the_running_jobs_of_every_worker_and_returns_once_they_are_gone(cspool):
    s = cspool
    jobs = [s.enqueue("sleep 300") for _ in range(3)]
    pool = _watching(s, "-j", "2")
    single = _watching(s)
    wait_for(lambda: len(_ids(s, "cur")) == 3, what="three jobs to run")
    run = s.run("stop", "--now", "--wait", check=False)
    assert run.returncode == 0 and run.stdout.count("exited") == 3, run
    assert pool.poll() is not None or pool.wait(10) is not None
    assert single.wait(10) is not None
    assert sorted(_ids(s, "failed")) == sorted(jobs)  # killed by a stop: due again now, the run counted
    assert s.status()["workers"] == []


def test_pause_keeps_workers_up_but_claiming_nothing_until_resume(cspool):
    s = cspool
    worker = _watching(s)
    try:
        assert s.run("pause").stdout == "paused\n"
        assert s.run("pause").stdout == "already paused\n"
        job = s.enqueue("true")
        assert s.run("wait", "--timeout", "2", job, check=False).returncode == 124
        assert _where(s, job) == ["new"] and worker.poll() is None
        assert s.status()["paused"]["by"] == _me()
        assert s.run("resume").stdout == "resumed\n"
        assert s.run("wait", "--timeout", "60", job, check=False).returncode == 0
        assert s.status()["paused"] is None
    finally:
        worker.terminate()
        worker.wait(60)


def test_a_paused_drain_waits_for_resume_then_drains(cspool):
    s = cspool
    job = s.enqueue("true")
    s.run("pause")
    drain = s.popen("work", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)
    assert drain.poll() is None and _where(s, job) == ["new"]
    s.run("resume")
    assert drain.wait(60) == 0 and _where(s, job) == ["done"]


def test_a_member_may_kill_its_own_running_job_and_is_refused_anothers(users):
    spool = users.shared_spool()
    out = users.open_folder("out")

    def spoolq(user, *args):
        return users.spoolq(user, "-s", str(spool), *args)

    mine = spoolq(users.web, "enqueue", f"touch {out}/mine; sleep 300").stdout.strip()
    owners = spoolq(users.owner, "enqueue", f"touch {out}/owners; sleep 300").stdout.strip()
    with watching(users, spool, "-j", "2"):
        try:
            _member_kills(users, spoolq, out, mine, owners)
        finally:
            spoolq(users.owner, "stop", "--now")


def _member_kills(users, spoolq, out, mine, owners):
        wait_for(lambda: (out / "mine").exists() and (out / "owners").exists(), what="both jobs to run")
        run = spoolq(users.web, "kill", owners)
        assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
        assert f"enqueued by {users.owner.name}, not by {users.web.name}" in run.stderr
        run = spoolq(users.evil, "kill", owners)
        assert run.returncode == 1 and "not trusted" in run.stderr, run.stderr
        run = spoolq(users.web, "cancel", mine)
        assert run.returncode == 0 and run.stdout in (f"cancelled {mine}\n", f"asked job {mine} to stop; it has ended "
                                                      "(whether cancelled is readable by the spool's owner only)\n"), run.stderr
        show = json.loads(spoolq(users.owner, "show", owners, "--json").stdout)
        assert show["state"] == "cur"
        assert spoolq(users.owner, "kill", owners).returncode == 0


def test_once_pause_returns_no_worker_claims_a_job_until_resume(cspool):
    s = cspool
    pool = _watching(s, "-j", "2")
    single = _watching(s)
    wait_for(lambda: len(s.status()["workers"]) == 3, what="three workers to start")
    try:
        api = s.api()
        for _ in range(5):
            assert api.pause() is True
            jobs = [api.enqueue("true") for _ in range(3)]  # at once: no worker may be about to claim
            time.sleep(1.0)
            assert _ids(s, "cur") + _ids(s, "done") == [], "a job was claimed after pause returned"
            assert s.run("resume").stdout == "resumed\n"
            assert s.run("wait", "--timeout", "60", *jobs, check=False).returncode == 0
            s.run("compact", "--keep", "0", "--yes")
    finally:
        for proc in (pool, single):
            proc.terminate()
            proc.wait(60)


def test_cancel_of_a_run_that_ignores_sigterm_says_it_is_still_stopping_within_seconds(cspool, tmp_path):
    s = cspool
    s.config("timeout_grace", "20")
    job = s.enqueue(f"trap '' TERM; touch {tmp_path}/began; sleep 300")
    worker = _watching(s)
    try:
        wait_for(lambda: (tmp_path / "began").exists(), what="the job to start")
        began = time.monotonic()
        run = s.run("cancel", job, check=False)
        assert time.monotonic() - began < 18  # a few seconds, not the whole grace
        assert (run.returncode, run.stdout) == (0, f"asked job {job} to stop; it is still stopping "
                                                   "(SIGKILL follows timeout_grace after SIGTERM)\n"), run.stderr
        assert _where(s, job) == ["cur"]
        assert s.run("wait", "--timeout", "60", job, check=False).returncode == 1  # killed by the SIGKILL
        assert s.show(job)["outcome"] == "cancelled"
    finally:
        worker.terminate()
        worker.wait(60)


def test_cancel_of_a_running_job_says_what_really_happened_to_it(cspool, tmp_path):
    """The job ends on its own while its worker cannot take the request
    (stopped): whichever comes first, the line says what the record says."""
    s = cspool
    job = s.enqueue(f"touch {tmp_path}/began; sleep 1")
    worker = _watching(s)
    try:
        wait_for(lambda: (tmp_path / "began").exists(), what="the job to start")
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            cancel = s.popen("cancel", job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(2.5)  # the job's sleep ends meanwhile
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        out, err = cancel.communicate(timeout=60)
        record = s.show(job)
        assert record["state"] == "done", record
        if record["outcome"] == "cancelled":
            assert (cancel.returncode, out) == (0, f"cancelled {job}\n"), err
        else:
            assert record["outcome"] == "succeeded"
            assert (cancel.returncode, out) == (1, f"{job} succeeded exit=0 (it ended before the cancel reached it)\n"), err
    finally:
        worker.terminate()
        worker.wait(60)
