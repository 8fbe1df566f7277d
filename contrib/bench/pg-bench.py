#!/usr/bin/env python3
"""The PostgreSQL spool beside procrastinate, on one local server, in one run.

Usage (from a checkout, with its virtual environment and the test extra):

    .venv/bin/python contrib/bench/pg-bench.py [--rounds 3] [--jobs 4000] [--fsync on|off] [--venv DIR]

It starts its own PostgreSQL server (as the tests do: tests/pgserver.py,
initdb and pg_ctl on a Unix socket in a temporary folder, here with the
server's default durability unless --fsync off) and installs procrastinate
into a virtual environment of its own (--venv, default
/tmp/spoolq-bench-procrastinate; never a spoolq dependency). Then, in
alternating rounds, each in a fresh database, for both queues:

- drain: N no-op jobs waiting, then 1, 2 and 4 worker processes started,
  connected and waiting for a go, timed from the go until all have exited;
- enqueue: 1,000 jobs one per transaction, and 20 batches of 1,000;
- pickup: a waiting worker, 40 jobs enqueued 50 ms apart, the time from
  each enqueue call's return to the job's start.

It prints the median of the rounds per figure and the ratios.

The spoolq workers here are a minimal loop over the PostgreSQL backend
(register, claim_next, a no-op, finish, and a group commit of up to 64
finishes or 50 ms, as the worker commits), because ``spoolq work`` does
not run on the storage port yet; its enqueue builds each record as
``Spool.enqueue`` does. procrastinate runs its own worker
(``run_worker(wait=False, concurrency=1)``, one job per process at a time
as spoolq -j 1) and its own ``defer``/``batch_defer``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKERS = (1, 2, 4)


# -- the roles a child process plays (one interpreter each) -------------------------------


def spoolq_backend(url: str):
    sys.path.insert(0, ROOT)
    from spoolq.pgspool import PgBackend

    backend = PgBackend(url)
    backend.open()
    return backend


def spoolq_records(backend, n: int) -> list:
    """Jobs as Spool.enqueue makes them: an id, the record, checked."""
    from spoolq import config, record
    from spoolq.ids import new_id

    items = []
    now = time.time()
    for _ in range(n):
        job_id = new_id()
        job = record.new_job({"kind": "noop"}, job_id, now)
        assert config.refusal(backend.settings, job) is None
        data = record.serialise(job)
        assert len(data) <= int(backend.settings["max_job_bytes"])
        items.append((job_id, data, None))
    return items


def spoolq_role(role: str, url: str, arg: int) -> None:
    from spoolq.record import Outcome

    if role == "schema":
        sys.path.insert(0, ROOT)
        from spoolq.pgspool import PgBackend

        PgBackend(url).init()
        return
    backend = spoolq_backend(url)
    if role == "fill":
        for start in range(0, arg, 1000):
            backend.enqueue(spoolq_records(backend, min(1000, arg - start)))
    elif role in ("single", "batch"):
        started = time.perf_counter()
        if role == "single":
            for _ in range(arg):
                backend.enqueue(spoolq_records(backend, 1))
        else:
            for _ in range(arg // 1000):
                backend.enqueue(spoolq_records(backend, 1000))
        print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)
    elif role == "drain":
        reg = backend.register()
        print("ready", flush=True)
        sys.stdin.readline()
        pending, since = 0, time.monotonic()
        while (claim := backend.claim_next()) is not None:
            start = time.time()
            backend.finish(claim, Outcome(start=start, end=time.time()), reg.worker_id)
            pending += 1
            if pending >= 64 or time.monotonic() - since >= 0.05:
                backend.commit()
                pending, since = 0, time.monotonic()
        backend.commit()
        reg.close()
    elif role == "watch":
        reg = backend.register()
        waker = backend.waker()
        waker.start()
        waker.listening.wait(30)
        print("ready", flush=True)
        while True:
            claim = backend.claim_next()
            if claim is None:
                waker.wait(1.0)
                waker.clear()
                continue
            print(json.dumps({"id": claim.job["payload"], "at": time.time()}), flush=True)
            backend.finish(claim, Outcome(start=time.time(), end=time.time()), reg.worker_id)
            backend.commit()
    elif role == "produce":
        for i in range(arg):
            time.sleep(0.05)
            from spoolq import record
            from spoolq.ids import new_id

            job_id = new_id()
            backend.enqueue([(job_id, record.serialise(record.new_job({"kind": "noop", "payload": i}, job_id,
                                                                      time.time())), None)])
            print(json.dumps({"id": i, "at": time.time()}), flush=True)


def procrastinate_app(url: str, sync: bool):
    import logging

    import procrastinate

    logging.getLogger("procrastinate").setLevel(logging.ERROR)  # it warns of an app defined in __main__

    connector = procrastinate.SyncPsycopgConnector(conninfo=url) if sync else procrastinate.PsycopgConnector(conninfo=url)
    app = procrastinate.App(connector=connector)

    @app.task(name="noop")
    def noop(i: int | None = None) -> None:
        if i is not None:
            print(json.dumps({"id": i, "at": time.time()}), flush=True)

    return app, noop


def procrastinate_role(role: str, url: str, arg: int) -> None:
    import asyncio

    if role in ("drain", "watch"):
        app, _ = procrastinate_app(url, sync=False)

        async def work() -> None:
            async with app.open_async():
                print("ready", flush=True)
                if role == "drain":
                    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
                await app.run_worker_async(wait=role == "watch", concurrency=1, install_signal_handlers=False)

        asyncio.run(work())
        return
    app, noop = procrastinate_app(url, sync=True)
    with app.open():
        if role == "schema":
            app.schema_manager.apply_schema()
        elif role == "fill":
            for start in range(0, arg, 1000):
                noop.batch_defer(*[{}] * min(1000, arg - start))
        elif role in ("single", "batch"):
            started = time.perf_counter()
            if role == "single":
                for _ in range(arg):
                    noop.defer()
            else:
                for _ in range(arg // 1000):
                    noop.batch_defer(*[{}] * 1000)
            print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)
        elif role == "produce":
            for i in range(arg):
                time.sleep(0.05)
                noop.defer(i=i)
                print(json.dumps({"id": i, "at": time.time()}), flush=True)


# -- the run ------------------------------------------------------------------------------


class Bench:
    def __init__(self, server, venv: str, jobs: int):
        self.server = server
        self.python = {"spoolq": sys.executable, "procrastinate": os.path.join(venv, "bin", "python")}
        self.jobs = jobs

    def child(self, system: str, role: str, url: str, arg: int = 0, **kw) -> subprocess.Popen:
        return subprocess.Popen([self.python[system], os.path.abspath(__file__), "--role", system, role, url, str(arg)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)

    def run(self, system: str, role: str, url: str, arg: int = 0) -> str:
        proc = self.child(system, role, url, arg)
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode:
            raise SystemExit(f"{system} {role} failed ({proc.returncode})")
        return out

    def database(self, system: str) -> str:
        url = self.server.url(self.server.new_database())
        self.run(system, "schema", url)
        return url

    def drain(self, system: str, workers: int) -> float:
        url = self.database(system)
        self.run(system, "fill", url, self.jobs)
        procs = [self.child(system, "drain", url) for _ in range(workers)]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        started = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            p.communicate(timeout=3600)
        return self.jobs / (time.perf_counter() - started)

    def enqueue(self, system: str, mode: str) -> float:
        n = 1000 if mode == "single" else 20000
        seconds = json.loads(self.run(system, mode, self.database(system), n))["seconds"]
        return n / seconds

    def pickup(self, system: str, count: int = 40) -> float:
        url = self.database(system)
        watcher = self.child(system, "watch", url)
        try:
            assert watcher.stdout.readline().strip() == "ready"
            time.sleep(0.5)
            sent = {e["id"]: e["at"] for e in map(json.loads, self.run(system, "produce", url, count).splitlines())}
            started: dict[int, float] = {}
            while len(started) < count:
                event = json.loads(watcher.stdout.readline())
                started[event["id"]] = event["at"]
        finally:
            watcher.kill()
            watcher.wait()
        return statistics.median(started[i] - sent[i] for i in sent) * 1000


def ensure_procrastinate(venv: str) -> None:
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    if subprocess.run([python, "-c", "import procrastinate, psycopg"], capture_output=True).returncode:
        subprocess.run([python, "-m", "pip", "install", "-q", "procrastinate"], check=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--role":
        system, role, url, arg = sys.argv[2:6]
        (spoolq_role if system == "spoolq" else procrastinate_role)(role, url, int(arg))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=4000, help="jobs each drain runs")
    ap.add_argument("--fsync", choices=("on", "off"), default="on")
    ap.add_argument("--venv", default="/tmp/spoolq-bench-procrastinate")
    args = ap.parse_args()
    ensure_procrastinate(args.venv)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from pgserver import PgServer, find_bindir

    settings = {"fsync": args.fsync, "full_page_writes": "on" if args.fsync == "on" else "off",
                "shared_buffers": "128MB"}
    server = PgServer(find_bindir(), settings)
    server.start()
    try:
        bench = Bench(server, args.venv, args.jobs)
        measures = [(f"drain, {w} worker{'s' if w > 1 else ''} (jobs/s)", "drain", w) for w in WORKERS]
        measures += [("enqueue, one per call (jobs/s)", "enqueue", "single"),
                     ("enqueue, batches of 1000 (jobs/s)", "enqueue", "batch"),
                     ("pickup latency p50 (ms)", "pickup", None)]
        results: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for label, kind, arg in measures:
                order = ("spoolq", "procrastinate") if r % 2 == 0 else ("procrastinate", "spoolq")
                for system in order:
                    method = getattr(bench, kind)
                    value = method(system, arg) if arg is not None else method(system)
                    results.setdefault((label, system), []).append(value)
                    print(f"round {r + 1}: {label:<36} {system:<14} {value:10.1f}", file=sys.stderr, flush=True)
        print(f"\n{args.rounds} rounds, {args.jobs} jobs per drain, fsync {args.fsync}; medians")
        print(f"| {'measure':<36} | {'spoolq (PostgreSQL)':>19} | {'procrastinate':>13} | {'ratio':>6} |")
        print(f"|{'-' * 38}|{'-' * 21}:|{'-' * 15}:|{'-' * 8}:|")
        for label, _, _ in measures:
            ours = statistics.median(results[(label, "spoolq")])
            theirs = statistics.median(results[(label, "procrastinate")])
            ratio = theirs / ours if "latency" in label else ours / theirs
            print(f"| {label:<36} | {ours:19.1f} | {theirs:13.1f} | {ratio:5.1f}x |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
