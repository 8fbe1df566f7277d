"""Worker death and recovery: kill -9 at any moment loses no job, leaves no
process of a job behind after a sweep, and counts the interrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SPOOLQ, alive, needs_tuning, tuned_worker, wait_for


def _processes_with_env(needle: str) -> list[int]:
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/environ", "rb") as f:
                    if needle.encode() in f.read().split(b"\0") and alive(int(p)):
                        found.append(int(p))
            except OSError:
                pass
    return found


def test_kill_9_mid_job_then_sweep_kills_its_processes_and_counts_the_run(fast_spool, tmp_path):
    s = fast_spool
    pids = tmp_path / "pids"
    # The job backgrounds a child that leaves the job's session entirely (setsid)
    # and one that stays in its group; both must be gone after the sweep.
    job_id = s.enqueue("--max-attempts", "3",
                       f"sleep 300 & echo $! >> {pids}; setsid sleep 301 & echo $! >> {pids}; "
                       f"echo $$ >> {pids}; sleep 302")
    worker = s.popen("work", stderr=subprocess.DEVNULL)
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 3, what="the job to start its children")
    job_pids = [int(p) for p in pids.read_text().split()]
    assert s.ids("cur") == [job_id]
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    assert all(alive(p) for p in job_pids)  # orphans, until recovery
    out = s.run("sweep").stdout
    assert "recovered 1 to failed/" in out
    for pid in job_pids:
        wait_for(lambda: not alive(pid), timeout=10, what=f"process {pid} of the dead run to be killed")
    assert s.where(job_id) == ["failed"]
    job = s.record("failed", job_id)
    assert job["attempts"] == 1
    assert job["history"][-1]["error"] == "interrupted: the worker running it died"
    assert abs(os.stat(s.path / "failed" / f"{job_id}.json").st_mtime - time.time()) < 30  # due now
    assert s.names("workers") == []  # the dead worker's registration is cleared


def test_recovery_never_kills_a_reused_pid(fast_spool, tmp_path):
    """A registration naming a process group whose leader is some other,
    later process (a reused pid) must not get that process killed."""
    s = fast_spool
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        job_id = s.enqueue("true")
        os.rename(s.path / "new" / f"{job_id}.json", s.path / "cur" / f"{job_id}.json")
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        registration = {
            "worker": "ghost.1.abcdef", "host": os.uname().nodename, "pid": 1, "boot_id": boot,
            "jobs": {job_id: {"attempt": 1, "pgid": bystander.pid, "spawned": [1, 2]}},
        }
        (s.path / "workers" / "ghost.1.abcdef.json").write_text(json.dumps(registration))
        assert "killed 0 processes" in s.run("sweep").stdout
        assert s.where(job_id) == ["failed"]
        assert bystander.poll() is None and alive(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()


def test_registrations_of_other_hosts_or_untrusted_owners_kill_nothing(fast_spool, tmp_path):
    s = fast_spool
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    pidfile = tmp_path / "pid"
    # A worker id of this test's own: a suite run beside this one must not find its victim.
    other = f"other.7.{os.getpid():x}"
    # A process that carries a worker id in its environment, as a job would.
    victim = subprocess.Popen(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"],
                              env=dict(os.environ, SPOOLQ_WORKER=other), start_new_session=True)
    try:
        wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the process to start")
        for name, host in ((other, "some-other-host"),):
            reg = {"worker": name, "host": host, "pid": 7, "boot_id": boot, "jobs": {}}
            (s.path / "workers" / f"{name}.json").write_text(json.dumps(reg))
        assert "killed 0 processes" in s.run("sweep").stdout
        assert victim.poll() is None
        if os.geteuid() == 0:
            import pwd

            nobody = pwd.getpwnam("nobody")
            # As a worker writes it: started (this test's process) before the victim.
            with open("/proc/self/stat") as f:
                proc_start = int(f.read().rsplit(")", 1)[1].split()[19])
            reg = {"worker": other, "host": os.uname().nodename, "pid": 7, "boot_id": boot, "proc_start": proc_start,
                   "jobs": {}}
            path = s.path / "workers" / "forged.json"
            path.write_text(json.dumps(reg))
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
            assert "killed 0 processes" in s.run("sweep").stdout
            assert victim.poll() is None
            os.chown(path, 0, 0)  # the same file from a trusted owner is acted on
            assert "killed 1 processes" in s.run("sweep").stdout
            victim.wait(timeout=10)
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()


def test_a_junk_registration_does_not_stop_recovery(fast_spool):
    s = fast_spool
    (s.path / "workers" / "junk.json").write_text("[" * 200000)
    job_id = s.enqueue("true")
    s.work()
    assert s.where(job_id) == ["done"]
    assert s.run("status").returncode == 0


def test_a_job_that_kills_its_worker_ends_in_dead(fast_spool, tmp_path):
    s = fast_spool
    runs = tmp_path / "runs"
    job_id = s.enqueue("--max-attempts", "3", f"echo run >> {runs}; kill -9 $PPID; sleep 1")
    for _ in range(10):
        s.run("work", check=False)
        if s.where(job_id) == ["dead"]:
            break
    assert s.where(job_id) == ["dead"]
    job = s.record("dead", job_id)
    assert job["attempts"] == 3
    assert len(runs.read_text().split()) == 3  # it ran exactly max_attempts times
    assert all(h["error"] == "interrupted: the worker running it died" for h in job["history"])


def test_an_in_process_handler_that_kills_its_worker_ends_in_dead(fast_spool, tmp_path):
    s = fast_spool
    app = tmp_path / "suicide_app.py"
    app.write_text("import os, signal\nHANDLERS = {'die': lambda p: os.kill(os.getpid(), signal.SIGKILL)}\n")
    job_id = s.enqueue("--kind", "die", "--max-attempts", "2")
    for _ in range(6):
        s.run("work", "--app", "suicide_app:HANDLERS", cwd=str(tmp_path), check=False)
        if s.where(job_id) == ["dead"]:
            break
    assert s.where(job_id) == ["dead"] and s.record("dead", job_id)["attempts"] == 2


def test_sigterm_lets_the_running_job_finish(fast_spool, tmp_path):
    s = fast_spool
    started = tmp_path / "started"
    first = s.enqueue(f"touch {started}; sleep 1; echo finished")
    second = s.enqueue("true")
    worker = s.popen("work", stderr=subprocess.PIPE, text=True)
    wait_for(started.exists, what="the job to start")
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0
    assert s.show(first)["state"] == "done" and s.show(first)["stdout"] == "finished\n"
    assert s.where(second) == ["new"]  # no claims after the signal
    assert "stopping" in err


def _await_line(proc: subprocess.Popen, text: str, timeout: float = 60) -> None:
    """Read the worker's stderr until a line containing ``text`` arrives
    (fail if none has within ``timeout`` seconds). Read from the descriptor
    itself, so nothing waits unseen in a buffer of the pipe's file object."""
    import select

    fd = proc.stderr.fileno()
    pending = proc.__dict__.setdefault("_unread", bytearray())  # read, not yet looked at
    deadline = time.monotonic() + timeout
    while True:
        while b"\n" in pending:
            line, _, rest = bytes(pending).partition(b"\n")
            pending[:] = rest
            if text in line.decode("utf-8", "replace"):
                return
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"the worker logged no {text!r} within {timeout}s")
        data = os.read(fd, 65536)
        if not data:
            raise AssertionError(f"the worker ended without logging {text!r}")
        pending += data


def test_a_second_signal_kills_the_job_and_keeps_it(fast_spool, tmp_path):
    s = fast_spool
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; exec sleep 300")
    worker = s.popen("work", stderr=subprocess.PIPE, text=True)
    wait_for(started.exists, what="the job to start")
    worker.send_signal(signal.SIGINT)
    _await_line(worker, "stopping on SIGINT: no new jobs; running jobs finish")  # the first signal was handled
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=60)
    assert worker.returncode == 0
    assert s.where(job_id) == ["failed"]
    job = s.record("failed", job_id)
    assert job["attempts"] == 1 and job["error"] == "killed: the worker was told to stop now"
    assert os.stat(s.path / "failed" / f"{job_id}.json").st_mtime <= time.time()  # due now
    s.run("work", "--max-jobs", "0")  # nothing left in cur/ for recovery either
    assert s.ids("cur") == []


def _registrations(s) -> list[str]:
    return [n for n in os.listdir(s.path / "workers") if not n.startswith(".")]


def test_a_lone_worker_ignores_sigusr1_and_sigusr2_and_names_the_stop_signals(fast_spool, tmp_path):
    """SIGUSR1 and SIGUSR2 are a worker pool's own signals: sent by hand to
    a `work -j 1` worker they are logged and ignored, not the end of it
    with its registration left behind. A stop names the signal sent and
    what a second one does; after it nothing of the worker is left."""
    s = fast_spool
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; exec sleep 300")
    worker = s.popen("work", "--watch", stderr=subprocess.PIPE, text=True)
    wait_for(started.exists, what="the job to start")
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        worker.send_signal(sig)
        _await_line(worker, f"signal={sig.name} ignored: this worker stops on SIGTERM or SIGINT")
    assert worker.poll() is None and s.where(job_id) == ["cur"]
    worker.send_signal(signal.SIGTERM)
    _await_line(worker, "stopping on SIGTERM: no new jobs; running jobs finish (a second SIGTERM or SIGINT kills them)")
    worker.send_signal(signal.SIGINT)
    _await_line(worker, "stopping now on SIGINT: running jobs are killed and go back to failed/")
    worker.communicate(timeout=60)
    assert worker.returncode == 0
    assert s.where(job_id) == ["failed"] and _registrations(s) == []


def test_a_worker_pool_logs_the_stop_signal_it_was_sent(fast_spool, tmp_path):
    """`work -j 2` passes a stop on to its worker processes as SIGUSR1 or
    SIGUSR2; its log says SIGTERM or SIGINT, as sent, once. SIGUSR1 sent
    to the command itself is ignored."""
    s = fast_spool
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; exec sleep 300")
    command = s.popen("work", "--watch", "-j", "2", stderr=subprocess.PIPE, text=True)
    wait_for(started.exists, what="the job to start")
    wait_for(lambda: len(s.status()["workers"]) == 2, what="both workers registered")
    command.send_signal(signal.SIGUSR1)
    _await_line(command, "signal=SIGUSR1 ignored: spoolq work -j 2 stops on SIGTERM or SIGINT")
    command.send_signal(signal.SIGINT)
    _await_line(command, "stopping on SIGINT: no new jobs; running jobs finish (a second SIGTERM or SIGINT kills them)")
    assert s.where(job_id) == ["cur"]
    command.send_signal(signal.SIGTERM)
    _, err = command.communicate(timeout=60)
    assert command.returncode == 0, err
    assert "stopping now on SIGTERM: running jobs are killed and go back to failed/" in err
    assert "stopping" not in err.split("stopping now on SIGTERM")[1], err  # once, not once per worker process
    assert s.where(job_id) == ["failed"] and _registrations(s) == []


def test_spool_work_in_a_program_ignores_sigusr1(fast_spool, tmp_path):
    """A program calling Spool.work(jobs=2) from its main thread: SIGUSR1,
    left at its default by the program, does not end it; SIGTERM stops it
    and its registration goes."""
    s = fast_spool
    started = tmp_path / "started"
    s.enqueue(f"touch {started}; sleep 1")
    program = tmp_path / "prog.py"
    program.write_text(
        "import sys\n"
        "from spoolq import Spool\n"
        "from spoolq.worker import Log\n"
        "Spool(sys.argv[1]).work(jobs=2, watch=True, log=Log(sys.stderr, 1))\n")
    proc = subprocess.Popen([sys.executable, str(program), str(s.path)], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(started.exists, what="the job to start")
        proc.send_signal(signal.SIGUSR1)
        _await_line(proc, "signal=SIGUSR1 ignored")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert _registrations(s) == [] and s.status()["done"] == 1


def test_a_second_signal_stops_an_in_process_handler(fast_spool, tmp_path):
    s = fast_spool
    app = tmp_path / "loop_app.py"
    marker = tmp_path / "started"
    app.write_text(
        "import pathlib\n"
        f"def spin(p):\n    pathlib.Path({str(marker)!r}).write_text(repr(__import__('time').time()))\n    while True:\n        pass\n"
        "HANDLERS = {'spin': spin}\n"
    )
    job_id = s.enqueue("--kind", "spin")
    worker = s.popen("work", "--app", "loop_app:HANDLERS", cwd=str(tmp_path), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: marker.exists() and marker.read_text(), what="the handler to start")
    worker.send_signal(signal.SIGTERM)
    _await_line(worker, "stopping on SIGTERM: no new jobs; running jobs finish")
    worker.send_signal(signal.SIGTERM)
    worker.communicate(timeout=60)
    assert s.where(job_id) == ["failed"] and s.record("failed", job_id)["attempts"] == 1
    # Audit: the run's start was the time of the kill (start == end, duration 0).
    from datetime import datetime

    run = s.record("failed", job_id)["history"][0]
    start, end = (datetime.fromisoformat(run[k].replace("Z", "+00:00")).timestamp() for k in ("start", "end"))
    assert start <= float(marker.read_text()) <= end


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_a_job_stopped_between_its_claim_and_its_start_goes_back_uncounted(fast_spool, tmp_path):
    """Audit: a second stop signal that came after a claim but before the
    job started charged a run that never happened ("killed: the worker was
    told to stop now", start == end): with max_attempts 1 the job went to
    dead/ without ever running. strace sends the first SIGTERM on the
    claim's rename and the second as the job's payload file is made, just
    before its process would start."""
    s = fast_spool
    ran = tmp_path / "ran"
    job_id = s.enqueue("--max-attempts", "1", "--payload", '{"a": 1}', f"cat > /dev/null; echo ran >> {ran}")
    before = s.record("new", job_id)
    # renameat2: the registration, then the claim. memfd_create: the spare stdout and stderr, then the payload.
    proc = subprocess.run(["strace", "-qq", "-o", os.devnull, "-e", "trace=renameat2,memfd_create",
                           "-e", "inject=renameat2:signal=TERM:when=2", "-e", "inject=memfd_create:signal=TERM:when=3",
                           *SPOOLQ, "-s", str(s.path), "work", "-v"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "not started: the worker was told to stop now; back in new/" in proc.stderr, proc.stderr
    assert s.where(job_id) == ["new"] and s.record("new", job_id) == before and not ran.exists()
    s.work()
    job = s.show(job_id)
    assert job["state"] == "done" and job["attempts"] == 1 and ran.read_text() == "ran\n"


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_a_job_put_back_whose_folder_sync_fails_is_not_also_finished(spool):
    """Review: when the sync after moving a not-started job back failed, the
    worker still took the job for one in cur/ and finished it as an
    interrupted run, leaving a stray staged record in cur/. The signals as
    in the test above, with fsync on; the put-back's fsync of new/ (the
    worker's first fsync) fails."""
    s = spool
    job_id = s.enqueue("--payload", '{"a": 1}', "cat > /dev/null")
    before = s.record("new", job_id)
    proc = subprocess.run(["strace", "-qq", "-o", os.devnull, "-e", "trace=renameat2,memfd_create,fsync",
                           "-e", "inject=renameat2:signal=TERM:when=2", "-e", "inject=memfd_create:signal=TERM:when=3",
                           "-e", "inject=fsync:error=EIO:when=1",
                           *SPOOLQ, "-s", str(s.path), "work"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "back in new/ but not synced; the worker stops claiming" in proc.stderr, proc.stderr
    assert s.where(job_id) == ["new"] and s.record("new", job_id) == before
    assert os.listdir(s.path / "cur") == []


def test_a_run_that_finished_but_was_not_moved_is_completed_not_rerun(fast_spool):
    """Recovery of a job whose outcome was recorded (attempts match the
    registration) just finishes the move: the run is not counted twice."""
    s = fast_spool
    job_id = s.enqueue("true")
    s.work()
    record = s.record("done", job_id)
    os.rename(s.path / "done" / f"{job_id}.json", s.path / "cur" / f"{job_id}.json")
    registration = {"worker": "gone.2.abcdef", "pid": 2, "boot_id": "", "jobs": {job_id: {"attempt": 1}}}
    (s.path / "workers" / "gone.2.abcdef.json").write_text(json.dumps(registration))
    assert "completed 1" in s.run("sweep").stdout
    assert s.where(job_id) == ["done"]
    assert s.record("done", job_id)["attempts"] == record["attempts"] == 1


def _pending_outcomes(s) -> dict[str, Path]:
    """The outcomes a worker recorded but has not yet moved on: files in
    cur/ beside its jobs that hold a job's record with its run's outcome,
    whatever their names. Job id -> file."""
    cur = s.path / "cur"
    jobs = set(s.names("cur"))
    pending = {}
    for name in os.listdir(cur):
        if name in jobs:
            continue
        try:
            job = json.loads((cur / name).read_bytes())
        except (OSError, ValueError):
            continue  # (a file being written, or not a record)
        if isinstance(job, dict) and job.get("state") in ("done", "failed", "dead") and job.get("history"):
            pending[job["id"]] = cur / name
    return pending


def _kill_with_staged_outcomes(s, tmp_path, finished: int, failing: int = 0) -> tuple[list[str], str]:
    """Run ``finished`` short jobs (each counts its runs; the last
    ``failing`` of them fail) and then a long one under a worker whose group
    commit never comes due, and kill -9 it while the short jobs' outcomes
    are staged, not yet moved on."""
    runs = tmp_path / "runs"
    runs.mkdir()
    short = [s.enqueue("--id", f"short{i}", "--max-attempts", "5",
                       f'echo ran >> {runs}/"$SPOOLQ_JOB_ID"' + ("; exit 3" if i >= finished - failing else ""))
             for i in range(finished)]
    started = tmp_path / "started"
    long_id = s.enqueue("--id", "long", f"touch {started}; exec sleep 300")
    worker = tuned_worker(s, {"commit_seconds": 600})
    wait_for(started.exists, what="the long job to start")
    wait_for(lambda: len(_pending_outcomes(s)) == finished, what="the short jobs' outcomes to be recorded")
    assert s.ids("cur") == sorted(short + [long_id])  # not one has moved on yet
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    return short, long_id


@needs_tuning
def test_outcomes_staged_for_a_group_sync_survive_kill_9(spool, tmp_path):
    """With fsync on, finished jobs wait in cur/ for one sync of all their
    records. A worker killed then loses none of those outcomes: recovery
    finds each staged record (whole: its CRC matches) and completes the
    move, and no finished job runs again."""
    s = spool
    short, long_id = _kill_with_staged_outcomes(s, tmp_path, 4, failing=2)
    out = s.run("sweep").stdout
    assert "completed 4" in out and "recovered 1 to failed/" in out, out
    for job_id, state in zip(short, ["done", "done", "failed", "failed"]):
        assert s.where(job_id) == [state]
        job = s.record(state, job_id)
        assert job["attempts"] == 1 and len(job["history"]) == 1 and job["history"][0]["exit_code"] == (0 if state == "done" else 3)
        assert (tmp_path / "runs" / job_id).read_text() == "ran\n"  # ran once, not again
        if state == "failed":  # and waits its backoff
            assert os.stat(s.path / "failed" / f"{job_id}.json").st_mtime > time.time() + 30
    assert s.where(long_id) == ["failed"]
    assert s.record("failed", long_id)["history"][-1]["error"] == "interrupted: the worker running it died"
    assert os.listdir(s.path / "cur") == []  # nothing left behind, hidden or not


@needs_tuning
def test_a_torn_staged_record_is_not_trusted(spool, tmp_path):
    """A recorded outcome whose bytes are not what the worker wrote (a power
    cut that kept the file but not all its data) is discarded: that run counts
    as interrupted and the job runs again; the intact one is completed."""
    s = spool
    (torn_id, kept_id), long_id = _kill_with_staged_outcomes(s, tmp_path, 2)
    torn = _pending_outcomes(s)[torn_id]
    data = bytearray(torn.read_bytes())
    data[data.index(b"succeeded")] = ord("S")  # still valid JSON: only the worker's own check can tell
    torn.write_bytes(bytes(data))
    out = s.run("sweep").stdout
    assert "completed 1" in out and "recovered 2 to failed/" in out, out
    assert s.where(kept_id) == ["done"]
    assert s.where(torn_id) == ["failed"]
    job = s.record("failed", torn_id)
    assert job["attempts"] == 1 and job["history"][-1]["error"] == "interrupted: the worker running it died"
    assert _pending_outcomes(s) == {}
    os.rename(s.path / "failed" / f"{long_id}.json", s.path / "dead" / f"{long_id}.json")  # not again
    s.work()
    assert (tmp_path / "runs" / torn_id).read_text() == "ran\nran\n"


def test_recovery_counts_a_cut_short_finish_once(fast_spool):
    """What a worker killed mid-finish leaves, made by hand: for ``swapped``
    the failed run's record already took the job's name, and the worker's
    registration (kept until the move for a failed run) names that run; for
    ``staged`` the record waits under its staged name, CRC in the name. Each
    counts the run once, and the failed one keeps its backoff. Each has a
    twin the evidence does not fit (the registration names a later run; the
    staged record's history is not this job's), whose run counts as
    interrupted."""
    import zlib

    s = fast_spool
    ids = ["swapped", "swapped_later_run", "staged", "staged_other_history"]
    for job_id in ids:
        s.enqueue("--id", job_id, "--max-attempts", "5", "exit 1")
    s.work()
    cur = s.path / "cur"
    for job_id in ids:  # each failed once, then its finish was cut short
        os.rename(s.path / "failed" / f"{job_id}.json", cur / f"{job_id}.json")
    for job_id, first in (("staged", None), ("staged_other_history", {"attempt": 1, "exit_code": 7})):
        job = s.record("cur", job_id)
        history = [first] if first else job["history"]
        job.update(state="done", outcome="succeeded", attempts=2, exit_code=0,
                   history=history + [{"attempt": 2, "exit_code": 0}])
        data = json.dumps(job).encode()
        (cur / f".staged.{job_id}.json.{zlib.crc32(data):08x}").write_bytes(data)
    runs = {"swapped": {"attempt": 1}, "swapped_later_run": {"attempt": 2}}
    registration = {"worker": "gone.2.abcdef", "pid": 2, "boot_id": "", "jobs": runs}
    (s.path / "workers" / "gone.2.abcdef.json").write_text(json.dumps(registration))

    out = s.run("sweep").stdout
    assert "completed 2" in out and "recovered 2 to failed/" in out, out
    assert s.where("swapped") == ["failed"] and s.record("failed", "swapped")["attempts"] == 1
    assert os.stat(s.path / "failed" / "swapped.json").st_mtime > time.time() + 30  # its backoff, as it would have had
    assert s.where("staged") == ["done"] and s.record("done", "staged")["attempts"] == 2
    for job_id in ("swapped_later_run", "staged_other_history"):
        job = s.record("failed", job_id)
        assert job["attempts"] == 2 and job["history"][-1]["error"] == "interrupted: the worker running it died", job_id
    assert not [n for n in os.listdir(cur) if n.startswith(".")]


def test_a_retry_that_kills_its_worker_before_a_flush_is_counted(fast_spool, tmp_path):
    """An in-process handler's run reaches workers/ when the registration is
    next flushed. A job whose first run lasted past a flush, failed, and was
    retried at once (zero backoff) by the same worker, which its retry then
    killed: the file must not still name the first run, or recovery takes
    the first run's recorded failure for the second's."""
    s = fast_spool
    s.config("backoff_initial", 0)
    s.run("enqueue", "--kind", "flaky", "--id", "flaky", "--max-attempts", "5")
    mark = tmp_path / "ran-once"
    program = (
        "import os, signal, sys, time\n"
        "from spoolq import Spool\n"
        "def flaky(payload):\n"
        f"    if not os.path.exists({str(mark)!r}):\n"
        f"        open({str(mark)!r}, 'w').close()\n"
        "        time.sleep(0.6)  # past the registration's flush (every 0.25 s)\n"
        "        raise RuntimeError('the first run fails')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"Spool({str(s.path)!r}).work(handlers={{'flaky': flaky}})\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert s.ids("cur") == ["flaky"]
    assert "recovered 1 to failed/" in s.run("sweep").stdout
    job = s.record("failed", "flaky")
    assert job["attempts"] == 2
    assert [h.get("error") for h in job["history"]] == ["RuntimeError: the first run fails",
                                                        "interrupted: the worker running it died"]


def test_recovery_of_more_jobs_than_the_open_file_limit_allows_open(fast_spool):
    """Many worker processes died at once (a power cut under -j 200), and a
    worker starts with a soft limit of 48 open files: recovery holds cur/'s
    jobs a batch at a time, where holding all of them at once failed with
    "Too many open files" and left every one in cur/. The dead worker's
    registration lists them all and is cleared once the last is back."""
    s = fast_spool
    s.run("enqueue", "--jsonl", "-", input='{"argv": ["true"]}\n' * 150)
    ids = s.ids("new")
    for job_id in ids:
        os.rename(s.path / "new" / f"{job_id}.json", s.path / "cur" / f"{job_id}.json")
    registration = {"worker": "gone.2.abcdef", "pid": 2, "boot_id": "",
                    "jobs": {job_id: {"attempt": 1} for job_id in ids}}
    (s.path / "workers" / "gone.2.abcdef.json").write_text(json.dumps(registration))
    proc = s.run("sweep", open_files=48, check=False)
    assert proc.returncode == 0, proc.stderr
    assert not s.names("cur") and sorted(s.ids("failed")) == sorted(ids)
    assert not os.listdir(s.path / "workers")
    assert all(s.record("failed", job_id)["attempts"] == 1 for job_id in ids[:5])


def test_sweep_leaves_live_workers_alone(fast_spool, tmp_path):
    s = fast_spool
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; sleep 2")
    worker = s.popen("work", stderr=subprocess.DEVNULL)
    try:
        wait_for(started.exists, what="the job to start")
        out = s.run("sweep").stdout
        assert "recovered 0" in out
        assert s.where(job_id) == ["cur"]
        assert len(s.names("workers")) == 1
    finally:
        worker.wait(timeout=60)
    assert s.where(job_id) == ["done"]


def test_a_copy_of_a_live_workers_registration_gets_none_of_its_processes_killed(fast_spool, tmp_path):
    """Regression (audit): a copied registration is unlocked, so it looked
    like a dead worker's, and sweep killed the live worker's running job."""
    s = fast_spool
    started, release = tmp_path / "started", tmp_path / "release"
    job_id = s.enqueue(f"touch {started}; while [ ! -e {release} ]; do sleep 0.05; done")
    worker = s.popen("work", stderr=subprocess.DEVNULL)
    try:
        wait_for(started.exists, what="the job to start")
        (registration,) = s.names("workers")
        wait_for(lambda: '"pgid"' in (s.path / "workers" / registration).read_text(), what="the run's process group on record")
        shutil.copy(s.path / "workers" / registration, s.path / "workers" / "copy.json")
        assert "killed 0 processes" in s.run("sweep").stdout
        assert s.where(job_id) == ["cur"]
        release.touch()
    finally:
        worker.wait(timeout=60)
    assert s.where(job_id) == ["done"] and s.show(job_id)["outcome"] == "succeeded"


MOVES = "rename,renameat,renameat2"
WRITES = "write,pwrite64,writev,pwritev,pwritev2"


def _killed_at(s, calls: str, k: int, *args: str, cwd: str | None = None) -> bool:
    """Run ``spoolq -s SPOOL ARGS``, killed (SIGKILL, by strace) on entering
    its ``k``-th call of one of ``calls``: whether it was (it makes fewer)."""
    proc = subprocess.run(["strace", "-qq", "-o", os.devnull, "-e", f"trace={calls}", "-e", f"inject={calls}:signal=KILL:when={k}",
                           *SPOOLQ, "-s", str(s.path), *args], cwd=cwd, capture_output=True, timeout=60)
    return proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
@pytest.mark.parametrize("fixture", ["fast_spool", "spool"])
def test_an_in_process_handler_killed_at_any_move_is_charged_once_per_run(request, fixture, tmp_path):
    """Regression (audit): a worker killed after a failed in-process run was
    written into its record in cur/, before the move to failed/, had not yet
    listed the run in its registration, so recovery took the record for the
    run before and added a run that never happened: the job went dead after
    two real runs of three. Killed on entering each of its moves in turn,
    then recovered by the next worker: every job has as many attempts as
    real runs, and sits in one folder."""
    s = request.getfixturevalue(fixture)
    s.config("backoff_initial", 0)
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "failapp.py").write_text(
        "import os\n"
        f"def fail(p):\n    open(os.path.join({str(runs)!r}, p), 'a').write('run\\n')\n"
        "    raise RuntimeError('boom')\n"
        "HANDLERS = {'fail': fail}\n")
    app = ("--app", "failapp:HANDLERS")
    for k in range(1, 100):
        job_id = f"hf{k}"
        s.enqueue("--id", job_id, "--kind", "fail", "--max-attempts", "3", "--payload", json.dumps(job_id))
        killed = _killed_at(s, MOVES, k, "work", *app, cwd=str(tmp_path))
        s.run("work", *app, cwd=str(tmp_path))  # recovery, then the runs left
        job = s.show(job_id)
        ran = (runs / job_id).read_text().count("run") if (runs / job_id).exists() else 0
        assert s.where(job_id) == ["dead"] and job["attempts"] == ran == 3, (k, ran, job)
        assert [h["error"] for h in job["history"]] == ["RuntimeError: boom"] * 3, (k, job["history"])
        if not killed:
            break
    assert 4 < k < 100  # it was killed at every move of all three runs, then ran through


@needs_tuning
def test_a_staged_finish_whose_history_was_trimmed_is_completed_by_recovery(spool, tmp_path):
    """Review: a record trimmed to fit max_job_bytes (its oldest history
    entries dropped) no longer had the job's history as its prefix, so
    recovery refused the outcome of a worker killed before the move and ran
    a finished job again. The worker here waits for its group sync (Tuning
    seam) while a long job runs, and is killed then."""
    s = spool
    s.config("max_job_bytes", 20000)
    runs = tmp_path / "runs"
    old_runs = [{"attempt": i, "worker": "w", "due": 1e9, "start": 1e9, "end": 1e9 + 1, "error": "e" * 200} for i in range(1, 61)]
    job = {"command": f"echo run >> {runs}", "state": "new", "attempts": 0, "max_attempts": 100,
           "created_at": "2026-01-01T00:00:00Z", "history": old_runs, "payload": ""}
    job["payload"] = "p" * (19950 - len(json.dumps(job, separators=(",", ":"))))
    s.drop("trimmed.json", json.dumps(job, separators=(",", ":")))
    past = time.time() - 60
    os.utime(s.path / "new" / "trimmed.json", (past, past))  # first in line
    started = tmp_path / "started"
    s.enqueue("--id", "long", f"touch {started}; exec sleep 300")
    worker = tuned_worker(s, {"commit_seconds": 600})
    wait_for(started.exists, what="the long job to start")
    wait_for(lambda: "trimmed" in _pending_outcomes(s), what="the trimmed job's outcome to be recorded")
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    assert "completed 1" in s.run("sweep").stdout
    done = s.show("trimmed")
    assert runs.read_text() == "run\n"  # not run again
    assert done["state"] == "done" and done["attempts"] == 1 and done["history_dropped"] >= 1
    assert len(done["history"]) + done["history_dropped"] == 61 and done["history"][-1]["attempt"] == 1
    assert os.path.getsize(s.path / "done" / "trimmed.json") <= 20000


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_a_recovery_killed_before_its_move_does_not_count_the_run_twice(fast_spool, tmp_path):
    """Review: a run no registration listed (its in-process handler killed
    the worker before the flusher wrote it down) was charged again when the
    recovery itself was killed between writing the interrupted record and
    moving the job on: the next recovery took that record for the run before.
    The recovery is killed on entering each of its moves in turn: the run
    is counted once."""
    s = fast_spool
    (tmp_path / "killapp.py").write_text("import os, signal\nHANDLERS = {'die': lambda p: os.kill(os.getpid(), signal.SIGKILL)}\n")
    for k in range(1, 50):
        job_id = f"dies{k}"
        s.enqueue("--id", job_id, "--kind", "die", "--max-attempts", "3")
        s.run("work", "--app", "killapp:HANDLERS", cwd=str(tmp_path), check=False)
        assert s.where(job_id) == ["cur"]
        killed = _killed_at(s, MOVES, k, "sweep")
        s.run("sweep")
        job = s.show(job_id)
        assert job["state"] == "failed" and job["attempts"] == 1 and [h["attempt"] for h in job["history"]] == [1], (k, job)
        if not killed:
            break
    assert k > 1


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_a_cancel_killed_at_any_step_leaves_a_job_that_runs_or_one_that_is_cancelled(fast_spool, tmp_path):
    """Regression (audit): cancel wrote "done, cancelled" into the record in
    new/ before the move; killed in between, the job was run by the next
    worker, and if that worker died too, recovery took the record for a
    recorded finish: a job that ran ended "cancelled" with no history.
    Killed on entering each of its moves and each of its writes in turn: the
    job is in one folder, and either runs or is cancelled (and read as
    cancelled before and after compaction), never both."""
    s = fast_spool
    outcomes = {}
    for calls in (MOVES, WRITES):
        for k in range(1, 100):
            job_id = s.enqueue("echo ran")
            killed = _killed_at(s, calls, k, "cancel", job_id)
            assert len(s.where(job_id)) == 1, (calls, k, s.where(job_id))
            if s.where(job_id) == ["done"]:
                assert s.show(job_id)["outcome"] == "cancelled", (calls, k)  # whatever the record says yet
            s.work()
            job = s.show(job_id)
            if job["outcome"] == "cancelled":
                assert "stdout" not in job and not job.get("history"), (calls, k, job)
            else:
                assert job["outcome"] == "succeeded" and job["stdout"] == "ran\n" and job["attempts"] == 1, (calls, k, job)
            outcomes[job_id] = job["outcome"]
            if not killed:
                assert job["outcome"] == "cancelled"
                break
        assert k > 1, calls
    assert "cancelled" in outcomes.values() and "succeeded" in outcomes.values()
    stats = json.loads(s.run("stats", "--json").stdout)["total"]
    assert stats["cancelled"] == list(outcomes.values()).count("cancelled"), stats
    s.run("compact")
    for job_id, outcome in outcomes.items():
        assert s.show(job_id)["outcome"] == outcome


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_a_retry_killed_at_any_step_leaves_the_dead_file_as_it_was_or_a_fresh_round(fast_spool, tmp_path):
    """Review: retry rewrote the dead record before the move, so a retry
    killed in between (or refused by a name taken meanwhile) left dead/
    holding a record that said new, its error gone. Now it moves first.
    Killed on entering each of its moves and each of its writes in turn:
    the job is in dead/ as it was, or in new/ as a fresh round that runs."""
    s = fast_spool
    s.config("backoff_initial", 0)
    for calls in (MOVES, WRITES):
        for k in range(1, 100):
            job_id = s.enqueue("--max-attempts", "2", f"test -e {tmp_path}/flag-$SPOOLQ_JOB_ID")
            s.work()
            dead = s.path / "dead" / f"{job_id}.json"
            before = dead.read_bytes()
            killed = _killed_at(s, calls, k, "retry", job_id)
            where = s.where(job_id)
            assert where in (["dead"], ["new"]), (calls, k, where)
            if where == ["dead"]:
                assert dead.read_bytes() == before, (calls, k)
                s.run("retry", job_id)
            (tmp_path / f"flag-{job_id}").touch()
            s.work()
            job = s.show(job_id)
            assert job["outcome"] == "succeeded" and job["attempts"] == 1 and len(job["history"]) == 3, (calls, k, job)
            if not killed:
                break
        assert k > 1, calls


def test_stale_tmp_files_are_removed_by_sweep(fast_spool):
    s = fast_spool
    old = s.path / "tmp" / "abandoned"
    old.write_text("{")
    fresh = s.path / "tmp" / "being-written"
    fresh.write_text("{")
    past = time.time() - 37 * 3600
    os.utime(old, (past, past))
    assert "removed 1 tmp/" in s.run("sweep").stdout
    assert not old.exists() and fresh.exists()


def test_a_forked_handler_does_not_inherit_locks_or_signal_handlers(fast_spool, tmp_path):
    """Regression (review): a handler child kept the worker's flocks (other
    jobs looked running) and its SIGTERM handler (timeouts waited the grace)."""
    s = fast_spool
    s.config("timeout_grace", 20)
    app = tmp_path / "slow_app.py"
    marker = tmp_path / "started"
    app.write_text(
        "import pathlib, time\n"
        f"def slow(p):\n    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(300)\n"
        "HANDLERS = {'slow': slow}\n"
    )
    slow = s.enqueue("--kind", "slow", "--timeout", "2", "--max-attempts", "1")
    failing = s.enqueue("--max-attempts", "3", "exit 1")
    log = open(tmp_path / "worker.log", "w")
    worker = s.popen("work", "-j", "2", "--app", "slow_app:HANDLERS", cwd=str(tmp_path), stderr=log)
    try:
        wait_for(marker.exists, what="the handler to start")
        wait_for(lambda: s.where(failing) == ["failed"], what="the failing job to fail once")
        proc = s.run("cancel", failing, check=False)  # not held by the forked child
        assert proc.returncode == 0, proc.stderr
        started = time.monotonic()
        worker.wait(timeout=60)
        assert time.monotonic() - started < 15  # SIGTERM ended it; no 20 s grace
    finally:
        if worker.poll() is None:
            worker.kill()
        log.close()
    assert s.show(slow)["error"] == "timed out after 2s"
    assert "stopping" not in (tmp_path / "worker.log").read_text()


def test_a_long_next_job_does_not_hold_back_the_previous_outcome(spool, tmp_path):
    """Regression (review): with group commit, an outcome waited for the next
    job to end before being synced and logged."""
    s = spool
    first = s.enqueue("true")
    started = tmp_path / "started"
    s.enqueue(f"touch {started}; sleep 30")
    log = open(tmp_path / "worker.log", "w")
    worker = s.popen("work", stderr=log)
    try:
        wait_for(started.exists, what="the long job to start")
        wait_for(lambda: f"job={first} outcome=succeeded" in (tmp_path / "worker.log").read_text(),
                 timeout=10, what="the first outcome to be logged while the second runs")
    finally:
        worker.kill()
        worker.wait()
        log.close()
        s.run("sweep")  # and the orphaned sleep with it


def _locked(path) -> bool:
    """Whether some process holds the file's flock (probed without waiting)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_the_job_prepared_ahead_is_let_go_and_never_charged(fast_spool, tmp_path):
    """-j 1 locks and reads the next job while the current one's process
    runs. A slow job lets it go (it can be cancelled, others can take it)."""
    s = fast_spool
    started = tmp_path / "started"
    slow = s.enqueue(f"touch {started}; exec sleep 300")
    s.enqueue("--id", "next-job", "true")
    worker = s.popen("work", "-j", "1", stderr=subprocess.DEVNULL)
    wait_for(started.exists, what="the slow job to start")
    wait_for(lambda: not _locked(s.path / "new" / "next-job.json"), what="the prepared job to be let go")
    assert s.run("cancel", "next-job").returncode == 0 and s.where("next-job") == ["done"]
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    s.run("sweep")
    s.run("cancel", slow)


@needs_tuning
def test_a_worker_killed_while_it_holds_a_prepared_job_loses_nothing(fast_spool, tmp_path):
    """A worker that holds the next job as long as the slow one runs (the
    hold lengthened through the Tuning seam), killed: the held job waits in
    new/, no attempt counted, and runs once later."""
    s = fast_spool
    started = tmp_path / "started"
    slow = s.enqueue(f"touch {started}; exec sleep 300")
    s.enqueue("--id", "held-job", "true")
    worker = tuned_worker(s, {"look_ahead_hold": 600})
    wait_for(started.exists, what="the slow job to start")
    wait_for(lambda: _locked(s.path / "new" / "held-job.json"), what="the next job to be prepared")
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    assert "recovered 1 to failed/" in s.run("sweep").stdout  # the running one, not the held one
    assert s.where("held-job") == ["new"]
    held = s.record("new", "held-job")
    assert held.get("attempts", 0) == 0 and not held.get("history")  # never charged
    s.run("cancel", slow)
    s.work()
    job = s.show("held-job")
    assert job["state"] == "done" and job["attempts"] == 1


@needs_tuning
def test_another_worker_takes_the_job_a_slow_one_prepared(fast_spool, tmp_path):
    """A worker that prepared the next job lets it go when its own job runs
    long; no event says so, yet a drain started meanwhile must take it (it
    looks again soon after finding a due file locked) rather than end."""
    s = fast_spool
    started = tmp_path / "started"
    s.enqueue(f"touch {started}; exec sleep 300")
    s.enqueue("--id", "next-job", "true")
    holder = tuned_worker(s, {"look_ahead_hold": 0.5})
    wait_for(started.exists, what="the slow job to start")
    wait_for(lambda: _locked(s.path / "new" / "next-job.json"), what="the next job to be prepared")
    s.work()  # a second worker, while the first still holds next-job
    assert s.where("next-job") == ["done"]
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    s.run("sweep")


def _worker_holding_the_next_job(s, tmp_path, job_id: str, command: str):
    """A -j 1 worker running a job that waits for a ``go`` file, holding the
    next one (``job_id``) prepared until then. Returns (worker, go, path)."""
    go = tmp_path / "go"
    s.enqueue(f"while [ ! -e {go} ]; do sleep 0.02; done")
    s.enqueue("--id", job_id, command)
    worker = tuned_worker(s, {"look_ahead_hold": 600})
    target = s.path / "new" / f"{job_id}.json"
    wait_for(lambda: _locked(target), what="the next job to be prepared")
    return worker, go, target


@needs_tuning
def test_a_prepared_job_postponed_with_touch_waits(fast_spool, tmp_path):
    """`touch -d` on a job the worker has already prepared (locked, read,
    still in new/) postpones it: when the job before it ends the worker lets
    it go instead of running it."""
    s = fast_spool
    worker, go, target = _worker_holding_the_next_job(s, tmp_path, "later", "true")
    future = time.time() + 3600
    os.utime(target, (future, future))
    go.touch()
    assert worker.wait(timeout=60) == 0
    assert s.where("later") == ["new"]
    assert abs(target.stat().st_mtime - future) < 1
    assert s.show("later")["attempts"] == 0 and not _locked(target)


@needs_tuning
def test_a_prepared_job_replaced_under_its_name_runs_as_replaced(fast_spool, tmp_path):
    """An editor that saves by rename while the worker holds the old file:
    the worker must not rename the new file into cur/ unlocked and run the
    old content; it lets the old one go and runs the new one."""
    s = fast_spool
    worker, go, target = _worker_holding_the_next_job(s, tmp_path, "edited", "echo original")
    job = json.loads(target.read_text())
    job["command"] = "echo edited"
    saved = s.path / "tmp" / "edited.json.swp"
    saved.write_text(json.dumps(job))
    os.rename(saved, target)
    go.touch()
    assert worker.wait(timeout=60) == 0
    done = s.show("edited")
    assert done["state"] == "done" and done["stdout"] == "edited\n"
    assert done["attempts"] == 1 and len(done["history"]) == 1


def _as(user: str, gid: int) -> list[str]:
    """A command prefix that runs as ``user`` with primary group ``gid``."""
    return ["setpriv", f"--reuid={user}", f"--regid={gid}", "--clear-groups"]


def test_the_owners_recovery_leaves_a_root_workers_job_to_root_so_it_stays_the_members(users):
    """A root worker runs a member's job as that member, and dies with the
    job's process still running. The spool owner's recovery leaves the job
    in cur/ (rewritten by the owner, it would run as the owner); root's
    kills what the run left and moves it on, and it runs again as the
    member."""
    base = users.folder("crash", owner=users.owner)
    path = str(base / "spool")
    job_id = f"long-{os.getpid()}"  # its own: a suite run beside this one has processes of the same job
    runs = base / "runs"

    def run(user, *args: str) -> subprocess.CompletedProcess:
        proc = users.spoolq(user, "-s", path, *args)
        assert proc.returncode == 0, proc.stderr
        return proc

    run(users.owner, "init", "--group", users.group)
    run(users.owner, "config", "set", "trusted_users", users.web.name)
    run(users.owner, "config", "set", "backoff_initial", "0")
    runs.touch()
    os.chmod(runs, 0o666)
    run(users.web, "enqueue", "--id", job_id, f'id -un >> {runs}; if [ "$SPOOLQ_ATTEMPT" = 1 ]; then exec sleep 300; fi')
    worker = users.popen(None, "-s", path, "work", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: runs.read_text() == "sqtweb\n", what="the job to start")
        worker.kill()
        worker.wait()
        job_pids = _processes_with_env(f"SPOOLQ_JOB_ID={job_id}")  # (readable: the test runs as root)
        assert len(job_pids) == 1  # the job's process outlived its worker
        assert os.stat(f"/proc/{job_pids[0]}").st_uid == users.web.uid
        out = run(users.owner, "sweep").stdout
        assert "recovered 0 to failed/" in out and "left 1 jobs of a root worker in cur/" in out, out
        assert os.listdir(os.path.join(path, "cur")) == [f"{job_id}.json"] and alive(job_pids[0])
        out = run(None, "sweep").stdout
        assert "recovered 1 to failed/" in out and "killed 1 processes" in out and "left" not in out, out
        wait_for(lambda: not alive(job_pids[0]), what="the job's process to end")
        ran = run(None, "work")
        assert runs.read_text() == "sqtweb\nsqtweb\n", (ran.stderr, run(None, "show", job_id).stdout)
        job = json.loads(run(None, "show", job_id, "--json").stdout)  # (the record is its worker's, root's: 0600)
        assert job["attempts"] == 2 and job["history"][0]["error"].startswith("interrupted")
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()
        for pid in _processes_with_env(f"SPOOLQ_JOB_ID={job_id}"):
            os.kill(pid, signal.SIGKILL)


def test_a_job_whose_worker_died_is_shown_abandoned_until_a_sweep(fast_spool, tmp_path):
    s = fast_spool
    pid_file = tmp_path / "job.pid"
    job_id = s.enqueue(f"echo $$ > {pid_file}; exec sleep 300")
    worker = s.popen("work", stderr=subprocess.DEVNULL)
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), what="the job to start")
    # While its worker lives, a running job is just running.
    assert s.status()["abandoned"] == 0 and "abandoned" not in s.run("status").stdout
    assert "abandoned" not in s.show(job_id) and "abandoned" not in s.run("list").stdout
    assert s.where(job_id) == ["cur"]
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    os.kill(int(pid_file.read_text()), signal.SIGKILL)

    status = s.status()
    assert status["cur"] == 1 and status["abandoned"] == 1
    text = s.run("status").stdout
    assert "1 abandoned: its worker died; 'spoolq sweep' or the next worker recovers it" in text
    listed = [json.loads(line) for line in s.run("list", "--json").stdout.splitlines()]
    assert [(j["id"], j["state"], j.get("abandoned")) for j in listed] == [(job_id, "cur", True)]
    line = s.run("list", "--state", "cur").stdout
    assert job_id in line and "abandoned: the worker running it died; 'spoolq sweep' (or the next worker) recovers it" in line
    shown = s.show(job_id)
    assert shown["state"] == "cur" and shown["abandoned"] is True
    assert "note: abandoned: the worker running it died; 'spoolq sweep' (or the next worker) recovers it" in \
        s.run("show", job_id).stdout.splitlines()

    s.run("sweep")
    assert s.where(job_id) == ["failed"]
    assert s.status()["abandoned"] == 0 and "abandoned" not in s.run("status").stdout
    assert "abandoned" not in s.show(job_id) and "abandoned" not in s.run("list").stdout
