"""The PostgreSQL spool as the storage port's ``Backend``: ``PgPort`` is
``PgBackend`` with what the facade, the read side and the worker loop ask
of every backend, in the port's signatures: the worker's pass verbs (a
claim is one query, so there is no pass to walk, no look-ahead and nothing
to read ahead), the plain commit pipeline (backend.PlainCommit: one COMMIT
for many finishes), and the read side's extras (an id's prefix, what waits
as a worker ends). Who may run workers is the database's roles and grants.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .. import config
from ..backend import Claim, CommitHooks, Look, PlainCommit
from ..errors import NotPossible, SpoolError
from ..ids import id_problem
from .backend import PgBackend, _translated

PREFIX_SHOWN = 10  # candidates named when an id prefix is ambiguous


class _Registration:
    """The liveness session's registration with the port's whole
    ``WorkerReg`` (what the directory spool notes lazily, it notes at once)."""

    def __init__(self, reg: Any):
        self._reg = reg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reg, name)

    def ensure_noted(self, job_id: str) -> None:
        pass  # noted when the run began

    def flush(self) -> None:
        pass


class PgPort(PgBackend):
    """A PostgreSQL spool behind the storage port."""

    def __init__(self, url: str):
        super().__init__(url)
        self.log = lambda text, level=0, severity=None: None

    # -- lifecycle and settings --------------------------------------------------

    def exists(self) -> bool:
        return self.missing() is None

    def missing(self) -> str | None:
        try:
            self.open()
        except SpoolError as e:
            return str(e)
        return None

    def settings_problem(self) -> str | None:
        return None  # settings are checked as they are stored

    def require_runner(self, action: str, command: str) -> None:
        pass  # who may claim and change jobs is the database's grants

    def require_shared_locks(self, forced: bool) -> None:
        pass  # liveness is each worker's database session, seen by every host

    def config_set(self, key: str, value: Any, on_dropped: Callable[[str], None] | None = None) -> Any:
        return super().config_set(config.setting_name(key), value)

    def config_unset(self, key: str, on_dropped: Callable[[str], None] | None = None) -> tuple[bool, str]:
        held = super().config_unset(key)
        name = config.setting_name(key)
        if not held and name != key:
            key, held = name, super().config_unset(name)
        if not held and key not in config.DEFAULTS:
            config.check(key, None)  # raises the unknown-key error
        return held, key

    # -- producers and reading ---------------------------------------------------

    def due_now(self) -> None:
        with _translated(self.location):
            self.open()
            self._conn("auto").execute("UPDATE spoolq.jobs SET at = now() WHERE state = 'new' AND at > now()")

    def counts(self, on_problem: Callable[[str], None] | None = None) -> dict[str, Any]:
        counts = super().counts()
        counts["paused"] = self.paused()
        return counts

    def control(self) -> Any:
        """The control channel (see control.py here)."""
        from .control import PgChannel

        self.open()
        return PgChannel(lambda: self._conn("auto"), self._connect)

    def live_output(self) -> Any:
        """spoolq.outputs, written by this worker's pump (see outputs.py)."""
        from .outputs import PgLiveSink

        return PgLiveSink(lambda: self._connect(synchronous_commit="off"),
                          lambda: self._reg.id if self._reg is not None else None, self.settings)

    def output(self, job_id: str, stream: str, offset: int, hold: bool = False) -> tuple[bytes, int] | None:
        """(``hold`` changes nothing: a follower reads a run's last bytes from its record.)"""
        from .outputs import read

        with _translated(self.location):
            self.open()
            return read(self._conn("auto"), job_id, stream, offset)

    def paused(self) -> dict[str, Any] | None:
        with _translated(self.location):
            return self.control().paused()

    def metrics(self, on_problem: Callable[[str], None] | None = None) -> dict[str, Any]:
        return super().metrics()

    def resolve(self, given: str, *args: Any, **kwargs: Any) -> str:
        """The id ``given`` stands for: itself when a job has it (or it is
        no valid id), else the one id that begins with it."""
        if not given or id_problem(given) or self.has_id(given):
            return given
        with _translated(self.location):
            rows = self._conn("auto").execute(
                "SELECT id FROM spoolq.jobs WHERE id LIKE %s ORDER BY id LIMIT %s",
                (given.replace("_", r"\_") + "%", PREFIX_SHOWN + 1)).fetchall()
        if len(rows) == 1:
            return rows[0][0]
        if len(rows) > 1:
            shown = ", ".join(r[0] for r in rows[:PREFIX_SHOWN]) + (", ..." if len(rows) > PREFIX_SHOWN else "")
            raise NotPossible(f"{given} is the start of several ids: {shown}")
        return given

    def leftovers(self) -> dict[str, Any]:
        with _translated(self.location):
            failed, next_retry, dead = self._conn("auto").execute(
                "SELECT count(*) FILTER (WHERE state = 'failed'), extract(epoch FROM min(at) FILTER (WHERE state = 'failed'))::float8, "
                "count(*) FILTER (WHERE state = 'dead' AND NOT purged) FROM spoolq.jobs").fetchone()
        return {"failed": failed, "next_retry": next_retry, "dead": dead}

    def complete_ids(self, states: tuple[str, ...], prefix: str) -> list[str]:
        return []  # (no database round trip for a shell's TAB)

    # -- the worker ----------------------------------------------------------------

    def register(self, kinds: list[str] | None = None, tuning: Any = None) -> Any:  # type: ignore[override]
        return _Registration(super().register(kinds))

    def next_look(self) -> Look:
        due = self.next_due()
        return Look(due=None if due is None else time.time() + due, busy=self.claims.busy)

    def look_ahead(self) -> None:
        pass  # a claim is one query: nothing to prepare

    def drop_ahead(self) -> None:
        pass

    def where(self, claim: Claim) -> str:
        return "cur"  # (a claimed job is shown as running, in cur, as a directory's)

    def committer(self, hooks: CommitHooks, seconds: float) -> PlainCommit:
        return PlainCommit(self, hooks, seconds)

    def housekeeping(self, settle: Callable[[], None]) -> None:  # type: ignore[override]
        report = super().housekeeping()
        if report is not None and (report.recovered or report.dead):
            self.log(f"recovered: failed={report.recovered} dead={report.dead} killed={report.killed}", 0, None)

    def count_workers(self) -> int:
        return len(self.live_workers())

    def stop_work(self) -> None:
        pass  # (the registration, closed by the worker, ends the liveness session)
