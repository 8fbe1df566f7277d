#!/usr/bin/env python3
"""What a shared spool's pickup costs per job.

Usage: pickup.py SCRATCH_DIR [N] [ROUNDS]   (default 10000 jobs, 3 rounds)

Each round makes two shared spools in SCRATCH_DIR (group: this user's own)
with the same N no-op handler jobs: into one they are dropped as a member
drops them (drop/.NAME renamed to drop/ID.json), and the owner's pickup
takes them all in (each read, checked and copied into new/ as a record of
the owner's side, then its drop file removed); into the other they are
enqueued straight into new/ as the spool's owner enqueues (tmp/, renamed into
new/). Both spools are then drained by spoolq's own worker. Prints, per job:
the pickup, the owner's enqueue beside it, and the drain (the same either
way): the wall-clock time, and in brackets the CPU time of this process
(steadier on a busy machine). Runs with fsync off, then on. Removes
nothing; delete SCRATCH_DIR afterwards.
"""

import grp
import os
import statistics
import sys
import time

from spoolq import Spool, record
from spoolq.dirspool.pickup import Pickup
from spoolq.dirspool.protocol import file_name, new_id


def make(path: str, fsync: bool) -> Spool:
    spool = Spool(path)
    spool.init(group=grp.getgrgid(os.getegid()).gr_name)
    spool.config_set("fsync", fsync)
    spool.config_set("compact_after", 0)
    spool.backend.dir.open()
    return spool


def jobs(n: int) -> list[tuple[str, bytes, None]]:
    now = time.time()
    out = []
    for _ in range(n):
        job_id = new_id()
        out.append((file_name(job_id), record.serialise(record.new_job({"kind": "noop"}, job_id, now)), None))
    return out


def timed(body) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``body()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    body()
    return time.perf_counter() - wall, time.process_time() - cpu


def one_round(scratch: str, n: int, fsync: bool, tag: str) -> list[tuple[float, float]]:
    items = jobs(n)
    dropped = make(os.path.join(scratch, f"drop-{tag}"), fsync)
    for start in range(0, n, 10000):
        dropped.backend.dir.drops.put(items[start:start + 10000])
    pickup = timed(lambda: Pickup(dropped.backend.context()).drain())
    assert len(os.listdir(os.path.join(dropped.path, "new"))) == n
    direct = make(os.path.join(scratch, f"direct-{tag}"), fsync)
    enqueue = timed(lambda: [direct.backend.dir.publish_many(items[start:start + 10000]) for start in range(0, n, 10000)])
    drain = timed(lambda: dropped.work(handlers={"noop": lambda payload: None}, signals=False, log=_Quiet()))
    assert len(os.listdir(os.path.join(dropped.path, "done"))) == n
    return [(wall / n * 1e6, cpu / n * 1e6) for wall, cpu in (pickup, enqueue, drain)]


class _Quiet:
    level = 0

    def line(self, text: str, level: int = 1, severity: int | None = None) -> None:
        pass


def main() -> None:
    scratch = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    os.makedirs(scratch, exist_ok=True)
    for fsync in (False, True):
        results = [one_round(scratch, n, fsync, f"{'sync' if fsync else 'nosync'}-{i}") for i in range(rounds)]
        figures = [(statistics.median(r[k][0] for r in results), statistics.median(r[k][1] for r in results))
                   for k in range(3)]
        said = "   ".join(f"{what} {wall:6.1f} ({cpu:5.1f}) us/job"
                           for what, (wall, cpu) in zip(("pickup", "owner's enqueue", "drain"), figures))
        print(f"fsync {'on ' if fsync else 'off'}: {said}   (medians of {rounds} rounds of {n:,} jobs)")


if __name__ == "__main__":
    main()
