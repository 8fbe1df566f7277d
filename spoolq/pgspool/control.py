"""The PostgreSQL spool's side of job control: requests into live workers
as rows of ``spoolq.requests`` (each followed by ``NOTIFY
spoolq_control``), the pause as the row of ``spoolq.paused``, and the
notifications waiters listen to: ``spoolq_finished`` (a trigger sends it
with the job's id whenever a job becomes done or dead, at commit) and
``spoolq_workers`` (a registration removed).

Who may send requests is the database's grants: the ``spoolq_worker``
role (as for cancel) anything; a ``spoolq_producer`` kills or cancels only
the running jobs it enqueued, through ``spoolq.request_kill`` (grants.sql),
which checks that. A run is signalled only by the worker running it.
A watch is a connection of its own in LISTEN; waiting on it is a
``select()`` on its socket: no polling, no lock held.
"""

from __future__ import annotations

import contextlib
import json
import select
import time
from typing import Any, Callable, Iterator

from ..errors import JobNotFound, NotPossible, SpoolError
from .connect import first_line, psycopg_module
from .outputs import OUTPUT  # a running job's output was pushed
from .waker import CHANNEL

CONTROL = "spoolq_control"
FINISHED = "spoolq_finished"
WORKERS = "spoolq_workers"
JOBS = CHANNEL  # every enqueue, retry and failure due now (what wakes workers)
CHANNELS = {"control": (CONTROL,), "finished": (FINISHED,), "workers": (WORKERS,), "states": (FINISHED,),
            "output": (OUTPUT,), "view": (JOBS, FINISHED, CONTROL, WORKERS)}  # view: what a live view shows (enqueues, finishes, pause, workers)
#: A worker that dies without removing its registration sends nothing: a
#: watch of workers looks again this often.
WORKERS_LOOK = 1.0


REFUSED = ("permission denied: stop, pause and resume are for worker roles and the spool's owner "
           "(a producer kills or cancels only its own running jobs; see docs/postgres.md)")


@contextlib.contextmanager
def _refused() -> Iterator[None]:
    """A request this role may not send, as one line."""
    try:
        yield
    except psycopg_module().errors.InsufficientPrivilege:
        raise SpoolError(REFUSED) from None


class PgChannel:
    """The control channel of one PostgreSQL spool (see control.Channel)."""

    member = False  # the database's grants decide who may send what

    def __init__(self, conn: Callable[[], Any], connect: Callable[[], Any]):
        """``conn()``: the backend's connection for commands (autocommit);
        ``connect()``: a new connection, for a watch's LISTEN."""
        self._conn = conn
        self._connect = connect

    def send(self, request: dict[str, Any]) -> str:
        body = json.dumps(dict(request, at=time.time()))
        conn = self._conn()
        psycopg = psycopg_module()
        try:
            with conn.transaction():
                token = conn.execute("INSERT INTO spoolq.requests (body) VALUES (%s::jsonb) RETURNING id",
                                     (body,)).fetchone()[0]
                conn.execute(f"NOTIFY {CONTROL}")
        except psycopg.errors.InsufficientPrivilege:
            if request.get("request") != "kill":
                raise SpoolError(REFUSED) from None
            return self._producers_kill(request)
        return str(token)

    def _producers_kill(self, request: dict[str, Any]) -> str:
        """A producer's kill of its own running job: the database checks
        that the job is the caller's (spoolq.request_kill) and writes it."""
        psycopg = psycopg_module()
        try:
            conn = self._conn()
            with conn.transaction():
                return str(conn.execute("SELECT spoolq.request_kill(%s, %s, %s)",
                                        (request["id"], request.get("attempt"), request.get("signal"))).fetchone()[0])
        except psycopg.errors.NoDataFound as e:
            raise JobNotFound(first_line(e)) from None
        except psycopg.errors.UndefinedFunction:
            raise SpoolError("this spool's database has no spoolq.request_kill, which lets a producer kill its own "
                             "jobs: the spool's owner adds it by running spoolq init again") from None
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.RaiseException) as e:
            raise NotPossible(first_line(e)) from None

    def requests(self) -> list[tuple[str, dict[str, Any]]]:
        rows = self._conn().execute("SELECT id, body FROM spoolq.requests ORDER BY id").fetchall()
        return [(str(token), body) for token, body in rows if isinstance(body, dict)]

    def done(self, token: str) -> None:
        """Remove a request; its sender, waiting on the control channel, is
        told. (A producer's request that no worker took stays for the
        workers to remove as stale: it may not delete rows.)"""
        conn = self._conn()
        try:
            with conn.transaction():
                if conn.execute("DELETE FROM spoolq.requests WHERE id = %s", (int(token),)).rowcount:
                    conn.execute(f"NOTIFY {CONTROL}")
        except psycopg_module().errors.InsufficientPrivilege:
            pass

    def pending(self, token: str) -> bool:
        return self._conn().execute("SELECT EXISTS (SELECT 1 FROM spoolq.requests WHERE id = %s)",
                                    (int(token),)).fetchone()[0]

    def paused(self) -> dict[str, Any] | None:
        row = self._conn().execute("SELECT by_user, extract(epoch FROM at) FROM spoolq.paused").fetchone()
        return None if row is None else {"by": row[0], "at": float(row[1])}

    def set_paused(self, info: dict[str, Any] | None) -> bool:
        conn = self._conn()
        with _refused(), conn.transaction():
            if info is None:
                changed = conn.execute("DELETE FROM spoolq.paused").rowcount > 0
            else:
                changed = conn.execute("INSERT INTO spoolq.paused (by_user) VALUES (%s) ON CONFLICT DO NOTHING",
                                       (str(info.get("by", "?")),)).rowcount > 0
            if changed:
                conn.execute(f"NOTIFY {CONTROL}")
        return changed

    def require_owner(self, action: str) -> None:
        """(The database's grants decide: a role without them is refused there.)"""

    def ask(self, request: dict[str, Any], what: str) -> Any:
        raise NotImplementedError("a PostgreSQL spool has no members")

    def interrupt(self) -> None:
        """Wake the listeners (one told to stop; the others look, find nothing new)."""
        self._conn().execute(f"NOTIFY {CONTROL}")

    def release(self) -> None:
        """(Nothing held between looks: the backend's connection stays.)"""

    def answer(self) -> None:
        """(No members' requests to answer: they send their own rows.)"""

    def watch(self, *kinds: str) -> "PgWatch":
        conn = self._connect()
        try:
            for channel in sorted({name for kind in kinds for name in CHANNELS[kind]}):
                conn.execute(f"LISTEN {channel}")
        except BaseException:
            conn.close()
            raise
        return PgWatch(conn, "workers" in kinds or "view" in kinds)


class PgWatch:
    """Notifications on a LISTENing connection: ``read(timeout)`` gives
    their payloads (job ids for finishes), an empty set when the time ran
    out first. A broken connection is raised."""

    def __init__(self, conn: Any, workers: bool):
        self.conn = conn
        self._workers = workers

    def fileno(self) -> int:
        return self.conn.pgconn.socket

    def read(self, timeout: float | None) -> set[str] | None:
        pgconn = self.conn.pgconn
        found = self._take(pgconn)
        if found:
            return found
        if self._workers:
            timeout = WORKERS_LOOK if timeout is None else min(timeout, WORKERS_LOOK)
        ready, _, _ = select.select([pgconn.socket], [], [], None if timeout is None else max(0.0, timeout))
        if ready:
            pgconn.consume_input()
            if pgconn.status != 0:
                raise ConnectionError("the connection to the spool's database ended")
        return self._take(pgconn)

    @staticmethod
    def _take(pgconn: Any) -> set[str]:
        found: set[str] = set()
        while (note := pgconn.notifies()) is not None:
            found.add(note.extra.decode("utf-8", "replace"))
        return found

    def close(self) -> None:
        self.conn.close()
