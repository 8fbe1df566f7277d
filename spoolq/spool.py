"""``Spool``: the one core that the command line and Python programs share.

Every ``spoolq`` command is a thin wrapper around a method here, so the CLI
and the API cannot drift apart::

    q = Spool("/var/spool/app")
    job_id = q.enqueue(command="make report")
    q.work(handlers={"send_email": send_email})

The spool itself is a backend behind the storage port (backend.py): a
directory (spoolq/dirspool/) or, for a ``postgresql://`` location, a
PostgreSQL database (spoolq/pgspool/). This module alone picks one; what
it does itself is what every backend shares: a job's validation and
shape, and running workers.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterator, Mapping

from . import config, record
from .errors import (  # noqa: F401 - importable from here too
    DuplicateId,
    Exists,
    InvalidJob,
    JobNotFound,
    NotPossible,
    PartlyEnqueued,
    RequestPending,
    SpoolError,
)
from .backend import Unavailable
from .ids import id_problem, new_id
from .owners import swappable, user_name
from .follow import Logs
from .jobcontrol import JobControl

#: What ``pip`` installs for a PostgreSQL spool.
POSTGRES_EXTRA = "pip install 'spoolq[postgres]'"


def open_backend(location: str) -> Any:
    """The backend for a location: a PostgreSQL spool for a
    ``postgresql://`` or ``postgres://`` URL, else a spool directory."""
    if location.startswith(("postgresql://", "postgres://")):
        from .pgspool import PgPort, is_url  # imported here: only a PostgreSQL spool needs it

        if is_url(location):
            return PgPort(location)
    from .dirspool.backend import DirBackend  # imported here: start-up speed of the other kind

    return DirBackend(location)


class Spool(JobControl, Logs):
    """A spool: enqueue, inspect, cancel, retry and run jobs.

    ``Spool()`` uses ``$SPOOLQ_DIR``, else ``./spool``: a directory path, or
    a ``postgresql://`` URL. Nothing is created until a method that writes
    needs it.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        if path is None:
            path = os.environ.get("SPOOLQ_DIR") or "spool"
        if os.fspath(path) == "":
            raise ValueError("the spool path is empty")
        self.backend = open_backend(os.fspath(path))
        self.location: str = self.backend.location  # a URL without its password
        self.path = self.location

    def __repr__(self) -> str:
        return f"Spool({self.location!r})"

    # -- settings ----------------------------------------------------------

    @property
    def settings(self) -> Any:
        """The spool's settings over the defaults: one holder, shared with
        the worker, whose reload reaches every reader."""
        return self.backend.settings

    def config_get(self, key: str) -> Any:
        key = config.setting_name(key)
        if key not in config.DEFAULTS:
            config.check(key, None)  # raises the unknown-key error
        return self.settings[key]

    def config_set(self, key: str, value: Any, on_dropped: Callable[[str], None] | None = None) -> Any:
        """Validate and store one setting; returns the stored value. Stored
        settings that do not parse (an unknown key, a bad value) are
        repaired on the way, each told to ``on_dropped``."""
        return self.backend.config_set(key, value, on_dropped)

    def config_unset(self, key: str, on_dropped: Callable[[str], None] | None = None) -> tuple[bool, str]:
        """Remove one stored setting (its default applies again); returns
        whether it was stored, and the name it went by."""
        return self.backend.config_unset(key, on_dropped)

    def setting_name(self, key: str) -> str:
        """A setting's name as a command may spell it, as it is stored."""
        return config.setting_name(key)

    def config_default(self, key: str) -> Any:
        """A setting's default (None for a key spoolq does not know)."""
        return config.DEFAULTS.get(key)

    def config_list(self) -> dict[str, Any]:
        return self.backend.config_list()

    def default_app(self) -> str | None:
        """The handlers a worker loads when it is given none (the ``app``
        setting), or None. Importing a module runs its code, so the user
        who may not run workers here is refused before anything is
        imported (see the backend's require_runner)."""
        self.backend.require_runner("run workers on it", "work")
        app = self.settings["app"]
        return app or None

    def exists(self) -> bool:
        """Whether the spool is there (made by ``init`` or a first write)."""
        return self.backend.exists()

    # -- layout ------------------------------------------------------------

    def init(self, group: str | None = None) -> list[str]:
        """Make the spool (idempotent); ``group`` makes a shared spool
        directory. Returns what it changed in an existing spool, a line each."""
        return self.backend.init(group=group)

    # -- enqueue -----------------------------------------------------------

    def _prepare(self, fields: Mapping[str, Any], now: float) -> tuple[str, bytes, float | None]:
        fields = dict(fields)
        job_id = fields.get("id")
        if job_id is None:
            job_id = new_id()
        else:
            problem = id_problem(job_id)
            if problem:
                raise InvalidJob(problem)
        cwd = fields.get("cwd")
        if isinstance(cwd, str) and cwd and "\x00" not in cwd:
            if not os.path.isabs(cwd):
                # Relative to the enqueuer's directory: a worker runs elsewhere.
                fields["cwd"] = os.path.abspath(cwd)
            if fields.get("kind") is None and not os.path.isdir(fields["cwd"]):
                # Caught now, not five retries later: a missing directory does not come back.
                what = "is not a directory" if os.path.exists(fields["cwd"]) else "does not exist"
                raise InvalidJob(f"cwd {fields['cwd']} {what}")
        run_at = fields.get("run_at")
        due = None
        if run_at is not None:
            if hasattr(run_at, "timestamp"):
                run_at = run_at.timestamp()
            try:
                when = record.parse_time(run_at)
            except ValueError as e:
                raise InvalidJob(f"run_at: {e}") from None
            fields["run_at"] = record.rfc3339(when)
            if when > now:
                due = when
        job = record.new_job(fields, job_id, now)
        problem = config.refusal(self.settings, job)
        if problem:
            raise InvalidJob(problem)
        data = record.serialise(job)
        limit = int(self.settings["max_job_bytes"])
        if len(data) > limit:
            raise InvalidJob(f"the job is {len(data)} bytes, larger than max_job_bytes ({limit})")
        return job_id, data, due

    def _check_unique(self, job_id: str) -> None:
        where = self.backend.has_id(job_id)
        if where:
            raise DuplicateId(f"id {job_id} is already in {where if isinstance(where, str) else 'the spool'}")

    def enqueue(
        self,
        command: str | None = None,
        *,
        argv: list[str] | None = None,
        kind: str | None = None,
        payload: Any = None,
        id: str | None = None,
        max_attempts: int | None = None,
        timeout: float | None = None,
        run_at: Any = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        **extra: Any,
    ) -> str:
        """Enqueue one job and return its id once it durably waits.

        Exactly one of ``command`` (run by /bin/sh -c), ``argv`` (run directly)
        or ``kind`` (a Python handler) is required. ``run_at`` (epoch seconds,
        an RFC 3339 string or a datetime) delays it. A relative ``cwd`` is
        made absolute here; without one the job runs in its user's home
        directory. Raises InvalidJob for a bad job and DuplicateId for an id
        already in the spool.
        """
        fields = dict(extra)
        fields.update(
            command=command, argv=argv, kind=kind, payload=payload, id=id,
            max_attempts=max_attempts, timeout=timeout, run_at=run_at,
            env=dict(env) if env is not None else None, cwd=cwd,
        )
        return self.enqueue_job(fields)

    def enqueue_job(self, fields: Mapping[str, Any], on_existing: Callable[[str], None] | None = None) -> str:
        """Enqueue a whole job object (the form of a job file). A job with
        a ``unique`` key an unfinished job holds adds nothing: that job's id
        is returned (and told to ``on_existing``)."""
        self.backend.open(create=True)
        job_id, data, due = self._prepare(fields, time.time())
        if fields.get("id") is not None:
            self._check_unique(job_id)
        told = None if on_existing is None else (lambda asked, holder: on_existing(holder))
        return self.backend.enqueue([(job_id, data, due)], on_existing=told)[0]

    def enqueue_many(self, jobs: list[Mapping[str, Any]]) -> list[str]:
        """Enqueue many jobs with one sync for the lot (group commit).

        Every job is validated first; if one is invalid nothing is enqueued
        (InvalidJob names its position). Returns the ids in order. Should
        the disk fail part way (or a duplicate id turn up at the last
        step), PartlyEnqueued says which jobs were enqueued."""
        self.backend.open(create=True)
        now = time.time()
        items = []
        seen: set[str] = set()
        for i, fields in enumerate(jobs):
            if not isinstance(fields, Mapping):
                raise InvalidJob(f"job {i + 1}: not a JSON object")
            try:
                job_id, data, due = self._prepare(fields, now)
                if fields.get("id") is not None:
                    if job_id in seen:
                        raise DuplicateId(f"id {job_id} appears twice")
                    self._check_unique(job_id)
            except (InvalidJob, DuplicateId) as e:
                raise type(e)(f"job {i + 1}: {e}") from None
            seen.add(job_id)
            items.append((job_id, data, due))
        if not items:
            return []
        return self.backend.enqueue(items)

    # -- looking -----------------------------------------------------------

    def get(self, job_id: str) -> dict[str, Any] | None:
        """The job's record with ``state`` set (``new``, ``cur``, ``failed``,
        ``dead``, ``done``), finished jobs' history included; None if there
        is no such job."""
        return self.backend.get(job_id)

    def resolve(self, given: str, *args: Any, **kwargs: Any) -> str:
        """The id ``given`` stands for: itself when a job has it, else the
        one id that begins with it (NotPossible names the candidates when
        several do)."""
        return self.backend.resolve(given, *args, **kwargs)

    def list(self, state: str | None = None, limit: int | None = None, since: float | None = None) -> Iterator[dict[str, Any]]:
        """Records oldest first, by due or finish time. ``state`` picks one
        state; done includes the history of finished jobs."""
        return self.backend.list(state, limit, since)

    def status(self, on_problem: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Counts per state (``done`` includes the history), jobs whose
        worker died (``abandoned``) and live workers; what cannot be read is
        skipped and told to ``on_problem``. A spool a relay moves jobs
        out of (its ``relay_to`` setting) also says how many wait to be
        relayed and since when (``relay``)."""
        counts = self.backend.counts(on_problem)
        to = self.settings.get("relay_to") if self.backend.exists() else None
        if to:
            counts["relay"] = self._relay_backlog(to, counts)
        return counts

    def _relay_backlog(self, to: str, counts: dict[str, Any]) -> dict[str, Any]:
        """Jobs waiting to be relayed (waiting, failed or being sent) and the
        creation time of the oldest of them."""
        oldest = None
        for state in ("new", "failed", "cur"):
            for job in self.backend.list(state, limit=1):
                created = job.get("created_at") or job.get("mtime")
                if created and (oldest is None or created < oldest):
                    oldest = created
        waiting = counts["new"] + counts["failed"] + counts["cur"]
        return {"to": to, "waiting": waiting, "since": oldest if waiting else None}

    def stats(self, since: float | None = None) -> dict[str, Any]:
        """Finished jobs, throughput, wait time (due to start) and run time
        (p50, p95, max) in total and per kind or program. ``since``: epoch seconds."""
        return self.backend.stats(since)

    def metrics(self, on_problem: Callable[[str], None] | None = None) -> dict[str, Any]:
        """What ``status --prometheus`` shows (see metrics.py)."""
        return self.backend.metrics(on_problem)

    def view(self, interval: float = 1.0, rows: int = 20) -> Any:
        """The live view ``spoolq top`` shows (a top.View: ``look()``,
        ``wait()``; open it with ``with``): looks taken as the spool
        changes, at most every ``interval`` seconds, with at most ``rows``
        running jobs."""
        from .top import View  # imported here: start-up speed (only top needs it)

        self.backend.open()
        return View(self, interval=interval, rows=rows)

    # -- history -----------------------------------------------------------

    def compact(self, keep: float | None = None) -> dict[str, int]:
        """Fold finished jobs into the history and drop history older than
        ``keep`` seconds (``keep=0`` drops every finished job's, the command
        asks for ``--yes`` first)."""
        return self.backend.compact(keep)

    def purge_dead(self, older_than: float) -> dict[str, int]:
        """Clear dead jobs older than ``older_than`` seconds into the history."""
        return self.backend.purge_dead(older_than)

    # -- changing ----------------------------------------------------------

    def cancel(self, job_id: str, check: bool = False, on_note: Callable[[str], None] | None = None) -> bool:
        """Cancel a waiting job (-> done, outcome cancelled). Returns whether
        it was cancelled; with ``check``, raises JobNotFound or NotPossible
        with the reason instead of returning False. ``on_note(message)``
        hears of a job cancelled whose record could not be updated after its
        move (a full disk): it reads as cancelled."""
        return self._checked(self.backend.cancel, job_id, check, on_note)

    def retry(self, job_id: str, check: bool = False, on_note: Callable[[str], None] | None = None) -> bool:
        """Move a dead job back to waiting with a fresh round of attempts,
        also one cleared into the history (``check`` and ``on_note`` as for
        ``cancel``)."""
        return self._checked(self.backend.retry, job_id, check, on_note)

    @staticmethod
    def _checked(move: Callable[..., Any], job_id: str, check: bool, on_note: Callable[[str], None] | None) -> bool:
        try:
            move(job_id, on_note)
            return True
        except (JobNotFound, NotPossible):
            if check:
                raise
            return False

    def hold(self, job_id: str) -> None:
        """Hold a waiting job: it stays in the spool and is never claimed
        until released. JobNotFound or NotPossible say why not."""
        self.backend.hold(job_id)

    def release(self, job_id: str, now: bool = False) -> str:
        """Release a held job: waiting again as before it was held (due when
        it was, or ``now``). Returns the state it is in now (new, failed,
        or waiting for its dependencies)."""
        return self.backend.release_held(job_id, now)

    def retry_all(self, on_problem: Callable[[str], None] | None = None,
                  on_note: Callable[[str], None] | None = None) -> list[str]:
        """Move every dead job back to waiting; returns their ids. One that
        cannot go stays dead, unchanged; ``on_problem(message)`` says why."""
        return self.backend.retry_all(on_problem, on_note)

    def sweep(self, allow_local_locks: bool = False) -> Any:
        """The recovery step alone: dead workers' jobs back to failed
        (killing what their runs left), stale half-written jobs removed.
        ``allow_local_locks``: as for ``work``."""
        self.backend.require_shared_locks(allow_local_locks)
        return self.backend.sweep()

    # -- running -----------------------------------------------------------

    def relay(self, to: str, watch: bool = False, poll: float | None = None, log: Any = None,
              stop: Any = None) -> Any:
        """Move this spool's due jobs into the PostgreSQL spool at ``to``
        (see relay.py), until none is due (or, with ``watch``, until
        ``stop``, a threading.Event, is set). Records ``to`` as this spool's
        ``relay_to`` setting, so that ``status`` counts what waits. Returns
        a relay.RelayResult (``unavailable``: why it stopped early)."""
        from .relay import Relay  # imported here: only a relay needs it

        if not to.startswith(("postgresql://", "postgres://")):
            raise SpoolError(f"--to must be a postgresql:// URL, not {to!r}")
        if self.location.startswith(("postgresql://", "postgres://")):
            raise SpoolError("a relay moves jobs out of a spool directory; -s names a PostgreSQL spool")
        source = self.backend
        source.require_runner("relay its jobs", "relay")
        source.open(create=False)
        dest = open_backend(to)
        shown = dest.location
        if self.settings.get("relay_to") != shown:
            source.config_set("relay_to", shown)
        try:
            dest.open(create=False)
        except Unavailable:
            pass  # the jobs wait here; the relay tries again
        return Relay(source, dest, watch=watch, poll=poll, log=log, stop=stop).run()

    def work(
        self,
        handlers: Mapping[str, Callable[[Any], Any]] | None = None,
        jobs: int = 1,
        max_jobs: int | None = None,
        max_time: float | None = None,
        watch: bool = False,
        poll: float | None = None,
        log: Any = None,
        signals: bool = True,
        processes: bool = False,
        tuning: Any = None,
        allow_local_locks: bool = False,
    ) -> int:
        """Run jobs and return how many ran.

        Without ``watch`` it recovers abandoned jobs, runs every due job and
        returns when none is due. ``handlers`` maps a job's ``kind`` to a
        function called with its payload; what a handler prints is its
        job's output. ``jobs`` runs that many at once: threads of this
        process, or with ``processes`` that many worker processes of one job
        each, as ``spoolq work -j N`` runs (they always handle the stop
        signals; see pool.py). ``log``: a logging.Logger for the worker's
        lines (by default the ``spoolq`` logger's records, shown as logging
        is configured). ``tuning``: a worker.Tuning, the timings of its
        pipelining and group commit (the defaults otherwise).
        ``allow_local_locks``: run even on a filesystem whose locks other
        machines do not see (sshfs; NFS mounted nolock), which is refused
        otherwise: only when every worker of the spool runs on this machine.

        The number returned is a WorkResult, whose ``clean`` is False when
        an outcome could not be recorded or a worker process failed.
        """
        from .output import as_log  # imported here: start-up speed (as the worker)

        backend = self.backend
        backend.require_runner("run workers on it", "work")
        backend.open(create=True)
        backend.require_runner("run workers on it", "work")
        caution = backend.require_shared_locks(allow_local_locks)
        options = dict(handlers=dict(handlers or {}), max_time=max_time, watch=watch, poll=poll, log=as_log(log), tuning=tuning)
        if caution:
            options["log"].line(caution, 0, 30)  # logging.WARNING (logging is imported only when used)
        if processes and max_jobs is not None:
            jobs = max(1, min(jobs, max_jobs))  # no worker process without a job to claim; one still recovers
        if processes and jobs > 1:
            from .pool import run_workers  # imported here: start-up speed (as the worker)

            backend.close()  # each worker process opens its own; the parent's would only use up the open-file limit
            location = self.location
            ran, clean = run_workers(lambda **kw: Spool(location)._worker(**options, **kw), jobs, max_jobs, options["log"])
            return WorkResult(ran, clean)
        worker = self._worker(jobs=jobs, max_jobs=max_jobs, signals=signals, **options)
        ran = worker.run()
        return WorkResult(ran, not worker.failed_to_record)

    def _worker(self, **options: Any):
        """A Worker on this spool's backend, nothing more of the facade."""
        from .worker import Worker  # imported here: start-up speed (the worker pulls in the runner)

        self.backend.open(create=True)
        return Worker(self.backend, **options)


class WorkResult(int):
    """How many jobs ``Spool.work`` ran, and whether it ended ``clean``:
    False when an outcome could not be recorded, or a worker process
    failed (``spoolq work`` then exits 1)."""

    clean: bool

    def __new__(cls, ran: int, clean: bool) -> "WorkResult":
        result = super().__new__(cls, ran)
        result.clean = clean
        return result


def load_app(spec: str) -> dict[str, Callable[[Any], Any]]:
    """Import ``MODULE:ATTR`` and return it as a kind -> handler mapping.
    The current directory is importable, as with ``python -m``, if only its
    owner (this user or root) can write it: a module planted there by
    another user would run as the worker."""
    import importlib
    import sys

    module_name, colon, attr = spec.partition(":")
    if not colon:
        attr = "HANDLERS"  # `--app myapp.jobs`: the module's HANDLERS
    if not module_name or not attr:
        raise ValueError(f"--app must be MODULE:ATTR (or MODULE, for MODULE:HANDLERS), not {spec!r}")
    cwd = os.getcwd()
    unsafe = _writable_by_others(cwd)
    if unsafe is None:
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
    else:  # `python -m spoolq` put it there first
        sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if unsafe is not None and isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0]:
            raise ValueError(f"--app: {cwd} is {unsafe}, so it is not put on the import path; run from a directory "
                             "only you can write, or install the module") from None
        raise ValueError(f"cannot import {module_name}: {e}") from None
    except Exception as e:  # the module itself fails as it is imported
        raise ValueError(f"importing {module_name} failed: {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{module_name} has no attribute {attr}") from None
    if callable(obj) and not isinstance(obj, Mapping):
        # A factory returning the mapping.
        try:
            obj = obj()
        except Exception as e:
            raise ValueError(f"{spec} is callable, so it was called for the handlers, and failed: "
                             f"{type(e).__name__}: {e}") from None
    if not isinstance(obj, Mapping):
        raise ValueError(f"{spec} must be a mapping of kind to handler, not {type(obj).__name__}")
    bad = [k for k, v in obj.items() if not callable(v)]
    if bad:
        raise ValueError(f"{spec}: handler for {bad[0]!r} is not callable")
    return dict(obj)


def _writable_by_others(path: str) -> str | None:
    """Why a user other than this one (or root) can put files in ``path``,
    or None: through its own mode or owner, or through a folder above it
    that lets others swap it (see owners.swappable)."""
    me = os.geteuid()
    try:
        st = os.stat(path)
    except OSError:
        return "unreadable"
    if st.st_uid not in (me, 0):
        return f"owned by another user ({user_name(st.st_uid)})"
    if st.st_mode & 0o002:
        return "writable by others"
    if st.st_mode & 0o020:
        return "writable by its group"
    found = swappable(path, {me, 0})
    if found is None:
        return None
    way, st = found
    if st.st_uid not in (me, 0):
        return f"inside {way}, owned by another user ({user_name(st.st_uid)})"
    return f"inside {way}, which others can write"


