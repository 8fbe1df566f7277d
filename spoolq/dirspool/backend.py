"""``DirBackend``: the storage port (backend.Backend) over a spool
directory, one object per open spool: its settings (config.json), its
layout, enqueue into new/ (or, for a member of a shared spool, into drop/),
the operator's moves (cancel, retry, compaction into the index, purge,
sweep) and, through its parts, the read side (reads.py's ``DirReads``) and
the worker's verbs (working.py's ``WorkerSide``).

Everything that knows paths, flocks, fsync, the SQLite history and the
folder trust model is behind it: nothing above the port sees a folder.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from .. import config, record
from ..backend import Report
from ..errors import (
    DuplicateId,
    Exists,
    NotASpool,
    JobNotFound,
    NotPossible,
    PartlyEnqueued,
    RequestPending,
    SpoolError,
)
from ..output import blocked_by
from ..owners import user_name
from . import mounts
from .protocol import DROP, STATES, SpoolDir, file_name, id_of, id_problem, refuse_inside_spool, refuse_non_directory, refuse_swappable_way
from .ordered import OnExisting, OrderSide, ordered
from .reads import DirReads
from .working import WorkerSide

#: Seconds a member's cancel or retry waits for a worker to answer its
#: request (a watching worker answers within milliseconds).
REQUEST_WAIT = 10.0


class DirBackend(DirReads, WorkerSide, OrderSide):
    """A spool directory behind the storage port."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.location = self.path
        self.dir = SpoolDir(self.path, fsync=True)
        self._settings = config.Settings(self.path)
        self._settings.on_load(self._settings_loaded)
        self._index = None
        self._init_worker_side()

    def __repr__(self) -> str:
        return f"DirBackend({self.path!r})"

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

    def config_list(self) -> dict[str, Any]:
        return dict(self.settings)

    def settings_problem(self) -> str | None:
        """Why config.json cannot be used (None when it can); the spool is
        then read with the default settings (what the metrics do)."""
        try:
            self.settings  # noqa: B018 - loads config.json
        except config.ConfigError as e:
            self._settings.use(dict(config.DEFAULTS))
            return str(e)
        return None

    def require_runner(self, action: str, command: str) -> None:
        """Refuse (SpoolError) a user who may not run, recover or signal
        jobs here (see _require_runner)."""
        _require_runner(self.dir, action, command)

    def require_shared_locks(self, forced: bool) -> str | None:
        """See mounts.require_shared_locks: a spool on a filesystem whose
        locks stay on the client is refused unless forced."""
        try:
            return mounts.require_shared_locks(self.dir.root, forced)
        except ValueError as e:
            raise SpoolError(str(e)) from None

    def control(self) -> Any:
        """The control channel (see control.Channel): requests into live
        workers, the pause mark, finish and worker events. A worker's
        channel also answers members' requests in drop/ (their kills)."""
        from .control import ControlDir  # imported here: start-up speed (only job control needs it)

        self._open()
        answering: Any = None

        def answer() -> None:
            nonlocal answering
            if answering is None:
                from .pickup import Pickup  # imported here: start-up speed (as recovery)

                answering = Pickup(self.context())
            answering.answer_requests()

        return ControlDir(self.dir, answer, self._ask)

    def paused(self) -> dict[str, Any] | None:
        """Who paused the spool and when, or None (a member: None, control/ is the owner's)."""
        try:
            return self.control().paused()
        except PermissionError:
            return None

    def context(self):
        """The transition context (settings, trust, index look-ups)."""
        from .transitions import Context  # imported here: start-up speed (transitions pulls in the runner and subprocess)

        return Context(self.dir, self.settings, index_has=self._index_has, index_get=self._history)

    def _open(self, create: bool = False) -> None:
        # The folders first: what is wrong with them (a loose mode, another
        # user's spool) comes before what is wrong with a file in them.
        self.dir.open(create=create)
        self.settings  # noqa: B018 - loads config and the fsync setting

    def open(self, create: bool = False) -> None:
        self._open(create=create)

    def close(self) -> None:
        self.stop_work()
        self.dir.close()

    def exists(self) -> bool:
        return self.dir.exists()

    def missing(self) -> str | None:
        """Why there is no spool here, in one line (None when there is one):
        the path lies inside a spool, cannot be reached, or holds no layout."""
        try:
            refuse_inside_spool(self.path)
        except SpoolError as e:
            return str(e)
        if self.dir.exists():
            return None
        refuse_non_directory(self.path)
        try:
            refuse_swappable_way(self.path)  # the real trouble, before "not a spool"
        except SpoolError as e:
            return str(e)
        if os.path.isdir(self.path) and not os.access(self.path, os.R_OK | os.X_OK):
            return f"permission denied: {self.path} (a shared spool: is this user in its group?)"
        if not os.path.isdir(self.path):
            blocked = blocked_by(self.path)
            if blocked:
                return f"permission denied: {blocked} (so the spool {self.path} cannot be reached)"
        return str(NotASpool(self.path))  # missing, or a directory without the layout

    def leftovers(self) -> dict[str, Any]:
        """What waits as a worker ends: failed jobs (and when the first is
        due again) and dead ones. A failed job's due time is its file's
        modification time, so this is one listing of each folder."""
        failed, next_due = 0, None
        for _name, st in self.dir.entries("failed"):
            failed += 1
            if next_due is None or st.st_mtime < next_due:
                next_due = st.st_mtime
        return {"failed": failed, "next_retry": next_due, "dead": self.dir.count("dead")}

    # -- layout ------------------------------------------------------------

    def init(self, group: str | None = None) -> list[str]:
        """Create the layout (idempotent); ``group`` makes a shared spool
        (refused, before anything is made, when the spool's owner is not in
        that group) and converts one of an older layout. Returns what it
        changed in an existing spool, a line each."""
        return self.dir.init(group=group)

    # -- enqueue -----------------------------------------------------------

    def has_id(self, job_id: str) -> str | None:
        """Where a job with this id is (a folder, or the index), or None:
        an id is a job's for life."""
        self._open()
        # A file dropped by hand may have the id as its whole name.
        where = self.dir.find((file_name(job_id), job_id), STATES + ((DROP,) if self.dir.shared else ()))
        if where is not None:
            return f"{where[0]}/"
        if self._index_has(job_id):
            return "the index (a compacted job)"
        return None

    def enqueue(self, jobs: list[tuple[str, Any, float | None]], existing_ok: bool = False,
                on_existing: OnExisting | None = None) -> list[str]:
        """Put jobs (id, record bytes, due time or None) into new/ -- or, for
        a member of a shared spool, into drop/ for the owner's side to pick
        up -- with one sync for the lot. Raises DuplicateId for an id taken
        meanwhile, PartlyEnqueued when the disk failed part way. Jobs with
        ordering fields go where those put them (see ordered.py), and a job
        whose unique key an unfinished job holds is not added: that job's id
        stands in for it, told to ``on_existing(id, holder)``."""
        self._open(create=True)
        items = [(file_name(job_id), data, None if due is None else int(due * 1e9)) for job_id, data, due in jobs]
        placed = [ordered(data) for _, data, _ in jobs]
        if any(placed):
            return self._enqueue_ordered(items, placed, on_existing)
        if len(items) == 1:
            try:
                return [self._publish_one(*items[0])]
            except DuplicateId:
                if existing_ok:
                    return [jobs[0][0]]
                raise
        folder = DROP if self.dir.drops_in else "new"
        try:
            names = self.dir.drops.put(items) if self.dir.drops_in else self.dir.publish_many(items)
        except BaseException as e:
            published = [id_of(n) for n in getattr(e, "published", ())]
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

    def _publish_one(self, name: str, data: bytes, mtime_ns: int | None) -> str:
        """One job into new/ (a member's: drop/); returns its id."""
        try:
            if self.dir.drops_in:
                self.dir.drops.put([(name, data, mtime_ns)])
            else:
                self.dir.publish(name, data, mtime_ns)
        except Exists:
            raise DuplicateId(f"id {id_of(name)} is already in {DROP if self.dir.drops_in else 'new'}/") from None
        return id_of(name)

    def due_now(self) -> None:
        """Make every job waiting for a later time due now (for tests: see testing.run_jobs)."""
        self._open()
        now = time.time()
        for name, _ in self.dir.entries("new"):
            os.utime(os.path.join(self.path, "new", name), (now, now))

    # -- looking -----------------------------------------------------------

    def _index_has(self, job_id: str) -> bool:
        index = self.index(create=False)
        return index is not None and index.has(job_id)

    def index(self, create: bool = False):
        """The SQLite history (None when there is none and ``create`` is off)."""
        if self._index is None:
            if not create and _empty_or_missing(os.path.join(self.path, "index.db")):
                return None
            from .index import Index  # imported here: start-up speed (sqlite3; enqueue never needs it)

            self._index = Index(os.path.join(self.path, "index.db"), durable=bool(self.settings["fsync"]), shared=self.dir.shared)
        return self._index

    # -- history -----------------------------------------------------------

    def compact(self, keep: float | None = None, stop: Callable[[], bool] | None = None) -> dict[str, int]:
        """Fold done/ into index.db (each file removed once its row is
        committed), drop history older than ``keep`` seconds, and remove
        tmp/ files older than 36 hours. ``keep=0`` drops every finished
        job's row, the ones just folded included (the command asks for
        ``--yes`` before it does that). ``stop``, asked after each batch
        of files folded, ends the folding early when it returns True."""
        from .compact import compact  # imported here: start-up speed (as the index)

        self._open(create=True)
        self.dir.require_owner("compact it")
        return compact(self.dir, self.index(create=True), self.settings, keep, stop)

    def purge_dead(self, older_than: float) -> dict[str, int]:
        """Clear dead jobs older than ``older_than`` seconds into index.db."""
        from .compact import purge_dead  # imported here: start-up speed (as the index)

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
        from .index import Index, stats  # imported here: start-up speed (as in index())

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

    def cancel(self, job_id: str, on_note: Callable[[str], None] | None = None) -> None:
        """Cancel a waiting job (new/ or failed/ -> done/, outcome cancelled);
        JobNotFound or NotPossible say why not. ``on_note(message)`` hears of
        a job cancelled whose record could not be updated after its move (a
        full disk): it reads as cancelled."""
        from . import waits  # imported here: start-up speed (as in context())

        self._open()
        if self.dir.member:
            self._ask({"request": "cancel", "id": job_id}, on_note, f"cancel {job_id}")
        else:
            waits.cancel(self.context(), job_id, on_note)

    def retry(self, job_id: str, on_note: Callable[[str], None] | None = None) -> None:
        """Move a dead job back to new/ with a fresh round of attempts, also
        one purged into index.db (``on_note`` as for ``cancel``)."""
        from . import transitions  # imported here: start-up speed (as in context())

        self._open()
        if self.dir.member:
            self._ask({"request": "retry", "id": job_id}, on_note, f"retry {job_id}")
            return
        try:
            transitions.retry(self.context(), job_id, on_note)
        except transitions.JobNotFound:
            index = self.index() if not id_problem(job_id) else None
            if index is None or not index.has(job_id):
                raise
            from .compact import retry_purged  # imported here: start-up speed (as the index)

            retry_purged(self.context(), index, job_id, on_note)

    def retry_all(self, on_problem: Callable[[str], None] | None = None,
                  on_note: Callable[[str], None] | None = None) -> list[str]:
        """Move every dead job back to new/; returns their ids. One that
        cannot go stays in dead/ unchanged; ``on_problem(message)`` says why."""
        from . import transitions  # imported here: start-up speed (as in context())

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

    def sweep(self) -> Report:
        """The recovery step alone: return abandoned jobs from cur/ (killing
        what their runs left) and remove stale tmp/ files."""
        from . import recovery, waits  # imported here: start-up speed (as in context())

        _require_runner(self.dir, "sweep it", "sweep")
        self._open(create=True)
        _require_runner(self.dir, "sweep it", "sweep")
        try:
            report = recovery.recover(self.context())
            waits.recover_waiting(self.context(), self.order, self._history)
        finally:
            self.dir.drop_spares()
        report.tmp_removed = self.dir.remove_tmp()
        self.dir.remove_stale_spares()
        self.dir.remove_stale_reasons()
        if self.dir.shared:
            from .pickup import Pickup  # imported here: start-up speed (as recovery)

            picked = Pickup(self.context()).drain()
            report.picked_up, report.dropped_dead = picked.picked, picked.dead
            report.tmp_removed += self.dir.drops.remove_stale()
        return report


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


def compact_beside(path: str) -> None:
    """The body of a worker's compaction process (see autocompact.py)."""
    from .autocompact import serve

    serve(lambda stop: DirBackend(path).compact(stop=stop))
