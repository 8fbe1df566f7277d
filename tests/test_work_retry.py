"""Failed runs: retries with backoff, dead letters, and the operator's
retry and cancel."""

from __future__ import annotations

import os
import shutil
import time

from conftest import wait_for


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
        proc = s.run("cancel", running, check=False)  # a running job is killed, not retried
        assert proc.returncode == 0, proc.stderr
        assert worker.wait(timeout=60) == 0
        job = s.show(running)
        assert job["state"] == "done" and job["outcome"] == "cancelled"
    finally:
        worker.kill()
        worker.wait()
