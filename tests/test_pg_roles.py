"""Who may do what in a PostgreSQL spool is the database's roles and grants
(docs/postgres.md): a producer role enqueues and reads, and can neither
claim nor change jobs; a worker role runs them; only the role that owns
the schema changes settings or deletes history."""

from __future__ import annotations

import os
import time

import pytest

from spoolq import record
from spoolq.errors import SpoolError
from spoolq.record import Outcome

pytest_plugins = ["pgserver"]

if os.environ.get("SPOOLQ_CI"):
    import psycopg  # under CI a missing psycopg fails the run
else:
    psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")

from spoolq.pgspool import PgBackend  # noqa: E402

ROLES = """
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'spoolq_producer') THEN
        CREATE ROLE spoolq_producer NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'spoolq_worker') THEN
        CREATE ROLE spoolq_worker NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'webapp') THEN
        CREATE ROLE webapp LOGIN IN ROLE spoolq_producer;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runner') THEN
        CREATE ROLE runner LOGIN IN ROLE spoolq_worker;
    END IF;
END $$;
"""


def job(job_id: str, **fields):
    fields.setdefault("command", "true")
    return job_id, record.serialise(record.new_job(fields, job_id, time.time())), None


@pytest.fixture
def roles(pg_url):
    """A spool made by its owner after the roles exist: (owner, producer, worker) backends."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(ROLES)
    owner = PgBackend(pg_url)
    owner.init()
    producer = PgBackend(pg_url.replace("user=postgres", "user=webapp"))
    worker = PgBackend(pg_url.replace("user=postgres", "user=runner"))
    yield owner, producer, worker
    for backend in (owner, producer, worker):
        backend.close()


def test_a_producer_enqueues_and_reads(roles):
    owner, producer, _ = roles
    assert producer.enqueue([job("p1"), job("p2")]) == ["p1", "p2"]
    assert producer.get("p1")["state"] == "new"
    assert [j["id"] for j in producer.list()] == ["p1", "p2"]
    assert producer.counts()["new"] == 2 and producer.stats()["total"]["jobs"] == 0
    assert producer.config_list()["max_attempts"] == 5
    with psycopg.connect(owner.url) as conn:
        assert conn.execute("SELECT enqueued_by FROM spoolq.jobs WHERE id = 'p1'").fetchone()[0] == "webapp"


def test_a_producer_can_neither_claim_nor_change_jobs(roles):
    owner, producer, _ = roles
    owner.enqueue([job("dead1")])
    reg = owner.register()
    claim = owner.claim_next()
    producer.enqueue([job("p1")])
    owner.finish(claim, Outcome(start=time.time(), end=time.time(), exit_code=1, error="x", permanent=True),
                 reg.worker_id)
    owner.commit()
    for attempt in (producer.register, lambda: producer.cancel("p1"), lambda: producer.retry("dead1"),
                    lambda: producer.config_set("max_attempts", "3"), lambda: producer.compact(0),
                    lambda: producer.purge_dead(0)):
        with pytest.raises(SpoolError, match="permission denied"):
            attempt()
    with psycopg.connect(producer.url, autocommit=True) as conn:
        for sql in ("SELECT id FROM spoolq.jobs FOR UPDATE SKIP LOCKED",
                    "UPDATE spoolq.jobs SET state = 'running' WHERE id = 'p1'",
                    "INSERT INTO spoolq.jobs (id, record, state) VALUES ('x', '{}', 'done')",
                    "DELETE FROM spoolq.jobs"):
            with pytest.raises((psycopg.errors.InsufficientPrivilege, psycopg.errors.CheckViolation)):
                conn.execute(sql)
    assert owner.get("p1")["state"] == "new" and owner.get("dead1")["state"] == "dead"
    reg.close()


def test_a_worker_runs_jobs_but_neither_changes_settings_nor_deletes_history(roles):
    owner, producer, worker = roles
    producer.enqueue([job("w1")])
    reg = worker.register()
    claim = worker.claim_next()
    done = worker.finish(claim, Outcome(start=time.time(), end=time.time(), exit_code=0), reg.worker_id)
    worker.commit()
    assert done.state == "done"
    assert worker.recover().recovered == 0
    for attempt in (lambda: worker.config_set("max_attempts", "3"), lambda: worker.compact(0)):
        with pytest.raises(SpoolError, match="permission denied"):
            attempt()
    reg.close()
    assert owner.compact(0)["dropped"] == 1


def test_a_producer_kills_or_cancels_its_own_running_job_only_and_may_not_stop_or_pause(roles, tmp_path):
    import subprocess

    from conftest import SPOOLQ, wait_for

    owner, producer, _ = roles

    def spoolq(url, *args):
        env = {k: v for k, v in os.environ.items() if k != "SPOOLQ_DIR"}
        return subprocess.run(SPOOLQ + ["-s", url, *args], capture_output=True, text=True, timeout=120, env=env)

    web = producer.url
    mine = spoolq(web, "enqueue", f"touch {tmp_path}/mine; sleep 300").stdout.strip()
    again = spoolq(web, "enqueue", f"touch {tmp_path}/again; sleep 300").stdout.strip()
    owners = spoolq(owner.url, "enqueue", f"touch {tmp_path}/owners; sleep 300").stdout.strip()
    worker = subprocess.Popen(SPOOLQ + ["-s", owner.url, "work", "--watch", "-j", "3"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: all((tmp_path / n).exists() for n in ("mine", "again", "owners")), what="the jobs to run")
        for verb in ("kill", "cancel"):
            run = spoolq(web, verb, owners)
            assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
            assert f"job {owners} was enqueued by postgres, not by webapp" in run.stderr
        for args in (("pause",), ("stop",), ("resume",)):
            run = spoolq(web, *args)
            assert run.returncode == 1 and run.stderr.count("\n") == 1 and "permission denied" in run.stderr, run
        assert '"paused": null' in spoolq(owner.url, "status", "--json").stdout
        run = spoolq(web, "cancel", mine)
        assert (run.returncode, run.stdout) == (0, f"cancelled {mine}\n"), run.stderr
        run = spoolq(web, "kill", again)
        assert (run.returncode, run.stdout) == (0, f"cancelled {again}\n"), run.stderr
        assert owner.get(owners)["state"] == "cur"
        assert [owner.get(j)["outcome"] for j in (mine, again)] == ["cancelled", "cancelled"]
        assert owner.get(mine)["history"][-1]["error"] == "cancelled by webapp"
        assert spoolq(web, "kill", mine).returncode == 1  # not running any more
    finally:
        spoolq(owner.url, "stop", "--now")
        worker.wait(60)
