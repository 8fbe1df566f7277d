#!/usr/bin/env python3
"""The PostgreSQL spool beside procrastinate, on one local server, in one
run, with the directory spool for reference.

Usage (from a checkout, with its virtual environment and the postgres extra):

    .venv/bin/python contrib/bench/pg-bench.py [--rounds 3] [--jobs 4000] [--fsync on|off] [--venv DIR]

It starts its own PostgreSQL server (as the tests do: tests/pgserver.py,
initdb and pg_ctl on a Unix socket in a temporary folder, here with the
server's default durability unless --fsync off) and installs procrastinate
into a virtual environment of its own (--venv, default
/tmp/spoolq-bench-procrastinate; never a spoolq dependency). Then, in
alternating rounds, each in a fresh database (or spool directory), for
each queue:

- drain: N no-op handler jobs waiting, then the real worker started --
  ``spoolq work -s URL -j W --app`` (W worker processes), or W
  procrastinate worker processes (``procrastinate worker`` as
  ``run_worker(wait=False, concurrency=1)``: one job at a time each, as a
  spoolq worker process) -- timed from the start of the processes until
  they have all exited, their start-up included for both;
- enqueue: 1,000 jobs one per call (``Spool.enqueue``; ``defer``), and 20
  batches of 1,000 (``Spool.enqueue_many``; ``batch_defer``);
- pickup: a waiting worker (``spoolq work --watch``; ``run_worker(wait=True)``),
  40 jobs enqueued 50 ms apart, the time from each enqueue call's return
  to the start of the job's handler.

The directory spool runs the same (``spoolq work -s DIR``), in a scratch
folder under /tmp. It prints the median of the rounds per figure and the
ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKERS = (1, 2, 4)


# -- the roles a child process plays (one interpreter each) -------------------------------

APP = """import time

def noop(payload=None):
    if payload:
        with open(payload["mark"], "a") as f:
            f.write(f"{payload['i']} {time.time()}\\n")

HANDLERS = {"noop": noop}
"""


def spoolq_role(role: str, location: str, arg: int) -> None:
    """What a child does with spoolq's Python API (the facade, as a program uses it)."""
    sys.path.insert(0, ROOT)
    from spoolq import Spool

    q = Spool(location)
    if role == "fill":
        for start in range(0, arg, 1000):
            q.enqueue_many([{"kind": "noop"}] * min(1000, arg - start))
    elif role in ("single", "batch"):
        started = time.perf_counter()
        if role == "single":
            for _ in range(arg):
                q.enqueue(kind="noop")
        else:
            for _ in range(arg // 1000):
                q.enqueue_many([{"kind": "noop"}] * 1000)
        print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)
    elif role == "produce":
        mark = os.environ["BENCH_MARK"]
        for i in range(arg):
            time.sleep(0.05)
            q.enqueue(kind="noop", payload={"i": i, "mark": mark})
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
                if role == "watch":
                    print("ready", flush=True)
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
    SYSTEMS = ("spoolq", "procrastinate", "spoolq-dir")

    def __init__(self, server, venv: str, jobs: int, scratch: str):
        self.server = server
        self.python = {"spoolq": sys.executable, "spoolq-dir": sys.executable,
                       "procrastinate": os.path.join(venv, "bin", "python")}
        self.jobs = jobs
        self.scratch = scratch  # the handlers' module, and the directory spools
        with open(os.path.join(scratch, "benchapp.py"), "w") as f:
            f.write(APP)
        self._n = 0

    def child(self, system: str, role: str, url: str, arg: int = 0, **kw) -> subprocess.Popen:
        kind = "procrastinate" if system == "procrastinate" else "spoolq"
        return subprocess.Popen([self.python[system], os.path.abspath(__file__), "--role", kind, role, url, str(arg)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)

    def worker(self, location: str, *args: str) -> subprocess.Popen:
        """The real ``spoolq work``, handlers from benchapp.py."""
        return subprocess.Popen([sys.executable, "-m", "spoolq", "-s", location, "work", "-q", "--app", "benchapp", *args],
                                cwd=self.scratch, stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=ROOT))

    def run(self, system: str, role: str, url: str, arg: int = 0, **kw) -> str:
        proc = self.child(system, role, url, arg, **kw)
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode:
            raise SystemExit(f"{system} {role} failed ({proc.returncode})")
        return out

    def database(self, system: str) -> str:
        if system == "spoolq-dir":
            self._n += 1
            location = os.path.join(self.scratch, f"spool{self._n}")
        else:
            location = self.server.url(self.server.new_database())
        if system == "procrastinate":
            self.run(system, "schema", location)
        else:
            subprocess.run([sys.executable, "-m", "spoolq", "-s", location, "init"], check=True, capture_output=True,
                           env=dict(os.environ, PYTHONPATH=ROOT))
        return location

    def drain(self, system: str, workers: int) -> float:
        url = self.database(system)
        self.run(system, "fill", url, self.jobs)
        started = time.perf_counter()
        if system == "procrastinate":
            procs = [self.child(system, "drain", url) for _ in range(workers)]
            for p in procs:
                p.communicate(timeout=3600)
        else:
            proc = self.worker(url, "-j", str(workers))
            if proc.wait(timeout=3600):
                raise SystemExit(f"spoolq work failed ({proc.returncode})")
        return self.jobs / (time.perf_counter() - started)

    def enqueue(self, system: str, mode: str) -> float:
        n = 1000 if mode == "single" else 20000
        seconds = json.loads(self.run(system, mode, self.database(system), n))["seconds"]
        return n / seconds

    def pickup(self, system: str, count: int = 40) -> float:
        url = self.database(system)
        if system == "procrastinate":
            watcher = self.child(system, "watch", url)
            assert watcher.stdout.readline().strip() == "ready"
        else:
            watcher = self.worker(url, "--watch")
        mark = os.path.join(self.scratch, f"marks{self._n}-{time.monotonic_ns()}")
        try:
            time.sleep(1.0)  # the worker connected and waiting
            env = dict(os.environ, BENCH_MARK=mark)
            sent = {e["id"]: e["at"] for e in map(json.loads, self.run(system, "produce", url, count, env=env).splitlines())}
            started: dict[int, float] = {}
            deadline = time.monotonic() + 120
            while len(started) < count and time.monotonic() < deadline:
                if system == "procrastinate":
                    event = json.loads(watcher.stdout.readline())
                    started[event["id"]] = event["at"]
                else:
                    time.sleep(0.05)
                    if os.path.exists(mark):
                        with open(mark) as f:
                            for line in f:
                                i, at = line.split()
                                started[int(i)] = float(at)
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
    scratch = tempfile.mkdtemp(prefix="spoolq-pg-bench-", dir="/tmp")
    try:
        bench = Bench(server, args.venv, args.jobs, scratch)
        measures = [(f"drain, {w} worker{'s' if w > 1 else ''} (jobs/s)", "drain", w) for w in WORKERS]
        measures += [("enqueue, one per call (jobs/s)", "enqueue", "single"),
                     ("enqueue, batches of 1000 (jobs/s)", "enqueue", "batch"),
                     ("pickup latency p50 (ms)", "pickup", None)]
        results: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for label, kind, arg in measures:
                order = Bench.SYSTEMS if r % 2 == 0 else tuple(reversed(Bench.SYSTEMS))
                for system in order:
                    method = getattr(bench, kind)
                    value = method(system, arg) if arg is not None else method(system)
                    results.setdefault((label, system), []).append(value)
                    print(f"round {r + 1}: {label:<36} {system:<14} {value:10.1f}", file=sys.stderr, flush=True)
        load = os.getloadavg()
        print(f"\n{args.rounds} rounds, {args.jobs} jobs per drain, fsync {args.fsync}; medians; "
              f"load average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
        print(f"| {'measure':<36} | {'spoolq (PostgreSQL)':>19} | {'procrastinate':>13} | {'ratio':>6} | "
              f"{'spoolq (directory)':>18} |")
        print(f"|{'-' * 38}|{'-' * 21}:|{'-' * 15}:|{'-' * 8}:|{'-' * 20}:|")
        for label, _, _ in measures:
            ours, theirs, local = (statistics.median(results[(label, system)])
                                   for system in ("spoolq", "procrastinate", "spoolq-dir"))
            ratio = theirs / ours if "latency" in label else ours / theirs
            print(f"| {label:<36} | {ours:19.1f} | {theirs:13.1f} | {ratio:5.1f}x | {local:18.1f} |")
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
