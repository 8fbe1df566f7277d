"""``Spool``: the one core that the command line and Python programs share.

Every ``spoolq`` command is a thin wrapper around a method here, so the CLI
and the API cannot drift apart::

    q = Spool("/var/spool/app")
    job_id = q.enqueue(command="make report")
    q.work(handlers={"send_email": send_email})
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping

from . import config, record
from .errors import (  # noqa: F401 - importable from here too
    DuplicateId,
    Exists,
    InvalidJob,
    JobNotFound,
    NotPossible,
    NotRegular,
    PartlyEnqueued,
    RequestPending,
    SpoolError,
)
from .owners import swappable, user_name
from .dirspool.protocol import DROP, STATES, SpoolDir, file_name, id_of, id_problem, new_id, refuse_non_directory
from .ordered import Ordering, ordered as _ordered
from .views import Views

#: Seconds a member's cancel or retry waits for a worker to answer its
#: request (a watching worker answers within milliseconds).
REQUEST_WAIT = 10.0


class Spool(Views, Ordering):
    """A spool directory: enqueue, inspect, cancel, retry and run jobs.

    ``Spool()`` uses ``$SPOOLQ_DIR``, else ``./spool``. Nothing is created
    until a method that writes needs it.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        if path is None:
            path = os.environ.get("SPOOLQ_DIR") or "spool"
        if os.fspath(path) == "":
            raise ValueError("the spool path is empty")
        self.path = os.path.abspath(os.fspath(path))
        self.dir = SpoolDir(self.path, fsync=True)
        self._settings = config.Settings(self.path)
        self._settings.on_load(self._settings_loaded)
        self._index = None

    def __repr__(self) -> str:
        return f"Spool({self.path!r})"

    # -- settings ----------------------------------------------------------

    @property
    def settings(self) -> config.Settings:
        """The spool's settings (config.json over the defaults): one holder,
        shared with the worker, whose reload reaches every reader."""
        if not self._settings.loaded:
            try:
                self._settings.reload()
            except config.ConfigError:
                refuse_non_directory(self.path)  # the real trouble, said plainly
                raise
        return self._settings

    def _settings_loaded(self, settings: config.Settings) -> None:
        self.dir.fsync = bool(settings["fsync"])

    def config_get(self, key: str) -> Any:
        key = config.setting_name(key)
        if key not in config.DEFAULTS:
            config.check(key, None)  # raises the unknown-key error
        return self.settings[key]

    def config_set(self, key: str, value: Any, on_dropped: Callable[[str], None] | None = None) -> Any:
        """Validate and store one setting; returns the stored value. A
        config.json that does not parse, or holds unknown keys or bad
        values, is repaired on the way: see _change_config."""
        key = config.setting_name(key)
        checked = config.check(key, value)
        self._change_config(lambda stored: stored.__setitem__(key, checked), on_dropped)
        return checked

    def config_unset(self, key: str, on_dropped: Callable[[str], None] | None = None) -> tuple[bool, str]:
        """Remove one setting from config.json (its default applies again),
        also one spoolq does not know; repairs the file as ``config_set``
        does. Returns whether the file held it, and the name it went by
        (``max-attempts`` is ``max_attempts`` unless the file has it so)."""
        held = self._change_config(lambda stored: stored.pop(key, None), on_dropped, unset=key)
        if not held and config.setting_name(key) != key:  # `max-attempts`, as a command spells it
            key = config.setting_name(key)
            held = self._change_config(lambda stored: stored.pop(key, None), on_dropped, unset=key)
        if not held and key not in config.DEFAULTS:
            config.check(key, None)  # raises the unknown-key error: a typo, not a setting to remove
        return held, key

    def _change_config(self, change: Callable[[dict[str, Any]], Any], on_dropped: Callable[[str], None] | None,
                       unset: str | None = None) -> bool:
        """Change config.json by ``change(stored settings)``. What of the
        file cannot be read (it does not parse, an unknown key, a bad value)
        is dropped and told to ``on_dropped``, the old file kept beside it
        as config.json.bad, so that a setting can always be repaired."""
        try:
            self._open(create=True)
        except config.ConfigError:
            # A bad config.json is what may be being repaired: open the
            # folders without the settings (the file is then written with
            # fsync, the default).
            self.dir.open(create=True)
        self.dir.require_owner("change its settings")
        stored, raw, dropped = config.read_stored(self.path)
        # The key being unset goes anyway, known or not: no need to say so.
        held = unset is not None and (unset in stored or dropped.pop(unset, None) is not None)
        before = dict(stored)
        change(stored)
        if dropped:
            # Only its owner reads the old file, whoever could read config.json.
            self.dir.replace_file(None, "config.json.bad", raw, self.dir.file_mode)
            if on_dropped:
                for key, why in dropped.items():
                    on_dropped(f"config.json: dropped {'the whole file: ' + why if key is None else why}")
                on_dropped(f"config.json: the old file is kept as {os.path.join(self.path, 'config.json.bad')}")
        # A set always writes, even a value the file has: the file, its
        # owner and its mode are then the ones a set makes.
        if unset is None or dropped or stored != before or held:
            self.dir.replace_file(None, "config.json", config.dumps(stored), self.dir.settings_mode)
        self._settings.loaded = False  # read again when next needed
        return held

    def setting_name(self, key: str) -> str:
        """A setting's name as a command may spell it, as config.json does."""
        return config.setting_name(key)

    def config_default(self, key: str) -> Any:
        """A setting's default (None for a key spoolq does not know)."""
        return config.DEFAULTS.get(key)

    def config_list(self) -> dict[str, Any]:
        return dict(self.settings)

    def default_app(self) -> str | None:
        """The handlers a worker loads when it is given none (the ``app``
        setting), or None. A root worker takes it only from a config.json
        root owns: importing a module runs its code, as root. So the user
        who may not run workers here is refused before anything is
        imported; root runs them only on a spool root owns, and the
        config.json of that is root's (config.read_file refuses any other)."""
        _require_runner(self.dir, "run workers on it", "work")
        app = self.settings["app"]
        return app or None

    def context(self):
        """The transition context (settings, trust, index look-ups)."""
        from .dirspool.transitions import Context  # imported here: start-up speed (transitions pulls in the runner and subprocess)

        return Context(self.dir, self.settings, index_has=self._index_has, index_get=self._history)

    def _open(self, create: bool = False) -> None:
        # The folders first: what is wrong with them (a loose mode, another
        # user's spool) comes before what is wrong with a file in them.
        self.dir.open(create=create)
        self.settings  # noqa: B018 - loads config and the fsync setting

    # -- layout ------------------------------------------------------------

    def init(self, group: str | None = None) -> list[str]:
        """Create the layout (idempotent); ``group`` makes a shared spool
        (refused, before anything is made, when the spool's owner is not in
        that group) and converts one of an older layout. Returns what it
        changed in an existing spool, a line each."""
        return self.dir.init(group=group)

    # -- enqueue -----------------------------------------------------------

    def _prepare(self, fields: Mapping[str, Any], now: float) -> tuple[str, bytes, int | None]:
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
        mtime_ns = None
        if run_at is not None:
            if hasattr(run_at, "timestamp"):
                run_at = run_at.timestamp()
            try:
                when = record.parse_time(run_at)
            except ValueError as e:
                raise InvalidJob(f"run_at: {e}") from None
            fields["run_at"] = record.rfc3339(when)
            if when > now:
                mtime_ns = int(when * 1e9)
        job = record.new_job(fields, job_id, now)
        problem = config.refusal(self.settings, job)
        if problem:
            raise InvalidJob(problem)
        data = record.serialise(job)
        limit = int(self.settings["max_job_bytes"])
        if len(data) > limit:
            raise InvalidJob(f"the job is {len(data)} bytes, larger than max_job_bytes ({limit})")
        return job_id, data, mtime_ns

    def _check_unique(self, job_id: str) -> None:
        # A file dropped by hand may have the id as its whole name.
        where = self.dir.find((file_name(job_id), job_id), STATES + ((DROP,) if self.dir.shared else ()))
        if where is not None:
            raise DuplicateId(f"id {job_id} is already in {where[0]}/")
        if self._index_has(job_id):
            raise DuplicateId(f"id {job_id} is already in the index (a compacted job)")

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
        """Enqueue one job and return its id once it is durably in new/.

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
        self._open(create=True)
        job_id, data, mtime_ns = self._prepare(fields, time.time())
        if fields.get("id") is not None:
            self._check_unique(job_id)
        if _ordered(fields):
            holder = self._enqueue_ordered(job_id, record.loads(data.decode("utf-8")), data, mtime_ns)
            if holder is not None and on_existing is not None:
                on_existing(holder)
            return holder or job_id
        try:
            if self.dir.drops_in:  # a member: into drop/, for the owner's side to pick up
                self.dir.drops.put([(file_name(job_id), data, mtime_ns)])
            else:
                self.dir.publish(file_name(job_id), data, mtime_ns)
        except Exists:
            raise DuplicateId(f"id {job_id} is already in {DROP if self.dir.drops_in else 'new'}/") from None
        return job_id

    def enqueue_many(self, jobs: list[Mapping[str, Any]]) -> list[str]:
        """Enqueue many jobs with one sync for the lot (group commit).

        Every job is validated first; if one is invalid nothing is enqueued
        (InvalidJob names its position). Returns the ids in order. Should
        the disk fail part way (or a duplicate id turn up at the last
        step), PartlyEnqueued says which jobs were enqueued."""
        self._open(create=True)
        if any(isinstance(fields, Mapping) and _ordered(fields) for fields in jobs):
            return self._enqueue_each(jobs)
        now = time.time()
        items = []
        seen: set[str] = set()
        for i, fields in enumerate(jobs):
            if not isinstance(fields, Mapping):
                raise InvalidJob(f"job {i + 1}: not a JSON object")
            try:
                job_id, data, mtime_ns = self._prepare(fields, now)
                if fields.get("id") is not None:
                    if job_id in seen:
                        raise DuplicateId(f"id {job_id} appears twice")
                    self._check_unique(job_id)
            except (InvalidJob, DuplicateId) as e:
                raise type(e)(f"job {i + 1}: {e}") from None
            seen.add(job_id)
            items.append((file_name(job_id), data, mtime_ns))
        try:
            names = self.dir.drops.put(items) if self.dir.drops_in else self.dir.publish_many(items)
        except BaseException as e:
            published = [id_of(n) for n in getattr(e, "published", ())]
            folder = DROP if self.dir.drops_in else "new"
            cause = f"id {id_of(str(e))} is already in {folder}/" if isinstance(e, Exists) else _reason(e)
            if not published or not isinstance(e, Exception):
                if isinstance(e, Exists):
                    raise DuplicateId(cause) from None
                e.published_ids = published  # type: ignore[attr-defined]  # (a KeyboardInterrupt part way)
                raise
            # Some are in new/ already and will run: say which, or a caller
            # that tries the whole batch again runs them twice.
            raise PartlyEnqueued(published, len(items), cause) from e
        return [id_of(n) for n in names]

    # -- looking -----------------------------------------------------------

    def _index_has(self, job_id: str) -> bool:
        index = self.index(create=False)
        return index is not None and index.has(job_id)

    def index(self, create: bool = False):
        """The SQLite history (None when there is none and ``create`` is off)."""
        if self._index is None:
            if not create and _empty_or_missing(os.path.join(self.path, "index.db")):
                return None
            from .dirspool.index import Index  # imported here: start-up speed (sqlite3; enqueue never needs it)

            self._index = Index(os.path.join(self.path, "index.db"), durable=bool(self.settings["fsync"]), shared=self.dir.shared)
        return self._index

    # -- history -----------------------------------------------------------

    def compact(self, keep: float | None = None) -> dict[str, int]:
        """Fold done/ into index.db (each file removed once its row is
        committed), drop history older than ``keep`` seconds, and remove
        tmp/ files older than 36 hours. ``keep=0`` drops every finished
        job's row, the ones just folded included (the command asks for
        ``--yes`` before it does that)."""
        from .dirspool.compact import compact  # imported here: start-up speed (as the index)

        self._open(create=True)
        self.dir.require_owner("compact it")
        return compact(self.dir, self.index(create=True), self.settings, keep)

    def purge_dead(self, older_than: float) -> dict[str, int]:
        """Clear dead jobs older than ``older_than`` seconds into index.db."""
        from .dirspool.compact import purge_dead  # imported here: start-up speed (as the index)

        self._open()
        self.dir.require_owner("purge it")
        try:
            return purge_dead(self.dir, self.index(create=True), self.settings, older_than)
        finally:
            self.dir.remove_stale_reasons()

    def stats(self, since: float | None = None) -> dict[str, Any]:
        """Finished jobs, throughput, wait time (due to start) and run time
        (p50, p95, max) in total and per kind or program, from index.db plus
        the records still in done/ and dead/. ``since``: epoch seconds."""
        from .dirspool.index import Index, stats  # imported here: start-up speed (as in index())

        self._open()
        extra = []
        for state in ("done", "dead"):
            for name, st in self.dir.entries(state):
                job = self._read_record(state, name, st)
                if job.get("valid") is False or job.get("readable") is False:
                    continue  # (a member counts only what it may read: the history, its own files)
                finished = job.get("finished_at")
                try:
                    finished_at = record.parse_time(finished) if finished else st.st_mtime
                except ValueError:
                    finished_at = st.st_mtime
                extra.append((job, state, finished_at))
        index = self.index() or Index(":memory:", durable=False)
        return stats(index, extra, since)

    # -- changing ----------------------------------------------------------

    def cancel(self, job_id: str, check: bool = False, on_note: Callable[[str], None] | None = None) -> bool:
        """Cancel a waiting job (new/ or failed/ -> done/, outcome cancelled).
        Returns whether it was cancelled; with ``check``, raises JobNotFound
        or NotPossible with the reason instead of returning False.
        ``on_note(message)`` hears of a job cancelled whose record could not
        be updated after its move (a full disk): it reads as cancelled."""
        from .dirspool import transitions  # imported here: start-up speed (as in context())

        self._open()
        try:
            if self.dir.member:
                self._ask({"request": "cancel", "id": job_id}, on_note, f"cancel {job_id}")
            else:
                ctx = self.context()
                transitions.cancel(ctx, job_id, on_note)
                from .dirspool import waits  # imported here: start-up speed (as transitions)

                waits.dependency_ended(ctx, self.order, job_id, "cancelled", self._history)
            return True
        except (transitions.JobNotFound, transitions.NotPossible):
            if check:
                raise
            return False

    def retry(self, job_id: str, check: bool = False, on_note: Callable[[str], None] | None = None) -> bool:
        """Move a dead job back to new/ with a fresh round of attempts, also
        one purged into index.db (``check`` and ``on_note`` as for ``cancel``)."""
        from .dirspool import transitions  # imported here: start-up speed (as in context())

        self._open()
        try:
            if self.dir.member:
                self._ask({"request": "retry", "id": job_id}, on_note, f"retry {job_id}")
            else:
                try:
                    transitions.retry(self.context(), job_id, on_note)
                except transitions.JobNotFound:
                    index = self.index() if not id_problem(job_id) else None
                    if index is None or not index.has(job_id):
                        raise
                    from .dirspool.compact import retry_purged  # imported here: start-up speed (as the index)

                    retry_purged(self.context(), index, job_id, on_note)
            return True
        except (transitions.JobNotFound, transitions.NotPossible):
            if check:
                raise
            return False

    def retry_all(self, on_problem: Callable[[str], None] | None = None,
                  on_note: Callable[[str], None] | None = None) -> list[str]:
        """Move every dead job back to new/; returns their ids. One that
        cannot go stays in dead/ unchanged; ``on_problem(message)`` says why."""
        from .dirspool import transitions  # imported here: start-up speed (as in context())

        self._open()
        if self.dir.member:
            answer = self._ask({"request": "retry_all"}, on_note, "retry your dead jobs")
            for problem in answer.get("problems") or ():
                if on_problem:
                    on_problem(str(problem))
            return [str(job_id) for job_id in answer.get("ids") or ()]
        return transitions.retry_all(self.context(), on_problem, on_note)

    def _ask(self, request: dict[str, Any], on_note: Callable[[str], None] | None, what: str,
             wait: float = REQUEST_WAIT) -> dict[str, Any]:
        """A member's request, carried out by the owner's side: dropped into
        drop/, then its reply awaited for up to ``wait`` seconds (a watching
        worker answers within milliseconds). Raises JobNotFound or
        NotPossible as the owner's own command would, or RequestPending
        when no worker answered in time (the request stays, and the next
        worker carries it out)."""
        import json

        token = self.dir.drops.request(json.dumps(request).encode())
        deadline = time.monotonic() + wait
        pause = 0.002
        while True:
            data = self.dir.drops.reply(token)
            if data is not None:
                break
            if time.monotonic() >= deadline:
                raise RequestPending(f"no worker of {user_name(self.dir.owner)} answered within {wait:g}s; the "
                                     f"request to {what} waits in {self.path}/drop/ and is carried out when one runs")
            time.sleep(pause)
            pause = min(pause * 1.5, 0.1)
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise SpoolError(f"the answer to the request to {what} is not one spoolq writes")
        for note in answer.get("notes") or ():
            if on_note:
                on_note(str(note))
        error = answer.get("error")
        if error == "not_found":
            raise JobNotFound(str(answer.get("message")))
        if error:
            raise NotPossible(str(answer.get("message")))
        return answer

    def sweep(self):
        """The recovery step alone: return abandoned jobs from cur/ (killing
        what their runs left) and remove stale tmp/ files."""
        from .dirspool import recovery  # imported here: start-up speed (as in context())

        _require_runner(self.dir, "sweep it", "sweep")
        self._open(create=True)
        _require_runner(self.dir, "sweep it", "sweep")
        try:
            report = recovery.recover(self.context())
        finally:
            self.dir.drop_spares()
        report.tmp_removed = self.dir.remove_tmp()
        self.dir.remove_stale_spares()
        self.dir.remove_stale_reasons()
        if self.dir.shared:
            from .dirspool.pickup import Pickup  # imported here: start-up speed (as recovery)

            picked = Pickup(self.context()).drain()
            report.picked_up, report.dropped_dead = picked.picked, picked.dead
            report.tmp_removed += self.dir.drops.remove_stale()
        return report

    # -- running -----------------------------------------------------------

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

        The number returned is a WorkResult, whose ``clean`` is False when
        an outcome could not be recorded or a worker process failed.
        """
        from .output import as_log  # imported here: start-up speed (as the worker)

        _require_runner(self.dir, "run workers on it", "work")
        self._open(create=True)
        _require_runner(self.dir, "run workers on it", "work")
        options = dict(handlers=dict(handlers or {}), max_time=max_time, watch=watch, poll=poll, log=as_log(log), tuning=tuning)
        if processes and max_jobs is not None:
            jobs = max(1, min(jobs, max_jobs))  # no worker process without a job to claim; one still recovers
        if processes and jobs > 1:
            from .pool import run_workers  # imported here: start-up speed (as the worker)

            self.dir.close()  # each worker process opens its own; the parent's would only use up the open-file limit
            path = self.path
            ran, clean = run_workers(lambda **kw: Spool(path)._worker(**options, **kw), jobs, max_jobs, options["log"])
            return WorkResult(ran, clean)
        worker = self._worker(jobs=jobs, max_jobs=max_jobs, signals=signals, **options)
        ran = worker.run()
        return WorkResult(ran, not worker.failed_to_record)

    def _worker(self, **options: Any):
        """A Worker on this spool: the spool directory's backend (with the
        shared settings and this spool's compaction), nothing more of the facade."""
        from .dirspool.backend import DirBackend  # imported here: start-up speed (the backend pulls in the runner and the watcher)
        from .worker import Worker  # (as the backend)

        self._open(create=True)
        return Worker(DirBackend(self.context(), compact=self.compact), **options)


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


def _require_runner(sp: SpoolDir, action: str, command: str) -> None:
    """Refuse (SpoolError) ``spoolq COMMAND`` (anything that runs jobs,
    recovers them or signals processes) to a user other than the spool's
    owner, and to root on a spool root does not own: in another user's
    spool every file is one that user could have written, so root would
    run, recover and signal on that user's word. Root's spool is root's
    alone, as atd's is. Called before the spool is opened (nothing is made
    in another user's folder: a missing workers/, say) and after."""
    if sp.owner == -1:
        try:
            owner = os.stat(sp.root).st_uid
        except OSError:
            return  # none yet: the one made next is this user's
    else:
        owner = sp.owner
        if os.geteuid() not in (owner, 0):
            raise SpoolError(f"only {user_name(owner)}, who owns {sp.root}, may {action}")
    if os.geteuid() == 0 and owner != 0:
        import shlex

        name = user_name(owner)
        doing = "sweeps only a spool" if command == "sweep" else "runs workers only on a spool"
        raise SpoolError(f"{sp.root} belongs to {name}: root {doing} root owns; run it as {name} "
                         f"(runuser -u {shlex.quote(name)} -- spoolq -s {shlex.quote(sp.root)} {command}), "
                         "or make a spool of root's")


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


def _empty_or_missing(path: str) -> bool:
    """Whether there is no index at ``path`` to read: none, or an empty
    file (one no index was ever written into: index.db is only linked into
    place whole, but a file made in place may be empty). Not followed: a
    symlink is an index the Index refuses, not a missing one."""
    try:
        return os.lstat(path).st_size == 0
    except FileNotFoundError:
        return True


def _reason(error: Exception) -> str:
    """An error as a short reason: an OSError's words, not its repr."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__
