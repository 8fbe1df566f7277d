"""Many processes on one spool: every job is claimed exactly once, and a
drain under random kill -9 loses nothing."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import time

from conftest import STATES, wait_for


def _enqueue_logging_jobs(s, log, n: int, extra: str = "") -> list[str]:
    lines = "".join(json.dumps({"command": f"{extra}echo $SPOOLQ_JOB_ID >> {log}"}) + "\n" for _ in range(n))
    return s.run("enqueue", "--jsonl", "-", input=lines).stdout.split()


def _assert_each_job_in_exactly_one_folder(s, ids) -> dict[str, str]:
    where = {}
    folder_of = collections.defaultdict(list)
    for state in STATES:
        for job_id in s.ids(state):
            folder_of[job_id].append(state)
    for job_id in ids:
        assert len(folder_of[job_id]) == 1, (job_id, folder_of[job_id])
        where[job_id] = folder_of[job_id][0]
    assert set(folder_of) == set(ids), "a file appeared that nobody enqueued"
    return where


def test_four_workers_run_each_of_1500_jobs_exactly_once(fast_spool, tmp_path):
    s = fast_spool
    log = tmp_path / "ran.log"
    ids = _enqueue_logging_jobs(s, log, 1500)
    workers = [s.popen("work", "-j", "2", "-q") for _ in range(4)]
    for w in workers:
        assert w.wait(timeout=600) == 0
    runs = collections.Counter(log.read_text().split())
    assert set(runs) == set(ids)
    assert max(runs.values()) == 1, [i for i, c in runs.items() if c > 1][:5]
    where = _assert_each_job_in_exactly_one_folder(s, ids)
    assert set(where.values()) == {"done"}
    # Every job was run by one of the eight worker processes (four `work -j 2`
    # commands of two each), and all eight took part.
    takers = collections.Counter(s.record("done", i)["history"][0]["worker"] for i in ids)
    assert len(takers) == 8
    print(f"\nexactly once: {len(ids)} jobs, 4 workers x 2 slots, {sum(runs.values()) - len(ids)} duplicates, "
          f"shares {sorted(takers.values())}")


def test_cancel_retry_and_sweep_race_with_workers(fast_spool, tmp_path):
    """Cancels, retries and sweeps while two workers drain: no job both runs
    and is cancelled, none is lost or doubled."""
    s = fast_spool
    s.config("backoff_initial", 0)
    log = tmp_path / "ran.log"
    ids = _enqueue_logging_jobs(s, log, 400)
    dead_ids = [s.enqueue("--max-attempts", "1", "exit 1") for _ in range(40)]
    s.work("-q")  # the 40 failing ones are now dead; the 400 ran once
    ids2 = _enqueue_logging_jobs(s, log, 400, extra="sleep 0.05; ")
    rng = random.Random(7)
    workers = [s.popen("work", "-j", "2", "-q") for _ in range(2)]
    from concurrent.futures import ThreadPoolExecutor

    def cancel(job_id):
        return job_id, s.run("cancel", job_id, check=False)

    cancelled = set()
    with ThreadPoolExecutor(4) as pool:  # four cancelling processes at a time
        results = pool.map(cancel, rng.sample(ids2, 120))
        extra = [pool.submit(s.run, "retry", j) for j in dead_ids[:20]] + [pool.submit(s.run, "sweep") for _ in range(3)]
        for job_id, proc in results:
            if proc.returncode == 0:
                cancelled.add(job_id)
            else:
                assert "running" in proc.stderr or "not waiting" in proc.stderr or "done/" in proc.stderr \
                    or "ended before the cancel reached it" in proc.stdout, proc
        for f in extra:
            f.result()
    for w in workers:
        assert w.wait(timeout=600) == 0
    s.work("-q")  # the retried dead jobs run (and fail) once more
    runs = collections.Counter(log.read_text().split())
    assert max(runs.values()) == 1
    listed = {j["id"]: j for j in map(json.loads, s.run("list", "--json").stdout.splitlines())}
    for job_id in ids2:
        job = listed[job_id]
        assert job["state"] == "done"
        if job_id in cancelled and runs[job_id] == 0:
            assert job["outcome"] == "cancelled", job_id  # cancelled while waiting: never ran
        elif job_id in cancelled:
            pass  # cancelled while running: killed (cancelled), or it ended first (succeeded); it ran once
        else:
            assert job["outcome"] == "succeeded" and runs[job_id] == 1, job_id
    assert set(ids2) - cancelled <= set(runs) and set(ids) <= set(runs)
    _assert_each_job_in_exactly_one_folder(s, ids + ids2 + dead_ids)
    assert all(listed[j]["state"] == "dead" and listed[j]["attempts"] == 1 for j in dead_ids)
    assert cancelled, "the race never let a cancel through; the test proves nothing"
    print(f"\nrace: 800 jobs, 2 workers, 120 concurrent cancels ({len(cancelled)} succeeded, {sum(runs[j] == 0 for j in cancelled)} before they ran), "
          f"20 retries, 3 sweeps; 0 duplicates, 0 lost")


def test_chaos_kill_9_workers_during_a_drain(fast_spool, tmp_path):
    """Kill -9 random workers every few hundred milliseconds while 4 drain
    400 jobs, restarting them; then a final drain. Every job ends done,
    none is lost, nothing is left in cur/. A job killed mid-run runs again
    (at-least-once); the number of such reruns is reported."""
    s = fast_spool
    s.config("backoff_initial", 0)
    s.config("max_attempts", 50)
    log = tmp_path / "ran.log"
    ids = _enqueue_logging_jobs(s, log, 400, extra="sleep 0.1; ")
    rng = random.Random(20261122)
    workers = [s.popen("work", "-j", "2", "-q") for _ in range(4)]
    kills = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(s.ids("done")) < len(ids):
        time.sleep(rng.uniform(0.1, 0.4))
        victim = rng.randrange(len(workers))
        if workers[victim].poll() is None:
            workers[victim].send_signal(signal.SIGKILL)
            kills += 1
        workers[victim].wait()
        workers[victim] = s.popen("work", "-j", "2", "-q")
    for w in workers:
        w.wait(timeout=600)
    s.work("-q")  # the final drain (recovery first)
    where = _assert_each_job_in_exactly_one_folder(s, ids)
    assert set(where.values()) == {"done"}, collections.Counter(where.values())
    assert s.ids("cur") == []
    runs = collections.Counter(log.read_text().split())
    assert set(runs) == set(ids)
    reruns = sum(c - 1 for c in runs.values())
    interrupted = sum(
        sum(1 for h in s.record("done", i)["history"] if h.get("error", "").startswith("interrupted"))
        for i in ids
    )
    # Every rerun is accounted for by an interrupted run in some history.
    assert reruns <= interrupted
    assert kills >= 5
    print(f"\nchaos: {len(ids)} jobs, {kills} kill -9, {interrupted} interrupted runs, "
          f"{reruns} jobs ran twice, 0 lost, cur/ empty")


def test_a_worker_on_an_empty_spool_does_not_spin(fast_spool):
    s = fast_spool
    # A file locked by someone else must not make a drain spin forever.
    job_id = s.enqueue("true")
    import fcntl

    with open(s.path / "new" / f"{job_id}.json") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        proc = s.work(timeout=30)
        assert proc.returncode == 0
        assert s.where(job_id) == ["new"]
    s.work()
    assert s.where(job_id) == ["done"]


def test_status_shows_live_workers_and_forgets_killed_ones(fast_spool, tmp_path):
    s = fast_spool
    pidfile = tmp_path / "job.pid"
    job_id = s.enqueue(f"echo $$ > {pidfile}; exec sleep 300")
    worker = s.popen("work", stderr=subprocess.DEVNULL)
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the job to start")
    job_pid = int(pidfile.read_text())
    st = wait_for(lambda: (lambda st: st if st["workers"] and st["workers"][0]["jobs"] else None)(s.status()),
                  what="the worker to list its job")
    assert st["workers"][0]["pid"] == worker.pid and job_id in st["workers"][0]["jobs"]
    assert st["cur"] == 1
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    assert s.status()["workers"] == []  # a dead worker's entry stops counting by itself
    assert os.path.exists(f"/proc/{job_pid}")
    s.run("sweep")
    wait_for(lambda: not os.path.exists(f"/proc/{job_pid}") or open(f"/proc/{job_pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z",
             timeout=10, what="the orphaned job process to be killed")
    assert s.where(job_id) == ["failed"]
