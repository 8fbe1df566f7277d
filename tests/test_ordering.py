"""Which job runs when, in a spool directory: files dropped by hand with a
priority, dependencies or held; a dependency folded into the history; a
lock freed the moment its worker is killed; and kill -9 of a worker at
random moments under dependencies and a mutex, with nothing lost, each
job in one state and no two holders of the lock running at once. (The
CLI's contract on both backends is tests/contract/test_contract_ordering.py.)"""

from __future__ import annotations

import json
import os
import random
import signal
import time

from conftest import wait_for


def _drop(spool, name: str, job: dict) -> None:
    spool.drop(f"{name}.json", json.dumps(job))


def _ran(log) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_dropped_files_keep_their_priority_dependencies_and_hold(spool, tmp_path):
    spool.config("fsync", "false")
    log = tmp_path / "log"
    for n in range(3):
        spool.enqueue("--id", f"plain{n}", f"echo plain{n} >> {log}")
    _drop(spool, "late", {"command": f"echo late >> {log}", "priority": -1})
    # Its place known before any read: the marker the reference gives, made first.
    (spool.path / "order" / "prio").mkdir(exist_ok=True)
    (spool.path / "order" / "prio" / "7~urgent").touch()
    _drop(spool, "urgent", {"command": f"echo urgent >> {log}", "priority": 7})
    _drop(spool, "second", {"command": f"echo second >> {log}", "after": "plain2"})
    _drop(spool, "ghost", {"command": "true", "after": ["nosuch"]})
    _drop(spool, "stay", {"command": f"echo stay >> {log}", "held": True})
    spool.work()
    ran = _ran(log)
    assert ran.index("second") > ran.index("plain2") and ran[-1] == "late"
    assert ran[0] == "urgent"
    assert "stay" not in ran and spool.show("stay")["state"] == "held"
    ghost = spool.show("ghost")
    assert ghost["state"] == "dead" and "no job nosuch" in ghost["error"]
    assert spool.show("late")["attempts"] == 1


def test_a_dependency_folded_into_the_history_counts_by_its_outcome(spool, tmp_path):
    spool.config("fsync", "false")
    spool.enqueue("--id", "old", "true")
    spool.enqueue("--id", "old-dead", "--max-attempts", "1", "false")
    spool.work()
    spool.run("compact", "--keep", "1d")
    spool.run("purge", "--older-than", "0s", check=False)
    assert spool.names("done") == []
    job_id = spool.enqueue("--after", "old", "true")
    assert spool.show(job_id)["state"] == "new"
    proc = spool.run("enqueue", "--after", "old-dead", "true", check=False)
    assert proc.returncode == 1 and "old-dead ended dead" in proc.stderr


def test_a_killed_workers_lock_is_free_at_once(spool, tmp_path):
    spool.config("fsync", "false")
    started = tmp_path / "started"
    spool.enqueue("--lock", "db", f"touch {started}; sleep 60")
    worker = spool.popen("work", "--watch", start_new_session=True)
    wait_for(started.exists, timeout=60, what="the first job to start")
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    second = tmp_path / "second"
    job_id = spool.enqueue("--lock", "db", f"touch {second}")
    other = spool.popen("work", "--watch", start_new_session=True)
    try:
        wait_for(second.exists, timeout=60, what="a job holding the same lock to start")
        wait_for(lambda: spool.show(job_id)["state"] == "done", timeout=60, what="it to finish")
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()


def test_kill_9_at_random_moments_loses_nothing_and_never_overlaps_a_lock(spool, tmp_path):
    spool.config("fsync", "true")
    spool.config("backoff_initial", "0")
    log = tmp_path / "log"
    step = (f'echo start $SPOOLQ_JOB_ID $(date +%s.%N) >> {log}; sleep 0.1; '
            f'echo end $SPOOLQ_JOB_ID $(date +%s.%N) >> {log}')
    ids = [spool.enqueue("--max-attempts", "50", "--lock", "m", step) for _ in range(12)]
    prev = None
    for n in range(8):
        args = ["--max-attempts", "50", "--priority", str(n % 3)] + (["--after", prev] if prev else [])
        prev = spool.enqueue(*args, f"echo link{n} >> {tmp_path / 'chain'}")
        ids.append(prev)
    kills = []
    rng = random.Random(31)
    for _ in range(6):
        worker = spool.popen("work", "--watch", "-j", "4", start_new_session=True)
        time.sleep(rng.uniform(0.2, 1.2))
        os.killpg(worker.pid, signal.SIGKILL)  # the worker and its jobs
        worker.wait()
        kills.append(time.time())
    spool.run("work", "-j", "4", timeout=300)
    for job_id in ids:
        assert spool.where(job_id) == ["done"], (job_id, spool.where(job_id))
    links = (tmp_path / "chain").read_text().split()
    assert [x for i, x in enumerate(links) if x not in links[:i]] == [f"link{n}" for n in range(8)]
    spans: dict[tuple[str, int], list[float]] = {}
    runs: dict[str, int] = {}
    for line in log.read_text().splitlines():
        what, job, t = line.split()
        if what == "start":
            runs[job] = runs.get(job, 0) + 1
        spans.setdefault((job, runs[job]), []).append(float(t))
    intervals = []
    for times in spans.values():
        start = times[0]
        end = times[1] if len(times) > 1 else min(k for k in kills + [time.time()] if k >= start)
        intervals.append((start, end))
    intervals.sort()
    for (s1, e1), (s2, _) in zip(intervals, intervals[1:]):
        assert s2 >= e1 - 0.001, "two holders of lock m ran at once"


def test_a_dropped_file_whose_unique_key_is_taken_goes_to_dead(spool):
    spool.config("fsync", "false")
    first = spool.enqueue("--unique", "k", "--in", "1h", "true")
    _drop(spool, "copy", {"command": "true", "unique": "k"})
    _drop(spool, "other", {"command": "true", "unique": "other-key"})
    spool.work()
    copy = spool.show("copy")
    assert copy["state"] == "dead" and f"held by job {first}" in copy["error"]
    assert spool.show("other")["state"] == "done"
    assert spool.run("enqueue", "--unique", "other-key", "true").stdout.strip() != "other"  # done: free
