#!/usr/bin/env python3
"""How fast could a drain be in Python on this design at all?

Usage: lean-drain.py SCRATCH_DIR [N] [ROUNDS]   (default 10000 jobs, 3 rounds)

Each round fills two spools in SCRATCH_DIR with N no-op handler jobs (fsync
off), then drains one with a hand-written loop that does only what a drain
must: open, flock, fstat, read, parse and check the record, stat the name,
rename into cur/, call the handler, write the record back with its history,
rename into done/, close. It skips everything spoolq adds around that
(registration, look-ahead, group commit, error handling, logging). The other
spool is drained by spoolq's own worker, and a third queue, the SQLite-table
queue of `spoolq bench --compare sqlite` (synchronous NORMAL), is filled
with N rows and drained by its own loop. Where huey is installed in the
same environment (`pip install huey`; spoolq does not need it), a fourth:
huey's SqliteHuey (fsync off, as the spools), N no-op tasks run one after
the other by the loop its consumer's worker runs (dequeue, execute). The
order of the queues turns from round to round, so that the machine's drift
spreads over all; the medians close the output. Prints the costs per job.
Removes nothing; delete SCRATCH_DIR afterwards.
"""

import fcntl
import os
import statistics
import sys
import time

from spoolq import Spool, record
from spoolq.bench import sqlite_create, sqlite_drain
from spoolq.dirspool.protocol import rename_noreplace


def fill(path: str, n: int) -> Spool:
    spool = Spool(path)
    spool.init()
    spool.config_set("fsync", False)
    spool.config_set("compact_after", 0)
    for start in range(0, n, 10000):
        spool.enqueue_many([{"kind": "noop"}] * min(10000, n - start))
    return spool


def lean_drain(path: str) -> tuple[int, float]:
    new, cur, done = (os.open(os.path.join(path, sub), os.O_RDONLY | os.O_DIRECTORY) for sub in ("new", "cur", "done"))
    names = sorted(entry.name for entry in os.scandir(new))
    handlers = {"noop": lambda payload: None}
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    start = time.perf_counter()
    for name in names:
        fd = os.open(name, flags, dir_fd=new)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.fstat(fd)
        job = record.parse(os.pread(fd, st.st_size + 1, 0), name[:-5])
        os.stat(name, dir_fd=new, follow_symlinks=False)
        rename_noreplace(new, name, cur, name)
        began = time.time()
        result = handlers[job["kind"]](job.get("payload"))
        ended = time.time()
        attempt = job.get("attempts", 0) + 1
        history = job.get("history") or []
        history.append({"attempt": attempt, "worker": "lean", "due": record.rfc3339(st.st_mtime_ns / 1e9),
                        "start": record.rfc3339(began), "end": record.rfc3339(ended)})
        job.update(history=history, attempts=attempt, state="done", result=result, outcome="succeeded",
                   finished_at=record.rfc3339(ended))
        os.pwrite(fd, record.dumps(job), 0)
        rename_noreplace(cur, name, done, name)
        os.close(fd)
    seconds = time.perf_counter() - start
    for fd in (new, cur, done):
        os.close(fd)
    return len(names), seconds


def sqlite_normal(path: str, n: int) -> float:
    db = sqlite_create(path, "NORMAL")
    now = time.time()
    db.execute("BEGIN")
    db.executemany("INSERT INTO jobs (kind, payload, run_at, created_at) VALUES (?, ?, ?, ?)", [("noop", "{}", now, now)] * n)
    db.execute("COMMIT")
    start = time.perf_counter()
    ran = sqlite_drain(db)
    seconds = time.perf_counter() - start
    db.close()
    assert ran == n, (ran, n)
    return seconds


def huey_drain(path: str, n: int) -> float | None:
    """SqliteHuey, fsync off: N no-op tasks enqueued, then dequeued and
    executed one by one as a consumer's worker does; None without huey."""
    try:
        from huey import SqliteHuey
    except ImportError:
        return None
    huey = SqliteHuey("bench", filename=path, fsync=False)

    @huey.task()
    def noop() -> None:
        return None

    for _ in range(n):
        noop()
    start = time.perf_counter()
    ran = 0
    while (task := huey.dequeue()) is not None:
        huey.execute(task)
        ran += 1
    seconds = time.perf_counter() - start
    assert ran == n, (ran, n)
    return seconds


def main() -> None:
    root = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    os.makedirs(root, exist_ok=True)
    costs: dict[str, list[float]] = {}

    def lean(r: int) -> float | None:
        path = os.path.join(root, f"lean-{r}")
        fill(path, n)
        ran, seconds = lean_drain(path)
        return seconds / ran

    def worker(r: int) -> float | None:
        spool = fill(os.path.join(root, f"worker-{r}"), n)
        start = time.perf_counter()
        worked = spool.work(handlers={"noop": lambda payload: None}, signals=False)
        return (time.perf_counter() - start) / worked

    def sqlite(r: int) -> float | None:
        return sqlite_normal(os.path.join(root, f"sqlite-{r}.db"), n) / n

    def huey(r: int) -> float | None:
        seconds = huey_drain(os.path.join(root, f"huey-{r}.db"), n)
        return None if seconds is None else seconds / n

    queues = [("lean loop", lean), ("spoolq worker", worker), ("SQLite-table queue (NORMAL)", sqlite),
              ("huey SqliteHuey (fsync off)", huey)]
    for r in range(rounds):
        said = []
        for name, drain in queues[r % len(queues):] + queues[:r % len(queues)]:
            cost = drain(r)
            if cost is not None:
                costs.setdefault(name, []).append(cost)
                said.append(f"{name} {cost * 1e6:.1f} us/job")
        print(f"round {r + 1}: " + ", ".join(said), flush=True)
    medians = {name: statistics.median(c) for name, c in costs.items()}
    print(f"medians of {rounds} rounds: " + ", ".join(f"{name} {m * 1e6:.1f} us/job ({1 / m:,.0f}/s)"
                                                    for name, m in medians.items()))
    worker_cost = medians["spoolq worker"]
    print(f"spoolq worker against the lean loop: {medians['lean loop'] / worker_cost:.2f}x its rate"
          + (f"; against huey: {medians['huey SqliteHuey (fsync off)'] / worker_cost:.2f}x"
             if "huey SqliteHuey (fsync off)" in medians else ""))


if __name__ == "__main__":
    main()
