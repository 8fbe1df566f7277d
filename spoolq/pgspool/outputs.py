"""Running jobs' output in a PostgreSQL spool: ``spoolq.outputs``, a row
per stream of each running job holding its latest log_limit bytes, so that
``spoolq logs`` follows a job from any host.

The worker's pump (liveout.py) puts what is new every quarter second;
each round is one transaction that rewrites the rows of the jobs that
wrote something, only while the job is still this worker's run, and
notifies ``spoolq_output`` with each job's id. A row goes when its job
leaves the running state, whatever moves it (a trigger: the finish, a
cancel, a recovery, in their own transactions); a recovery also removes
rows whose job no longer runs (a worker cut off mid-round).
"""

from __future__ import annotations

from typing import Any, Callable

OUTPUT = "spoolq_output"

PUT = """INSERT INTO spoolq.outputs (id, stream, start, data)
SELECT %(id)s, %(stream)s, %(start)s, %(data)s
WHERE EXISTS (SELECT 1 FROM spoolq.jobs WHERE id = %(id)s AND state = 'running' AND worker = %(worker)s)
ON CONFLICT (id, stream) DO UPDATE SET start = excluded.start, data = excluded.data"""

ORPHANS = """DELETE FROM spoolq.outputs o
WHERE NOT EXISTS (SELECT 1 FROM spoolq.jobs j WHERE j.id = o.id AND j.state = 'running')"""


class PgLiveSink:
    """backend.LiveSink over spoolq.outputs (a connection of its own: the
    pump's thread)."""

    def __init__(self, connect: Callable[[], Any], worker: Callable[[], int | None], settings: Any):
        """``connect()``: a new connection; ``worker()``: the id of this
        worker's registration row (its claims' ``worker``)."""
        self._connect = connect
        self._worker = worker
        self._settings = settings
        self._conn: Any = None
        self._tails: dict[tuple[str, str], list[Any]] = {}  # (job, stream) -> [start, bytearray]
        self._pending: dict[tuple[str, str], dict[str, Any]] = {}

    def put(self, job_id: str, stream: str, start: int, data: bytes) -> None:
        key = (job_id, stream)
        tail = self._tails.get(key)
        if tail is None or tail[0] + len(tail[1]) != start:
            tail = self._tails[key] = [start, bytearray(data)]
        else:
            tail[1] += data
        limit = int(self._settings["log_limit"])
        if len(tail[1]) > limit:
            cut = len(tail[1]) - limit
            tail[0] += cut
            del tail[1][:cut]
        self._pending[key] = {"id": job_id, "stream": stream, "start": tail[0], "data": bytes(tail[1])}

    def told(self, job_ids: list[str]) -> None:
        pending, self._pending = list(self._pending.values()), {}
        if not pending:
            return
        worker = self._worker()
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self._connect()
        with self._conn.transaction():
            with self._conn.cursor() as cur:
                cur.executemany(PUT, [dict(row, worker=worker) for row in pending])
                for job_id in sorted({row["id"] for row in pending}):
                    cur.execute("SELECT pg_notify(%s, %s)", (OUTPUT, job_id))

    def remove(self, job_id: str) -> None:
        """(Its rows go with the job's finish: see the module's docstring.)"""
        for stream in ("stdout", "stderr"):
            self._tails.pop((job_id, stream), None)
            self._pending.pop((job_id, stream), None)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def read(conn: Any, job_id: str, stream: str, offset: int, most: int = 1 << 20) -> tuple[bytes, int] | None:
    """What is kept of a running job's stream from ``offset`` on (see Backend.output)."""
    row = conn.execute("SELECT start, data FROM spoolq.outputs WHERE id = %s AND stream = %s",
                       (job_id, stream)).fetchone()
    if row is None:
        return None
    start, data = int(row[0]), bytes(row[1])
    end = start + len(data)
    begin = min(max(offset, start), end)
    chunk = data[begin - start:begin - start + most]
    return chunk, begin + len(chunk)
