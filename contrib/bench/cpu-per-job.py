#!/usr/bin/env python3
"""The CPU time spoolq spends per job: an enqueue in batches and a drain.

Usage: cpu-per-job.py SCRATCH_DIR [N]   (default 5000 no-op handler jobs, fsync off)

Makes a spool in SCRATCH_DIR/spool, enqueues N no-op handler jobs with
``Spool.enqueue_many`` (1000 a call), then drains them with
``Spool.work`` in this process, and prints the process's CPU time per job
of each (user plus system, ``time.process_time``), with the wall time
beside it. CPU time moves far less than wall time with what else the
machine runs, so it is the figure to compare two versions by (run each in
turn, several rounds, and compare medians; see README.md here). Removes
the spool afterwards.
"""

import os
import shutil
import sys
import time

from spoolq import Spool


def main() -> None:
    root = os.path.join(sys.argv[1], "spool")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    os.makedirs(sys.argv[1], exist_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    spool = Spool(root)
    spool.init()
    spool.config_set("fsync", False)
    jobs = [{"kind": "noop", "payload": {"n": i}} for i in range(1000)]
    cpu, wall = time.process_time(), time.perf_counter()
    for start in range(0, n, 1000):
        spool.enqueue_many(jobs[: min(1000, n - start)])
    enqueue_cpu, enqueue_wall = time.process_time() - cpu, time.perf_counter() - wall
    cpu, wall = time.process_time(), time.perf_counter()
    ran = spool.work(handlers={"noop": lambda payload: None}, signals=False)
    drain_cpu, drain_wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"enqueue_many: {enqueue_cpu / n * 1e6:.1f} us CPU/job ({enqueue_wall / n * 1e6:.1f} wall); "
          f"drain: {drain_cpu / ran * 1e6:.1f} us CPU/job ({drain_wall / ran * 1e6:.1f} wall)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
