"""Which job runs when, in a PostgreSQL spool (against a real server,
tests/pgserver.py): priorities, dependencies (a chain, one that dies or
is cancelled, an unknown one, a retry), unique keys (also from 10
processes at once), locks and their limits (also from concurrent claims),
and held jobs. The directory spool's side, and both through the CLI, are
in test_ordering.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from spoolq import record
from spoolq.errors import InvalidJob, NotPossible
from spoolq.record import Outcome

pytest_plugins = ["pgserver"]

if os.environ.get("SPOOLQ_CI"):
    import psycopg  # noqa: F401 - under CI a missing psycopg fails the run
else:
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")

from spoolq.pgspool import PgBackend  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job(job_id: str, **fields) -> tuple[str, bytes, None]:
    fields.setdefault("command", "true")
    return job_id, record.serialise(record.new_job(fields, job_id, time.time())), None


@pytest.fixture
def spool(pg_spool_url):
    backend = PgBackend(pg_spool_url)
    reg = backend.register()
    yield backend
    reg.close()
    backend.close()


def finish(spool, claim, code: int = 0, **kw) -> None:
    spool.finish(claim, Outcome(start=time.time(), end=time.time(), exit_code=code,
                                error=None if code == 0 else "exit 1", **kw), "w")
    spool.commit()


def drain(spool) -> list[str]:
    ran = []
    while (claim := spool.claim_next()) is not None:
        ran.append(claim.job_id)
        finish(spool, claim)
    return ran


def test_priority_first_then_due_time_then_id(spool):
    spool.enqueue([job("a"), job("b", priority=5), job("c", priority=-1), job("d", priority=5), job("e")])
    assert drain(spool) == ["b", "d", "a", "e", "c"]


def test_a_chain_runs_in_order_and_waits_are_no_attempts(spool):
    spool.enqueue([job("c1")])
    spool.enqueue([job("c2", after="c1"), job("c3", after=["c2"])])
    assert spool.get("c2")["state"] == "waiting"
    first = spool.claim_next()
    assert first.job_id == "c1" and spool.claim_next() is None  # the others wait
    finish(spool, first)
    assert drain(spool) == ["c2", "c3"]
    assert spool.get("c3")["attempts"] == 1


def test_a_dependency_that_dies_or_is_cancelled_takes_its_dependents_to_dead(spool):
    spool.enqueue([job("d1", max_attempts=1), job("x1")])
    spool.enqueue([job("d2", after="d1"), job("d3", after="d2"), job("x2", after="x1")])
    finish(spool, spool.claim_next(), code=1)  # d1: dead at once
    for dependent, reason in (("d2", "its dependency d1 ended dead"), ("d3", "its dependency d2 ended dead")):
        job_ = spool.get(dependent)
        assert job_["state"] == "dead" and job_["error"] == reason
    spool.cancel("x1")
    assert spool.get("x2")["state"] == "dead" and "x1 ended cancelled" in spool.get("x2")["error"]
    with pytest.raises(NotPossible, match="retry d1 first"):
        spool.retry("d2")
    assert sorted(spool.retry_all()) == ["d1", "d2", "d3"]  # dependencies first, dependents waiting for them
    assert [spool.get(i)["state"] for i in ("d1", "d2", "d3")] == ["new", "waiting", "waiting"]
    assert drain(spool) == ["d1", "d2", "d3"]


def test_an_unknown_dependency_is_refused_and_enqueues_nothing(spool):
    with pytest.raises(InvalidJob, match="after: no job ghost"):
        spool.enqueue([job("u1"), job("u2", after="ghost")])
    assert spool.get("u1") is None


def test_a_dependency_already_finished_counts_by_its_outcome(spool):
    spool.enqueue([job("f1"), job("f2", max_attempts=1)])
    drain(spool)  # f1 done
    spool.enqueue([job("g1", after="f1")])
    assert spool.get("g1")["state"] == "new"


def test_unique_adds_nothing_while_the_holder_is_unfinished(spool):
    told = []
    assert spool.enqueue([job("k1", unique="nightly")]) == ["k1"]
    assert spool.enqueue([job("k2", unique="nightly")], on_existing=lambda *a: told.append(a)) == ["k1"]
    assert told == [("k2", "k1")] and spool.get("k2") is None
    spool.hold("k1")
    assert spool.enqueue([job("k3", unique="nightly")]) == ["k1"]  # held holds it
    spool.release_held("k1")
    claim = spool.claim_next()
    assert spool.enqueue([job("k4", unique="nightly")]) == ["k1"]  # running holds it
    finish(spool, claim)
    assert spool.enqueue([job("k5", unique="nightly")]) == ["k5"]  # done frees it


def test_ten_processes_enqueueing_one_key_leave_one_job(pg_spool_url):
    code = ("import sys, time; sys.path.insert(0, sys.argv[2]); from spoolq import record; "
            "from spoolq.pgspool import PgBackend; b = PgBackend(sys.argv[1]); i = sys.argv[3]; "
            "print(b.enqueue([(i, record.serialise(record.new_job({'command': 'true', 'unique': 'k'}, i, "
            "time.time())), None)])[0])")
    procs = [subprocess.Popen([sys.executable, "-c", code, pg_spool_url, ROOT, f"p{n}"], stdout=subprocess.PIPE,
                              text=True) for n in range(10)]
    printed = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    backend = PgBackend(pg_spool_url)
    assert len(printed) == 1 and [j["id"] for j in backend.list()] == list(printed)
    backend.close()


def test_a_lock_lets_one_holder_run_and_a_limit_more(spool):
    spool.enqueue([job("l1", lock="db"), job("l2", lock=["db", "gpu"]), job("l3"), job("g1", lock="gpu"),
                   job("g2", lock="gpu"), job("g3", lock="gpu")])
    claims = [spool.claim_next() for _ in range(4)]
    assert [c.job_id if c else None for c in claims] == ["g1", "l1", "l3", None]  # (one batch: by id) l2: db taken; g2: gpu taken
    spool.config_set("lock_limits", "gpu=2")
    spool.settings.reload()  # (as a worker does when the settings change)
    g2 = spool.claim_next()
    assert g2.job_id == "g2" and spool.claim_next() is None
    finish(spool, claims[1])  # db free: l2 waits for gpu still (g1 and g2 hold both of its slots)
    assert spool.claim_next() is None
    finish(spool, claims[0])
    assert spool.claim_next().job_id == "g3"  # (before l2 by id) a gpu slot is free again


def test_concurrent_claims_never_exceed_a_lock_limit(pg_spool_url):
    owner = PgBackend(pg_spool_url)
    owner.config_set("lock_limits", "gpu=2")
    owner.enqueue([job(f"j{n}", lock="gpu") for n in range(40)])
    code = """
import sys, time; sys.path.insert(0, sys.argv[2])
from spoolq.pgspool import PgBackend
from spoolq.record import Outcome
b = PgBackend(sys.argv[1]); reg = b.register(); idle = 0
while idle < 50:
    c = b.claim_next()
    if c is None:
        idle += 1; time.sleep(0.02); continue
    idle = 0
    n = b._conn("auto").execute("SELECT count(*) FROM spoolq.jobs WHERE state = 'running'").fetchone()[0]
    print(n, flush=True)
    time.sleep(0.01)
    b.finish(c, Outcome(start=time.time(), end=time.time(), exit_code=0), reg.worker_id); b.commit()
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, pg_spool_url, ROOT], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    seen = [int(n) for p in procs for n in p.communicate(timeout=300)[0].split()]
    assert len(seen) == 40 and max(seen) <= 2
    assert owner.counts()["done"] == 40
    owner.close()


def test_a_held_job_is_never_claimed_until_released(spool):
    spool.enqueue([job("h1", held=True), job("h2")])
    spool.hold("h2")
    assert spool.get("h1")["state"] == "held" and spool.claim_next() is None
    spool.release_held("h2")
    spool.release_held("h1", now=True)
    assert sorted(drain(spool)) == ["h1", "h2"]
    with pytest.raises(NotPossible, match="not held"):
        spool.release_held("h1")


def test_a_row_inserted_by_hand_is_ordered_by_its_record(spool, pg_spool_url):
    import psycopg

    with psycopg.connect(pg_spool_url, autocommit=True) as conn:
        for job_id, extra, priority in (("plain", "", 0), ("urgent", ', "priority": 5', 5),
                                        ("late", ', "priority": -5', 0), ("kept", ', "held": true', 0)):
            conn.execute("INSERT INTO spoolq.jobs (id, record, priority) VALUES (%s, %s, %s)",
                         (job_id, '{"command": "true"' + extra + "}", priority))
    # The priority column orders a row from the start; a record's priority
    # from its first sight (late: passed over then, and last).
    assert drain(spool) == ["urgent", "plain", "late"]
    kept = spool.get("kept")
    assert kept["state"] == "held" and kept["why"] == "held (spoolq release kept)"
