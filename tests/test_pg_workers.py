"""Workers of a PostgreSQL spool, as separate processes against a real
server: claims are exactly once; a dead worker's job is recovered once its
session has ended and never while it lives (stopped or not); a finish from
a worker that lost its claim changes nothing; a worker whose session is cut
or stops answering kills its runs before anyone else can run them; a
waiting worker wakes at once for a new job.

The workers are tests/pgloop.py, a minimal loop over the backend (claim,
run, finish, commit)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import alive, wait_for
from spoolq import record
from spoolq.record import Outcome

pytest_plugins = ["pgserver"]

if os.environ.get("SPOOLQ_CI"):
    import psycopg  # under CI a missing psycopg fails the run
else:
    psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")

from spoolq.pgspool import PgBackend  # noqa: E402
from spoolq.pgspool.liveness import HEARTBEAT, LOST_AFTER, RECOVERY_GRACE  # noqa: E402
from spoolq.pgspool.types import Unavailable  # noqa: E402

LOOP = str(Path(__file__).with_name("pgloop.py"))

# A job that, as it starts, notes whether a process of an earlier run of
# it still lives (OVERLAP), then its own pid, then sleeps.
OVERLAP_SCRIPT = textwrap.dedent("""
    import os, sys, time
    log = sys.argv[1]
    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False
    earlier = [int(line) for line in open(log).read().split()] if os.path.exists(log) else []
    with open(log, "a") as f:
        f.write("".join(f"OVERLAP{p}\\n" for p in earlier if alive(p)) + f"{os.getpid()}\\n")
    time.sleep(600)
""")


def job(job_id: str, **fields):
    if not {"command", "argv", "kind"} & set(fields):
        fields["kind"] = "noop"
    return job_id, record.serialise(record.new_job(fields, job_id, time.time())), None


class Loop:
    """One worker process (tests/pgloop.py) and what it said."""

    def __init__(self, url: str, folder: Path, watch: bool = True):
        self.out = folder / f"loop-{os.urandom(4).hex()}.log"
        argv = [sys.executable, LOOP, url] + (["--watch"] if watch else [])
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        self.worker = wait_for(lambda: self.first("registered"), 60, what="the worker to register")["worker"]

    def events(self, kind: str | None = None) -> list[dict]:
        found = []
        for line in self.out.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if kind is None or event.get("event") == kind:
                found.append(event)
        return found

    def first(self, kind: str, **match) -> dict | None:
        return next((e for e in self.events(kind) if all(e.get(k) == v for k, v in match.items())), None)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


@pytest.fixture
def loops(pg_spool_url, tmp_path):
    """Start workers; at the end they are killed and a sweep kills what their runs left."""
    started: list[Loop] = []

    def start(watch: bool = True) -> Loop:
        loop = Loop(pg_spool_url, tmp_path, watch)
        started.append(loop)
        return loop

    yield start
    for loop in started:
        try:
            os.kill(loop.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        loop.kill()
    backend = PgBackend(pg_spool_url)
    try:
        backend.sweep()
    finally:
        backend.close()


@pytest.fixture
def spool(pg_spool_url):
    backend = PgBackend(pg_spool_url)
    yield backend
    backend.close()


def session_pid(url: str, worker: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT session_pid FROM spoolq.workers WHERE worker = %s ORDER BY id DESC LIMIT 1",
                            (worker,)).fetchone()[0]


def overlap_job(spool, tmp_path: Path, job_id: str = "long") -> Path:
    script = tmp_path / "overlap.py"
    script.write_text(OVERLAP_SCRIPT)
    log = tmp_path / f"{job_id}.pids"
    spool.enqueue([job(job_id, argv=[sys.executable, str(script), str(log)])])
    return log


def pids(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_several_workers_drain_thousands_of_jobs_each_exactly_once(spool, loops):
    n = 3000
    spool.enqueue([job(f"j{i:05d}") for i in range(n)])
    workers = [loops(watch=False) for _ in range(4)]
    for w in workers:
        assert w.proc.wait(timeout=600) == 0, w.out.read_text()[-2000:]
    finished = [e["id"] for w in workers for e in w.events("finished")]
    assert len(finished) == n and len(set(finished)) == n
    assert all(not e["lost"] and e["state"] == "done" for w in workers for e in w.events("finished"))
    assert sum(1 for w in workers if w.events("finished")) >= 2  # they shared the work
    counts = spool.counts()
    assert (counts["done"], counts["new"], counts["cur"]) == (n, 0, 0)
    with psycopg.connect(spool.url) as conn:
        runs = conn.execute("SELECT count(*) FROM spoolq.jobs, spoolq.runs_of(record)").fetchone()[0]
    assert runs == n  # one run each


def test_a_killed_workers_job_is_recovered_once_its_session_ends_never_while_it_lives(spool, loops, tmp_path):
    log = overlap_job(spool, tmp_path)
    worker = loops()
    first = int(wait_for(lambda: pids(log), 60, what="the job to start")[0])
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        # Stopped, its session lives: however long, nobody takes its job.
        deadline = time.monotonic() + RECOVERY_GRACE + 2 * HEARTBEAT + 1
        while time.monotonic() < deadline:
            report = spool.recover()
            assert (report.recovered, report.dead, report.waiting) == (0, 0, 0)
            time.sleep(0.5)
        assert spool.sweep().recovered == 0
        rec = spool.get("long")
        assert rec["state"] == "cur" and rec["worker"] == worker.worker and not rec.get("abandoned")
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    worker.kill()  # the worker alone: its job's process lives on, in a session of its own
    assert alive(first)
    report = wait_for(lambda: spool.sweep().recovered, 30, what="recovery")
    assert report == 1
    rec = spool.get("long")
    assert rec["state"] == "failed" and rec["attempts"] == 1
    assert rec["history"][0]["error"] == "interrupted: the worker running it died"
    assert not alive(first)  # recovery on the worker's host killed what the run left
    assert spool.sweep().recovered == 0  # once


def test_a_finish_from_a_worker_that_lost_its_claim_changes_nothing(spool, pg_spool_url):
    spool.enqueue([job("t")])
    reg1 = spool.register()
    stale = spool.claim_next()
    with psycopg.connect(pg_spool_url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(session_pid) FROM spoolq.workers WHERE id = %s", (reg1.id,))
    wait_for(lambda: reg1.losses == 1, 30, what="the worker to see its session end")
    other = PgBackend(pg_spool_url)
    try:
        assert other.sweep().recovered == 1
        reg2 = other.register()
        fresh = other.claim_next()
        assert fresh.job_id == "t" and fresh.attempt == 2
        late = spool.finish(stale, Outcome(start=time.time(), end=time.time(), exit_code=0), reg1.worker_id)
        spool.commit()
        assert late.lost and late.state is None
        rec = spool.get("t")
        assert rec["state"] == "cur" and rec["worker"] == reg2.worker_id and len(rec["history"]) == 1
        done = other.finish(fresh, Outcome(start=time.time(), end=time.time(), exit_code=0), reg2.worker_id)
        other.commit()
        assert done.state == "done"
        assert [h.get("error") for h in spool.get("t")["history"]] == ["interrupted: the worker running it died", None]
        reg2.close()
    finally:
        other.close()
        reg1.close()


def test_a_cut_session_ends_the_runs_before_anyone_runs_the_job_again(spool, loops, tmp_path, pg_spool_url):
    log = overlap_job(spool, tmp_path)
    workers = [loops(), loops()]
    first = int(wait_for(lambda: pids(log), 60, what="the job to start")[0])
    runner = spool.get("long")["worker"]
    cut = time.monotonic()
    with psycopg.connect(pg_spool_url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (session_pid(pg_spool_url, runner),))
    wait_for(lambda: not alive(first), 30, interval=0.01, what="the run to be killed")
    killed_after = time.monotonic() - cut
    assert killed_after < RECOVERY_GRACE  # seen at once, killed before recovery could take the job
    wait_for(lambda: len(pids(log)) >= 2, 60, what="the job to run again")
    assert not any(p.startswith("OVERLAP") for p in pids(log)), pids(log)
    rec = spool.get("long")
    assert rec["history"][0]["error"].startswith("interrupted: the worker lost its database session")
    owner = next(w for w in workers if w.worker == runner)
    assert any("lost its database session" in e["text"] for e in owner.events("log"))


def test_a_worker_whose_session_stops_answering_kills_its_runs(spool, loops, tmp_path, pg_spool_url):
    log = overlap_job(spool, tmp_path)
    worker = loops()
    first = int(wait_for(lambda: pids(log), 60, what="the job to start")[0])
    backend_pid = session_pid(pg_spool_url, worker.worker)
    os.kill(backend_pid, signal.SIGSTOP)  # as a partition looks to the worker: no answer
    stopped = time.monotonic()
    try:
        wait_for(lambda: not alive(first), LOST_AFTER + HEARTBEAT + 30, interval=0.02, what="the run to be killed")
        assert time.monotonic() - stopped < LOST_AFTER + HEARTBEAT + 5
        wait_for(lambda: len(pids(log)) >= 2, 60, what="the job to run again (under a new session)")
        assert not any(p.startswith("OVERLAP") for p in pids(log)), pids(log)
    finally:
        os.kill(backend_pid, signal.SIGCONT)
    assert any("no answer from the server" in e["text"] for e in worker.events("log"))


def test_a_waiting_worker_picks_a_new_job_up_within_100_ms(spool, loops):
    worker = loops()
    spool.enqueue([job("warm")])
    wait_for(lambda: worker.first("finished", id="warm"), 30, what="the first job")
    latencies = []
    for i in range(20):
        time.sleep(0.2)  # the worker is waiting again
        sent = time.time()
        spool.enqueue([job(f"w{i}")])
        claimed = wait_for(lambda: worker.first("claimed", id=f"w{i}"), 30, interval=0.005, what=f"w{i}")
        latencies.append(claimed["at"] - sent)
    assert statistics.median(latencies) < 0.1, latencies


def test_a_server_restarted_under_load_loses_nothing(pg_server, spool, loops):
    n = 1500
    spool.enqueue([job(f"r{i:05d}") for i in range(n)])
    workers = [loops(), loops()]
    wait_for(lambda: sum(len(w.events("finished")) for w in workers) >= 200, 120, what="the drain to get going")
    pg_server.restart()

    def done() -> bool:
        try:
            return spool.counts()["done"] == n
        except Unavailable:
            return False

    wait_for(done, 300, interval=0.5, what="every job to be done")
    counts = spool.counts()
    assert (counts["new"], counts["cur"], counts["failed"], counts["dead"]) == (0, 0, 0, 0)
    with psycopg.connect(spool.url) as conn:
        ok = conn.execute("SELECT count(*) FROM spoolq.jobs, spoolq.runs_of(record) WHERE NOT failed").fetchone()[0]
    assert ok == n  # one successful run each
    assert all(w.proc.poll() is None for w in workers)  # the workers rode it out
