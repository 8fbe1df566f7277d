"""Which job runs when, through ``spoolq`` against a location, on both
backends: priorities with one and two workers, a dependency chain, a
dependency that dies, an unknown one, unique keys (also from 10
processes at once), a mutex across -j 4 with timestamps that prove no
overlap and a limit of 2, and hold and release."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest

from conftest import SPOOLQ, wait_for

pytest_plugins = ["pgserver"]


def _ran(log) -> list[str]:
    return log.read_text().split() if log.exists() else []


@pytest.mark.parametrize("workers", [1, 2])
def test_the_highest_priority_runs_first(sq, tmp_path, workers):
    log = tmp_path / "log"
    for name, priority in (("low", -5), ("plain1", 0), ("high", 9), ("mid", 3), ("plain2", 0)):
        # (Each runs a while, so that with two workers the pairs are apart.)
        sq.enqueue("--id", name, "--priority", str(priority), f"echo {name} >> {log}; sleep 0.5")
    if workers == 1:
        sq.run("work")
        assert _ran(log) == ["high", "mid", "plain1", "plain2", "low"]
    else:
        sq.run("work", "-j", "2")
        ran = _ran(log)
        # Two at a time: each pair starts before any later one.
        assert set(ran[:2]) == {"high", "mid"} and set(ran[2:4]) == {"plain1", "plain2"} and ran[4] == "low"
    assert [j["id"] for j in sq.listing("--state", "done")] and sq.show("high")["priority"] == 9


def test_a_chain_runs_in_order_and_each_waits_for_the_last(sq, tmp_path):
    log = tmp_path / "log"
    prev = sq.enqueue("--id", "c0", f"sleep 0.2; echo c0 >> {log}")
    for n in range(1, 5):
        prev = sq.enqueue("--id", f"c{n}", "--after", prev, f"echo c{n} >> {log}")
    assert sq.show("c3")["state"] == "waiting" and "waiting for job c2" in sq.show("c3")["why"]
    sq.run("work")
    assert _ran(log) == [f"c{n}" for n in range(5)]
    assert all(sq.show(f"c{n}")["attempts"] == 1 for n in range(5))


def test_a_dependency_that_dies_sends_its_dependents_to_dead_and_retry_runs_them(sq, tmp_path):
    flag = tmp_path / "ok"
    sq.enqueue("--id", "dep", "--max-attempts", "1", f"test -e {flag}")
    sq.enqueue("--id", "mid", "--after", "dep", "true")
    sq.enqueue("--id", "end", "--after", "mid", "true")
    sq.run("work")
    assert sq.show("dep")["state"] == "dead"
    assert sq.show("mid")["state"] == "dead" and "its dependency dep ended dead" in sq.show("mid")["error"]
    assert sq.show("end")["state"] == "dead" and "its dependency mid ended dead" in sq.show("end")["error"]
    flag.touch()
    sq.run("retry", "dep")
    sq.run("work")
    sq.run("retry", "mid")
    sq.run("retry", "end")
    sq.run("work")
    assert [sq.show(i)["state"] for i in ("dep", "mid", "end")] == ["done"] * 3


def test_an_unknown_dependency_is_refused(sq):
    proc = sq.fail("enqueue", "--after", "nosuchjob", "true")
    assert proc.returncode == 1 and "nosuchjob" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert sq.listing() == []


def test_a_cancelled_dependency_sends_its_dependent_to_dead(sq):
    sq.enqueue("--id", "later", "--in", "1h", "true")
    sq.enqueue("--id", "after-it", "--after", "later", "true")
    sq.run("cancel", "later")
    job = sq.show("after-it")
    assert job["state"] == "dead" and "later ended cancelled" in job["error"]


def test_unique_adds_nothing_while_the_first_is_unfinished(sq):
    first = sq.enqueue("--unique", "nightly", "true")
    proc = sq.run("enqueue", "--unique", "nightly", "echo again")
    assert proc.returncode == 0 and proc.stdout.strip() == first
    assert "nothing added" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert [j["id"] for j in sq.listing()] == [first]
    sq.run("work")
    second = sq.enqueue("--unique", "nightly", "true")  # done: the key is free again
    assert second != first


def test_ten_processes_enqueueing_one_key_leave_one_job(sq):
    procs = [subprocess.Popen(SPOOLQ + ["-s", sq.location, "enqueue", "--unique", "k", "true"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(10)]
    printed = set()
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        printed.add(out.strip())
    assert len(printed) == 1 and [j["id"] for j in sq.listing()] == list(printed)


def _intervals(log) -> list[tuple[float, float]]:
    spans = {}
    for line in log.read_text().splitlines():
        what, job, t = line.split()
        spans.setdefault(job, {})[what] = float(t)
    return sorted((s["start"], s["end"]) for s in spans.values())


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize("limit", [1, 2])
def test_a_lock_lets_at_most_its_limit_run_at_once_under_j4(sq, tmp_path, limit):
    if limit > 1:
        sq.run("config", "set", "lock_limits", f"gpu={limit}")
    log = tmp_path / "log"
    step = (f'echo start $SPOOLQ_JOB_ID $(date +%s.%N) >> {log}; sleep 0.3; '
            f'echo end $SPOOLQ_JOB_ID $(date +%s.%N) >> {log}')
    for _ in range(6):
        sq.enqueue("--lock", "gpu", step)
    free = [sq.enqueue(f"echo free >> {tmp_path / 'free'}") for _ in range(3)]
    sq.run("work", "-j", "4", timeout=300)
    spans = _intervals(log)
    assert len(spans) == 6 and _most_at_once(spans) == limit
    assert all(sq.show(i)["state"] == "done" for i in free)
    assert all(j["attempts"] == 1 for j in sq.listing("--state", "done"))  # a skip is no attempt


def test_a_held_job_waits_until_released(sq, tmp_path):
    log = tmp_path / "log"
    held = sq.enqueue("--hold", f"echo held >> {log}")
    other = sq.enqueue(f"echo other >> {log}")
    sq.run("hold", other)
    assert sq.show(other)["state"] == "held"
    sq.run("work")
    assert _ran(log) == [] and sq.show(held)["state"] == "held"
    assert sq.run("release", held).stdout.startswith(f"released {held}")
    sq.run("release", "--now", other)
    sq.run("work")
    assert sorted(_ran(log)) == ["held", "other"]
    assert sq.fail("release", held).returncode == 1


@pytest.mark.parametrize("kill", ["worker", "group"])
def test_kill_9_of_a_worker_at_random_moments_loses_nothing_and_never_overlaps_a_lock(sq, tmp_path, kill):
    """kill -9 of a worker at random moments, of the worker alone (its
    job's processes run on) or of its process group (its jobs with it),
    while another worker watches, fsync on: every job ends done, the chain
    in order, and no two holders of lock m run at once. Each holder of
    lock m flocks a probe file for as long as any of its processes lives,
    so a second holder running at once is seen by the kernel, not guessed
    from times."""
    sq.run("config", "set", "fsync", "true")
    sq.run("config", "set", "backoff_initial", "0")
    log, probe, chain = tmp_path / "log", tmp_path / "probe", tmp_path / "chain"
    step = (f'exec 9>>{probe}; flock -n 9 || echo overlap $SPOOLQ_JOB_ID >> {log}; '
            f'echo start $SPOOLQ_JOB_ID >> {log}; sleep 0.4; echo end $SPOOLQ_JOB_ID >> {log}')
    ids = [sq.enqueue("--max-attempts", "50", "--lock", "m", step) for _ in range(8)]
    prev = None
    for n in range(6):
        args = ["--max-attempts", "50", "--priority", str(n % 3)] + (["--after", prev] if prev else [])
        prev = sq.enqueue(*args, f"echo link{n} >> {chain}; sleep 0.1")
        ids.append(prev)
    held = sq.enqueue("--hold", "--max-attempts", "50", "--lock", "m", step)
    unique = sq.enqueue("--unique", "once", "--max-attempts", "50", "sleep 0.2")
    ids += [held, unique]
    keeper = sq.popen("work", "--watch", stderr=open(tmp_path / "keeper.log", "w"))
    rng = random.Random(7)
    for round_ in range(5):
        worker = sq.popen("work", "--watch", stderr=open(tmp_path / f"worker{round_}.log", "w"))
        time.sleep(rng.uniform(0.3, 1.5))
        if kill == "worker":
            os.kill(worker.pid, signal.SIGKILL)  # the worker alone: its job's processes run on
        else:
            os.killpg(worker.pid, signal.SIGKILL)  # the worker and its jobs
        worker.wait(timeout=60)
        again = sq.enqueue("--unique", "once", "--max-attempts", "50", "true")
        if again != unique:  # (the first had finished: the key was free)
            assert sq.show(unique)["state"] == "done"
            unique = again
            ids.append(again)
        if round_ == 2:
            sq.run("release", held)
    keeper.send_signal(signal.SIGTERM)
    keeper.wait(timeout=120)
    sq.run("sweep")  # (waits out the grace of a worker killed just now)
    sq.run("work", timeout=300)
    for job_id in ids:
        assert sq.show(job_id)["state"] == "done", sq.show(job_id)
    text = log.read_text()
    assert "overlap" not in text, "two holders of lock m ran at once"
    assert {line.split()[1] for line in text.splitlines() if line.startswith("end")} >= set(ids[:8] + [held])
    links = chain.read_text().split()
    assert [x for i, x in enumerate(links) if x not in links[:i]] == [f"link{n}" for n in range(6)]


def test_show_and_list_say_why_a_waiting_job_is_not_running(sq, tmp_path):
    started = tmp_path / "started"
    holder = sq.enqueue("--lock", "x", f"touch {started}; sleep 60")
    worker = sq.popen("work", "--watch", stderr=open(tmp_path / "worker.log", "w"))
    try:
        wait_for(started.exists, 60, what="the lock's holder to start")
        blocked = sq.enqueue("--lock", "x", "true")
        later = sq.enqueue("--in", "1h", "true")
        held = sq.enqueue("--hold", "true")
        after = sq.enqueue("--after", holder, "true")
        why = {job_id: sq.show(job_id).get("why", "") for job_id in (blocked, later, held, after)}
        assert why[blocked] == f"lock x held by job {holder}"
        assert why[later].startswith("not due until ")
        assert why[held].startswith("held") and why[after] == f"waiting for job {holder}"
        listed = sq.run("list").stdout
        for job_id in why:
            line = next(line for line in listed.splitlines() if job_id in line)
            assert why[job_id] in line, line
    finally:
        sq.stop_all()


def test_a_lock_outlives_a_worker_killed_alone_until_its_jobs_processes_end(sq, tmp_path):
    """A worker is killed while its job holds lock m; the job's processes
    run on, and a second worker waits for m with a job due: that job starts
    only once the first job's processes are gone (they ended, or recovery
    killed them), as the probe's flock proves."""
    log, probe = tmp_path / "log", tmp_path / "probe"

    def step(name: str) -> str:
        return (f'exec 9>>{probe}; flock -n 9 || echo overlap >> {log}; echo start {name} >> {log}; '
                f'touch {tmp_path / name}; sleep 3; echo end {name} >> {log}')

    first = sq.enqueue("--lock", "m", step("a"))
    killed = sq.popen("work", "--watch", stderr=open(tmp_path / "killed.log", "w"))
    wait_for((tmp_path / "a").exists, 60, what="the first job to start")
    second = sq.enqueue("--lock", "m", step("b"))
    waiting = sq.popen("work", "--watch", stderr=open(tmp_path / "waiting.log", "w"))
    try:
        time.sleep(1.0)  # the second worker has started and met the taken lock
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
        wait_for((tmp_path / "b").exists, 120, what="the second job to start")
        wait_for(lambda: sq.show(second)["state"] == "done", 120, what="the second job to finish")
    finally:
        waiting.send_signal(signal.SIGTERM)
        waiting.wait(timeout=120)
    sq.run("work", timeout=300)  # (recovery: the killed worker's job runs again)
    assert sq.show(first)["state"] == "done"
    assert "overlap" not in log.read_text(), log.read_text()


def test_list_shows_the_priority_and_lists_waiting_jobs_in_the_order_they_run(sq):
    for name, priority in (("low", -5), ("plain", 0), ("high", 9), ("mid", 3)):
        sq.enqueue("--id", name, "--priority", str(priority), "true")
    assert [j["id"] for j in sq.listing("--state", "new")] == ["high", "mid", "plain", "low"]
    assert [j.get("priority", 0) for j in sq.listing("--state", "new")] == [9, 3, 0, -5]
    lines = sq.run("list", "--state", "new").stdout.splitlines()
    assert "[priority 9]" in lines[0] and "priority" not in lines[2]


def test_a_dependency_compacted_into_the_history_counts_by_its_outcome(sq):
    sq.enqueue("--id", "old", "true")
    sq.enqueue("--id", "old-dead", "--max-attempts", "1", "false")
    sq.run("work")
    sq.run("compact", "--keep", "1d")
    sq.run("purge", "--dead", "--older-than", "0s", "--yes", check=False)
    job_id = sq.enqueue("--after", "old", "true")
    assert sq.show(job_id)["state"] == "new"
    refused = sq.fail("enqueue", "--after", "old-dead", "true")
    assert refused.returncode == 1 and "old-dead ended dead" in refused.stderr


def test_the_api_returns_the_holders_id_for_a_unique_key(sq):
    spool = sq.api()
    first = spool.enqueue(command="true", unique="nightly")
    told = []
    assert spool.enqueue(command="echo again", unique="nightly") == first
    assert spool.enqueue_job({"command": "true", "unique": "nightly"}, on_existing=told.append) == first
    assert told == [first] and [j["id"] for j in spool.list()] == [first]
    spool.hold(first)
    assert spool.get(first)["state"] == "held"
    assert spool.release(first, now=True) == "new"
