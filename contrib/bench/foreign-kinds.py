#!/usr/bin/env python3
"""Do handler jobs that no worker can run slow the drain of the others?

Usage: foreign-kinds.py SCRATCH_DIR [OTHERS] [FOREIGN] [ROUNDS] [command|handler] [cold|warm]
       (default 10000 others, 10000 foreign jobs, 5 rounds, command, warm)

Each round fills two spools in SCRATCH_DIR (fsync off, no compaction) with
OTHERS jobs: `true` command jobs, or with `handler` no-op handler jobs of a
kind the worker has a handler for. One of them also gets FOREIGN jobs of a
kind the worker has no handler for, enqueued in between the others, so
every pass meets them. Then each spool is drained by `spoolq work -q` (with
`--app` for the handler jobs), timed from start to exit, in turn (which one
goes first alternates by round). The foreign jobs are left waiting, and
the figure is the drain's slowdown: the median with them over the median
without, in wall-clock time and in the CPU time of the drain's processes
(the worker and its jobs; steadier than wall-clock time on a busy
machine). `warm`: a worker has run on both spools before the others are
enqueued (so it met the foreign jobs already, as on a spool where they
wait while workers come and go); `cold`: the drain is the first worker to
meet them. Removes nothing; delete SCRATCH_DIR afterwards.
"""

import os
import resource
import statistics
import subprocess
import sys
import time

from spoolq import Spool

APP = "def noop(payload):\n    return None\n\nHANDLERS = {'noop': noop}\n"


def fill(path: str, others: int, foreign: int, what: str, warm: bool, app_dir: str) -> None:
    spool = Spool(path)
    spool.init()
    spool.config_set("fsync", False)
    spool.config_set("compact_after", 0)
    job = {"argv": ["true"]} if what == "command" else {"kind": "noop"}
    jobs = []
    for i in range(max(others, foreign)):
        if i < others:
            jobs.append(job)
        if i < foreign:
            jobs.append({"kind": "elsewhere", "payload": {"n": i}})
    if warm:  # the foreign jobs first, met by a worker before the others come
        spool.enqueue_many([j for j in jobs if j.get("kind") == "elsewhere"])
        drain(path, what, app_dir)
        jobs = [j for j in jobs if j.get("kind") != "elsewhere"]
    for start in range(0, len(jobs), 10000):
        spool.enqueue_many(jobs[start:start + 10000])


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def drain(path: str, what: str, app_dir: str) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds) of one `spoolq work -q`."""
    args = [sys.executable, "-m", "spoolq", "-s", path, "work", "-q"]
    if what == "handler":
        args += ["--app", "foreign_bench_app:HANDLERS"]
    cpu = _cpu()
    start = time.perf_counter()
    subprocess.run(args, check=True, cwd=app_dir)
    return time.perf_counter() - start, _cpu() - cpu


def main() -> None:
    scratch = sys.argv[1]
    others = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    foreign = int(sys.argv[3]) if len(sys.argv) > 3 else 10000
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    what = sys.argv[5] if len(sys.argv) > 5 else "command"
    warm = (sys.argv[6] if len(sys.argv) > 6 else "warm") == "warm"
    os.makedirs(scratch, exist_ok=True)
    app_dir = os.path.join(scratch, "app")
    os.makedirs(app_dir, mode=0o755, exist_ok=True)
    with open(os.path.join(app_dir, "foreign_bench_app.py"), "w") as f:
        f.write(APP)
    times: dict[str, list[tuple[float, float]]] = {"without": [], "with": []}
    for r in range(rounds):
        paths = {}
        for label, n in (("without", 0), ("with", foreign)):
            paths[label] = os.path.join(scratch, f"r{r}-{label}")
            fill(paths[label], others, n, what, warm, app_dir)
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        for label in order:
            times[label].append(drain(paths[label], what, app_dir))
            left = len(os.listdir(os.path.join(paths[label], "new")))
            assert left == (foreign if label == "with" else 0), (label, left)
        (w0, c0), (w1, c1) = times["without"][-1], times["with"][-1]
        print(f"round {r + 1}: without {w0:.3f}s ({c0:.3f}s CPU), with {w1:.3f}s ({c1:.3f}s CPU)", file=sys.stderr)
    print(f"{others} {what} jobs drained beside {foreign} waiting jobs of a foreign kind ({'warm' if warm else 'cold'}), "
          f"medians of {rounds} rounds:")
    for i, measure in enumerate(("wall-clock", "CPU")):
        without = statistics.median(t[i] for t in times["without"])
        with_ = statistics.median(t[i] for t in times["with"])
        print(f"  {measure}: {without:.3f}s alone, {with_:.3f}s beside them: {100 * (with_ / without - 1):+.1f}%")


if __name__ == "__main__":
    main()
