"""Running jobs with ``spoolq work`` in drain mode: the process contract of
section 6, retries and backoff, dead letters, cancel and retry."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import SPOOLQ, wait_for


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
    b = s.enqueue("--cwd", str(tmp_path / "nowhere"), "true")
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
        wait_for(lambda: not _alive(pid), timeout=10, what=f"pid {pid} to die")


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
    wait_for(lambda: not _alive(pid), timeout=10, what="the escaped process to die")
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
    wait_for(lambda: not _alive(pid), timeout=10, what="the escaped process to die")


def test_a_job_that_floods_its_output_costs_the_worker_only_a_little_memory(fast_spool):
    """Audit: a worker looked at a job's captured output every 0.25 s, so a
    job printing `yes` (a gigabyte a second here) held 100-450 MB of memory
    between two looks. It now looks sooner while a job writes fast. The
    resident size of the output file is read from the test, through
    /proc/PID/fd, as the job runs."""
    s = fast_spool
    s.enqueue("--timeout", "2", "--max-attempts", "1", "yes")
    worker = s.popen("work", stderr=subprocess.DEVNULL)
    peak = written = 0
    while worker.poll() is None:
        try:
            for fd in os.listdir(f"/proc/{worker.pid}/fd"):
                if "spoolq-stdout" in os.readlink(f"/proc/{worker.pid}/fd/{fd}"):
                    st = os.stat(f"/proc/{worker.pid}/fd/{fd}")
                    peak, written = max(peak, st.st_blocks * 512), max(written, st.st_size)
        except OSError:
            pass  # an output file closed meanwhile
        time.sleep(0.001)
    assert worker.returncode == 0
    if written < 1300 << 20:  # below ~650 MB/s, even looks every 250 ms would hold under the bound
        pytest.skip(f"the job wrote only {written >> 20} MB: too slowly to tell")
    assert peak < 160 << 20, f"{peak >> 20} MB resident of {written >> 20} MB written"
    assert s.show(s.ids("dead")[0])["stdout"].endswith("y\n")


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_a_run_that_spoolq_itself_failed_to_run_keeps_a_real_start_time(fast_spool):
    """Review: a command job whose run failed inside spoolq (here the write
    of its payload, made to fail by strace: the worker's second write) was
    recorded with a start time from the monotonic clock: 1970 in its
    history, a duration of 56 years in the log and in stats."""
    s = fast_spool
    job_id = s.enqueue("--payload", '{"a": 1}', "cat > /dev/null")
    proc = subprocess.run(["strace", "-qq", "-o", os.devnull, "-e", "trace=write", "-e", "inject=write:error=EIO:when=2",
                           *SPOOLQ, "-s", str(s.path), "work"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert proc.returncode == 0, proc.stderr
    run = s.record("failed", job_id)["history"][0]
    assert run["error"].startswith("internal error running the job: OSError")
    assert run["start"][:4] == run["end"][:4] == time.strftime("%Y", time.gmtime())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_failures_retry_with_backoff_then_go_dead(fast_spool):
    s = fast_spool
    s.config("backoff_initial", 100)
    s.config("backoff_factor", 3)
    job_id = s.enqueue("--max-attempts", "3", "exit 2")
    before = time.time()
    s.work()
    path = s.path / "failed" / f"{job_id}.json"
    assert s.where(job_id) == ["failed"]
    delay = os.stat(path).st_mtime - before
    assert 90 - 1 <= delay <= 110 + 5  # 100 s +-10 % jitter
    s.work()  # not due: nothing happens
    assert s.record("failed", job_id)["attempts"] == 1
    os.utime(path, (time.time() - 1, time.time() - 1))  # make it due now
    before = time.time()
    s.work()
    delay = os.stat(path).st_mtime - before
    assert 270 - 1 <= delay <= 330 + 5  # 100 * 3 = 300 s +-10 %
    os.utime(path, (time.time() - 1, time.time() - 1))
    s.work()
    job = s.show(job_id)
    assert job["state"] == "dead" and job["attempts"] == 3
    assert [h["attempt"] for h in job["history"]] == [1, 2, 3]
    assert all(h["exit_code"] == 2 for h in job["history"])


def test_backoff_is_capped_and_zero_stays_zero(fast_spool):
    s = fast_spool
    s.config("backoff_initial", 1000)
    s.config("backoff_max", 50)
    capped = s.enqueue("--max-attempts", "2", "exit 1")
    before = time.time()
    s.work()
    assert 45 - 1 <= os.stat(s.path / "failed" / f"{capped}.json").st_mtime - before <= 55 + 5
    s.config("backoff_initial", 0)
    zero = s.enqueue("--max-attempts", "4", "exit 1")
    s.work()  # zero backoff: due again at once, so one drain runs all four attempts
    assert s.show(zero)["attempts"] == 4 and s.where(zero) == ["dead"]


def test_zero_backoff_retries_run_in_the_same_drain_with_fsync_on(spool):
    """With fsync on a failed job waits in cur/ for its group sync when the
    drain looks again; the drain must still see it due once it moves on."""
    s = spool
    s.config("backoff_initial", 0)
    zero = s.enqueue("--max-attempts", "3", "exit 1")
    s.work()
    assert s.show(zero)["attempts"] == 3 and s.where(zero) == ["dead"]


def test_dead_job_back_with_retry_and_with_mv(fast_spool):
    s = fast_spool
    s.config("backoff_initial", 0)
    flag = s.path.parent / "flag"
    a = s.enqueue("--max-attempts", "2", f"test -e {flag}")
    b = s.enqueue("--max-attempts", "2", f"test -e {flag}")
    s.work()
    assert s.where(a) == ["dead"] and s.where(b) == ["dead"]
    flag.write_text("")
    assert s.run("retry", a).stdout.strip() == a
    os.rename(s.path / "dead" / f"{b}.json", s.path / "new" / f"{b}.json")  # the operator's way
    s.work()
    for job_id in (a, b):
        job = s.show(job_id)
        assert job["state"] == "done"
        assert job["attempts"] == 1  # a fresh round ...
        assert len(job["history"]) == 3  # ... with the history kept
        assert "retried_at" in job  # either way (a crash audit: the mv way did not say so)


def test_retry_all_and_exit_codes(fast_spool):
    s = fast_spool
    ids = [s.enqueue("--max-attempts", "1", "false") for _ in range(3)]
    s.work()
    assert sorted(s.run("retry", "--all").stdout.split()) == sorted(ids)
    assert sorted(s.ids("new")) == sorted(ids)
    proc = s.run("retry", ids[0], check=False)
    assert proc.returncode == 1 and "new/" in proc.stderr


def test_a_refused_retry_leaves_the_dead_file_as_it_was_and_retry_all_says_so(fast_spool):
    """Regression (audit): a retry refused because new/ held the name had
    already rewritten the dead record (its error gone), and retry --all
    skipped it in silence with exit 0. A retry that would put an id in two
    folders is refused too."""
    s = fast_spool
    blocked, finished, free = (s.enqueue("--id", i, "--max-attempts", "1", "exit 3") for i in ("blocked", "finished", "free"))
    s.work()
    assert sorted(s.ids("dead")) == ["blocked", "finished", "free"]
    s.drop("blocked.json", '{"command": "echo another job"}')
    shutil.copy(s.path / "dead" / "finished.json", s.path / "done" / "finished.json")
    before = {n: ((s.path / "dead" / n).read_bytes(), os.stat(s.path / "dead" / n).st_mtime_ns) for n in ("blocked.json", "finished.json")}
    proc = s.run("retry", "--all", check=False)
    assert proc.returncode == 1 and proc.stdout == "free\n"
    assert proc.stderr.splitlines() == ["spoolq: a job blocked is already in new/; the dead job stays in dead/",
                                        "spoolq: a job finished is already in done/; the dead job stays in dead/"]
    for name in ("blocked.json", "finished.json"):
        assert ((s.path / "dead" / name).read_bytes(), os.stat(s.path / "dead" / name).st_mtime_ns) == before[name]
    proc = s.run("retry", "blocked", check=False)
    assert proc.returncode == 1 and "already in new/" in proc.stderr
    assert s.record("dead", "blocked")["error"] == "exit status 3"
    assert s.where("free") == ["new"] and s.record("new", "free")["attempts"] == 0
    os.mkfifo(s.path / "dead" / "evil\nspoolq: fake.json")  # quoted in the message: still one line
    proc = s.run("retry", "--all", check=False)
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 3 and "evil\\nspoolq: fake.json" in proc.stderr


def test_cancel_waiting_jobs_but_not_running_or_finished(fast_spool):
    s = fast_spool
    waiting = s.enqueue("--in", "1h", "true")
    s.run("cancel", waiting)
    job = s.show(waiting)
    assert job["state"] == "done" and job["outcome"] == "cancelled"
    failed = s.enqueue("--max-attempts", "3", "false")
    s.work()
    assert s.where(failed) == ["failed"]
    s.run("cancel", failed)
    assert s.show(failed)["outcome"] == "cancelled"
    proc = s.run("cancel", waiting, check=False)
    assert proc.returncode == 1 and "done/" in proc.stderr
    running = s.enqueue("sleep 30")
    worker = s.popen("work", stderr=open(os.devnull, "w"))
    try:
        wait_for(lambda: s.ids("cur") == [running], what="the job to start")
        proc = s.run("cancel", running, check=False)
        assert proc.returncode == 1 and "running" in proc.stderr
        assert s.where(running) == ["cur"]
    finally:
        worker.kill()
        worker.wait()


def test_fifo_order(fast_spool, tmp_path):
    s = fast_spool
    log = tmp_path / "order.log"
    ids = s.run("enqueue", "--jsonl", "-",
                input="".join(json.dumps({"command": f"echo $SPOOLQ_JOB_ID >> {log}"}) + "\n" for _ in range(30))).stdout.split()
    ids += [s.enqueue(f"echo $SPOOLQ_JOB_ID >> {log}") for _ in range(5)]
    s.work()
    assert log.read_text().split() == ids


def test_due_order_beats_name_order(fast_spool, tmp_path):
    s = fast_spool
    log = tmp_path / "order.log"
    a = s.enqueue("--id", "a", f"echo a >> {log}")
    b = s.enqueue("--id", "b", f"echo b >> {log}")
    now = time.time()
    os.utime(s.path / "new" / "a.json", (now - 10, now - 10))
    os.utime(s.path / "new" / "b.json", (now - 20, now - 20))
    s.work()
    assert log.read_text().split() == [b, a]


def test_a_bounded_scan_hands_out_every_due_file_in_order_over_several_passes(fast_spool):
    """With more due files than a pass keeps, each pass returns the earliest
    ones by (due time, name) and says more are waiting; taking them away and
    scanning again yields the rest, in order, then the files not yet due."""
    import random

    from spoolq.protocol import SpoolDir

    s = fast_spool
    rng = random.Random(7)
    now = time.time_ns()
    expected = []
    for i in range(120):
        state = "failed" if i % 3 == 0 else "new"
        name = f"job{rng.randrange(10**6):06d}-{i}.json"
        # Few distinct due times, so ties are broken by name.
        due = now - rng.randrange(1, 6) * 10**9
        path = s.path / state / name
        path.write_text('{"command": "true"}')
        os.utime(path, ns=(due, due))
        expected.append((due, name, state))
    later = s.path / "new" / "later.json"
    later.write_text('{"command": "true"}')
    os.utime(later, ns=(now + 60 * 10**9, now + 60 * 10**9))
    expected.sort()

    sp = SpoolDir(str(s.path), fsync=False)
    sp.open()
    handed_out = []
    for _ in range(30):
        scan = sp.scan(now, limit=7)
        assert len(scan.due) <= 7
        assert scan.next_due_ns == now + 60 * 10**9
        for entry in scan.due:
            handed_out.append((entry.due_ns, entry.name, entry.state))
            os.unlink(s.path / entry.state / entry.name)
        if not scan.truncated:
            break
    sp.close()
    assert handed_out == expected
    assert later.exists()


def test_a_bounded_scan_breaks_ties_at_the_cut_by_folder(fast_spool):
    """Same due time, same name in new/ and failed/: failed/ sorts first,
    also when the pair sits exactly where a pass is cut off."""
    import pytest

    from spoolq.protocol import SpoolDir

    s = fast_spool
    due = time.time_ns() - 10**9
    files = [s.path / "new" / f"a{i}.json" for i in range(5)] + [s.path / "failed" / "a3.json"]
    for path in files:
        path.write_text('{"command": "true"}')
        os.utime(path, ns=(due, due))
    sp = SpoolDir(str(s.path), fsync=False)
    sp.open()
    try:
        scan = sp.scan(time.time_ns(), limit=4)
        assert [(e.state, e.name) for e in scan.due] == [
            ("new", "a0.json"), ("new", "a1.json"), ("new", "a2.json"), ("failed", "a3.json")]
        assert scan.truncated
        assert not sp.scan(time.time_ns(), limit=6).truncated  # all six fit: nothing left out
        with pytest.raises(ValueError):
            sp.scan(time.time_ns(), limit=0)
    finally:
        sp.close()


def test_jobs_run_concurrently_with_j(fast_spool, tmp_path):
    s = fast_spool
    # Each job waits until all three have started: only -j 3 can finish them.
    d = tmp_path / "barrier"
    d.mkdir()
    cmd = f"touch {d}/$SPOOLQ_JOB_ID; n=0; while [ $(ls {d} | wc -l) -lt 3 ] && [ $n -lt 200 ]; do sleep 0.05; n=$((n+1)); done; [ $n -lt 200 ]"
    ids = [s.enqueue("--max-attempts", "1", cmd) for _ in range(3)]
    s.work("-j", "3", timeout=60)
    assert all(s.where(i) == ["done"] for i in ids)


def test_max_jobs_and_max_time(fast_spool):
    s = fast_spool
    for _ in range(5):
        s.enqueue("true")
    s.work("--max-jobs", "2")
    assert len(s.ids("done")) == 2 and len(s.ids("new")) == 3
    for _ in range(5):
        s.enqueue("sleep 0.3")
    started = time.monotonic()
    s.work("--max-time", "1")
    took = time.monotonic() - started
    # It stops claiming after 1 s and lets the running job finish.
    assert 1 <= len(s.ids("done")) - 2 < 8 and took < 10
    assert s.ids("cur") == []


def test_j_runs_worker_processes_that_share_max_jobs(fast_spool):
    """`work -j 3` is three worker processes; `--max-jobs 4` is their budget
    together, not each one's."""
    s = fast_spool
    ids = [s.enqueue("--argv", "--", "sleep", "0.2") for _ in range(10)]
    proc = s.work("-j", "3", "--max-jobs", "4")
    assert len(s.ids("done")) == 4 and len(s.ids("new")) == 6 and s.ids("cur") == []
    takers = {s.record("done", i)["history"][0]["worker"] for i in ids if s.where(i) == ["done"]}
    assert 2 <= len(takers) <= 3, takers  # not one worker doing it all
    assert proc.returncode == 0


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


def test_max_jobs_zero_with_j_still_recovers(fast_spool, tmp_path):
    s = fast_spool
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; exec sleep 300")
    worker = s.popen("work", stderr=subprocess.DEVNULL)
    wait_for(started.exists, what="the job to start")
    worker.kill()
    worker.wait()
    s.work("-j", "3", "--max-jobs", "0")
    assert s.where(job_id) == ["failed"] and s.ids("new") == []


def test_handler_output_of_worker_processes_is_flushed_once(fast_spool, tmp_path):
    """Handlers that print, under -j 2 with stdout a pipe: each line once,
    and what the app printed on import not repeated by each process."""
    s = fast_spool
    (tmp_path / "printing_app.py").write_text(
        "print('imported')\n"
        "def say(payload):\n"
        "    print('job', payload)\n"
        "HANDLERS = {'say': say}\n"
    )
    for i in range(4):
        s.enqueue("--kind", "say", "--payload", str(i))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.pop("SPOOLQ_DIR", None)
    proc = subprocess.run(SPOOLQ + ["-s", str(s.path), "work", "-j", "2", "--app", "printing_app:HANDLERS"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["imported"], proc.stdout  # what the handlers print is their jobs'
    assert sorted(s.show(i)["stdout"] for i in s.ids("done")) == [f"job {i}\n" for i in range(4)]


def test_a_process_a_handler_forks_does_not_go_on_as_a_second_worker(fast_spool, tmp_path):
    """Audit: a handler that forked and let its child return from it (as
    code that forks and forgets to exit does) had that child carry on as a
    second worker: it ran jobs the worker had already run, or failed with
    "Bad file descriptor". Such a child now exits on its return."""
    s = fast_spool
    runs, child_pid = tmp_path / "runs", tmp_path / "child.pid"
    (tmp_path / "forkapp.py").write_text(
        "import os, time\n"
        "def forker(payload):\n"
        "    if os.fork() == 0:\n"
        f"        open({str(child_pid)!r}, 'w').write(str(os.getpid()))\n"
        "        time.sleep(0.2)  # the worker is running the next jobs meanwhile\n"
        "        return 'from the child'\n"
        "    return 'from the worker'\n"
        "def ok(payload):\n"
        f"    open({str(runs)!r}, 'a').write(f'{{payload}}\\n')\n"
        "HANDLERS = {'fork': forker, 'ok': ok}\n")
    s.enqueue("--kind", "fork")
    for i in range(3):
        s.enqueue("--kind", "ok", "--payload", str(i))
    s.enqueue("--kind", "ok", "--payload", '"late"', "--in", "1s")
    proc = s.popen("work", "--app", "forkapp:HANDLERS", "--watch", "--max-time", "3", cwd=str(tmp_path),
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    pid = int(child_pid.read_text())
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z",
             what="the forked child to end")
    assert proc.returncode == 0, err
    assert sorted(runs.read_text().split()) == ["0", "1", "2", "late"]  # each once
    assert "spoolq:" not in err and "Bad file descriptor" not in err, err
    assert [n for n in os.listdir(s.path / "cur")] == []
    assert {s.show(i)["state"] for i in s.ids("done")} == {"done"} and len(s.ids("done")) == 5


def test_a_forked_child_that_exits_from_a_handler_keeps_its_status_and_output(fast_spool, tmp_path):
    """Review: the fork guard ended such a child with status 1 for the usual
    `sys.exit(0)` (the handler's SystemExit is caught as a failure) and
    lost what it had printed (os._exit flushes nothing)."""
    s = fast_spool
    status = tmp_path / "status"
    (tmp_path / "exitapp.py").write_text(
        "import os, sys\n"
        "def forker(payload):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        print('printed by the child')\n"
        "        sys.exit(payload)\n"
        "    _, code = os.waitpid(pid, 0)\n"
        f"    open({str(status)!r}, 'a').write(f'{{os.waitstatus_to_exitcode(code)}}\\n')\n"
        "HANDLERS = {'fork': forker}\n")
    for code in ("0", "3"):
        s.enqueue("--kind", "fork", "--payload", code)
    proc = s.run("work", "--app", "exitapp:HANDLERS", cwd=str(tmp_path))
    assert status.read_text().split() == ["0", "3"]
    assert proc.stdout.count("printed by the child") == 2


@pytest.mark.parametrize("processes", ["1", "2"])
def test_what_a_handler_prints_is_its_jobs_output_not_the_workers(fast_spool, tmp_path, processes):
    """A handler's print() and writes to sys.stderr land in its job's
    stdout and stderr tails, as a command's output does, whether it runs in
    the worker or forked (a timeout), and not in the worker's own output
    (cron's mail); the tails keep to output_limit."""
    s = fast_spool
    s.config("output_limit", 100)
    (tmp_path / "talkapp.py").write_text(
        "import sys, time\n"
        "def say(payload):\n"
        "    print('said', payload)\n"
        "    print('warned', payload, file=sys.stderr)\n"
        "    sys.stdout.buffer.write(b'raw\\n')\n"
        "    sys.stdout.write('no newline')\n"
        "    return payload\n"
        "def fail(payload):\n"
        "    print('before failing', payload)\n"
        "    raise ValueError('bad payload')\n"
        "def flood(payload):\n"
        "    for i in range(20000):\n"
        "        print(i)\n"
        "    print('end', payload)\n"
        "def hang(payload):\n"
        "    print('about to hang')\n"
        "    time.sleep(600)\n"
        "HANDLERS = {'say': say, 'fail': fail, 'flood': flood, 'hang': hang}\n")
    jobs = {}
    for where, options in (("inline", []), ("forked", ["--timeout", "60"])):
        for kind in ("say", "fail", "flood"):
            jobs[where, kind] = s.enqueue("--kind", kind, "--payload", f'"{where}"', "--max-attempts", "1", *options)
    hung = s.enqueue("--kind", "hang", "--max-attempts", "1", "--timeout", "1")
    proc = s.run("work", "-j", processes, "--app", "talkapp:HANDLERS", cwd=str(tmp_path))
    for where in ("inline", "forked"):
        said = s.show(jobs[where, "say"])
        assert said["state"] == "done" and said["result"] == where, said
        assert said["stdout"] == f"said {where}\nraw\nno newline" and said["stderr"] == f"warned {where}\n", said
        failed = s.show(jobs[where, "fail"])
        assert failed["state"] == "dead" and failed["stdout"] == f"before failing {where}\n", failed
        assert failed["stderr"].endswith("ValueError: bad payload\n"), failed
        flooded = s.show(jobs[where, "flood"])
        assert flooded["stdout"].endswith(f"19999\nend {where}\n") and len(flooded["stdout"].encode()) == 100, flooded
    hung = s.show(hung)
    assert hung["error"] == "timed out after 1s" and hung["stdout"] == "about to hang\n", hung  # what it printed before
    assert proc.stdout == ""
    for text in ("said", "warned", "before failing", "19999"):
        assert text not in proc.stderr, proc.stderr


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


def test_work_exits_when_nothing_is_due(fast_spool):
    s = fast_spool
    s.enqueue("--in", "1h", "true")
    started = time.monotonic()
    proc = s.work()
    assert proc.returncode == 0 and time.monotonic() - started < 10
    assert len(s.ids("new")) == 1


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


def test_worker_processes_of_work_j_do_not_keep_the_commands_descriptors(fast_spool):
    """Audit: each worker process of `work -j N` kept the command's own
    descriptors of the spool's folders beside its own, eight fewer for its
    jobs and records: under a low limit and a busy disk, jobs failed with
    "Too many open files"."""
    s = fast_spool
    command = s.popen("work", "--watch", "-j", "2", stderr=subprocess.DEVNULL)
    try:
        workers = wait_for(lambda: len(s.status()["workers"]) == 2 and s.status()["workers"], what="both workers")
        for pid in (w["pid"] for w in workers):
            targets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            assert targets.count(str(s.path / "new")) == 1, targets
    finally:
        command.send_signal(signal.SIGTERM)
        command.wait(timeout=60)


@pytest.mark.parametrize("processes", ["1", "2", "4"])
def test_a_durable_worker_runs_within_a_low_open_file_limit(spool, processes):
    """fsync on keeps spare files open to rewrite records into, and the old
    inodes until they are synced: up to 320 descriptors, so under a soft
    limit of 64 a worker ran out after ~50 jobs ("cannot record the
    outcome: Too many open files") and stopped. Their number now follows
    the limit. (Audit: with -j N each worker process also kept the
    command's own descriptors of the spool, and jobs failed to start.)"""
    spool.run("enqueue", "--jsonl", "-", input='{"argv": ["echo", "hi"]}\n' * 600)
    proc = spool.run("work", "-j", processes, open_files=48, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    st = spool.status()
    assert st["done"] == 600 and st["failed"] == 0 and st["cur"] == 0, st


def test_a_long_running_worker_keeps_no_descriptors_of_finished_jobs(fast_spool):
    """-j 1 makes the next job's output files ahead and closes the last
    one's after the next has started: the count stays flat however many
    jobs run, and every job captures only its own output."""
    s = fast_spool
    watcher = s.popen("work", "--watch", stderr=subprocess.DEVNULL)
    echo = ["--argv", "--", "sh", "-c", "echo $SPOOLQ_JOB_ID; echo err-$SPOOLQ_JOB_ID >&2"]
    ids = []

    def open_fds() -> int:
        return len(os.listdir(f"/proc/{watcher.pid}/fd"))

    def run_batch(n: int) -> None:
        batch = [s.enqueue(*echo) for _ in range(n)]
        ids.extend(batch)
        wait_for(lambda: all(s.where(j) == ["done"] for j in batch), what="the batch to run")

    try:
        run_batch(5)
        after_five = open_fds()
        run_batch(40)
        # Polled: the worker closes the last job's files a moment after it moves it to done/.
        wait_for(lambda: open_fds() <= after_five, timeout=10, what=f"the worker to hold no more than {after_five} fds")
    finally:
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=60) == 0
    for job_id in ids:
        job = s.show(job_id)
        assert job["stdout"] == job_id + "\n" and job["stderr"] == f"err-{job_id}\n", job


def test_jobs_that_cannot_start_leave_no_descriptors_behind(fast_spool):
    """A job whose program is missing never starts; its output files are
    closed at once, so a long run of such jobs cannot use up the worker's
    descriptors (here only 64) and turn later jobs into internal errors."""
    s = fast_spool
    s.config("max_attempts", 1)
    lines = "".join(json.dumps({"argv": ["/nonexistent-program"]}) + "\n" for _ in range(150))
    s.run("enqueue", "--jsonl", "-", input=lines)
    ok = s.enqueue("--argv", "--", "true")
    proc = s.run("work", open_files=64, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "internal error" not in proc.stderr
    assert len(s.ids("dead")) == 150 and s.where(ok) == ["done"]
    assert proc.stderr.count("cannot start: No such file or directory") == 150


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



def _strace_filters() -> bool:
    """Whether strace runs here, with seccomp-bpf filtering (ptrace may be refused)."""
    if shutil.which("strace") is None:
        return False
    return subprocess.run(["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=execve", "-o", os.devnull, "true"],
                          capture_output=True).returncode == 0


def _has_pidfd() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (AttributeError, OSError):
        return False  # the runner then polls anyway (its fallback), which this test could not tell apart


def _cpu_cgroup(quota: float) -> str | None:
    """A new cgroup limited to ``quota`` CPUs; its folder, None when one
    cannot be made here (not root, or no writable cpu controller)."""
    name = f"spoolq-test-{os.getpid()}"
    try:
        with open("/sys/fs/cgroup/cgroup.subtree_control") as f:
            v2 = "cpu" in f.read().split()
    except OSError:
        v2 = False
    path = f"/sys/fs/cgroup/{name}" if v2 else f"/sys/fs/cgroup/cpu/{name}"
    try:
        os.mkdir(path)
    except OSError:
        return None
    try:
        if v2:
            with open(f"{path}/cpu.max", "w") as f:
                f.write(f"{int(quota * 100000)} 100000")
        else:
            with open(f"{path}/cpu.cfs_quota_us", "w") as f:
                f.write(str(int(quota * 100000)))
        return path
    except OSError:
        os.rmdir(path)
        return None


def _remove_cgroup(path: str) -> None:
    """Kill whatever still runs in the cgroup (a run that timed out), then remove it."""
    for _ in range(100):
        with open(f"{path}/cgroup.procs") as f:
            pids = [int(p) for p in f.read().split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)  # (no event says a killed process has left its cgroup)
    os.rmdir(path)


def _polled_pids(spool, *work_args: str, cpus: list[int], window: str = "30", load: str = "0",
                 cgroup: str | None = None) -> tuple[set[int], set[int]]:
    """Run ``spoolq work`` on the CPUs ``cpus`` (in ``cgroup``) under
    strace, with the load average taken as ``load``; return the pids of the
    job processes whose exit the worker polled for (waitid with WNOHANG and
    WNOWAIT, see worker.SPIN_WINDOW) and of all the job processes."""
    logs = spool.path.parent / "waitid"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    enter = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"] if cgroup else []
    # -ff: a file per process, so that no call is split in two ("unfinished"
    # and "resumed") by another process's call in between.
    subprocess.run(
        enter + ["taskset", "-c", ",".join(map(str, cpus)),
                 "strace", "-ff", "-qq", "--seccomp-bpf", "-e", "trace=waitid,execve", "-o", str(logs / "trace")]
        + SPOOLQ + ["-s", str(spool.path), "work", *work_args],
        capture_output=True, text=True, check=True, timeout=120,
        env={**os.environ, "SPOOLQ_TEST_SPIN_WINDOW": window, "SPOOLQ_TEST_LOADAVG": load},
    )
    polled, jobs = set(), set()
    for log in logs.iterdir():
        pid = int(log.name.rsplit(".", 1)[1])
        for call in log.read_text().splitlines():
            if re.match(r"waitid\(P_PID, \d+, .*WNOHANG", call):
                assert "WNOWAIT" in call, call  # polling must not reap: the runner reaps once it knows
                polled.add(int(call.split(",")[1]))
            elif re.match(r'execve\("[^"]*/(true|sleep|sh)"', call):
                jobs.add(pid)
    return polled, jobs


@pytest.mark.skipif(not _strace_filters() or shutil.which("taskset") is None or not _has_pidfd()
                    or len(os.sched_getaffinity(0)) < 2, reason="needs strace (seccomp-bpf), taskset, pidfd and two CPUs")
def test_a_lone_worker_polls_for_short_jobs_only_with_a_cpu_to_spare(fast_spool, tmp_path):
    """-j 1 polls for a short job's exit rather than sleep (a VM's idle CPU
    is slow to wake) only when it and its job can each have a CPU, the load
    average is below the CPU count, and jobs are short: not with one CPU,
    nor for two worker processes on two CPUs, nor under load, and after a
    long job not for the next (a cgroup quota: the next test)."""
    s = fast_spool
    two = sorted(os.sched_getaffinity(0))[:2]

    def enqueue(argv: list[str], n: int, **fields) -> None:
        s.run("enqueue", "--jsonl", "-", input="".join(json.dumps({"argv": argv, **fields}) + "\n" for _ in range(n)))

    enqueue(["true"], 5)
    enqueue(["sh", "-c", "exit 3"], 1, cwd=str(tmp_path))  # a job with a cwd is started by Popen: polled too
    polled, jobs = _polled_pids(s, cpus=two)
    assert len(jobs) == 6 and polled == jobs  # two CPUs, one worker: every short job
    assert len(s.ids("done")) == 5 and len(s.ids("failed")) == 1  # and each exit status is the job's own
    assert s.show(s.ids("failed")[0])["exit_code"] == 3

    enqueue(["true"], 6)
    polled, jobs = _polled_pids(s, cpus=two[:1])
    assert len(jobs) == 6 and not polled  # one CPU: the job needs it

    enqueue(["true"], 6)
    polled, jobs = _polled_pids(s, "-j", "2", cpus=two)
    assert len(jobs) == 6 and not polled  # two workers and their jobs on two CPUs

    enqueue(["true"], 6)
    polled, jobs = _polled_pids(s, cpus=two, load="2.5")
    assert len(jobs) == 6 and not polled  # a machine busier than its CPUs

    enqueue(["sleep", "0.3"], 3)
    polled, jobs = _polled_pids(s, cpus=two, window="0.1")
    assert len(jobs) == 3 and len(polled) == 1 and polled < jobs  # only the first, before a job was seen to be long
    assert len(s.ids("done")) == 26


@pytest.mark.skipif(not _strace_filters() or shutil.which("taskset") is None or not _has_pidfd()
                    or len(os.sched_getaffinity(0)) < 2, reason="needs strace (seccomp-bpf), taskset, pidfd and two CPUs")
def test_a_worker_under_a_one_cpu_quota_does_not_poll(fast_spool):
    """Two CPUs to run on, but a cgroup quota of one (a container started
    with --cpus 1): the job needs the CPU the worker would poll on."""
    cgroup = _cpu_cgroup(1.0) if os.geteuid() == 0 else None
    if cgroup is None:
        pytest.skip("cannot make a cgroup with a CPU quota here (needs root and a writable cpu controller)")
    s = fast_spool
    try:
        s.run("enqueue", "--jsonl", "-", input=json.dumps({"argv": ["true"]}) + "\n")
        polled, jobs = _polled_pids(s, cpus=sorted(os.sched_getaffinity(0))[:2])
        assert len(jobs) == 1 and polled == jobs  # outside the cgroup: polled
        s.run("enqueue", "--jsonl", "-", input="".join(json.dumps({"argv": ["true"]}) + "\n" for _ in range(6)))
        polled, jobs = _polled_pids(s, cpus=sorted(os.sched_getaffinity(0))[:2], cgroup=cgroup)
        assert len(jobs) == 6 and not polled  # inside: not
    finally:
        _remove_cgroup(cgroup)


def test_the_cpu_quota_is_read_from_the_cgroup_and_its_parents(tmp_path):
    """cgroup v1 and v2 as /proc shows them, on a host and in a container
    (whose mount root is its own cgroup), with quotas on the cgroup or a
    parent; odd contents give no quota rather than an error."""
    from spoolq.procs import cgroup_cpu_quota

    def layout(cgroup: str, mountinfo: str, files: dict[str, str]) -> tuple[str, str]:
        for rel, text in files.items():
            path = tmp_path / "fs" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (tmp_path / "cgroup").write_text(cgroup)
        (tmp_path / "mountinfo").write_text(mountinfo.replace("FS", str(tmp_path / "fs")))
        return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")

    # v2 on a host: the quota sits on a parent slice.
    args = layout("0::/app.slice/spoolq.service\n",
                  "30 23 0:26 / FS/v2 rw - cgroup2 cgroup2 rw\n",
                  {"v2/app.slice/cpu.max": "150000 100000\n", "v2/app.slice/spoolq.service/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(*args) == 1.5
    # v1 in a container: /proc shows /docker/abc, mounted as the root of cpu,cpuacct.
    args = layout("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n",
                  "40 31 0:29 /docker/abc FS/v1c rw - cgroup cgroup rw,cpu,cpuacct\n",
                  {"v1c/cpu.cfs_quota_us": "50000\n", "v1c/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(*args) == 0.5
    # No quota anywhere (v1 -1, v2 max), and a root cgroup.
    args = layout("0::/\n3:cpu:/\n",
                  "30 23 0:26 / FS/v2r rw - cgroup2 cgroup2 rw\n32 31 0:29 / FS/v1r rw - cgroup cgroup rw,cpu\n",
                  {"v2r/cpu.max": "max 100000\n", "v1r/cpu.cfs_quota_us": "-1\n", "v1r/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(*args) is None
    # Odd contents: a period of 0, garbage lines, bytes that are not UTF-8.
    args = layout("0::/x\ngarbage\n", "30 23 0:26 / FS/odd rw - cgroup2 cgroup2 rw\nnonsense\n",
                  {"odd/x/cpu.max": "100000 0\n"})
    assert cgroup_cpu_quota(*args) is None
    (tmp_path / "cgroup").write_bytes(b"0::/\xff\xfe\n")
    assert cgroup_cpu_quota(*args) is None
    assert cgroup_cpu_quota(str(tmp_path / "missing"), args[1]) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a worker polls only with a CPU to spare")
def test_a_timeout_holds_while_the_worker_polls(fast_spool):
    """A polling window longer than a job's timeout does not delay the kill."""
    job_id = fast_spool.enqueue("--timeout", "0.3", "--argv", "--", "sleep", "30")
    started = time.monotonic()
    fast_spool.work(env={"SPOOLQ_TEST_SPIN_WINDOW": "20", "SPOOLQ_TEST_LOADAVG": "0"})
    assert time.monotonic() - started < 15  # the job's 30 s sleep was cut short
    job = fast_spool.show(job_id)
    assert job["error"] == "timed out after 0.3s" and job["exit_code"] == -15


def _evict(paths) -> None:
    """Drop files' pages from the page cache (written back first), as the
    kernel does to files nobody touched for a while."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cached(path) -> bool:
    """Whether the first page of ``path`` is in the page cache (a read that
    does not wait for the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    except OSError as e:  # RWF_NOWAIT not supported by this filesystem (overlayfs)
        pytest.skip(f"cannot tell a cached page here: {e}")
    finally:
        os.close(fd)


def _cold_reads_are_slow(folder) -> bool:
    """Whether reading an evicted small file here waits long enough for a
    worker to notice (protocol.SLOW_READ_NS): not on tmpfs, where nothing
    leaves memory, nor on a disk as fast as memory."""
    from spoolq.protocol import SLOW_READ_NS

    folder.mkdir()
    paths = [folder / str(i) for i in range(32)]
    for p in paths:
        p.write_bytes(b"{}" * 50)
    _evict(paths)
    slow = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        began = time.perf_counter_ns()
        os.pread(fd, 200, 0)
        slow += time.perf_counter_ns() - began > SLOW_READ_NS
        os.close(fd)
    return slow >= 24


def _willneeds(spool, *work_args: str) -> int:
    """Run ``spoolq work`` under strace; how many files it read ahead."""
    log = spool.path.parent / "fadvise.log"
    subprocess.run(["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=fadvise64", "-o", str(log)]
                   + SPOOLQ + ["-s", str(spool.path), "work", *work_args],
                   capture_output=True, text=True, check=True, timeout=120)
    return sum("POSIX_FADV_WILLNEED" in line for line in log.read_text().splitlines())


@pytest.mark.skipif(not _strace_filters() or not hasattr(os, "RWF_NOWAIT"), reason="needs strace (seccomp-bpf) and preadv2")
def test_a_drain_reads_ahead_once_its_files_have_left_the_page_cache(fast_spool, tmp_path):
    """A backlog that waited long enough for the kernel to drop its files
    from memory would cost each claim a disk read of its own: a worker
    that sees its claims' reads wait asks the kernel to read the files
    ahead (posix_fadvise WILLNEED), and one whose files are in memory
    does not. Either way each job runs once."""
    if not _cold_reads_are_slow(tmp_path / "probe"):
        pytest.skip("reading an evicted file here is not slower than reading memory")
    s = fast_spool
    n = 400
    s.run("enqueue", "--jsonl", "-", input='{"argv": ["true"]}\n' * n)
    assert _willneeds(s, "--max-jobs", "100") == 0  # read from memory: nothing to read ahead
    waiting = [s.path / "new" / name for name in s.names("new")]
    assert len(waiting) == n - 100
    for _ in range(5):  # (a page still being written back, or just read, is not dropped at once)
        _evict(waiting)
        if not any(_cached(p) for p in waiting[-20:]):
            break
    else:
        pytest.skip("the kernel kept these files in memory")
    ahead = _willneeds(s)
    # The first claims find out (one or two PROBE_CLAIMS of 64, three on a
    # very busy host), the rest were read ahead, none twice.
    assert (n - 100) // 3 <= ahead <= n - 100
    assert len(s.ids("done")) == n and not s.names("new") and not s.names("cur")
    assert all(s.record("done", i)["attempts"] == 1 for i in s.ids("done"))
