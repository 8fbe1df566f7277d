"""Workers of a PostgreSQL spool, as separate ``spoolq work`` processes
against a real server, each on a host of its own (its own PID and UTS
namespaces, where this machine lets the tests make them; else a plain
process): claims are exactly once; a dead host's job is recovered once its
worker's session has ended and never while it lives (stopped or not); a
finish from a worker that lost its claim changes nothing; a worker whose
session is cut or stops answering kills its runs before anyone else can run
them; a waiting worker starts a new job at once; a server restart loses
nothing."""

from __future__ import annotations

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

# Handler jobs (kind noop) do nothing.
APP = "HANDLERS = {'noop': lambda payload: None}\n"

# A job that, as it starts, notes whether a process of an earlier run of it
# still lives (OVERLAP: the earlier run still holds the lock, on whichever
# host it runs), then its attempt, then sleeps holding the lock.
OVERLAP_SCRIPT = textwrap.dedent("""
    import fcntl, os, sys, time
    log = sys.argv[1]
    lock = open(log + ".lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        overlap = ""
    except BlockingIOError:
        overlap = "OVERLAP"
        fcntl.flock(lock, fcntl.LOCK_EX)
    with open(log, "a") as f:
        f.write(overlap + os.environ["SPOOLQ_ATTEMPT"] + "\\n")
    time.sleep(600)
""")


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--uts", "--fork", "--mount-proc", "hostname", "spoolq-probe"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


HOSTS = _unshare_works()


def job(job_id: str, **fields):
    if not {"command", "argv", "kind"} & set(fields):
        fields["kind"] = "noop"
    return job_id, record.serialise(record.new_job(fields, job_id, time.time())), None


def children() -> dict[int, list[int]]:
    """Every process's children, by parent pid."""
    found: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            found.setdefault(ppid, []).append(int(entry))
    return found


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first."""
    kids, found = children(), [pid]
    for p in found:
        found.extend(kids.get(p, []))
    return found


def run_pids(log: Path) -> list[int]:
    """The live processes of the runs of an overlap job (by its log, given
    as their argument), on any host."""
    found = []
    arg = str(log).encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if arg in f.read().split(b"\0") and alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                continue
    return found


class Host:
    """One ``spoolq work`` process on a host of its own, and what it logged."""

    def __init__(self, url: str, folder: Path, watch: bool = True):
        self.name = f"spoolq-host-{os.urandom(3).hex()}"
        self.out = folder / f"{self.name}.log"
        argv = [sys.executable, "-m", "spoolq", "-s", url, "work", "--app", "noopapp:HANDLERS"]
        argv += ["--watch"] if watch else []
        if HOSTS:
            # The shell stays the namespace's init (its last command is not
            # exec'd): killing it kills everything on the host at once.
            argv = ["unshare", "--pid", "--uts", "--fork", "--mount-proc", "sh", "-c",
                    'hostname "$0" && "$@"; exit $?', self.name] + argv
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=folder)
        self.url = url
        self.worker = wait_for(self._registered, 60, what="the worker to register")

    def _registered(self) -> str | None:
        where, key = ("host", self.name) if HOSTS else ("pid", self.proc.pid)
        with psycopg.connect(self.url) as conn:
            row = conn.execute(f"SELECT worker FROM spoolq.workers WHERE {where} = %s ORDER BY id DESC LIMIT 1",
                               (key,)).fetchone()
        return row[0] if row else None

    def log(self) -> str:
        return self.out.read_text()

    def worker_pid(self) -> int:
        """The worker process (as this machine numbers it)."""
        if not HOSTS:
            return self.proc.pid
        for pid in tree(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spoolq" in f.read().split(b"\0") and pid != self.proc.pid:
                        return pid
            except OSError:
                continue
        raise AssertionError(f"no worker process on {self.name}")

    def kill(self) -> None:
        """SIGKILL the whole host: the worker and every process of its runs."""
        if HOSTS:
            for init in children().get(self.proc.pid, []):
                os.kill(init, signal.SIGKILL)  # the namespace's init: the kernel kills the rest
        else:
            found = tree(self.proc.pid)
            for pid in found:
                try:
                    os.kill(pid, signal.SIGSTOP)  # nobody forks or reaps while the tree is collected
                except ProcessLookupError:
                    pass
            for pid in tree(self.proc.pid) + found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


@pytest.fixture
def hosts(pg_spool_url, tmp_path):
    """Start workers on hosts of their own; at the end the hosts are killed
    and a sweep kills what their runs left."""
    (tmp_path / "noopapp.py").write_text(APP)
    started: list[Host] = []

    def start(watch: bool = True) -> Host:
        host = Host(pg_spool_url, tmp_path, watch)
        started.append(host)
        return host

    yield start
    for host in started:
        for pid in tree(host.proc.pid):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        host.kill()
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
    log = tmp_path / f"{job_id}.runs"
    spool.enqueue([job(job_id, argv=[sys.executable, str(script), str(log)])])
    return log


def runs(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def history(url: str) -> list[tuple]:
    """(job, worker, start, error) of every run of every job."""
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT id, h ->> 'worker', spoolq.epoch(h -> 'start'), h ->> 'error' "
                            "FROM spoolq.jobs, json_array_elements(record::json -> 'history') AS h").fetchall()


def test_several_workers_drain_thousands_of_jobs_each_exactly_once(spool, hosts):
    n = 3000
    spool.enqueue([job(f"j{i:05d}") for i in range(n)])
    workers = [hosts(watch=False) for _ in range(4)]
    for w in workers:
        assert w.proc.wait(timeout=600) == 0, w.log()[-2000:]
    counts = spool.counts()
    assert (counts["done"], counts["new"], counts["cur"]) == (n, 0, 0)
    ran = history(spool.url)
    assert len(ran) == n and len({r[0] for r in ran}) == n  # one run each
    assert all(r[3] is None for r in ran)
    assert len({r[1] for r in ran}) >= 2  # they shared the work
    assert {r[1] for r in ran} <= {w.worker for w in workers}


def test_a_killed_hosts_job_is_recovered_once_its_session_ends_never_while_it_lives(spool, hosts, tmp_path):
    log = overlap_job(spool, tmp_path)
    host = hosts()
    wait_for(lambda: runs(log), 60, what="the job to start")
    first = run_pids(log)
    assert len(first) == 1, first
    worker = host.worker_pid()
    os.kill(worker, signal.SIGSTOP)
    try:
        # Stopped, its session lives: however long, nobody takes its job.
        deadline = time.monotonic() + RECOVERY_GRACE + 2 * HEARTBEAT + 1
        while time.monotonic() < deadline:
            report = spool.recover()
            assert (report.recovered, report.dead, report.waiting) == (0, 0, 0)
            time.sleep(0.5)
        assert spool.sweep().recovered == 0
        rec = spool.get("long")
        assert rec["state"] == "cur" and rec["worker"] == host.worker and not rec.get("abandoned")
        assert alive(first[0])
    finally:
        os.kill(worker, signal.SIGCONT)
    host.kill()  # the worker and its job's processes, at once
    wait_for(lambda: not alive(first[0]), 30, what="the host's processes to end")
    report = wait_for(lambda: spool.sweep().recovered, 30, what="recovery")
    assert report == 1
    rec = spool.get("long")
    assert rec["state"] == "failed" and rec["attempts"] == 1
    assert rec["history"][0]["error"] == "interrupted: the worker running it died"
    assert spool.sweep().recovered == 0  # once
    assert runs(log) == ["1"]


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


def test_a_cut_session_ends_the_runs_before_anyone_runs_the_job_again(spool, hosts, tmp_path, pg_spool_url):
    log = overlap_job(spool, tmp_path)
    workers = [hosts(), hosts()]
    wait_for(lambda: runs(log), 60, what="the job to start")
    first = run_pids(log)
    assert len(first) == 1, first
    runner = spool.get("long")["worker"]
    cut = time.monotonic()
    with psycopg.connect(pg_spool_url, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (session_pid(pg_spool_url, runner),))
    wait_for(lambda: not alive(first[0]), 30, interval=0.01, what="the run to be killed")
    killed_after = time.monotonic() - cut
    assert killed_after < RECOVERY_GRACE  # seen at once, killed before recovery could take the job
    wait_for(lambda: len(runs(log)) >= 2, 60, what="the job to run again")
    assert runs(log) == ["1", "2"]  # no OVERLAP: the first run had ended
    rec = spool.get("long")
    assert rec["history"][0]["error"].startswith("interrupted: the worker lost its database session")
    owner = next(w for w in workers if w.worker == runner)
    assert "lost its database session" in owner.log()
    assert all(w.proc.poll() is None for w in workers)


def test_a_worker_whose_session_stops_answering_kills_its_runs(spool, hosts, tmp_path, pg_spool_url):
    log = overlap_job(spool, tmp_path)
    host = hosts()
    wait_for(lambda: runs(log), 60, what="the job to start")
    first = run_pids(log)
    assert len(first) == 1, first
    backend_pid = session_pid(pg_spool_url, host.worker)
    os.kill(backend_pid, signal.SIGSTOP)  # as a partition looks to the worker: no answer
    stopped = time.monotonic()
    try:
        wait_for(lambda: not alive(first[0]), LOST_AFTER + HEARTBEAT + 30, interval=0.02, what="the run to be killed")
        assert time.monotonic() - stopped < LOST_AFTER + HEARTBEAT + 5
        wait_for(lambda: len(runs(log)) >= 2, 60, what="the job to run again (under a new session)")
        assert runs(log) == ["1", "2"]  # no OVERLAP: the first run had ended
    finally:
        os.kill(backend_pid, signal.SIGCONT)
    assert "no answer from the server" in host.log()


def test_a_waiting_worker_starts_a_new_job_within_100_ms(spool, hosts):
    host = hosts()
    spool.enqueue([job("warm")])
    wait_for(lambda: spool.get("warm")["state"] == "done", 30, what="the first job")
    latencies = []
    for i in range(20):
        time.sleep(0.2)  # the worker is waiting again
        sent = time.time()
        spool.enqueue([job(f"w{i}")])
        wait_for(lambda: spool.get(f"w{i}")["state"] == "done", 30, interval=0.005, what=f"w{i}")
        started = next(r[2] for r in history(spool.url) if r[0] == f"w{i}")
        latencies.append(started - sent)
    # The median: a loaded machine may hold back the odd wake-up, never most.
    assert statistics.median(latencies) < 0.1, latencies
    assert all(lat > 0 for lat in latencies), latencies


def test_a_server_restarted_under_load_loses_nothing(pg_server, spool, hosts):
    n = 1500
    spool.enqueue([job(f"r{i:05d}") for i in range(n)])
    workers = [hosts(), hosts()]

    def finished() -> int:
        try:
            return spool.counts()["done"]
        except Unavailable:
            return 0

    wait_for(lambda: finished() >= 200, 120, what="the drain to get going")
    pg_server.restart()
    wait_for(lambda: finished() == n, 300, interval=0.5, what="every job to be done")
    counts = spool.counts()
    assert (counts["new"], counts["cur"], counts["failed"], counts["dead"]) == (0, 0, 0, 0)
    ok = [r for r in history(spool.url) if r[3] is None]
    assert len(ok) == n and len({r[0] for r in ok}) == n  # one successful run each
    assert all(w.proc.poll() is None for w in workers)  # the workers rode it out
    # ... and still hear what is asked of them, and wake for new jobs.
    spool.enqueue([job("after")])
    wait_for(lambda: spool.get("after")["state"] == "done", 60, what="a job enqueued after the restart")
    subprocess.run([sys.executable, "-m", "spoolq", "-s", spool.url, "stop"], check=True, timeout=120)
    for w in workers:
        assert w.proc.wait(timeout=120) == 0, w.log()[-2000:]
