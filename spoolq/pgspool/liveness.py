"""A worker's liveness in a PostgreSQL spool, and its self-fencing.

A worker registers as a row of ``spoolq.workers`` and holds the session
advisory lock ``(LOCK_CLASS, row id)`` on a connection of its own for its
whole life: the lock is free exactly when that session has ended, which is
how recovery tells a dead worker from a live one, with no guessed timeout.

A thread watches that session. It waits on the connection's socket, so a
session the server ends (``pg_terminate_backend``, a restart) is seen at
once, and every HEARTBEAT seconds it makes a round trip (writing the runs'
process groups when they changed); a round trip unanswered for LOST_AFTER
seconds means the server can no longer be reached. Either way the worker
*fences itself*: it kills the processes of the runs it has under way, then
closes the session, then registers again (a new row and lock) with
backoff. Recovery waits RECOVERY_GRACE seconds after it first finds a lock
free before it takes that worker's jobs, and a session the server ends
because its host went silent ends no sooner than connect.SERVER_SILENCE
seconds after the last packet: in both cases the runs were killed before
anyone else could run their jobs (docs/postgres.md gives the bounds).
"""

from __future__ import annotations

import json
import os
import re
import select
import threading
import time
from typing import Any, Callable, Iterable

from .. import procs
from ..record import rfc3339
from .schema import LOCK_CLASS

HEARTBEAT = 1.0  # seconds between the liveness session's round trips
LOST_AFTER = 5.0  # a round trip unanswered this long: the server cannot be reached
RECONNECT_FIRST = 0.1  # the first wait before registering again; doubled each time ...
RECONNECT_MAX = 5.0  # ... up to this
# How long recovery waits after it first finds a worker's lock free: more
# than a worker needs to see its session ended and kill its runs.
RECOVERY_GRACE = 3.0

REGISTER = ("INSERT INTO spoolq.workers (worker, host, pid, uid, boot_id, proc_start, kinds) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id")
# The last worker to start says which kinds it runs (see status).
NOTE_KINDS = ("INSERT INTO spoolq.notes (name, value) VALUES ('kinds', %s) "
              "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value, at = now()")


def make_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", os.uname().nodename)[:40] or "host"
    return f"{host}.{os.getpid()}.{os.urandom(3).hex()}"


class Lost(Exception):
    """The liveness session is gone, or cannot be reached."""


class PgWorkerReg:
    """This worker's registration: a workers row, the session that holds
    its lock, and the runs under way (for fencing and for recovery)."""

    def __init__(self, connect: Callable[[], Any], worker_id: str | None = None,
                 log: Callable[[str], None] | None = None, kinds: Iterable[str] | None = None):
        self.worker_id = worker_id or make_worker_id()
        self.kinds = sorted(kinds) if kinds is not None else None  # handler kinds it runs (None: every kind)
        self.id: int | None = None  # the workers row held now
        self.live = threading.Event()  # set while the session holds the lock
        self.fenced: set[str] = set()  # jobs whose runs a fence killed (their finish records an interruption)
        self.losses = 0
        self._connect = connect
        self._log = log or (lambda text: None)
        self._conn: Any = None
        self._runs: dict[str, dict[str, Any]] = {}
        self._dirty = False
        self._lock = threading.Lock()
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        self._on_lost: list[Callable[[str], None]] = []
        self._thread: threading.Thread | None = None
        self._proc_start = procs.start_time(os.getpid())

    # -- the worker's side -------------------------------------------------

    def open(self) -> None:
        """Register (raises SpoolError when the database cannot be reached)
        and start watching the session."""
        self._register()
        with procs.signals_to_main_thread():
            self._thread = threading.Thread(target=self._watch, name="spoolq-liveness", daemon=True)
            self._thread.start()

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` when the session is lost, after the
        runs' processes were killed (an in-process handler is the worker's
        to stop)."""
        self._on_lost.append(callback)

    def note_run(self, job_id: str, attempt: int, pgid: int | None = None,
                 window: tuple[int, int] | None = None) -> None:
        """A run begins (``pgid``: its process group, once spawned, with the
        boot ticks just before and after the spawn). A run noted while the
        session is lost is fenced at once."""
        with self._lock:
            entry = self._runs.setdefault(job_id, {"attempt": attempt, "started_at": rfc3339()})
            entry["attempt"] = attempt
            if pgid is not None:
                entry["pgid"] = pgid
                entry["spawned"] = list(window) if window else None
            self._dirty = True
            live = self.live.is_set()
            if not live:
                self.fenced.add(job_id)
        if not live:
            self._kill(job_id, entry)
        elif pgid is not None:
            self._poke()  # recovery kills by it: written now, not at the next heartbeat

    def end_run(self, job_id: str) -> None:
        with self._lock:
            if self._runs.pop(job_id, None) is not None:
                self._dirty = True

    def was_fenced(self, job_id: str) -> bool:
        """Whether a fence killed this job's run (asked once, as it finishes)."""
        with self._lock:
            if job_id in self.fenced:
                self.fenced.discard(job_id)
                return True
            return False

    def close(self) -> None:
        """Unregister: the row goes when no job of it is running; the
        session ends either way, and with it the lock."""
        self._closing = True
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout=LOST_AFTER + 5)
        conn, self._conn = self._conn, None
        self.live.clear()
        if conn is not None:
            try:
                if not self._runs and self.id is not None:
                    conn.pgconn.exec_params(
                        b"DELETE FROM spoolq.workers WHERE id = $1 AND NOT EXISTS "
                        b"(SELECT 1 FROM spoolq.jobs WHERE state = 'running' AND worker = $1)",
                        [str(self.id).encode()])
            finally:
                conn.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the session -------------------------------------------------------

    def _register(self) -> None:
        conn = self._connect()
        try:
            with conn.transaction():
                kinds = json.dumps(self.kinds) if self.kinds is not None else None
                row = conn.execute(REGISTER, (self.worker_id, os.uname().nodename, os.getpid(), os.geteuid(),
                                              procs.boot_id(), self._proc_start, kinds)).fetchone()
                if kinds is not None:
                    conn.execute(NOTE_KINDS, (kinds,))
                conn.execute("SELECT pg_advisory_lock(%s, %s)", (LOCK_CLASS, row[0]))
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._conn, self.id = conn, row[0]
            self._dirty = bool(self._runs)
        self.live.set()

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b".")
        except OSError:
            pass

    def _watch(self) -> None:
        delay = RECONNECT_FIRST
        while not self._closing:
            if not self.live.is_set():
                if self._wait(delay):
                    continue
                try:
                    self._register()
                    self._log(f"worker={self.worker_id} registered again (session {self.id})")
                    delay = RECONNECT_FIRST
                except Exception as e:
                    self._log(f"worker={self.worker_id} cannot register again: {e}")
                    delay = min(RECONNECT_MAX, delay * 2)
                continue
            try:
                self._beat()
                self._idle(HEARTBEAT)
            except Lost as e:
                if not self._closing:
                    self._fence(str(e))

    def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless poked; True when closing."""
        ready, _, _ = select.select([self._wake_r], [], [], seconds)
        if ready:
            os.read(self._wake_r, 4096)
        return self._closing

    def _beat(self) -> None:
        """One round trip on the session, within LOST_AFTER seconds: the
        runs written when they changed, else a bare query."""
        pgconn = self._conn.pgconn
        with self._lock:
            dirty, self._dirty = self._dirty, False
            runs = json.dumps({k: v for k, v in self._runs.items() if k not in self.fenced}) if dirty else None
        try:
            if runs is not None:
                pgconn.send_query_params(b"UPDATE spoolq.workers SET runs = $1::jsonb WHERE id = $2",
                                         [runs.encode(), str(self.id).encode()])
            else:
                pgconn.send_query_params(b"SELECT 1", None)
            pgconn.flush()
            deadline = time.monotonic() + LOST_AFTER
            while pgconn.is_busy():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Lost(f"no answer from the server in {LOST_AFTER:g} s")
                select.select([pgconn.socket], [], [], left)
                pgconn.consume_input()
            failed = None
            while (result := pgconn.get_result()) is not None:
                if result.error_message:
                    failed = _one_line(result.error_message.decode(errors="replace"))
            if failed or pgconn.status != 0:
                raise Lost(failed or "the session ended")
        except Lost:
            self._dirty = self._dirty or dirty
            raise
        except Exception as e:  # psycopg.OperationalError: the connection broke
            raise Lost(_one_line(e)) from None

    def _idle(self, seconds: float) -> None:
        """Wait ``seconds`` (less when poked) watching the socket: anything
        the server sends unasked on this session is its end."""
        pgconn = self._conn.pgconn
        ready, _, _ = select.select([pgconn.socket, self._wake_r], [], [], seconds)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        if pgconn.socket in ready:
            try:
                pgconn.consume_input()
            except Exception as e:
                raise Lost(_one_line(e)) from None
            if pgconn.status != 0:
                raise Lost("the session ended")

    def _fence(self, why: str) -> None:
        """Kill the runs under way, then let the session go, then say so."""
        self.live.clear()
        self.losses += 1
        with self._lock:
            runs = dict(self._runs)
            self.fenced.update(runs)
        killed = self._kill(None, None)
        conn, self._conn = self._conn, None
        try:
            conn.close()
        except Exception:
            pass
        self._log(f"worker={self.worker_id} lost its database session ({why}): killed {killed} processes of "
                  f"{len(runs)} runs; registering again")
        for callback in self._on_lost:
            try:
                callback(why)
            except Exception as e:
                self._log(f"worker={self.worker_id} on_lost callback failed: {e}")

    def _kill(self, job_id: str | None, entry: dict | None) -> int:
        """Kill the processes of one run (or of every run) of this worker:
        those that carry its SPOOLQ_WORKER (and the run's SPOOLQ_JOB_ID)."""
        owner = 0 if os.geteuid() == 0 else os.geteuid()
        if procs.boot_id() and self._proc_start is not None:
            run = None
            if job_id is not None:
                window = entry.get("spawned") if entry else None
                run = (job_id, entry.get("pgid") if entry else None, tuple(window) if window else None)
            return procs.kill_run(self.worker_id, procs.boot_id(), self._proc_start, owner, run)[0]
        markers = [f"SPOOLQ_WORKER={self.worker_id}"] + ([f"SPOOLQ_JOB_ID={job_id}"] if job_id else [])
        return procs.kill_marked(markers)


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
