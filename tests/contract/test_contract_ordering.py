"""Which job runs when, through ``spoolq`` against a location, on both
backends: priorities with one and two workers, a dependency chain, a
dependency that dies, an unknown one, unique keys (also from 10
processes at once), a mutex across -j 4 with timestamps that prove no
overlap and a limit of 2, and hold and release."""

from __future__ import annotations

import subprocess

import pytest

from conftest import SPOOLQ

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
