"""``spoolq bench``: measure this machine and filesystem.

Every figure is taken in a scratch spool on the same filesystem as the spool
given (a dot-folder inside it, removed afterwards), next to a bare-loop
baseline doing the same system calls with nothing else, so each rate reads
as a fraction of what this machine can do at all.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import config
from .linux import syncfs
from .output import Log
from .pool import run_workers
from .dirspool.protocol import refuse_non_directory
from .record import parse_time
from .spool import Spool
from .dirspool.watcher import make_waker
from .worker import SCAN_LIMIT

SPOOLQ_CMD = [sys.executable, "-m", "spoolq"]


@dataclass
class Figure:
    name: str
    jobs: int
    seconds: float
    baseline: str | None = None  # the name of the figure this one is a ratio to
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    kind: str = "rate"  # "rate": jobs/s; "latency" and "time": see extra/note

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds > 0 else float("inf")

    @property
    def us_per_job(self) -> float:
        return self.seconds / self.jobs * 1e6 if self.jobs else 0.0


class Bench:
    """A run of measurements in one scratch directory."""

    def __init__(self, root: str, jobs: int, fsync: bool, progress: bool = True, settings: dict[str, Any] | None = None):
        self.root = root
        self.settings = settings or {}  # the measured spool's own settings (those config.json sets), for the scale section
        self.jobs = jobs
        self.fsync = fsync
        self.progress = progress
        self.figures: dict[str, Figure] = {}
        self._n = 0

    # -- helpers -----------------------------------------------------------

    def fresh_spool(self, tag: str, settings: dict[str, Any] | None = None) -> Spool:
        """A scratch spool with the bench's fsync and, unless ``settings``
        are given (a spool's own, compaction included), no compaction."""
        self._n += 1
        path = os.path.join(self.root, f"{self._n:02d}-{tag}")
        spool = Spool(path)
        spool.init()
        for key, value in (settings or {"compact_after": 0}).items():
            try:
                spool.config_set(key, value)
            except ValueError:  # a setting this scratch spool cannot take (a user name, say): its default
                if key == "compact_after":
                    raise
        spool.config_set("fsync", self.fsync)
        return Spool(path)

    def add(self, fig: Figure) -> Figure:
        self.figures[fig.name] = fig
        note = f"  {fig.note}" if fig.note else ""
        if fig.kind == "rate" and fig.jobs:
            self.say(f"{fig.name}: {fig.rate:,.0f} jobs/s ({fig.us_per_job:,.1f} us/job){note}")
        else:  # a time or a latency: its figures are in the note
            self.say(f"{fig.name}:{note}")
        return fig

    def say(self, text: str) -> None:
        if self.progress:
            print(f"  {text}", file=sys.stderr, flush=True)

    def loop(self, label: str, n: int, body: Callable[[int], None]) -> float:
        """Time ``body(i)`` for i in range(n), with a progress bar for long runs."""
        if self.progress and n >= 20000:
            import click

            start = time.perf_counter()
            with click.progressbar(range(n), label=f"  {label}", file=sys.stderr, width=30) as bar:
                for i in bar:
                    body(i)
            return time.perf_counter() - start
        start = time.perf_counter()
        for i in range(n):
            body(i)
        return time.perf_counter() - start

    # -- baselines ---------------------------------------------------------

    def bare_enqueue(self, n: int, name: str = "bare_enqueue") -> Figure:
        """tmp write (+ fsync) + rename (+ folder fsync): the floor of an
        enqueue, in folders of its own."""
        base = os.path.join(self.root, name)
        os.makedirs(os.path.join(base, "tmp"))
        os.makedirs(os.path.join(base, "new"))
        seconds = self._bare_enqueue_loop("bare enqueue", base, range(n))
        return self.add(Figure(name, n, seconds, note="tmp write + rename" + (" + fsyncs" if self.fsync else "")))

    def _bare_enqueue_loop(self, label: str, base: str, numbers: range) -> float:
        """Time the bare enqueue of one file per number, into ``base``/tmp
        and then ``base``/new."""
        new_fd = os.open(os.path.join(base, "new"), os.O_RDONLY | os.O_DIRECTORY)
        data = b'{"command": "true", "id": "x", "state": "new", "attempts": 0, "created_at": "2026-01-01T00:00:00.000000Z"}\n'
        fsync = self.fsync
        first = numbers.start

        def body(i: int) -> None:
            tmp = os.path.join(base, "tmp", f"bare-{first + i}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data)
            if fsync:
                os.fsync(fd)
            os.close(fd)
            os.rename(tmp, os.path.join(base, "new", f"bare-{first + i}.json"))
            if fsync:
                os.fsync(new_fd)

        try:
            return self.loop(label, len(numbers), body)
        finally:
            os.close(new_fd)

    def bare_claim(self, n: int) -> Figure:
        """rename new -> cur + unlink: the floor of taking a job."""
        base = os.path.join(self.root, "bare-claim")
        os.makedirs(os.path.join(base, "new"))
        os.makedirs(os.path.join(base, "cur"))
        for i in range(n):
            with open(os.path.join(base, "new", f"{i}.json"), "wb") as f:
                f.write(b"{}")

        def body(i: int) -> None:
            os.rename(os.path.join(base, "new", f"{i}.json"), os.path.join(base, "cur", f"{i}.json"))
            os.unlink(os.path.join(base, "cur", f"{i}.json"))

        return self.add(Figure("bare_claim", n, self.loop("bare claim", n, body), note="rename + unlink"))

    def bare_drain(self, spool: Spool, n: int, name: str = "bare_drain") -> Figure:
        """The system calls of one claim and one finish and nothing else, on
        the first ``n`` due files of ``spool``: open, flock, fstat, stat (the
        name still names it), read, rename into cur/, write the record back,
        rename out, close. Measured on the spool's own files, so it reads
        from a folder as large as the drain that follows starts with. The
        files end in a folder of their own, not in done/."""
        sp = spool.backend.dir
        out = os.path.join(spool.path, "bare-done")
        os.makedirs(out, exist_ok=True)
        new_fd, cur_fd = sp.fd("new"), sp.fd("cur")
        out_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        todo = [e.name for e in sp.scan(time.time_ns(), min(n, SCAN_LIMIT)).due if e.state == "new"]
        start = time.perf_counter()  # the scan is left out: its cost is a figure of its own
        for job in todo:
            fd = os.open(job, flags, dir_fd=new_fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st = os.fstat(fd)
            os.stat(job, dir_fd=new_fd, follow_symlinks=False)
            data = os.read(fd, st.st_size + 1)
            os.rename(job, job, src_dir_fd=new_fd, dst_dir_fd=cur_fd)
            os.pwrite(fd, data, 0)
            os.rename(job, job, src_dir_fd=cur_fd, dst_dir_fd=out_fd)
            os.close(fd)
        seconds = time.perf_counter() - start
        os.close(out_fd)
        return self.add(Figure(name, len(todo), seconds, note="the system calls of a claim and a finish: open, flock, "
                                                              "fstat, stat, read, rename, pwrite, rename, close"))

    # -- spoolq ------------------------------------------------------------

    def enqueue_inprocess(self, n: int) -> Figure:
        """Spool.enqueue next to the bare loop, both creating their files in
        the same folders (a fresh spool's tmp/ and new/), the bare loop's
        halves before and after: on ext4, where a file's inode comes from
        its folder's block group, creating files is 5-10 times slower for
        minutes in a group where many were deleted, so folders of their own
        could put the two sides in different states."""
        spool = self.fresh_spool("enqueue")
        half = range(n // 2)
        bare = self._bare_enqueue_loop("bare enqueue", spool.path, half)
        seconds = self.loop("enqueue", n, lambda i: spool.enqueue(command="true"))
        bare += self._bare_enqueue_loop("bare enqueue", spool.path, range(len(half), n))
        self.add(Figure("bare_enqueue", n, bare, note="tmp write + rename" + (" + fsyncs" if self.fsync else "")
                        + ", in the folders of the enqueue below, half before it and half after"))
        return self.add(Figure("enqueue", n, seconds, baseline="bare_enqueue", note="Spool.enqueue, one job at a time"))

    def enqueue_many(self, n: int, batch: int = 1000) -> Figure:
        spool = self.fresh_spool("enqueue-many")
        job = {"command": "true"}

        def body(i: int) -> None:
            spool.enqueue_many([job] * batch)

        seconds = self.loop("enqueue_many", n // batch, body)
        return self.add(Figure("enqueue_many", (n // batch) * batch, seconds, baseline="bare_enqueue",
                               note=f"Spool.enqueue_many, {batch} per call (one sync per call)"))

    def enqueue_jsonl(self, n: int) -> Figure:
        spool = self.fresh_spool("jsonl")
        lines = ('{"command": "true"}\n' * n).encode()
        start = time.perf_counter()
        proc = subprocess.run(SPOOLQ_CMD + ["-s", spool.path, "enqueue", "--jsonl", "-"], input=lines,
                              capture_output=True, check=True)
        seconds = time.perf_counter() - start
        assert proc.stdout.count(b"\n") == n
        return self.add(Figure("enqueue_jsonl", n, seconds, baseline="bare_enqueue", note="spoolq enqueue --jsonl - (whole command)"))

    def drain_handlers(self, n: int, name: str = "drain_handlers", timeout: float | None = None) -> Figure:
        spool = self.fresh_spool("drain")
        job = {"kind": "noop"} if timeout is None else {"kind": "noop", "timeout": timeout}
        for start in range(0, n, 10000):
            spool.enqueue_many([job] * min(10000, n - start))
        start = time.perf_counter()
        ran = spool.work(handlers={"noop": _noop}, signals=False)
        seconds = time.perf_counter() - start
        assert ran == n, (ran, n)
        note = "no-op handlers, in-process, -j 1"
        if timeout is not None:
            note = "no-op handlers with a timeout: each in a process of its own (forked by the fork server), -j 1"
        return self.add(Figure(name, n, seconds, baseline="bare_drain", note=note))

    def drain_two_workers(self, n: int) -> Figure:
        """Two worker processes (``Spool.work``, as two ``spoolq work --app``
        would run) draining one spool of no-op handler jobs at once."""
        spool = self.fresh_spool("drain-2w")
        for start in range(0, n, 10000):
            spool.enqueue_many([{"kind": "noop"}] * min(10000, n - start))
        seconds, outputs = _run_together([[sys.executable, "-c", _WORKER_DRAIN, spool.path]] * 2)
        ran = [int(out.split()[0]) for out in outputs]
        done = spool.status()["done"]
        assert sum(ran) == n and done == n, (ran, done, n)
        return self.add(Figure("drain_handlers_2w", n, seconds, baseline="drain_handlers",
                               note=f"no-op handlers, two worker processes at once (they ran {ran[0]:,} and {ran[1]:,})"))

    def true_commands(self, n: int) -> None:
        """``spoolq work -j 1`` and ``-j 2``, each one command draining ``n``
        argv ["true"] jobs (start-up included), against a bare
        ``subprocess.run(["true"])`` loop of ``n`` runs split in quarters
        around them: bare, -j 1, bare, bare, -j 2, bare. Each drain sits
        between equal shares of the bare loop, so a host that speeds up or
        slows down during the run moves both sides alike. Each part starts
        with nothing left for the kernel to write back on the spool's
        filesystem (an untimed syncfs), and a drain's time includes writing
        back what it wrote (a syncfs at its end): with fsync off, the kernel
        would otherwise write a drain's 10,000 records while a later part of
        the bare loop runs."""
        quarter = max(1, n // 4)
        bare = 0.0
        drains = {}
        for step in ("bare", 1, "bare", "bare", 2, "bare"):
            self._syncfs()
            if step == "bare":
                bare += self.loop(f"bare true ({quarter:,})", quarter, lambda i: subprocess.run(["true"]))
            else:
                drains[step] = self._drain_true(n, step)
        self.add(Figure("bare_true", quarter * 4, bare, note='subprocess.run(["true"])'))
        for jobs in (1, 2):
            self.add(Figure(f"drain_true_j{jobs}", n, drains[jobs], baseline="bare_true",
                            note=f"spoolq work -j {jobs} on argv [\"true\"] jobs (one whole command)"))

    def _syncfs(self) -> None:
        """Write back what is dirty on the spool's filesystem (only there:
        other filesystems' writeback is not this run's to pay for)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            syncfs(fd)
        finally:
            os.close(fd)

    def _drain_true(self, n: int, jobs: int) -> float:
        spool = self.fresh_spool(f"true-j{jobs}")
        spool.enqueue_many([{"argv": ["true"]}] * n)
        self._syncfs()
        start = time.perf_counter()
        subprocess.run(SPOOLQ_CMD + ["-s", spool.path, "work", "-q", "-j", str(jobs)], check=True)
        self._syncfs()
        seconds = time.perf_counter() - start
        done = spool.status()["done"]
        assert done == n, (done, n)
        return seconds

    def pickup_latency(self, n: int, jobs: int, scope: str = "new", interval: float = 0.005) -> Figure:
        """Latency from the rename into new/ to the job's start (the worker's
        timestamp right before it spawns the process), with a watcher running.
        ``scope`` "paired" is watchdog's stock move pairing, in which claims
        stall events for up to half a second; "new" is spoolq's watch."""
        spool = self.fresh_spool(f"latency-{scope}-j{jobs}")
        spool.config_set("fsync", False)  # pickup is measured without fsync
        log = open(os.path.join(self.root, f"watch-{scope}-{jobs}.log"), "w")
        worker = subprocess.Popen([sys.executable, "-c", _WATCHER, spool.path, scope, str(jobs)], stderr=log)
        try:
            deadline = time.monotonic() + 30
            while not spool.status()["workers"]:  # wait until it watches
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise RuntimeError("the watcher did not start")
                time.sleep(0.01)
            tmp_dir = os.path.join(spool.path, "tmp")
            new_dir = os.path.join(spool.path, "new")
            dropped: dict[str, float] = {}
            body = b'{"argv": ["true"]}\n'
            for i in range(n):
                name = f"lat-{i:06d}"
                tmp = os.path.join(tmp_dir, name)
                with open(tmp, "wb") as f:
                    f.write(body)
                dropped[name] = time.time()
                os.rename(tmp, os.path.join(new_dir, name + ".json"))
                time.sleep(interval)  # pacing: one job at a time, not a backlog
            deadline = time.monotonic() + 120
            while spool.backend.dir.count("done") < n:
                if time.monotonic() > deadline:
                    raise RuntimeError("not every job ran")
                time.sleep(0.05)
        finally:
            worker.terminate()
            worker.wait(30)
            log.close()
        latencies = []
        for name, at in dropped.items():
            job = spool.get(name)
            latencies.append(parse_time(job["history"][0]["start"]) - at)
        latencies.sort()
        p50 = latencies[len(latencies) // 2]
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        fig = Figure(f"pickup_{scope}_j{jobs}", n, sum(latencies), kind="latency",
                     note=f"{'stock watchdog (claims stall events)' if scope == 'paired' else 'spoolq watch'}, -j {jobs}: "
                          f"p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
        fig.extra.update(p50_ms=round(p50 * 1000, 2), p99_ms=round(p99 * 1000, 2), max_ms=round(latencies[-1] * 1000, 2))
        return self.add(fig)

    def sqlite_queue(self, n: int, synchronous: str) -> tuple[Figure, Figure]:
        """The SQLite-table queue of "Background Jobs Without a Job Queue":
        one table, WAL, a partial index on pending rows, claim by UPDATE ...
        WHERE id = (SELECT ... LIMIT 1) RETURNING, a commit per job."""
        db = sqlite_create(os.path.join(self.root, f"sqlite-{synchronous.lower()}.db"), synchronous)

        def enqueue(i: int) -> None:
            now = time.time()
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO jobs (kind, payload, run_at, created_at) VALUES (?, ?, ?, ?)", ("noop", "{}", now, now))
            db.execute("COMMIT")

        enq = self.loop(f"sqlite {synchronous} enqueue", n, enqueue)
        start = time.perf_counter()
        done = sqlite_drain(db)
        drain = time.perf_counter() - start
        db.close()
        tag = synchronous.lower()
        a = self.add(Figure(f"sqlite_{tag}_enqueue", n, enq, note=f"SQLite-table queue, synchronous={synchronous}, commit per job"))
        b = self.add(Figure(f"sqlite_{tag}_drain", done, drain, note=f"SQLite-table queue, synchronous={synchronous}: claim + complete per job"))
        return a, b

    def sqlite_two_workers(self, n: int, synchronous: str) -> Figure:
        """The same SQLite-table queue drained by two worker processes at once
        (each claims and completes with its own connection, a commit each)."""
        path = os.path.join(self.root, f"sqlite-{synchronous.lower()}-2w.db")
        db = sqlite_create(path, synchronous)
        now = time.time()
        db.execute("BEGIN")
        db.executemany("INSERT INTO jobs (kind, payload, run_at, created_at) VALUES (?, ?, ?, ?)",
                       [("noop", "{}", now, now)] * n)
        db.execute("COMMIT")
        seconds, outputs = _run_together([[sys.executable, "-c", _SQLITE_WORKER, path, synchronous]] * 2)
        done = db.execute("SELECT count(*) FROM jobs WHERE status = 'done'").fetchone()[0]
        db.close()
        assert done == n and sum(int(out) for out in outputs) == n, (done, outputs)
        tag = synchronous.lower()
        return self.add(Figure(f"sqlite_{tag}_drain_2w", n, seconds,
                               note=f"SQLite-table queue, synchronous={synchronous}: two worker processes at once"))

    def status_time(self, spool: Spool, label: str, name: str | None = None) -> Figure:
        """`spoolq status --json` on a spool (the whole command, cold), as
        figure ``name`` (default status_LABEL)."""
        times = []
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run(SPOOLQ_CMD + ["-s", spool.path, "status", "--json"], capture_output=True, check=True)
            times.append(time.perf_counter() - start)
        st = spool.status()
        waiting = st["new"] + st["failed"]
        fig = Figure(name or f"status_{label}", 0, min(times), kind="time",
                     note=f"spoolq status --json, {waiting:,} waiting, {st['compacted']:,} compacted: {min(times) * 1000:.0f} ms")
        fig.extra.update(ms=round(min(times) * 1000, 1), waiting=waiting, compacted=st["compacted"])
        return self.add(fig)

    def cold_start(self, runs: int = 15) -> tuple[Figure, Figure]:
        """A cold `spoolq enqueue` next to `python3 -c "import click"` (medians)."""
        spool = self.fresh_spool("cold")

        def median(cmd: list[str]) -> float:
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                subprocess.run(cmd, capture_output=True, check=True)
                times.append(time.perf_counter() - start)
            return sorted(times)[len(times) // 2]

        click_t = median([sys.executable, "-c", "import click"])
        enq_t = median(SPOOLQ_CMD + ["-s", spool.path, "enqueue", "true"])
        a = self.add(Figure("cold_import_click", 0, click_t, kind="time", note=f'python3 -c "import click": {click_t * 1000:.0f} ms'))
        b = self.add(Figure("cold_enqueue", 0, enq_t, kind="time", baseline="cold_import_click",
                            note=f"spoolq enqueue true, a fresh process: {enq_t * 1000:.0f} ms"))
        return a, b

    def used_filesystem(self, n: int) -> None:
        """The same enqueues right after deleting ``n`` files (what compaction
        does). On ext4 without a journal a freed inode is not reused for about
        a minute and every create walks past the recently freed ones, so this
        is the slow case there; on journaled ext4 or xfs it is like the rest."""
        junk = os.path.join(self.root, "junk")
        os.makedirs(junk)
        for i in range(n):
            with open(os.path.join(junk, str(i)), "wb") as f:
                f.write(b"{}")
        shutil.rmtree(junk)
        m = min(n, 5000)
        fig = self.bare_enqueue(m, name="bare_enqueue_used")
        fig.note += f", just after deleting {n:,} files"
        spool = self.fresh_spool("enqueue-used")
        seconds = self.loop("enqueue (used)", m, lambda i: spool.enqueue(command="true"))
        self.add(Figure("enqueue_used", m, seconds, baseline="bare_enqueue_used",
                        note=f"Spool.enqueue, just after deleting {n:,} files"))

    # -- report ------------------------------------------------------------

    def table(self) -> str:
        rows = [("figure", "jobs", "jobs/s", "us/job", "vs baseline", "what")]
        for fig in self.figures.values():
            ratio = ""
            base = self.figures.get(fig.baseline) if fig.baseline else None
            if base is not None:
                if fig.kind == "time":
                    ratio = f"{fig.seconds / base.seconds:.2f}x the time of {base.name}"
                else:
                    ratio = f"{fig.rate / base.rate:.2f}x {base.name}"
            if fig.kind == "rate":
                rate, per = f"{fig.rate:,.0f}", f"{fig.us_per_job:,.1f}"
            else:
                rate, per = "", ""
            rows.append((fig.name, f"{fig.jobs:,}" if fig.jobs else "", rate, per, ratio, fig.note))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = []
        for j, r in enumerate(rows):
            lines.append("  ".join(c.ljust(widths[i]) if i in (0, 4, 5) else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        out = {}
        for fig in self.figures.values():
            entry = {"jobs": fig.jobs, "seconds": round(fig.seconds, 6), "jobs_per_s": round(fig.rate, 1),
                     "us_per_job": round(fig.us_per_job, 2), "note": fig.note}
            base = self.figures.get(fig.baseline) if fig.baseline else None
            if base is not None:
                entry["baseline"] = fig.baseline
                if fig.kind == "time":  # a ratio of times: lower is better
                    entry["time_ratio"] = round(fig.seconds / base.seconds, 3) if base.seconds else None
                else:
                    entry["ratio"] = round(fig.rate / base.rate, 3) if base.rate else None
            entry.update(fig.extra)
            out[fig.name] = entry
        return out


class Scale:
    """The scale and history sections: one bench's figures at growing queue
    sizes, and the history of its largest spool once compacted."""

    def __init__(self, bench: Bench):
        self.bench = bench
        self._history_spool: tuple[Spool, int] | None = None  # the last scale spool (see run)

    def run(self, sizes: tuple[int, ...], with_history: bool = False) -> None:
        """At each queue size: enqueue cost (the last 1,000 jobs in), status
        time, the bare system calls of a drain on a tenth of the jobs, and a
        whole worker draining the rest in a process of its own (cost per job
        and its peak RSS); then each larger size's per-job cost as a ratio
        to the smallest's.

        A small size is over in a fraction of a second, a snapshot of a host
        whose speed drifts over the minutes a million jobs take: when larger
        sizes follow, the smallest (if at most SCALE_REPEAT_UP_TO jobs) is
        measured SCALE_BASELINE_RUNS times, some before the larger sizes and
        the rest after them, and its figures are the medians."""
        sizes = tuple(sorted(set(sizes)))
        first = _short(sizes[0])
        repeat = len(sizes) > 1 and sizes[0] <= SCALE_REPEAT_UP_TO
        before = (SCALE_BASELINE_RUNS + 1) // 2 if repeat else 1
        history: tuple[Spool, int] | None = None
        runs = [self._scale_at(sizes[0]) for _ in range(before)]
        for size in sizes[1:]:
            self._scale_at(size)
        if with_history:
            history = self._history_spool
        if repeat:
            runs += [self._scale_at(sizes[0]) for _ in range(SCALE_BASELINE_RUNS - before)]
            for kind in ("enqueue", "status", "scan", "bare_drain", "drain"):
                name = f"scale_{kind}_{first}"
                figs = sorted((run[name] for run in runs), key=lambda f: f.seconds / max(f.jobs, 1))
                median = figs[len(figs) // 2]
                spread = ", ".join(f"{f.seconds / max(f.jobs, 1) * 1e6:.0f}" if f.jobs else f"{f.seconds * 1000:.0f} ms"
                                   for f in (run[name] for run in runs))
                median.note += (f"; median of {len(runs)} runs, {before} before the larger sizes and "
                                f"{len(runs) - before} after ({'us per job: ' if median.jobs else ''}{spread})")
                median.extra["runs"] = len(runs)
                self.bench.add(median)
        # The history section deletes most of the largest spool's files,
        # which slows creates for minutes: it comes after the runs above.
        if history is not None:
            self.history_at(*history)
        for kind in ("enqueue", "bare_drain", "drain"):
            base = self.bench.figures[f"scale_{kind}_{first}"]
            for size in sizes[1:]:
                fig = self.bench.figures[f"scale_{kind}_{_short(size)}"]
                fig.extra["cost_ratio"] = round(fig.us_per_job / base.us_per_job, 3)
                fig.note += f"; per-job cost {fig.us_per_job / base.us_per_job:.2f}x of {first}"

    def _scale_at(self, size: int) -> dict[str, Figure]:
        """One measurement of the scale section at one queue size, in a
        fresh spool; returns its figures by name (the spool, and how many of
        its jobs the worker finished, are kept for the history section)."""
        spool = self.bench.fresh_spool(f"scale-{size}", dict(self.bench.settings, compact_after=self.bench.settings.get(
            "compact_after", config.DEFAULTS["compact_after"])))
        tail = min(1000, size)
        for start in range(0, size - tail, 10000):
            spool.enqueue_many([{"kind": "noop"}] * min(10000, size - tail - start))
        t0 = time.perf_counter()
        for _ in range(tail):
            spool.enqueue(kind="noop")
        enq = time.perf_counter() - t0
        label = _short(size)
        figs = [self.bench.add(Figure(f"scale_enqueue_{label}", tail, enq, note=f"Spool.enqueue with {size - tail:,} already waiting"))]
        figs.append(self.bench.status_time(spool, label, name=f"scale_status_{label}"))
        t0 = time.perf_counter()
        spool.backend.dir.scan(time.time_ns(), SCAN_LIMIT)
        scan = time.perf_counter() - t0
        figs.append(self.bench.add(Figure(f"scale_scan_{label}", size, scan, kind="time",
                                          note=f"one pass over new/ with {size:,} files (scandir + lstat, keep the first "
                                               f"{SCAN_LIMIT // 1000}k): {scan * 1000:.0f} ms, {scan / size * 1e6:.1f} us per file")))
        # The bare system calls of a drain, on the first tenth (at least
        # 100, at most half) of these very files: what this filesystem
        # itself costs at this size. Its second rename goes to a folder
        # of its own, not to done/.
        bare = self.bench.bare_drain(spool, max(size // 10, min(100, size // 2)), f"scale_bare_drain_{label}")
        figs.append(bare)
        # Timed inside its process: no start-up to subtract, which on a
        # noisy host could leave a short drain with a negative time.
        _, outputs = _run_together([[sys.executable, "-c", _WORKER_DRAIN, spool.path]])
        ran, drain, rss_kb = outputs[0].split()
        rss_mb = int(rss_kb) / 1024
        counts = spool.status()
        limit = int(spool.settings["compact_after"])
        fig = self.bench.add(Figure(f"scale_drain_{label}", int(ran), float(drain),
                                    note=f"a worker (Spool.work, as `spoolq work --app` runs it) draining {int(ran):,} "
                                         f"no-op handler jobs with compact_after {limit} (its compaction's stop at the end "
                                         f"included): {counts['compacted']:,} compacted, {counts['done_files']:,} left in "
                                         f"done/; its peak RSS {rss_mb:.0f} MB"))
        fig.extra.update(peak_rss_mb=round(rss_mb, 1), compact_after=limit, compacted=counts["compacted"],
                         done_files=counts["done_files"])
        figs.append(fig)
        self._history_spool = (spool, size - bare.jobs)
        return {f.name: f for f in figs}

    def history_at(self, spool: Spool, finished: int) -> None:
        """With ``finished`` jobs in done/: compact them (rate), then put
        100,000 jobs in new/ (not due) and time `status` and `show` of a
        compacted job, both as whole commands."""
        ids = [n[:-5] for n in spool.backend.dir.names("done")][:1]
        t0 = time.perf_counter()
        result = spool.compact()
        took = time.perf_counter() - t0
        self.bench.add(Figure("compact", result["folded"], took, note=f"spoolq compact: {finished:,} done/ files into index.db"))
        waiting = 100_000
        later = time.time() + 86400
        for start in range(0, waiting, 10000):
            spool.enqueue_many([{"kind": "noop", "run_at": later}] * 10000)
        self.bench.status_time(spool, f"{_short(finished)}_compacted")
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            subprocess.run(SPOOLQ_CMD + ["-s", spool.path, "show", ids[0], "--json"], capture_output=True, check=True)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(100):
            spool.get(ids[0])
        inproc = (time.perf_counter() - t0) / 100
        fig = self.bench.add(Figure("show_compacted", 0, min(times), kind="time",
                                    note=f"spoolq show ID of a compacted job among {finished:,}: {min(times) * 1000:.0f} ms "
                                         f"(whole command); Spool.get {inproc * 1000:.2f} ms"))
        fig.extra.update(ms=round(min(times) * 1000, 1), get_ms=round(inproc * 1000, 3))


def _noop(payload: Any) -> None:
    return None


# The smallest size of the scale section, when larger ones follow and it has
# at most this many jobs, is measured this many times (half before them).
SCALE_REPEAT_UP_TO = 10_000
SCALE_BASELINE_RUNS = 5

SECTIONS = ("enqueue", "drain", "true", "latency", "sqlite", "status", "scale", "history", "used")
NOOP_HANDLERS = {"noop": lambda payload: None}  # for `spoolq work --app spoolq.bench:NOOP_HANDLERS`


def peak_rss_kb() -> int:
    """This process's own peak resident memory, in KiB. Linux's ru_maxrss
    also counts the memory of the process it was forked from, up to the
    exec (a drain started by a bench that had just scanned a million files
    would report the bench's size), so the memory map's high-water mark
    (VmHWM, reset by exec) is read where there is one."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# A whole worker in a process of its own (for its peak RSS) that waits,
# imported and with the spool open, until told to go, then times its own
# drain: the interpreter's start-up is never counted, and figures of several
# workers start them all at once. Prints "<jobs run> <seconds> <peak KiB>".
_WORKER_DRAIN = """
import sys, time
from spoolq import Spool
from spoolq.bench import NOOP_HANDLERS, peak_rss_kb
spool = Spool(sys.argv[1])
spool.settings  # reads config.json: the spool is open
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
ran = spool.work(handlers=NOOP_HANDLERS, signals=False)
seconds = time.perf_counter() - start
print(ran, seconds, peak_rss_kb())
"""
_WATCHER = """
import sys
from spoolq.bench import watch
sys.exit(watch(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""
_SQLITE_WORKER = """
import sqlite3, sys
from spoolq.bench import sqlite_drain
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=60)
db.execute(f"PRAGMA synchronous={sys.argv[2]}")
print("ready", flush=True)
sys.stdin.readline()
print(sqlite_drain(db))
"""


def watch(path: str, scope: str, jobs: int) -> int:
    """Run ``spoolq work --watch -q -j JOBS`` on ``path`` as the CLI does,
    but with the watch ``scope`` given (see watcher.make_waker): the other
    scopes are for pickup_latency's comparison, not an option of the CLI.
    Returns the exit status."""
    log = Log(level=0)

    def make_worker(**kw: Any) -> Any:
        spool = Spool(path)
        return spool._worker(watch=True, log=log, waker=make_waker(spool.backend.dir, None, log, scope=scope), **kw)

    if jobs == 1:
        worker = make_worker(jobs=1)
        worker.run()
        return 0 if not worker.failed_to_record else 1
    _, clean = run_workers(make_worker, jobs, None, log)
    return 0 if clean else 1


def _run_together(commands: list[list[str]]) -> tuple[float, list[str]]:
    """Start ``commands``, wait until each says it is ready, let them all go
    at once and time until the last has exited. Returns (seconds, the last
    line each printed)."""
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for cmd in commands]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a bench worker did not start: {proc.args}")
        start = time.perf_counter()
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.close()
        outputs = [proc.stdout.read().strip() for proc in procs]
        for proc in procs:
            if proc.wait() != 0:
                raise RuntimeError(f"a bench worker failed: {proc.args}")
        return time.perf_counter() - start, outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def sqlite_create(path: str, synchronous: str):
    """The table of the SQLite-table queue, as the article builds it."""
    import sqlite3

    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={synchronous}")
    db.execute("""CREATE TABLE jobs (id INTEGER PRIMARY KEY, kind TEXT NOT NULL, payload TEXT NOT NULL,
                  status TEXT NOT NULL DEFAULT 'pending', run_at REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
                  result TEXT, error TEXT, created_at REAL NOT NULL, updated_at REAL)""")
    db.execute("CREATE INDEX jobs_pending ON jobs (run_at) WHERE status = 'pending'")
    return db


def sqlite_drain(db: Any) -> int:
    """Claim and complete due jobs of the SQLite-table queue, a commit each,
    until none is left; returns how many this connection ran."""
    done = 0
    while True:
        now = time.time()
        db.execute("BEGIN IMMEDIATE")
        row = db.execute(
            "UPDATE jobs SET status = 'running', attempts = attempts + 1, updated_at = ? WHERE id = "
            "(SELECT id FROM jobs WHERE status = 'pending' AND run_at <= ? ORDER BY run_at LIMIT 1) "
            "RETURNING id, kind, payload", (now, now)).fetchone()
        db.execute("COMMIT")
        if row is None:
            return done
        _noop(json.loads(row[2]))
        db.execute("BEGIN IMMEDIATE")
        db.execute("UPDATE jobs SET status = 'done', result = ?, updated_at = ? WHERE id = ?", ("null", time.time(), row[0]))
        db.execute("COMMIT")
        done += 1


def _short(n: int) -> str:
    return f"{n // 1000000}M" if n >= 1000000 and n % 1000000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)


def run(spool_path: str, jobs: int, fsync: bool, sections: tuple[str, ...] = SECTIONS, true_jobs: int | None = None,
        scale_sizes: tuple[int, ...] = (1000, 100000), latency_jobs: int = 1000, keep: bool = False,
        progress: bool = True) -> Bench:
    """Run the chosen sections in a scratch folder inside ``spool_path``.
    Nothing is deleted until the end: deletions slow down later creates on
    some filesystems (the "used" section measures exactly that)."""
    refuse_non_directory(spool_path)
    os.makedirs(spool_path, exist_ok=True)
    root = os.path.join(spool_path, f".bench-{os.getpid()}")
    os.makedirs(root)
    bench = Bench(root, jobs, fsync, progress, _own_settings(spool_path))
    try:
        bench.say(f"scratch spool {root}, fsync {'on' if fsync else 'off'}, {jobs:,} jobs")
        if "enqueue" in sections:
            bench.enqueue_inprocess(jobs)  # and the bare loop beside it
            bench.enqueue_many(jobs)
            bench.enqueue_jsonl(jobs)
        if "drain" in sections:
            _drain_section(bench, jobs)
        if "true" in sections:
            bench.true_commands(true_jobs or min(jobs, 2000))
        if "latency" in sections:
            for scope in ("new", "paired"):
                for j in (1, 4):
                    bench.pickup_latency(latency_jobs, j, scope)
        if "sqlite" in sections:
            _sqlite_section(bench, jobs, fsync)
        if "status" in sections:
            spool = bench.fresh_spool("status")
            for start in range(0, jobs, 10000):
                spool.enqueue_many([{"kind": "noop"}] * min(10000, jobs - start))
            bench.status_time(spool, _short(jobs))
            bench.cold_start()
        if "scale" in sections:
            # At 1,000 waiting jobs and at 100 (or 1,000) times as many: a flat
            # cost per job means no operation lists a folder once per job.
            Scale(bench).run(scale_sizes, with_history="history" in sections)
        if "used" in sections:
            bench.used_filesystem(max(jobs, 20000))
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return bench


def _own_settings(spool_path: str) -> dict[str, Any]:
    """The settings the spool's config.json sets (fsync aside: the bench
    has its own), for the scale section's spools; none when the folder is
    no spool."""
    try:
        settings = Spool(spool_path).settings
        return {k: settings[k] for k in config.DEFAULTS if k != "fsync" and settings[k] != config.DEFAULTS[k]}
    except Exception:  # no spool, or one whose config.json does not read: the defaults
        return {}


def _drain_section(bench: Bench, jobs: int) -> None:
    """The drain section: the bare claim and drain loops, handler jobs drained
    by one worker and by two, and the cost of a handler job run in a process of its own."""
    bench.bare_claim(jobs)
    sample, size = bench.fresh_spool("bare-drain"), min(jobs, 20000)
    for start in range(0, size, 10000):
        sample.enqueue_many([{"kind": "noop"}] * min(10000, size - start))
    bench.bare_drain(sample, size)
    bench.drain_handlers(jobs)
    bench.drain_two_workers(jobs)
    forked = bench.drain_handlers(min(jobs, 5000), name="drain_handlers_forked", timeout=60)
    inline = bench.figures["drain_handlers"]
    forked.extra["fork_cost_us"] = round(forked.us_per_job - inline.us_per_job, 1)
    bench.say(f"cost of a process of its own per handler job (a timeout): {forked.us_per_job - inline.us_per_job:,.0f} us per job")


def _sqlite_section(bench: Bench, jobs: int, fsync: bool) -> None:
    """The sqlite section: the SQLite-table queue's figures, and spoolq's
    figures measured so far as ratios to them."""
    bench.sqlite_queue(jobs, "NORMAL")
    bench.sqlite_queue(min(jobs, 5000), "FULL")
    # The targets compare like with like: fsync off with NORMAL, on with FULL.
    sync = "full" if fsync else "normal"
    bench.sqlite_two_workers(jobs if not fsync else min(jobs, 5000), sync.upper())
    for mine, theirs in (("enqueue", f"sqlite_{sync}_enqueue"), ("enqueue_many", f"sqlite_{sync}_enqueue"),
                         ("drain_handlers", f"sqlite_{sync}_drain"),
                         ("drain_handlers_2w", f"sqlite_{sync}_drain_2w")):
        if mine in bench.figures and theirs in bench.figures:
            fig, other = bench.figures[mine], bench.figures[theirs]
            fig.extra[f"vs_{theirs}"] = round(fig.rate / other.rate, 3)
            fig.note += f"; {fig.rate / other.rate:.2f}x {theirs}"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "kernel": os.uname().release}
    return info


def report(bench: Bench, as_json: bool) -> str:
    if as_json:
        return json.dumps({"machine": machine(), "fsync": bench.fsync, "figures": bench.as_json()}, indent=2)
    return bench.table()
