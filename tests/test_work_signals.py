"""Stopping workers: signals to `work` and to `work -j N`'s worker
processes, a worker process killed, and a caller of Spool.work
interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import SPOOLQ, wait_for


def test_ctrl_c_reaching_the_whole_process_group_counts_once(fast_spool, tmp_path):
    """A terminal's Ctrl-C reaches `work -j 2` and its worker processes
    alike: that is one stop (running jobs finish), not two (killed)."""
    s = fast_spool
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; sleep 1; echo finished")
    worker = s.popen("work", "--watch", "-j", "2", start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(started.exists, what="the job to start")
        os.killpg(worker.pid, signal.SIGINT)
        _, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    assert worker.returncode == 0, err
    job = s.show(job_id)
    assert job["state"] == "done" and job["stdout"] == "finished\n", job
    assert "stopping now" not in err and err.count("stopping on SIGINT: no new jobs; running jobs finish") == 1, err


def test_a_killed_worker_process_stops_the_others_and_its_job_is_recovered(fast_spool, tmp_path):
    """One of `work -j 2`'s worker processes is killed (say by the OOM
    killer) while it runs a job: the other stops too and the command exits 1,
    so that whoever restarts it (systemd, cron) recovers the job."""
    s = fast_spool
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; exec sleep 300")
    command = s.popen("work", "--watch", "-j", "2", stderr=subprocess.PIPE, text=True)
    try:
        wait_for(started.exists, what="the job to start")
        busy = wait_for(lambda: [w for w in s.status()["workers"] if job_id in w.get("jobs", {})], what="its worker")[0]
        os.kill(busy["pid"], signal.SIGKILL)
        _, err = command.communicate(timeout=60)
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
    assert command.returncode == 1 and "was killed by SIGKILL" in err, err
    assert s.where(job_id) == ["cur"]
    s.config("max_attempts", 1)
    s.work()  # recovery: the run is counted, the orphaned `sleep` is killed
    assert s.where(job_id) == ["dead"] and "interrupted" in s.show(job_id)["error"]


def test_a_worker_process_whose_pool_parent_was_killed_still_stops_on_sigterm(fast_spool, tmp_path):
    """Audit: after `kill -9` of the parent of `work -j 2` its worker
    processes stop claiming and finish their jobs, as designed, but then
    ignored SIGTERM and SIGINT for good (they left those to the parent):
    an operator could not stop a long job but with SIGKILL. The parent's
    death was their first stop signal; SIGTERM is now the second, as for
    any worker: the job is killed and goes back to failed/."""
    s = fast_spool
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; exec sleep 300")
    command = s.popen("work", "--watch", "-j", "2", stderr=subprocess.DEVNULL)
    pids: list[int] = []

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False

    try:
        wait_for(started.exists, what="the job to start")
        workers = wait_for(lambda: len(s.status()["workers"]) == 2 and s.status()["workers"], what="both workers")
        pids = [w["pid"] for w in workers]
        busy = wait_for(lambda: [w["pid"] for w in s.status()["workers"] if job_id in w.get("jobs", {})], what="its worker")[0]
        command.kill()
        command.wait()
        idle = [pid for pid in pids if pid != busy]
        wait_for(lambda: not alive(idle[0]), what="the idle worker to stop by itself")
        assert alive(busy)  # finishing its job
        os.kill(busy, signal.SIGTERM)
        wait_for(lambda: not alive(busy), what="the busy worker to stop")
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert s.where(job_id) == ["failed"] and "told to stop" in s.record("failed", job_id)["error"]


def test_a_stop_while_the_worker_processes_start_ends_cleanly(fast_spool):
    """SIGTERM right after `work -j 4` starts, many times: never a worker
    process killed by the signal passed on before it could handle it."""
    s = fast_spool
    for attempt in range(15):
        command = s.popen("work", "--watch", "-j", "4", stderr=subprocess.PIPE, text=True)
        wait_for(lambda: os.path.exists(f"/proc/{command.pid}/task/{command.pid}/children")
                 and open(f"/proc/{command.pid}/task/{command.pid}/children").read().split(), interval=0.001,
                 what="the first worker process")
        command.send_signal(signal.SIGTERM)
        _, err = command.communicate(timeout=60)
        assert command.returncode == 0 and "killed by" not in err, (attempt, err)
    assert s.status()["workers"] == []


def test_work_j2_learns_of_a_killed_worker_when_started_with_sigchld_ignored(fast_spool):
    """An ignored SIGCHLD survives exec (a daemon may start us so), and
    then the kernel sends none and reaps children itself, exit status and
    all. `work -j 2` puts it back to its default: a worker killed with -9
    is still seen for what it was, the other one is stopped, and the
    command fails."""
    s = fast_spool
    ignoring = "import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); os.execvp(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", ignoring] + SPOOLQ + ["-s", str(s.path), "work", "--watch", "-j", "2"],
                            stderr=subprocess.PIPE, text=True)
    children = f"/proc/{proc.pid}/task/{proc.pid}/children"
    workers = wait_for(lambda: len(open(children).read().split()) == 2 and open(children).read().split(),
                       what="two worker processes")
    wait_for(lambda: len(s.status()["workers"]) == 2, what="both workers registered")
    os.kill(int(workers[0]), signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=60)
    finally:  # (started without the fixture's popen: no worker outlives a failure)
        if proc.poll() is None:
            for pid in open(children).read().split():
                os.kill(int(pid), signal.SIGKILL)
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    assert f"a worker process (pid {workers[0]}) was killed by SIGKILL" in err


def test_a_stop_that_reaches_a_thread_of_the_app_still_stops_work_j2(fast_spool, tmp_path):
    """An --app module imported by `work -j 2` may start a thread of its
    own in the parent, where the signals are not blocked, so a stop can
    land there (sent to that thread here, with tgkill): the parent's
    handler passes it on once its wait next times out, within a second."""
    import ctypes

    tgkill = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)
    if tgkill is None:
        pytest.skip("tgkill's system call number is known here only for x86_64 and aarch64")
    s = fast_spool
    (tmp_path / "threaded_app.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=lambda: time.sleep(3600), name='app-thread', daemon=True).start()\n"
        "HANDLERS = {}\n"
    )
    proc = s.popen("work", "--watch", "-j", "2", "--app", "threaded_app:HANDLERS", cwd=str(tmp_path),
                   stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(s.status()["workers"]) == 2, what="both workers registered")
    app_threads = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
    assert len(app_threads) == 1  # the parent runs no thread of its own
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(tgkill, proc.pid, app_threads[0], signal.SIGTERM) == 0
    _, err = proc.communicate(timeout=20)  # not asleep until a worker ends (never, watching)
    assert proc.returncode == 0, err
    assert err.count("stopping on SIGTERM: no new jobs") == 1 and "SIGUSR" not in err, err


def _blocked_signals(pid: int) -> dict[int, int]:
    """Each thread of ``pid`` and the mask of signals it blocks."""
    masks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                masks[int(tid)] = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
        except FileNotFoundError:
            pass
    return masks


def test_a_stop_always_reaches_a_workers_main_thread(fast_spool, tmp_path):
    """A signal sent to a process goes to any of its threads that does not
    block it, and Python runs the handler only once the main thread runs
    Python again: a SIGTERM sent to one of the helper threads (with
    tgkill: registration, commit, watchdog's) left a watching worker asleep
    until its next rescan, 28 s later. So every helper thread blocks the
    signals a worker handles and its main thread none, and the jobs it
    starts inherit no blocked signal."""
    s = fast_spool
    handled = sum(1 << (sig - 1) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2))
    for n, args in enumerate((["--watch"], ["--poll", "5"], ["--watch", "-j", "2"])):
        out = tmp_path / f"job-mask-{n}"
        s.enqueue(f"grep SigBlk /proc/self/status > {out}.tmp && mv {out}.tmp {out}")
        proc = s.popen("work", *args, stderr=subprocess.PIPE, text=True)
        wait_for(out.exists, what="the job")  # by then every thread of the worker has started
        assert int(out.read_text().split()[1], 16) == 0
        def masks_as_they_should_be() -> bool:
            """Every worker process started all its threads (the main one,
            the registration's, the committer's, and watchdog's when
            watching), helper threads block the handled signals, the main
            thread none. (With -j 2 the other worker may still be starting.)"""
            if "-j" in args:
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    workers = [int(p) for p in f.read().split()]
            else:
                workers = [proc.pid]
            if len(workers) != (2 if "-j" in args else 1):
                return False
            for pid in workers:
                masks = _blocked_signals(pid)
                if len(masks) < (3 if "--poll" in args else 6) or masks.pop(pid) & handled:
                    return False
                if not all(mask & handled == handled for mask in masks.values()):
                    return False
            return True

        wait_for(masks_as_they_should_be, what=f"signal masks of the threads of work {' '.join(args)}")
        proc.terminate()
        _, err = proc.communicate(timeout=15)  # well before the 30 s rescan
        assert proc.returncode == 0, err


def test_outcomes_of_running_slots_are_committed_when_the_caller_is_interrupted(spool, tmp_path):
    """A program calling Spool.work (without spoolq's signal handlers) gets
    Ctrl-C while two slots run jobs: the slots finish, and both outcomes are
    synced and logged before work() gives the interrupt back."""
    s = spool  # fsync on: finishes wait for a group commit before they are logged
    ids = [s.enqueue("--argv", "--", "sh", "-c", "sleep 1") for _ in range(2)]
    program = tmp_path / "prog.py"
    program.write_text(
        "import sys\n"
        "from spoolq import Spool\n"
        "from spoolq.worker import Log\n"
        "try:\n"
        "    Spool(sys.argv[1]).work(jobs=2, signals=False, log=Log(sys.stderr, 1))\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', file=sys.stderr)\n"
    )
    proc = subprocess.Popen([sys.executable, str(program), str(s.path)], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(s.names("cur")) == 2, what="both jobs to run")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "interrupted" in err
    for job_id in ids:
        assert s.where(job_id) == ["done"]
        assert f"job={job_id} outcome=succeeded" in err, err
