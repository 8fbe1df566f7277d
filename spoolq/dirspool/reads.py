"""The read side of a spool directory: job records as ``show`` and
``list`` give them, looked up by id, listed in order, and counted per
state, from the folders and the index of compacted jobs.

``DirReads`` is the part of ``DirBackend`` that only reads (the port's
``get``, ``list``, ``counts``, ``resolve``). It relies on what the backend
gives: ``path``, ``dir``, ``settings``, ``context()``, ``index()`` and
``_open()``.
"""

from __future__ import annotations

import heapq
import os
import time
from typing import Any, Callable, Iterator

from .. import config, record
from ..errors import InvalidJob, NotPossible, NotRegular
from ..owners import user_name
from .protocol import DROP, REPLY_SUFFIX, STATES, file_name, id_of, id_problem, listed_names


PREFIX_SHOWN = 10  # candidates named when an id prefix is ambiguous


class DirReads:
    """Reading a spool's jobs: one record, a listing, the counts."""

    def _read_record(self, state: str, name: str, st: os.stat_result | None = None) -> dict[str, Any]:
        """A file's record as ``show`` prints it (invalid files included)."""
        job_id = id_of(name)
        limit = int(self.settings["max_job_bytes"])
        job: dict[str, Any]
        try:
            data, st = self.dir.read(state, name, record.read_size(limit))
            job = record.parse_sized(data, job_id, limit)
        except PermissionError:
            if self.dir.member:
                return self._listed(state, name, st)
            job = None
        except (InvalidJob, NotRegular, OSError):
            job = None
        if job is None or (state == "dead" and job.get("error") is None):
            # Imported here: start-up speed (the transitions bring in the
            # runner, which `spoolq show` of a good record does not need).
            from .transitions import dead_reason

            reason = self.dir.noted_reason(name) if state == "dead" else None
            if reason is None:  # none kept (or not for this file): worked out from the file as it is
                reason = dead_reason(self.context(), state, name)
            if job is None:
                job = {"id": job_id, "error": reason or "unreadable", "valid": False}
            elif reason:
                job["error"] = reason
        if state == "done" and job.get("valid") is not False:
            job = record.as_done(job)
        if state == "new" and job.get("state") in ("dead", "failed", "done", "cur"):
            job["moved_back_from"] = job["state"]  # (`mv dead/x.json new/`): what it says of its runs is history
        if state == "cur" and self.dir.is_locked("cur", name) is False:
            job["abandoned"] = True  # its worker died: nobody holds it (see protocol's header)
        if state in ("new", "failed") and isinstance(job.get("kind"), str) and job.get("valid") is not False:
            handled = self._handled()
            if handled is not None and job["kind"] not in handled:
                job["waits_for_handler"] = True  # no worker of this spool has one (see registry.handled_kinds)
        job["state"] = state
        job["file"] = os.path.join(self.path, state, name)
        if st is not None:
            job["mtime"] = record.rfc3339(st.st_mtime)
            if state in ("new", "failed"):
                job["due_at"] = record.rfc3339(st.st_mtime)
        if state in ("new", "failed", "held", "waiting") and job.get("valid") is not False:
            why = self._why(job, state, st)
            if why:
                job["why"] = why
        return job

    def _why(self, job: dict[str, Any], state: str, st: os.stat_result | None) -> str | None:
        """Why a waiting job is not running (None: nothing keeps it but a free worker)."""
        from .ordering import holders, outcome_state  # imported here: start-up speed

        if state == "held":
            return f"held (spoolq release {job['id']})"
        try:
            if state == "waiting":
                deps = [d for d in record.after_of(job)
                        if outcome_state(self.dir, self._history, d) == "unfinished"]
                return f"waiting for job {', '.join(deps)}" if deps else "its dependencies have finished: released soon"
            if st is not None and st.st_mtime > time.time():
                return f"not due until {record.rfc3339(st.st_mtime)}"
            for name in record.locks_of(job):
                taken = holders(self.order, name)
                if len(taken) >= config.lock_limit(self.settings, name):
                    return f"lock {name} held by job {', '.join(taken)}"
        except (InvalidJob, TypeError, AttributeError):
            return None
        return None

    def _listed(self, state: str, name: str, st: os.stat_result | None = None) -> dict[str, Any]:
        """What the listing tells of a file whose record this user may not
        read (a member, of a record of the owner's side): its id, state and
        times, and whose the record is. Never called invalid: it is not."""
        if st is None:
            st = self.dir.lstat(state, name)
        job: dict[str, Any] = {"id": id_of(name), "state": "dropped" if state == DROP else state,
                               "file": os.path.join(self.path, state, name), "mtime": record.rfc3339(st.st_mtime)}
        if state in ("new", "failed"):
            job["due_at"] = job["mtime"]
        job["readable"] = False
        owner = user_name(self.dir.owner)
        if state == DROP:
            job["note"] = f"waiting in drop/ for a worker of {owner}, the spool's owner, to pick it up"
        else:
            job["note"] = (f"the record is readable by {owner}, the spool's owner, only; "
                           "it is shown whole once it is in the history (compacted into index.db)")
        return job

    def _handled(self) -> set[str] | None:
        """The handler kinds the spool's workers run, as they last said;
        worked out once per command (None: no worker has said, or this
        user is a member, who may not read workers/)."""
        if self.dir.member:
            return None
        cached = getattr(self, "_handled_cache", False)
        if cached is False:
            from .registry import handled_kinds  # imported here: start-up speed (as in get())

            said = handled_kinds(self.dir)
            cached = self._handled_cache = said[0] if said is not None else None
        return cached

    def resolve(self, given: str, states: tuple[str, ...] = STATES,
                finished: tuple[str, ...] = ("done", "dead")) -> str:
        """The id ``given`` stands for: itself when a job has it (or it is
        no valid id), else the one id in ``states`` (and, compacted, in the
        index's ``finished``) that begins with it, as git takes a commit's.
        NotPossible names the candidates when several begin with it; with
        none, ``given`` is returned for the caller's own "no such job"."""
        self._open()
        if not given or id_problem(given) or self.dir.find((file_name(given), given)) is not None:
            return given
        index = self.index()
        if index is not None and index.has(given):
            return given
        found: set[str] = set()
        for state in states:
            found.update(id_of(name) for name in self.dir.names(state)
                         if name.startswith(given) and not id_problem(id_of(name)))
        if index is not None and finished:
            found.update(index.ids_with_prefix(given, finished, PREFIX_SHOWN + 1))
        if len(found) == 1:
            return found.pop()
        if found:
            shown = sorted(found)[:PREFIX_SHOWN]
            more = ", ..." if len(found) > PREFIX_SHOWN else ""
            raise NotPossible(f"{given} is the start of more than one job's id: {', '.join(shown)}{more} (give more of it)")
        return given

    def get(self, job_id: str) -> dict[str, Any] | None:
        """The job's record as a dict with ``state`` set from where it is
        (``new``, ``cur``, ``failed``, ``dead``, ``done``), compacted jobs
        included; None if there is no such job."""
        self._open()
        named = bool(id_problem(job_id))  # a file listed under a name that is no valid id
        names = listed_names(job_id) if named else (file_name(job_id), job_id)
        if not names:
            return None
        for _ in range(3):  # the file may move between looking and reading
            where = self.dir.find(names)
            if where is None:
                break
            state, name = where
            try:
                job = self._read_record(state, name)
            except FileNotFoundError:
                continue
            if state == "cur" and not self.dir.member:
                from .registry import live_workers  # imported here: start-up speed (only a job in cur/ needs it)

                for w in live_workers(self.dir):
                    if job_id in (w.get("jobs") or {}):
                        job["worker"] = w.get("worker")
            return job
        if self.dir.shared:
            where = self.dir.find(names, (DROP,))
            if where is not None:
                try:
                    return self._listed(DROP, where[1])
                except FileNotFoundError:
                    pass  # picked up meanwhile: in new/ now, or further
                return self.get(job_id) if not named else None
        index = self.index() if not named else None
        if index is not None:
            return index.get(job_id)
        return None

    def output(self, job_id: str, stream: str, offset: int, hold: bool = False) -> tuple[bytes, int] | None:
        """A running job's output from out/ (see LiveOutputs.read)."""
        self.dir.open()
        return self.dir.outputs.read(job_id, stream, offset, hold)

    def live_workers(self) -> list[dict[str, Any]]:
        """The live workers' registrations (none for a member: they are the owner's)."""
        from .registry import live_workers  # imported here: start-up speed (as in get())

        self._open()
        return [] if self.dir.member else live_workers(self.dir)

    def complete_ids(self, states: tuple[str, ...], prefix: str) -> list[str]:
        """The ids in these states' folders that begin with ``prefix``, for
        shell completion: only a listing (compacted jobs are not offered)."""
        found = set()
        for state in states:
            try:
                with os.scandir(os.path.join(self.path, state)) as entries:
                    for entry in entries:
                        name = entry.name[:-5] if entry.name.endswith(".json") else entry.name
                        if name.startswith(prefix) and not entry.name.startswith("."):
                            found.add(name)
            except OSError:
                continue
        return sorted(found)

    def metrics(self, on_problem: Callable[[str], None] | None = None) -> dict[str, Any]:
        """The numbers behind ``status --prometheus`` (see metrics.py)."""
        from .metrics import collect  # imported here: start-up speed (only the metrics need it)

        return collect(self, on_problem)

    def counts(self, on_problem: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Counts per state (``done`` includes compacted jobs), the jobs in
        cur/ whose worker died (``abandoned``), and live workers; a file in
        workers/ that is no registration is skipped and told to ``on_problem``."""
        self._open()
        counts: dict[str, Any] = {state: self.dir.count(state) for state in ("new", "cur", "failed")}
        # A file compaction (or a purge) has committed but not yet removed
        # counts once, as the index's: done/ and dead/ are listed first,
        # then the index read as of one instant after that.
        listed = {state: [id_of(name) for name in self.dir.names(state)] for state in ("dead", "done")}
        index = self.index()
        compacted = purged = 0
        if index is not None:
            with index.snapshot():
                compacted, purged = index.count("done"), index.count("dead")
                for state in ("dead", "done"):
                    if listed[state]:
                        folded = index.present(listed[state], state)
                        listed[state] = [i for i in listed[state] if i not in folded]
        counts.update(dead=len(listed["dead"]), done=len(listed["done"]) + compacted, done_files=len(listed["done"]),
                      compacted=compacted, dead_purged=purged)
        counts.update(held=self.dir.count("held"), waiting=self.dir.count("waiting"))
        from .registry import live_workers  # imported here: start-up speed (as in get())

        if self.dir.shared and not self.dir.member:
            counts["dropped"] = sum(1 for name in self.dir.drops.names()
                                    if name[0] != "." and not name.endswith(REPLY_SUFFIX))
        counts["abandoned"] = sum(self.dir.is_locked("cur", name) is False for name in self.dir.names("cur"))
        # Registrations and the note of what waits are the owner's alone:
        # a member sees no workers.
        if self.dir.member:
            counts["workers"], counts["workers_seen"], counts["unhandled"] = [], False, {}
            counts["paused"] = None
            return counts
        counts["paused"] = self.paused()
        workers = live_workers(self.dir, on_problem)
        counts["workers"] = [{k: w.get(k) for k in ("worker", "host", "pid", "started_at", "jobs", "kinds")} for w in workers]
        counts["unhandled"] = self._unhandled(workers, counts["new"] + counts["failed"])
        return counts

    def _unhandled(self, workers: list[dict[str, Any]], waiting: int) -> dict[str, int]:
        """Due handler jobs that wait for a worker with a handler for their
        kind, by kind, as the last worker to finish a pass counted them
        (kinds a live worker runs left out: it will take them)."""
        from .registry import read_unhandled  # imported here: start-up speed (as in get())

        note = read_unhandled(self.dir) if waiting else None
        if note is None:
            return {}
        live = {k for w in workers for k in (w.get("kinds") or []) if isinstance(k, str)}
        return {str(k): min(n, waiting) for k, n in note["waiting"].items() if k not in live and n > 0}

    def recent(self, state: str, limit: int) -> list[dict[str, Any]]:
        """The ``limit`` newest files of ``state`` by modification time (a
        finished job's is its finish, a failed one's its due time), newest
        first: one listing with the files' times, and those files read."""
        self._open()
        newest = heapq.nlargest(limit, ((st.st_mtime_ns, name) for name, st in self.dir.entries(state)))
        found = []
        for _, name in newest:
            try:
                found.append(self._read_record(state, name))
            except FileNotFoundError:
                continue  # moved on meanwhile
        return found

    def list(
        self, state: str | None = None, limit: int | None = None, since: float | None = None
    ) -> Iterator[dict[str, Any]]:
        """Records oldest first, by (due or finish time = file mtime, name).
        ``state`` picks one folder; done includes compacted jobs, dead the
        ones purged into the index. The jobs of new/ or failed/ alone are
        listed in the order a worker takes them: the highest priority
        first (its marker's), then as above."""
        self._open()
        states = (state,) if state else STATES
        found = []
        for st_name in states:
            for name, st in self.dir.entries(st_name):
                if since is not None and st.st_mtime < since:
                    continue
                found.append((st.st_mtime_ns, name, st_name))
        found.sort()
        if state in ("new", "failed"):
            marks = self.order.priorities()
            if marks:
                found.sort(key=lambda f: -marks.get(f[1], 0))  # (stable: due time within a priority)
        finished = tuple(s for s in ("done", "dead") if s in states)
        index = self.index() if finished else None
        if index is None:
            yield from self._merged(found, iter(()), limit)
            return
        with index.snapshot():
            # A done/ or dead/ file whose row compaction (or a purge) has
            # committed is listed once, from the index (see status).
            for st_ in finished:
                ids = [id_of(name) for _, name, st_name in found if st_name == st_]
                folded = index.present(ids, st_) if ids else set()
                if folded:
                    found = [f for f in found if f[2] != st_ or id_of(f[1]) not in folded]
            rows = index.iter_finished(finished, since=since)
            yield from self._merged(found, self._not_in_folders(rows), limit, folded_later=self._folded_later)

    def _not_in_folders(self, rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """The index's purged dead jobs but those back in a folder: a retry
        of one that was killed before the index said so leaves both."""
        for job in rows:
            if job["state"] != "dead" or self.dir.find((file_name(job["id"]),), ("new", "cur", "failed", "done")) is None:
                yield job

    def _folded_later(self, job_id: str) -> dict[str, Any] | None:
        """A job's compacted record, read past the snapshot a listing holds:
        for a file compaction removed after the snapshot was taken."""
        from .index import Index  # imported here: start-up speed (as in index())

        later = Index(self.index().path, durable=False, shared=self.dir.shared)
        try:
            return later.get(job_id)
        finally:
            later.close()

    def _merged(self, found: list, compacted: Iterator[dict[str, Any]], limit: int | None,
                folded_later: Callable[[str], dict[str, Any] | None] | None = None) -> Iterator[dict[str, Any]]:
        """The listed files' records and the compacted jobs, merged in order."""
        count = 0
        pending = next(compacted, None)
        for mtime_ns, name, st_name in found:
            while pending is not None and pending["_sort"] < (mtime_ns, name):
                if limit is not None and count >= limit:
                    return
                pending.pop("_sort", None)
                yield pending
                count += 1
                pending = next(compacted, None)
            if limit is not None and count >= limit:
                return
            try:
                job = self._read_record(st_name, name)
            except FileNotFoundError:
                job = folded_later(id_of(name)) if folded_later is not None and st_name in ("done", "dead") else None
                if job is None:
                    continue
            yield job
            count += 1
        while pending is not None and (limit is None or count < limit):
            pending.pop("_sort", None)
            yield pending
            count += 1
            pending = next(compacted, None)
