"""The index: the SQLite history of finished jobs (``index.db``), its
cumulative counters, and the statistics asked of it.

One row per job in ``jobs`` (its fields as columns plus the whole record as
JSON) and one row per run in ``runs`` (from the record's history), so every
question about past jobs is one query. Rows arrive from compact.py, which
commits them before it removes each file; a job stored twice (a fold that
crashed after its commit) is recognised here, and the primary key keeps one
row per job.

The index is history only: it never decides where a waiting job is.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import json
import os
import stat
import sqlite3
import time
from typing import Any, Callable, Iterable, Iterator

from .. import procs, record
from ..errors import SpoolError
from ..record import RUN_SECONDS_BUCKETS  # noqa: F401 - importable from here too
from .protocol import check_owner_file, duplicate_name, file_name, id_of

SCHEMA_VERSION = 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id          TEXT PRIMARY KEY,  -- the job id
    state       TEXT NOT NULL,     -- 'done'; 'dead' for jobs purged from dead/; 'retried' for those retried since
    outcome     TEXT,              -- 'succeeded' | 'cancelled' (done), NULL (dead)
    kind        TEXT,              -- handler jobs
    command     TEXT,              -- shell jobs
    argv        TEXT,              -- argv jobs, as a JSON array
    target      TEXT NOT NULL,     -- what stats group by: kind, else program name
    attempts    INTEGER,           -- runs in the last round
    runs        INTEGER NOT NULL,  -- runs in the whole history
    exit_code   INTEGER,
    error       TEXT,
    created_at  REAL,              -- epoch seconds (all times are)
    finished_at REAL NOT NULL,
    record      TEXT NOT NULL      -- the whole JSON record
);
CREATE INDEX IF NOT EXISTS jobs_by_finish ON jobs (finished_at, id);
CREATE TABLE IF NOT EXISTS runs (
    job_id      TEXT NOT NULL,
    attempt     INTEGER,
    target      TEXT NOT NULL,
    worker      TEXT,
    due         REAL,
    start       REAL,
    end         REAL,
    wait        REAL,              -- start - due: time spent waiting while due
    duration    REAL,              -- end - start
    exit_code   INTEGER,
    error       TEXT,              -- NULL for a successful run
    PRIMARY KEY (job_id, attempt, start)
);
CREATE INDEX IF NOT EXISTS runs_by_end ON runs (end);
CREATE TABLE IF NOT EXISTS counters (
    name        TEXT PRIMARY KEY,  -- cumulative: never lowered by --keep
    value       INTEGER NOT NULL
);
"""

# An index of schema 1 has no run-duration counters: they are made from
# its runs table as it is opened for writing (rows --keep dropped are gone).
HISTOGRAM_FROM_RUNS = "".join(
    f"INSERT OR REPLACE INTO counters (name, value) SELECT '{name}', {value} FROM runs WHERE duration IS NOT NULL{cond};"
    for name, value, cond in [(f"run_seconds_le_{b:g}", "COUNT(*)", f" AND duration <= {b:g}") for b in RUN_SECONDS_BUCKETS]
    + [("run_seconds_count", "COUNT(*)", ""), ("run_seconds_sum_us", "COALESCE(SUM(CAST(ROUND(duration * 1e6) AS INTEGER)), 0)", "")]
)

JOB_COLUMNS = ("id", "state", "outcome", "kind", "command", "argv", "target", "attempts", "runs", "exit_code",
               "error", "created_at", "finished_at", "record")
RUN_COLUMNS = ("job_id", "attempt", "target", "worker", "due", "start", "end", "wait", "duration", "exit_code", "error")


_SQL_INT = range(-(1 << 63), 1 << 63)


def _sql(value: Any) -> Any:
    """``value`` as SQLite can bind it. A string that is not valid UTF-8 (a
    lone surrogate, from a ``\\udcff`` escape in a record or a file name that
    is not UTF-8) gets those characters as ``\\udcff`` escapes: in the
    ``record`` column that is the same JSON, elsewhere a stable spelling that
    lookups use too. An integer beyond 64 bits becomes NULL (the record column
    keeps it exactly). Either would otherwise stop every compaction."""
    if value.__class__ is str:
        if value.isascii():
            return value
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
    elif value.__class__ is int and value not in _SQL_INT:
        return None
    return value


def _sql_row(row: tuple) -> tuple:
    return tuple(map(_sql, row))


_UNBINDABLE = (UnicodeEncodeError, OverflowError)  # what sqlite3 raises binding such a value


def _insert(db: sqlite3.Connection, sql: str, rows: list[tuple]) -> sqlite3.Cursor:
    """Insert ``rows``, made bindable (``_sql``) only when one is not: the
    check costs more than SQLite's own bind, and nearly every row binds as
    it is. (A value that does not bind fails before its row is stored;
    rows before it in ``rows`` are stored again, so ``sql`` must be an
    INSERT OR REPLACE or OR IGNORE, or ``rows`` one row.)"""
    try:
        return db.executemany(sql, rows)
    except _UNBINDABLE:
        return db.executemany(sql, [_sql_row(row) for row in rows])


def _later_version(old: dict, old_finished: float, new: dict, new_finished: float) -> bool:
    """Whether ``new`` is a later record of ``old``'s job: created at the
    same time (an enqueue's time to the microsecond, or a dropped file's
    mtime), finished no earlier. Such a job was left in its folder by a
    killed compaction or purge, then retried, cancelled or moved by hand."""
    return old.get("created_at") is not None and old.get("created_at") == new.get("created_at") \
        and new_finished >= old_finished


def _tally(counts: dict[str, int], job: dict, state: str, runs: list[tuple], sign: int) -> None:
    """Add (``sign`` 1) or take back (-1) a stored job in the counters."""
    for name, n in ((f"rows_{state}", 1),
                    (f"jobs_{job.get('outcome') or 'succeeded'}" if state == "done" else "jobs_dead", 1),
                    *run_counts(job, runs).items()):
        counts[name] = counts.get(name, 0) + sign * n


def run_counts(job: dict, runs: list[tuple] | None = None) -> dict[str, int]:
    """What the runs in ``job``'s history add to the counters: runs by
    result and the run-duration histogram (see run_summary; ``_le_``
    counts are cumulative, the sum is in microseconds)."""
    if runs is None:
        succeeded, failed, durations = run_summary(job)
    else:
        succeeded = sum(1 for r in runs if r[10] is None)
        failed = len(runs) - succeeded + record.dropped_runs(job)
        durations = [r[8] for r in runs if r[8] is not None]
    return histogram_counts(succeeded, failed, durations)


def histogram_counts(succeeded: int, failed: int, durations: list[float]) -> dict[str, int]:
    counts = {"runs_succeeded": succeeded, "runs_failed": failed,
              "run_seconds_count": len(durations), "run_seconds_sum_us": sum(round(d * 1e6) for d in durations)}
    durations = sorted(durations)
    counts.update((f"run_seconds_le_{b:g}", bisect.bisect_right(durations, b)) for b in RUN_SECONDS_BUCKETS)
    return counts


def run_summary(job: dict) -> tuple[int, int, list[float]]:
    """(succeeded, failed, durations) of the runs in ``job``'s history, as
    run_rows sees them: a run failed if its entry has an error. The entries
    trimming dropped (counted in ``history_dropped``) were failed runs:
    only a job's last run can succeed. Durations: runs with a start and an
    end."""
    history = job.get("history")
    succeeded, failed, durations = 0, record.dropped_runs(job), []
    if isinstance(history, list):
        for h in history:
            if not isinstance(h, dict):
                continue
            if isinstance(h.get("error"), str):
                failed += 1
            else:
                succeeded += 1
            start, end = record.time_or_none(h.get("start")), record.time_or_none(h.get("end"))
            if start is not None and end is not None:
                durations.append(max(0.0, end - start))
    return succeeded, failed, durations


def job_row(job: dict, state: str, finished_at: float) -> tuple:
    argv = job.get("argv")
    history = job.get("history") if isinstance(job.get("history"), list) else []
    return (
        job["id"], state, job.get("outcome") if state == "done" else None,
        job.get("kind") if isinstance(job.get("kind"), str) else None,
        job.get("command") if isinstance(job.get("command"), str) else None,
        json.dumps(argv) if argv is not None else None,
        record.target_label(job),
        job.get("attempts") if isinstance(job.get("attempts"), int) else None,
        len(history),
        job.get("exit_code") if isinstance(job.get("exit_code"), int) else None,
        job.get("error") if isinstance(job.get("error"), str) else None,
        record.time_or_none(job.get("created_at")),
        finished_at,
        json.dumps(job, ensure_ascii=False),
    )


def run_rows(job: dict) -> list[tuple]:
    rows = []
    target = record.target_label(job)
    history = job.get("history") if isinstance(job.get("history"), list) else []
    for i, h in enumerate(history):
        if not isinstance(h, dict):
            continue
        due, start, end = (record.time_or_none(h.get(key)) for key in ("due", "start", "end"))
        rows.append((
            job["id"], h.get("attempt") if isinstance(h.get("attempt"), int) else i + 1, target,
            h.get("worker") if isinstance(h.get("worker"), str) else None,
            due, start, end,
            max(0.0, start - due) if start is not None and due is not None else None,
            max(0.0, end - start) if end is not None and start is not None else None,
            h.get("exit_code") if isinstance(h.get("exit_code"), int) else None,
            h.get("error") if isinstance(h.get("error"), str) else None,
        ))
    return rows


def _disk_full_explained(change):
    """Decorate a change of the index: an SQLite error met on a full disk
    (SQLite says "disk I/O error", or "readonly database" when it could
    not size its -shm file) becomes the OSError it stands for."""

    @functools.wraps(change)
    def wrapper(self, *args, **kwargs):
        try:
            return change(self, *args, **kwargs)
        except sqlite3.Error as error:
            # SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL (primary codes)
            full = (getattr(error, "sqlite_errorcode", 0) or 0) & 0xFF in (8, 10, 13)
            try:
                fs = os.statvfs(os.path.dirname(self.path) or ".")
                # (A filesystem without inode counts, btrfs for one, reports f_files 0.)
                full = full and (fs.f_bavail == 0 or (fs.f_files > 0 and fs.f_favail == 0))
            except OSError:
                full = False
            if full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path) from error
            raise

    return wrapper


@functools.lru_cache(maxsize=1)
def _own_schema() -> frozenset[tuple]:
    """What SCHEMA puts in sqlite_master: (type, name, table, SQL)."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(SCHEMA)
        return frozenset(db.execute("SELECT type, name, tbl_name, sql FROM main.sqlite_master"))
    finally:
        db.close()


def _refuse_foreign_schema(db: sqlite3.Connection, path: str) -> None:
    """Raise SpoolError when the database holds an object SCHEMA does not
    make (a trigger, a view, another table or index, a changed definition):
    one planted by whoever could write the file, which would run inside
    this process's writes."""
    for row in db.execute("SELECT type, name, tbl_name, sql FROM main.sqlite_master"):
        if tuple(row) not in _own_schema():
            article = "an" if row[0][0] in "aeiou" else "a"
            raise SpoolError(f"{path} holds {article} {row[0]} {row[1]!r} that spoolq does not make: not used "
                             "(an index.db holds only spoolq's own tables and indexes)")


@contextlib.contextmanager
def _immediate(db: sqlite3.Connection, path: str) -> Iterator[None]:
    """A write transaction, taken at once (BEGIN IMMEDIATE), committed at
    the end and rolled back on any error. The schema is checked once the
    write lock is held, so nothing added since the database was opened
    fires inside the transaction."""
    db.execute("BEGIN IMMEDIATE")
    try:
        _refuse_foreign_schema(db, path)
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:  # SQLite has rolled back by itself after some errors (a full disk)
            db.execute("ROLLBACK")
        raise


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


READ_ONLY_FOR = 5.0  # seconds a read-only fallback connection is used before read-write is tried again


class Index:
    """The SQLite history of one spool."""

    def __init__(self, path: str, durable: bool = True, shared: bool = False):
        self.path = path
        self.durable = durable
        self.shared = shared  # a group-shared spool: the database and its -wal and -shm files 0640
        self.read_only = False  # the connection is the read-only fallback (see db)
        self._read_only_since = 0.0
        self._db: sqlite3.Connection | None = None

    @property
    def db(self) -> sqlite3.Connection:
        """The connection: read-write, or, when that cannot be had (a full
        disk, where WAL's -shm file cannot be made), read-only, so that
        status and history still answer. A change reopens it (writable)."""
        if self._db is not None and self.read_only and time.monotonic() - self._read_only_since > READ_ONLY_FOR \
                and not self._db.in_transaction:
            self.close()  # the trouble may be over: a long-lived process must not read a snapshot for ever
        if self._db is None:
            try:
                self._db = self._open()
            except sqlite3.Error as error:
                try:
                    self._db = self._open_read_only()
                except sqlite3.Error:
                    raise error from None
                self.read_only = True
                self._read_only_since = time.monotonic()
        return self._db

    def writable(self) -> sqlite3.Connection:
        """The connection for a change: read-write, or the error why not
        (never the read-only fallback)."""
        if self._db is None or self.read_only:
            self.close()
            self._db = self._open()
        return self._db

    def _open(self) -> sqlite3.Connection:
        if self.path != ":memory:" and not os.path.lexists(self.path):
            self._create()
        if self.shared:
            self._share()
        self._refuse_non_files()
        db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
        try:
            self._distrust(db)
            db.execute("PRAGMA journal_mode=WAL")
            # FULL: a commit is on disk before compaction removes the files it holds.
            db.execute(f"PRAGMA synchronous={'FULL' if self.durable else 'NORMAL'}")
            if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                db.executescript(f"BEGIN IMMEDIATE; {SCHEMA} {HISTOGRAM_FROM_RUNS} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
        except BaseException:
            db.close()
            raise
        return db

    def _create(self) -> None:
        """Make index.db whole under a temporary name and link it into
        place: a reader finds no index or a complete one, never a file
        whose creation failed (a full disk) and which no one can read. A
        creator that comes second keeps the first one's."""
        tmp = f"{self.path}.new-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            # Made here, not by SQLite: never through a symlink planted at
            # the name, and with the spool's mode whatever the umask (SQLite
            # gives the -wal and -shm files the database's mode).
            mode = 0o640 if self.shared else 0o600
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            db = sqlite3.connect(tmp, isolation_level=None)
            try:
                db.execute(f"PRAGMA synchronous={'FULL' if self.durable else 'NORMAL'}")
                db.executescript(f"BEGIN IMMEDIATE; {SCHEMA} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
                db.execute("PRAGMA journal_mode=WAL")  # the last write: the file needs nothing from a -wal
            finally:
                db.close()
            if self.durable:
                _fsync(tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return
            if self.durable:
                _fsync(os.path.dirname(self.path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        finally:
            for path in (tmp, tmp + "-wal", tmp + "-shm", tmp + "-journal"):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def remove_stale_tmp(self) -> int:
        """Remove what a creator that died left of its temporary database
        (``index.db.new-PID-*``, see _create): files whose PID no longer
        runs. Returns how many."""
        folder, base = os.path.split(self.path)
        prefix = base + ".new-"
        removed = 0
        for name in os.listdir(folder or "."):
            if not name.startswith(prefix):
                continue
            pid = name[len(prefix):].split("-", 1)[0]
            if not pid.isdigit() or procs.start_time(int(pid)) is not None:  # its creator still runs
                continue
            try:
                os.unlink(os.path.join(folder, name))
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def _open_read_only(self) -> sqlite3.Connection:
        """The database opened read-only: ``mode=ro``, else ``immutable``
        (which reads the main file alone, without what the -wal file holds
        that was not yet checkpointed: a little behind; and, taking no
        locks, it could read a page a checkpoint is writing at that
        instant, which SQLite then reports as an error: a last resort,
        kept for READ_ONLY_FOR seconds at most)."""
        from urllib.parse import quote

        self._refuse_non_files()
        for flags in ("mode=ro", "mode=ro&immutable=1"):
            db = sqlite3.connect(f"file:{quote(self.path)}?{flags}", uri=True, timeout=60, isolation_level=None,
                                 check_same_thread=False)
            try:
                self._distrust(db)
                db.execute("PRAGMA temp_store=MEMORY")  # stats builds temporary tables
                if db.execute("PRAGMA user_version").fetchone()[0] >= 1:  # every version reads the same
                    return db
            except sqlite3.Error:
                pass
            db.close()
        raise sqlite3.OperationalError("cannot open index.db read-only")

    def _refuse_non_files(self) -> None:
        """Raise SpoolError when index.db, or its -wal or -shm file, is a
        symlink or anything but a regular file (SQLite would follow it and
        create or write the file it points to), or is not the spool owner's
        alone to write (see protocol.check_owner_file)."""
        if self.path == ":memory:":
            return
        owner = os.stat(os.path.dirname(self.path) or ".").st_uid
        for path in (self.path, self.path + "-wal", self.path + "-shm"):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            mode = st.st_mode
            if stat.S_ISREG(mode):
                check_owner_file(path, st, owner)
            else:
                what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
                raise SpoolError(f"{path} is {what}: not opened (index.db and its -wal and -shm files "
                                 "must be regular files)")

    def _distrust(self, db: sqlite3.Connection) -> None:
        """No function or virtual table a schema names runs unless SQLite
        deems it harmless, and a schema with anything spoolq does not make
        is refused (SpoolError) before a statement touches it."""
        db.execute("PRAGMA trusted_schema=OFF")
        try:
            _refuse_foreign_schema(db, self.path)
        except SpoolError:
            db.close()
            raise

    def _share(self) -> None:
        """Make the database 0640, and its -wal and -shm files (SQLite gives
        them the database's mode less the umask): members of the group read
        them whatever this process's umask; only the owner writes them."""
        for path in (self.path, self.path + "-wal", self.path + "-shm"):
            try:
                # Through a descriptor opened without following a symlink: a
                # member of the group could swap one in for the name.
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue  # not there, or not a file we may open: its owner's process mends it
            try:
                st = os.fstat(fd)
                if st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != 0o640:
                    os.fchmod(fd, 0o640)
            except OSError:
                pass
            finally:
                os.close(fd)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
            self.read_only = False

    # -- reading -----------------------------------------------------------

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """Read the index as of one instant: every query inside sees the
        same commits. Folders listed before it are then reconciled with it:
        a job whose file was listed is in this snapshot if compaction had
        committed it by then, whether or not its file is gone."""
        db = self.db
        if db.in_transaction:  # an enclosing snapshot
            yield
            return
        db.execute("BEGIN")
        try:
            yield
        finally:
            if db.in_transaction:
                db.execute("COMMIT")

    def present(self, ids: Iterable[str], state: str | None = None) -> set[str]:
        """Those of ``ids`` that have a row (in ``state``, when given)."""
        wanted = {_sql(i): i for i in ids}
        keys = list(wanted)
        found: set[str] = set()
        where = "" if state is None else " AND state = ?"
        for pos in range(0, len(keys), 500):
            chunk = keys[pos:pos + 500]
            found.update(wanted[row[0]] for row in self.db.execute(
                f"SELECT id FROM jobs WHERE id IN ({', '.join('?' * len(chunk))}){where}",
                chunk + ([state] if state is not None else [])))
        return found

    def records(self, ids: Iterable[str]) -> dict[str, dict]:
        """The stored records of those of ``ids`` that have a row."""
        wanted = {_sql(i): i for i in ids}
        keys = list(wanted)
        found: dict[str, dict] = {}
        for pos in range(0, len(keys), 500):
            chunk = keys[pos:pos + 500]
            for key, rec in self.db.execute(
                    f"SELECT id, record FROM jobs WHERE id IN ({', '.join('?' * len(chunk))})", chunk):
                found[wanted[key]] = json.loads(rec)
        return found

    def ids_with_prefix(self, prefix: str, states: tuple[str, ...], limit: int) -> list[str]:
        """Up to ``limit`` ids in ``states`` that begin with ``prefix`` (an
        id's characters, all ASCII: a range of the primary key)."""
        after = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        return [row[0] for row in self.db.execute(
            f"SELECT id FROM jobs WHERE id >= ? AND id < ? AND state IN ({', '.join('?' * len(states))}) LIMIT ?",
            (prefix, after, *states, limit))]

    def has(self, job_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM jobs WHERE id = ?", (_sql(job_id),)).fetchone() is not None

    def get(self, job_id: str) -> dict | None:
        row = self.db.execute("SELECT record, state FROM jobs WHERE id = ?", (_sql(job_id),)).fetchone()
        if row is None:
            return None
        job = json.loads(row[0])
        job["state"] = row[1]
        job["compacted"] = True
        return job

    def count(self, state: str = "done") -> int:
        row = self.db.execute("SELECT value FROM counters WHERE name = ?", (f"rows_{state}",)).fetchone()
        return int(row[0]) if row else 0

    def counters(self) -> dict[str, int]:
        return {name: value for name, value in self.db.execute("SELECT name, value FROM counters")}

    def iter_finished(self, states: tuple[str, ...] = ("done",), since: float | None = None) -> Iterator[dict]:
        """Compacted done jobs (and purged dead ones, for ``dead`` in
        ``states``) by finish time, each with ``_sort`` = (ns, name) to merge
        with the files of done/ and dead/ (whose sort key is (mtime ns, name))."""
        cursor = self.db.execute(
            f"SELECT record, finished_at, id, state FROM jobs WHERE state IN ({', '.join('?' * len(states))}) "
            "AND finished_at >= ? ORDER BY finished_at, id",
            (*states, since if since is not None else -1.0),
        )
        for rec, finished_at, job_id, state in cursor:
            job = json.loads(rec)
            job["state"] = state
            job["compacted"] = True
            job["_sort"] = (int(finished_at * 1e9), file_name(job_id))
            yield job

    @_disk_full_explained
    def mark_retried(self, job_id: str) -> None:
        """A purged dead job is back in new/ (``compact.retry_purged``): its
        row stays, as ``retried``, until the job finishes again and its
        later record replaces it (see add), so the runs it counted are not
        counted twice; listings and stats leave it out meanwhile."""
        db = self.writable()
        with _immediate(db, self.path):
            if db.execute("UPDATE jobs SET state = 'retried' WHERE id = ? AND state = 'dead'", (_sql(job_id),)).rowcount:
                self._bump("rows_dead", -1)
                self._bump("rows_retried", 1)

    # -- writing -----------------------------------------------------------

    @_disk_full_explained
    def add(self, jobs: list[tuple[dict, str, float]]) -> list[str]:
        """Insert finished jobs in one transaction; returns the ids stored.
        A job already there with the same record is skipped (a compaction
        that crashed after its commit); one with a different record is stored
        under a ``.dup-`` id so neither is lost."""
        stored = []
        db = self.writable()
        counts: dict[str, int] = {}
        insert_job = f"INSERT OR IGNORE INTO jobs ({', '.join(JOB_COLUMNS)}) VALUES ({', '.join('?' * len(JOB_COLUMNS))})"
        insert_runs = f"INSERT OR REPLACE INTO runs ({', '.join(RUN_COLUMNS)}) VALUES ({', '.join('?' * len(RUN_COLUMNS))})"
        with _immediate(db, self.path):
            for job, state, finished_at in self._add_fresh(db, jobs, insert_job, insert_runs, counts, stored):
                if _insert(db, insert_job, [job_row(job, state, finished_at)]).rowcount == 0:
                    key = _sql(job["id"])
                    old_record, old_state, old_finished = db.execute(
                        "SELECT record, state, finished_at FROM jobs WHERE id = ?", (key,)).fetchone()
                    old = json.loads(old_record)
                    if old == job:
                        stored.append(job["id"])  # stored by a compaction that crashed after its commit
                        continue
                    if _later_version(old, old_finished, job, finished_at):
                        # The same job, changed since its row was stored: its
                        # newer record replaces the row (one row per id).
                        _tally(counts, old, old_state, run_rows(old), -1)
                        db.execute("DELETE FROM runs WHERE job_id = ?", (key,))
                        db.execute("DELETE FROM jobs WHERE id = ?", (key,))
                    else:
                        job = dict(job, id=id_of(duplicate_name(file_name(job["id"]))), duplicate_of=job["id"])
                    _insert(db, insert_job, [job_row(job, state, finished_at)])
                runs = run_rows(job)
                _insert(db, insert_runs, runs)
                _tally(counts, job, state, runs, 1)
                stored.append(job["id"])
            for name, n in counts.items():
                self._bump(name, n)
        return stored

    def _add_fresh(self, db: sqlite3.Connection, jobs: list[tuple[dict, str, float]], insert_job: str, insert_runs: str,
                   counts: dict[str, int], stored: list[str]) -> list[tuple[dict, str, float]]:
        """Insert those of ``jobs`` that have no row yet all at once (one
        statement for their rows, one for their runs, their counters summed
        once: most of what a fold costs in Python is otherwise spent once per
        job); returns the others, for add to weigh one at a time."""
        there = self.present(job["id"] for job, _, _ in jobs)
        fresh = [entry for entry in jobs if entry[0]["id"] not in there]
        if len(fresh) < 2:
            return jobs
        db.execute("SAVEPOINT fresh")
        if _insert(db, insert_job, [job_row(*entry) for entry in fresh]).rowcount != len(fresh):
            # Two ids that SQLite stores alike (see _sql): one at a time after all.
            db.execute("ROLLBACK TO fresh")
            db.execute("RELEASE fresh")
            return jobs
        all_runs: list[tuple] = []
        succeeded = failed = 0
        durations: list[float] = []
        for job, state, _ in fresh:
            runs = run_rows(job)
            all_runs += runs
            for name in (f"rows_{state}", f"jobs_{job.get('outcome') or 'succeeded'}" if state == "done" else "jobs_dead"):
                counts[name] = counts.get(name, 0) + 1
            ok = sum(1 for r in runs if r[10] is None)
            succeeded += ok
            failed += len(runs) - ok + record.dropped_runs(job)
            durations += [r[8] for r in runs if r[8] is not None]
            stored.append(job["id"])
        _insert(db, insert_runs, all_runs)
        db.execute("RELEASE fresh")
        for name, n in histogram_counts(succeeded, failed, durations).items():
            counts[name] = counts.get(name, 0) + n
        return [entry for entry in jobs if entry[0]["id"] in there]

    def _bump(self, name: str, by: int) -> None:
        if by:
            self.db.execute(
                "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + ?",
                (name, by, by),
            )

    @_disk_full_explained
    def drop_older(self, cutoff: float) -> int:
        """Delete jobs (and their runs) that finished before ``cutoff``."""
        db = self.writable()
        n = {}
        # A retried row stays until its job finishes again (see mark_retried).
        with _immediate(db, self.path):
            for state in ("done", "dead"):
                n[state] = db.execute("SELECT COUNT(*) FROM jobs WHERE state = ? AND finished_at < ?", (state, cutoff)).fetchone()[0]
            db.execute("DELETE FROM runs WHERE job_id IN (SELECT id FROM jobs WHERE finished_at < ? AND state != 'retried')",
                       (cutoff,))
            db.execute("DELETE FROM jobs WHERE finished_at < ? AND state != 'retried'", (cutoff,))
            for state, count in n.items():
                self._bump(f"rows_{state}", -count)
        return sum(n.values())


# --------------------------------------------------------------------------
# statistics


STATS_SQL = """
WITH r AS (
    SELECT {group} AS grp, wait, duration, error FROM all_runs WHERE end >= :since
),
ranked AS (
    SELECT grp, wait, duration, error,
           ROW_NUMBER() OVER (PARTITION BY grp ORDER BY wait) AS wait_rank,
           ROW_NUMBER() OVER (PARTITION BY grp ORDER BY duration) AS run_rank,
           COUNT(*) OVER (PARTITION BY grp) AS n
    FROM r
),
pct AS (  -- nearest-rank percentiles: the value at rank ceil(p * n)
    SELECT grp,
           MAX(CASE WHEN wait_rank = MAX(1, CAST(0.50 * n + 0.999999 AS INTEGER)) THEN wait END) AS wait_p50,
           MAX(CASE WHEN wait_rank = MAX(1, CAST(0.95 * n + 0.999999 AS INTEGER)) THEN wait END) AS wait_p95,
           MAX(wait) AS wait_max,
           MAX(CASE WHEN run_rank = MAX(1, CAST(0.50 * n + 0.999999 AS INTEGER)) THEN duration END) AS run_p50,
           MAX(CASE WHEN run_rank = MAX(1, CAST(0.95 * n + 0.999999 AS INTEGER)) THEN duration END) AS run_p95,
           MAX(duration) AS run_max,
           COUNT(*) AS runs,
           SUM(error IS NOT NULL) AS failed_runs
    FROM ranked GROUP BY grp
),
j AS (
    SELECT {group} AS grp,
           SUM(state = 'done' AND outcome = 'succeeded') AS succeeded,
           SUM(state = 'done' AND outcome = 'cancelled') AS cancelled,
           SUM(state = 'dead') AS dead,
           COUNT(*) AS jobs,
           MIN(finished_at) AS first_finish,
           MAX(finished_at) AS last_finish
    FROM all_jobs WHERE finished_at >= :since GROUP BY grp
),
g AS (SELECT grp FROM j UNION SELECT grp FROM pct)
SELECT g.grp,
       COALESCE(j.jobs, 0), COALESCE(j.succeeded, 0), COALESCE(pct.failed_runs, 0), COALESCE(j.dead, 0),
       COALESCE(j.cancelled, 0), COALESCE(pct.runs, 0), j.first_finish, j.last_finish,
       pct.wait_p50, pct.wait_p95, pct.wait_max, pct.run_p50, pct.run_p95, pct.run_max
FROM g LEFT JOIN j ON j.grp = g.grp LEFT JOIN pct ON pct.grp = g.grp
ORDER BY 2 DESC, 1
"""

MIN_WINDOW = 60.0  # seconds: the shortest window a throughput is taken over

STAT_FIELDS = ("target", "jobs", "succeeded", "failed_runs", "dead", "cancelled", "runs", "first_finish", "last_finish",
               "wait_p50", "wait_p95", "wait_max", "run_p50", "run_p95", "run_max")


def stats(index: Index, extra_jobs: list[tuple[dict, str, float]], since: float | None) -> dict[str, Any]:
    """Per-target and total statistics over the index plus ``extra_jobs``
    (the finished jobs still in folders), in SQL. Percentiles are nearest-rank.
    An extra job the index holds already (compaction committed it, its
    file not yet removed) counts once, as the index's."""
    with index.snapshot():
        folded = {(job_id, state) for state in ("done", "dead")
                  for job_id in index.present([job.get("id") for job, s, _ in extra_jobs if s == state], state)}
        if folded:
            extra_jobs = [entry for entry in extra_jobs if (entry[0].get("id"), entry[1]) not in folded]
        return _stats(index, extra_jobs, since)


def _stats(index: Index, extra_jobs: list[tuple[dict, str, float]], since: float | None) -> dict[str, Any]:
    db = index.db
    db.execute("DROP TABLE IF EXISTS temp.extra_jobs")
    db.execute("DROP TABLE IF EXISTS temp.extra_runs")
    db.execute("CREATE TEMP TABLE extra_jobs AS SELECT * FROM main.jobs WHERE 0")
    db.execute("CREATE TEMP TABLE extra_runs AS SELECT * FROM main.runs WHERE 0")
    db.executemany(f"INSERT INTO temp.extra_jobs VALUES ({', '.join('?' * len(JOB_COLUMNS))})",
                   [_sql_row(job_row(j, s, f)) for j, s, f in extra_jobs])
    db.executemany(f"INSERT INTO temp.extra_runs VALUES ({', '.join('?' * len(RUN_COLUMNS))})",
                   [_sql_row(r) for j, _, _ in extra_jobs for r in run_rows(j)])
    db.execute("DROP VIEW IF EXISTS temp.all_jobs")
    db.execute("DROP VIEW IF EXISTS temp.all_runs")
    # A retried row is history of a job that waits again: its record (and
    # its runs) count once the job has finished again, from its file.
    db.execute("CREATE TEMP VIEW all_jobs AS SELECT * FROM main.jobs WHERE state != 'retried' "
               "UNION ALL SELECT * FROM temp.extra_jobs")
    db.execute("CREATE TEMP VIEW all_runs AS SELECT * FROM main.runs WHERE job_id NOT IN "
               "(SELECT id FROM main.jobs WHERE state = 'retried') UNION ALL SELECT * FROM temp.extra_runs")
    params = {"since": since if since is not None else -1.0}
    groups = [dict(zip(STAT_FIELDS, row)) for row in db.execute(STATS_SQL.format(group="target"), params)]
    total_rows = [dict(zip(STAT_FIELDS, row)) for row in db.execute(STATS_SQL.format(group="'total'"), params)]
    total = total_rows[0] if total_rows else {**dict.fromkeys(STAT_FIELDS, 0), **dict.fromkeys(STAT_FIELDS[7:])}
    # One window for every group: the --since period, else from the first
    # finish counted to now; never under a minute, so that a burst of two
    # jobs a millisecond apart is not "2000 jobs/s".
    first = total.get("first_finish")
    now = time.time()
    start = since if since is not None else first
    window = max(MIN_WINDOW, now - start) if start is not None else None
    for entry in groups + [total]:
        entry.pop("first_finish"), entry.pop("last_finish")
        entry["throughput_per_s"] = round(entry["jobs"] / window, 3) if window and entry["jobs"] else None
        entry["group"] = entry.pop("target")
    total.pop("group", None)
    db.execute("DROP VIEW temp.all_jobs")
    db.execute("DROP VIEW temp.all_runs")
    db.execute("DROP TABLE temp.extra_jobs")
    db.execute("DROP TABLE temp.extra_runs")
    return {"total": total, "groups": groups}
