"""``PgBackend``: a spool in a PostgreSQL database, with the verbs of the
storage port (docs/postgres.md; the port's interface is what the facade,
the read side and the worker call).

It owns the connections (opened when first needed, opened again when
broken) and turns database errors into spoolq's: a role without the
grants gets one line saying so, a server out of reach ``Unavailable``. The
work is done by the modules beside it: schema (init), settings, moves
(enqueue, cancel, retry, retention), reads, claims (the worker's claims,
finishes and group commit), liveness (registration and self-fencing),
recovery and waker.

A worker process uses four connections: claims, finishes, its liveness
session and (watching) its LISTEN; a command uses one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator

from ..backend import Look, PlainCommit
from ..errors import ConfigError, SpoolError
from . import moves, ordering, reads, recovery, schema
from .claims import Claims
from .connect import connect, first_line, is_url, psycopg_module, without_password
from .liveness import PgWorkerReg
from .settings import PgSettings, load, put, remove, stored
from .types import Claim, Finished, Report, Unavailable
from .waker import PgWaker

RECOVER_EVERY = 2.0  # seconds between the recoveries a worker runs as housekeeping


@contextlib.contextmanager
def _translated(location: str) -> Iterator[None]:
    """Database errors as spoolq's: one line, naming the spool."""
    psycopg = psycopg_module()
    try:
        yield
    except psycopg.errors.InsufficientPrivilege as e:
        raise SpoolError(f"{location}: {first_line(e)} (see docs/postgres.md for the roles and their grants)") from None
    except psycopg.OperationalError as e:
        raise Unavailable(f"{location}: {first_line(e)}") from None
    except psycopg.Error as e:
        raise SpoolError(f"{location}: {first_line(e)}") from None


def _db(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self: "PgBackend", *args: Any, **kwargs: Any) -> Any:
        with _translated(self.location):
            return method(self, *args, **kwargs)

    return wrapper


class PgBackend:
    """One PostgreSQL spool, as the port sees it."""

    durable_claims = False  # a claim is not waited on for durability (see claims.py)

    def __init__(self, url: str):
        if not is_url(url):
            raise ValueError(f"{url!r} is not a postgresql:// URL")
        self.url = url
        self.location = without_password(url)  # the only form of it ever shown
        self.log: Callable[..., None] = lambda text, level=0, severity=None: None
        self._conns: dict[str, Any] = {}
        self._conn_lock = threading.Lock()
        self.settings = PgSettings(self.location, lambda: self._conn("auto"))
        self.settings.on_load(self._settings_loaded)
        self._reg: PgWorkerReg | None = None
        self.claims = Claims(self._conn, self.settings, lambda: self._reg)
        self._last_recovery = 0.0
        self._checked = False  # the schema was found and is of this version

    def __repr__(self) -> str:
        return f"PgBackend({self.location!r})"

    # -- connections and lifecycle -------------------------------------------

    def _connect(self, synchronous_commit: str | None = None) -> Any:
        return connect(self.url, synchronous_commit=synchronous_commit)

    def _conn(self, name: str, fresh: bool = False) -> Any:
        """The connection for ``name``: ``auto`` (commands and reads),
        ``claim`` (claims: their commits not waited on) or ``finish`` (the
        group commit: waited on when fsync is on). All in autocommit mode:
        what needs a transaction opens one."""
        with self._conn_lock:
            conn = self._conns.get(name)
            if conn is not None and not fresh and not conn.closed and not conn.broken:
                return conn
            if conn is not None:
                conn.close()
            if name == "claim":
                conn = self._connect(synchronous_commit="off")
            else:
                conn = self._connect(synchronous_commit=None if self._fsync() else "off")
            self._conns[name] = conn
            return conn

    def _fsync(self) -> bool:
        return bool(self.settings["fsync"]) if self.settings.loaded else True

    def _settings_loaded(self, settings: Any) -> None:
        for name in ("auto", "finish"):
            conn = self._conns.get(name)
            if conn is not None and not conn.closed:
                try:
                    conn.execute(f"SET synchronous_commit = {'on' if settings['fsync'] else 'off'}")
                except psycopg_module().Error:
                    conn.close()  # opened again, with the setting, when next needed

    @property
    def durable(self) -> bool:
        """Whether a finish needs ``commit`` before its outcome may be told
        (always: a finish is a pending transaction until then)."""
        return True

    @_db
    def open(self, create: bool = False) -> None:
        """Check the database holds a spool (with ``create``: make the
        schema if it has none) and load the settings."""
        if not self._checked:
            conn = self._conn("auto")
            if create and schema.installed_version(conn) is None:
                schema.init(conn, self.location)
            schema.check(conn, self.location)
            self._checked = True
        if not self.settings.loaded:
            self.settings.reload()

    def close(self) -> None:
        with self._conn_lock:
            conns, self._conns = self._conns, {}
        for conn in conns.values():
            with contextlib.suppress(Exception):
                conn.close()

    @_db
    def init(self, group: str | None = None) -> list:
        """Make the schema (idempotent; brings an older one up to date) and
        grant spoolq's roles what they may do. Returns [] (no folder modes)."""
        if group is not None:
            raise ConfigError("a PostgreSQL spool has no group: who may do what is the database's roles and "
                              "grants (see docs/postgres.md)")
        schema.init(self._conn("auto"), self.location)
        self.settings.reload()
        return []

    # -- settings ------------------------------------------------------------

    @_db
    def config_set(self, key: str, value: Any) -> Any:
        self.open()
        checked = put(self._conn("auto"), key, value)
        self.settings.loaded = False
        return checked

    @_db
    def config_unset(self, key: str) -> bool:
        self.open()
        found = remove(self._conn("auto"), key)
        self.settings.loaded = False
        return found

    @_db
    def config_list(self) -> dict[str, Any]:
        self.open()
        return load(self._conn("auto"), self.location)

    @_db
    def config_stored(self) -> dict[str, Any]:
        self.open()
        return stored(self._conn("auto"))

    # -- producers -------------------------------------------------------------

    @_db
    def enqueue(self, jobs: list[tuple[str, Any, float | None]], existing_ok: bool = False,
                on_existing: Callable[[str, str], None] | None = None) -> list[str]:
        """One durable batch of (id, record, due epoch or None); see moves.enqueue."""
        self.open(create=True)
        return moves.enqueue(self._conn("auto"), jobs, existing_ok, on_existing)

    @_db
    def has_id(self, job_id: str) -> bool:
        self.open()
        return self._conn("auto").execute("SELECT 1 FROM spoolq.jobs WHERE id = %s", (job_id,)).fetchone() is not None

    # -- reading ---------------------------------------------------------------

    @_db
    def get(self, job_id: str) -> dict | None:
        self.open()
        return reads.get(self._conn("auto"), job_id, self.settings["lock_limits"])

    @_db
    def ids_with_prefix(self, prefix: str, states: tuple[str, ...] | None = None, limit: int = 11) -> list[str]:
        """Up to ``limit`` ids (of jobs in ``states``, the shown names;
        None: any) that begin with ``prefix``, in order."""
        self.open()
        return reads.ids_with_prefix(self._conn("auto"), prefix, states, limit)

    def list(self, state: str | None = None, limit: int | None = None, since: float | None = None) -> Iterator[dict]:
        with _translated(self.location):
            self.open()
            yield from reads.listing(self._conn("auto"), state, limit, since, self.settings["lock_limits"])

    @_db
    def counts(self, on_problem: Callable[[str], None] | None = None) -> dict[str, Any]:
        self.open()
        return reads.counts(self._conn("auto"))

    @_db
    def recent(self, state: str, limit: int) -> list[dict]:
        self.open()
        return reads.recent(self._conn("auto"), state, limit)

    @_db
    def live_workers(self) -> list[dict]:
        self.open()
        return reads.live_workers(self._conn("auto"))

    @_db
    def stats(self, since: float | None = None) -> dict[str, Any]:
        self.open()
        return reads.stats(self._conn("auto"), since)

    @_db
    def metrics(self, on_problem: Callable[[str], None] | None = None) -> dict[str, Any]:
        self.open()
        return reads.metrics(self._conn("auto"))

    # -- operator moves --------------------------------------------------------

    @_db
    def cancel(self, job_id: str, on_note: Callable[[str], None] | None = None) -> None:
        self.open()
        moves.cancel(self._conn("auto"), job_id)

    @_db
    def retry(self, job_id: str, on_note: Callable[[str], None] | None = None) -> None:
        self.open()
        moves.retry(self._conn("auto"), job_id, self.settings)

    @_db
    def retry_all(self, on_problem: Callable[[str], None] | None = None,
                  on_note: Callable[[str], None] | None = None) -> list[str]:
        self.open()
        return moves.retry_all(self._conn("auto"), self.settings, on_problem)

    @_db
    def hold(self, job_id: str) -> None:
        """A waiting job held: never claimed until released."""
        self.open()
        ordering.hold(self._conn("auto"), job_id, moves.held_row)

    @_db
    def release_held(self, job_id: str, now: bool = False) -> str:
        """A held job waiting again, due when it was (``now``: due now);
        returns the state it is in now."""
        self.open()
        return ordering.release(self._conn("auto"), job_id, now, moves.held_row)

    @_db
    def compact(self, keep: float | None = None) -> dict[str, Any]:
        self.open()
        return moves.compact(self._conn("auto"), keep)

    @_db
    def purge_dead(self, older_than: float) -> dict[str, int]:
        self.open()
        return moves.purge_dead(self._conn("auto"), older_than)

    @_db
    def sweep(self) -> Report:
        """Recovery alone, waiting out the grace of workers lost just now."""
        self.open()
        return recovery.recover(self._conn("auto"), self.settings, wait=True)

    # -- the worker --------------------------------------------------------------

    @_db
    def register(self, kinds: Any = None, worker_id: str | None = None) -> PgWorkerReg:
        """This worker's registration (its liveness session); the claims
        made from now on are under it, and take handler jobs only of
        ``kinds`` (None: every kind)."""
        self.open()
        reg = PgWorkerReg(lambda: self._connect(), worker_id, log=self.log, kinds=kinds)
        reg.open()
        self._reg = reg
        return reg

    def waker(self, poll: float | None = None, log: Any = None) -> PgWaker:
        """What wakes a waiting worker: LISTEN/NOTIFY (``poll`` adds nothing:
        the worker's rescans are timed by its rescan interval). ``log``: the
        worker's log (its ``line``) or a port Log, else this backend's."""
        line = getattr(log, "line", None) or log or self.log
        return PgWaker(lambda: self._connect(), log=lambda text: line(text, 0, logging.WARNING))

    @_db
    def recover(self) -> Report:
        """Recover the jobs of workers dead for longer than the grace."""
        self.open()
        self._last_recovery = time.monotonic()
        report = recovery.recover(self._conn("auto"), self.settings)
        ordering.release_stuck(self._conn("auto"))
        return report

    def housekeeping(self, settle: Callable[[], None] | None = None) -> Report | None:
        """Between passes: a recovery every RECOVER_EVERY seconds, so a dead
        worker's jobs do not wait for the next worker to start (``settle``:
        the worker's pending finishes, which recovery does not need)."""
        if time.monotonic() - self._last_recovery < RECOVER_EVERY:
            return None
        try:
            return self.recover()
        except SpoolError as e:
            self.log(f"recovery failed: {e}")
            return None

    def claim_next(self, now: float | None = None) -> Claim | None:
        """The first due job (due by the database's clock), now this worker's."""
        with _translated(self.location):
            return self.claims.claim_next()

    def next_look(self) -> Look:
        """When to look again after ``claim_next`` gave nothing: when the
        next job this worker can run is due (epoch seconds, by this host's
        clock from the database's distance to it)."""
        due = self.next_due()
        return Look(due=time.time() + due if due is not None else None, busy=self.claims.busy)

    def look_ahead(self) -> None:
        """Nothing to prepare: a claim is one statement."""

    def drop_ahead(self) -> None:
        """Nothing prepared to let go."""

    def where(self, claim: Claim) -> str:
        """The state the claim's job is in now, as users see it."""
        job = self.get(claim.job_id)
        return job["state"] if job is not None else "gone"

    def committer(self, hooks: Any, seconds: float) -> PlainCommit:
        """The worker's group commit: ``commit`` writes every pending finish in one statement."""
        return PlainCommit(self, hooks, seconds)

    @_db
    def exists(self) -> bool:
        """Whether the database holds a spoolq schema."""
        return schema.installed_version(self._conn("auto")) is not None

    @_db
    def count_workers(self) -> int:
        return len(reads.live_workers(self._conn("auto")))

    def next_due(self) -> float | None:
        with _translated(self.location):
            return self.claims.next_due()

    def finish(self, claim: Claim, outcome: Any, worker_id: str) -> Finished:
        with _translated(self.location):
            return self.claims.finish(claim, outcome, worker_id)

    def commit(self, finished: list[Finished] | None = None) -> None:
        with _translated(self.location):
            self.claims.commit()

    def unclaim(self, claim: Claim) -> str:
        with _translated(self.location):
            return self.claims.unclaim(claim)

    def release(self, claim: Claim) -> None:
        """Nothing to let go: a claim is taken whole or not at all."""
