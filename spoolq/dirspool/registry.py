"""Worker registrations: one file per running worker in ``workers/``.

A worker creates ``workers/<worker id>.json`` already locked and holds that
flock for its whole life, so a registration whose lock is free belongs to a
dead worker. The file says who the worker is (host, pid, boot id, process
start time) and which jobs it runs, with their attempt number and the process
group of each run. ``status`` reads it to show live workers; recovery reads a
dead worker's file to count the interrupted runs and kill what they left.

The file is rewritten in place (no fsync: it only has to survive the death
of its process; after a power cut every process is gone anyway).

Beside the registrations, ``workers/.unhandled`` says which kinds of due
handler jobs the last worker to finish a pass left waiting for want of a
handler, and which kinds it had handlers for: what ``status``, ``list``
and ``show`` tell of such jobs once that worker is gone. ``workers/.passed``
lists those jobs (folder, name, due time, kind), so that the next worker
passes them over without reading each one again.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time
from typing import Any, Callable

from .. import procs
from .protocol import Busy, Gone, Held, NotRegular, SpoolDir
from ..record import rfc3339

_encoder = json.JSONEncoder(separators=(",", ":"))


def make_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", os.uname().nodename)[:40] or "host"
    return f"{host}.{os.getpid()}.{os.urandom(3).hex()}"


class Registration:
    """This worker's registration, kept current as jobs start and end."""

    def __init__(self, spool: SpoolDir, worker_id: str | None = None, kinds: list[str] | None = None):
        self.spool = spool
        self.worker_id = worker_id or make_worker_id()
        self.jobs: dict[str, dict[str, Any]] = {}
        self._on_disk: set[str] = set()  # the jobs of the last save
        self._dirty = False
        self._stop_flusher: threading.Event | None = None
        self._prefix = ""
        self._held: Held | None = None
        self._lock = threading.Lock()
        pid = os.getpid()
        self._info = {
            "worker": self.worker_id,
            "host": os.uname().nodename,
            "pid": pid,
            "boot_id": procs.boot_id(),
            "proc_start": procs.start_time(pid),
            "started_at": rfc3339(),
            "kinds": sorted(kinds or []),  # the handler kinds it runs
        }

    def open(self) -> None:
        self.spool.open(create=True)
        # The fixed part is serialised once; each save only adds the jobs.
        self._prefix = json.dumps(self._info, separators=(",", ":"))[:-1] + ',"jobs":'
        self._held = self.spool.create_held("workers", self.worker_id + ".json", self._dumps())

    def _dumps(self) -> bytes:
        # A run's start is kept as a number and written as a time here: a
        # save comes far less often than a start.
        jobs = {job_id: {**entry, "started_at": rfc3339(entry["started_at"])} for job_id, entry in self.jobs.items()}
        return (self._prefix + _encoder.encode(jobs) + "}\n").encode()

    def _save(self) -> None:
        self._dirty = False
        if self._held is not None:
            self._held.rewrite(self._dumps(), durable=False)
            self._on_disk = set(self.jobs)

    # Only job_spawned writes at once: the process group must be on disk
    # before the worker can die and orphan it. Starts and ends are written by
    # flush() (the worker's flusher thread, or when it goes idle): recovery
    # counts an interrupted run whether or not its entry made it to disk, and
    # an entry for a job no longer in cur/ is ignored. For status the lag is
    # at most the flush interval; for a drain it saves a write per job.

    def job_started(self, job_id: str, attempt: int) -> None:
        """Note that a run begins. Written at once if the file still lists
        this job's previous run (ended, not yet flushed: a job retried within
        the flush interval): recovery would take that run for the one under
        way, and a recorded finish of it for this run's."""
        with self._lock:
            self.jobs[job_id] = {"attempt": attempt, "started_at": time.time()}
            self._dirty = True
            if job_id in self._on_disk:
                self._save()

    def ensure_listed(self, job_id: str) -> None:
        """Write now if the file does not list this job's run yet. Called
        before a failed run's outcome goes into its record in cur/: should
        the worker die before the move to failed/, recovery must see that
        the record is of this run, or it takes it for the run before and
        counts a run that never happened. (Runs with a process are listed
        when it starts; an in-process handler's only here.)"""
        with self._lock:
            if job_id in self.jobs and job_id not in self._on_disk:
                self._save()

    def job_spawned(self, job_id: str, pid: int, spawn_window: tuple[int, int]) -> None:
        """Record the process group of a run now, so recovery can kill what it
        leaves. ``spawn_window``: boot ticks just before and after the spawn,
        which the leader's start time must fall in (pid reuse check)."""
        with self._lock:
            entry = self.jobs.get(job_id)
            if entry is not None:
                entry["pgid"] = pid
                entry["spawned"] = list(spawn_window)
                self._save()

    def job_ended(self, job_id: str) -> None:
        """Forget a run that ended."""
        with self._lock:
            if self.jobs.pop(job_id, None) is not None:
                self._dirty = True

    # The port's names (backend.WorkerReg).

    def note_run(self, job_id: str, attempt: int, pgid: int | None = None,
                 window: tuple[int, int] | None = None) -> None:
        if pgid is None:
            self.job_started(job_id, attempt)
        else:
            self.job_spawned(job_id, pgid, window or (0, 0))

    def ensure_noted(self, job_id: str) -> None:
        self.ensure_listed(job_id)

    def end_run(self, job_id: str) -> None:
        self.job_ended(job_id)

    def flush(self) -> None:
        """Write pending changes."""
        with self._lock:
            if self._dirty:
                self._save()

    def start_flusher(self, interval: float = 0.25) -> None:
        """Flush every ``interval`` seconds in a daemon thread until close()."""
        self._stop_flusher = threading.Event()

        def loop() -> None:
            while not self._stop_flusher.wait(interval):
                try:
                    self.flush()
                except OSError:
                    pass

        with procs.signals_to_main_thread():
            threading.Thread(target=loop, name="spoolq-registration", daemon=True).start()

    def close(self) -> None:
        """Unregister. If runs are still listed (the worker is failing, not
        exiting cleanly) the file is kept, just unlocked: recovery needs it to
        count those runs and kill what they left."""
        if self._stop_flusher is not None:
            self._stop_flusher.set()
        with self._lock:
            if self._held is not None:
                if self.jobs:
                    try:
                        self._save()
                    except OSError:
                        pass
                    self._held.release()
                else:
                    self._held.unlink()
                self._held = None


_UNREADABLE = " unreadable"  # the key read_all marks a file it could not parse with (no JSON key a worker writes)


def read_all(spool: SpoolDir) -> list[dict[str, Any]]:
    """Every registration with ``live`` set when its worker still runs."""
    out = []
    try:
        names = sorted(spool.names("workers"))
    except Exception:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        live = spool.is_locked("workers", name)
        if live is None:
            continue
        try:
            data, _ = spool.read("workers", name, 1 << 20)
            info = json.loads(data)
        except (OSError, ValueError, NotRegular, RecursionError) as e:
            info = {"worker": name[:-5], _UNREADABLE: "not JSON" if isinstance(e, ValueError) else "unreadable"}
        if not isinstance(info, dict):
            info = {"worker": name[:-5], _UNREADABLE: "not a JSON object"}
        info["live"] = live
        info["file"] = name
        out.append(info)
    return out


def live_workers(spool: SpoolDir, on_problem: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The registrations of running workers. Any file in workers/ can be
    locked by whoever may write there, so one that is not a registration as
    a worker writes it is skipped (and told to ``on_problem``), never
    passed on for status and metrics to trip over."""
    out = []
    for w in read_all(spool):
        if not w.get("live"):
            continue
        problem = registration_problem(w)
        if problem is None:
            out.append(w)
        elif on_problem is not None:
            on_problem(f"workers/{w['file']}: {problem}; skipped")
    return out


_FIELDS = (("worker", str, "a string"), ("host", str, "a string"), ("pid", int, "a number"),
           ("started_at", str, "a string"), ("jobs", dict, "an object"))


def registration_problem(info: dict[str, Any]) -> str | None:
    """Why a live registration's content is not one a worker writes, or None."""
    if _UNREADABLE in info:
        return f"not a worker registration ({info[_UNREADABLE]})"
    for key, kind, what in _FIELDS:
        value = info.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"not a worker registration ({key} is not {what})"
    if not all(isinstance(entry, dict) for entry in info["jobs"].values()):
        return "not a worker registration (an entry of jobs is not an object)"
    return None


class DeadRegistration:
    """A dead worker's registration, held by the recovery that handles it."""

    def __init__(self, held: Held, info: dict[str, Any], believed: bool = True):
        self.held = held
        self.info = info
        # False for a file this user may not take the word of (see
        # take_dead): it is only looked at, to leave alone a job whose run
        # goes on; nothing it names is signalled, counted or rewritten.
        self.believed = believed
        # Set by take_dead when a locked registration names the same worker:
        # this file is a copy (or a leftover) of a live worker's, whose
        # processes are not ours to kill.
        self.worker_alive = False
        # Jobs whose runs left processes this recovery may not kill (another
        # user's): they stay in cur/ until those end (see kill_processes).
        self.unkillable: set[str] = set()

    @property
    def jobs(self) -> dict[str, dict[str, Any]]:
        jobs = self.info.get("jobs")
        return jobs if isinstance(jobs, dict) else {}

    def kill_processes(self) -> int:
        """Kill whatever the dead worker's runs left alive: only for a worker
        of this host (another host's, or another container's, pids are not
        ours to see) and of this boot. Returns how many were killed. A run
        whose processes live on because they are not ours to kill (a worker
        of another user died, in a shared spool) is put in ``unkillable``:
        its job must stay in cur/, or it would run twice at once."""
        killed = 0
        worker_id = self.info.get("worker")
        boot = str(self.info.get("boot_id", ""))
        since = self.info.get("proc_start")
        if self.info.get("host") != os.uname().nodename or self.worker_alive:
            return 0
        # Without the worker's own start time no process can be checked
        # against it, and one with an empty id marks nothing.
        if not (isinstance(worker_id, str) and worker_id and isinstance(since, int) and not isinstance(since, bool)):
            return 0
        owner = self.held.st.st_uid
        for job_id, entry in self.jobs.items():
            if not isinstance(entry, dict):
                continue
            pgid = entry.get("pgid") if isinstance(entry.get("pgid"), int) else None
            window = entry.get("spawned")
            if not (isinstance(window, list) and len(window) == 2 and all(isinstance(t, int) for t in window)):
                window = None
            done, refused = procs.kill_run(worker_id, boot, since, owner, (job_id, pgid, tuple(window) if window else None),
                                           self.believed)
            killed += done
            if refused:
                self.unkillable.add(job_id)
        # The worker may have died between starting a process and
        # recording it: find those by the SPOOLQ_WORKER they inherited.
        done, refused = procs.kill_run(worker_id, boot, since, owner, None, self.believed)
        killed += done
        if refused:  # whose run they belong to is not known: none of its jobs may go
            self.unkillable.update(self.jobs)
        return killed

    def note_run(self, job_id: str, attempt: int) -> None:
        """List a run of this dead worker that it had not written down."""
        self.info["jobs"] = dict(self.jobs, **{job_id: {"attempt": attempt}})
        self.held.rewrite((json.dumps(self.info, separators=(",", ":")) + "\n").encode(), durable=False)

    def forget(self, job_ids: set[str]) -> None:
        """Drop the entries of runs that have been recovered, so a later
        recovery does not act on them again."""
        jobs = {k: v for k, v in self.jobs.items() if k not in job_ids}
        if jobs != self.jobs:
            self.info["jobs"] = jobs
            self.held.rewrite((json.dumps(self.info, separators=(",", ":")) + "\n").encode(), durable=False)

    def remove(self) -> None:
        self.held.unlink()

    def release(self) -> None:
        self.held.release()


def take_dead(spool: SpoolDir, wait_for: set[str] = frozenset(), patience: float = 5.0,
              trusted: frozenset[int] | None = None) -> list[DeadRegistration]:
    """Lock the registrations of dead workers. A registration that is still
    locked but lists a job in ``wait_for`` (a ``cur/`` job we found unlocked)
    belongs to a worker that is dying right now: wait up to ``patience``
    seconds for the kernel to finish releasing its locks.

    A registration is believed only if a user in ``trusted`` owns it, with
    one link, and neither the group nor others may write it: anyone else's
    file could name any process and any count of runs. One that is not is
    still returned, not believed (``DeadRegistration.believed``), so that a
    job whose run it names and that visibly goes on (processes of that
    file's owner marked with its worker id) is left alone rather than run a
    second time at once."""
    taken = []
    live_ids: set[str] = set()
    try:
        names = sorted(spool.names("workers"))
    except Exception:
        return taken
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            held = _hold_dead(spool, name, wait_for, patience, live_ids)
        except OSError:
            # Out of descriptors: fail the recovery rather than
            # recover a job without killing what its run left alive.
            for reg in taken:
                reg.release()
            raise
        if held is None:
            continue
        st = held.st
        believed = trusted is None or (st.st_uid in trusted and st.st_nlink == 1 and not st.st_mode & 0o022)
        taken.append(DeadRegistration(held, _registration_info(held), believed))
    for reg in taken:
        reg.worker_alive = str(reg.info.get("worker", "")) in live_ids
    return taken


def _hold_dead(spool: SpoolDir, name: str, wait_for: set[str], patience: float, live_ids: set[str]) -> Held | None:
    """Lock one registration if its worker is dead (see take_dead); None if
    it is not to be taken, its worker id added to ``live_ids`` when that
    worker is alive. Raises OSError only when out of descriptors."""
    deadline = time.monotonic() + patience
    replaced = 0
    while True:
        try:
            return spool.hold("workers", name)
        except Busy:
            if wait_for and time.monotonic() < deadline and _lists_any(spool, name, wait_for):
                time.sleep(0.01)
                continue
            live_ids.add(_worker_of(spool, name))
            return None
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise
            return None
        except Gone:
            # The name now names another file: a live worker rewriting its
            # registration by rename. Look again; if it keeps changing,
            # its worker is alive.
            replaced += 1
            if replaced < 20:
                time.sleep(0.001)
                continue
            live_ids.add(_worker_of(spool, name))
            return None
        except NotRegular:
            return None


def _registration_info(held: Held) -> dict[str, Any]:
    """A held registration's JSON object ({} when it is not one)."""
    try:
        info = json.loads(held.read(1 << 20) or b"{}")
        if not isinstance(info, dict):
            info = {}
    except (ValueError, RecursionError):
        info = {}
    return info


def _worker_of(spool: SpoolDir, name: str) -> str:
    """The worker id a registration names (its file name if unreadable)."""
    try:
        data, _ = spool.read("workers", name, 1 << 20)
        info = json.loads(data)
        if isinstance(info, dict) and isinstance(info.get("worker"), str):
            return info["worker"]
    except (OSError, ValueError, NotRegular, RecursionError):
        pass
    return name[:-5]


def _lists_any(spool: SpoolDir, name: str, job_ids: set[str]) -> bool:
    try:
        data, _ = spool.read("workers", name, 1 << 20)
        jobs = json.loads(data).get("jobs") or {}
    except (OSError, ValueError, AttributeError, NotRegular, RecursionError):
        return False
    return any(j in jobs for j in job_ids)


UNHANDLED = ".unhandled"


def read_unhandled(spool: SpoolDir) -> dict[str, Any] | None:
    """``workers/.unhandled``: ``{"worker", "at", "kinds": [the kinds its
    writer had handlers for], "waiting": {kind: due jobs left waiting}}``,
    or None when there is none (or it is not what a worker writes)."""
    try:
        data, _ = spool.read("workers", UNHANDLED, 1 << 16)
        note = json.loads(data)
    except (OSError, ValueError, NotRegular, RecursionError):
        return None
    if not isinstance(note, dict) or not isinstance(note.get("kinds"), list) or not isinstance(note.get("waiting"), dict):
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in note["waiting"].values()):
        return None
    return note


def write_unhandled(spool: SpoolDir, worker_id: str, kinds: list[str], waiting: dict[str, int]) -> None:
    """Say which due handler jobs this worker left waiting, by kind, unless
    the note says so already (workers that see the same spool write nothing)."""
    note = read_unhandled(spool)
    if note is None and not waiting:
        return
    if note is not None and sorted(note["kinds"]) == sorted(kinds) and note["waiting"] == waiting:
        return
    data = {"worker": worker_id, "at": rfc3339(), "kinds": sorted(kinds), "waiting": dict(sorted(waiting.items()))}
    spool.replace_file("workers", UNHANDLED, (json.dumps(data) + "\n").encode())


def handled_kinds(spool: SpoolDir, workers: list[dict[str, Any]] | None = None) -> tuple[set[str], dict[str, Any] | None] | None:
    """The kinds the spool's workers have handlers for, by their word (the
    live workers' registrations and the last note), and the note; None
    when no worker has said (none runs, and none ever left a note)."""
    if workers is None:
        workers = live_workers(spool)
    note = read_unhandled(spool)
    if note is None and not workers:
        return None
    kinds = {k for w in workers for k in (w.get("kinds") or []) if isinstance(k, str)}
    if note is not None:
        kinds.update(k for k in note["kinds"] if isinstance(k, str))
    return kinds, note


PASSED = ".passed"
PASSED_MAX = 200_000  # entries kept: more are read again by the next worker


def read_passed(spool: SpoolDir) -> dict[tuple[str, str, int], str]:
    """``workers/.passed``: (folder, name, due time in ns) -> kind of the due
    handler jobs the last worker to end left waiting for want of a handler
    (empty when there is none, or it is not what a worker writes)."""
    try:
        data, _ = spool.read("workers", PASSED, 64 << 20)
        passed = json.loads(data)
    except (OSError, ValueError, NotRegular, RecursionError):
        return {}
    out: dict[tuple[str, str, int], str] = {}
    if not isinstance(passed, dict):
        return out
    for kind, entries in passed.items():
        if not isinstance(entries, list):
            continue
        for entry in entries:
            if (isinstance(entry, list) and len(entry) == 3 and entry[0] in ("new", "failed")
                    and isinstance(entry[1], str) and type(entry[2]) is int):
                out[(entry[0], entry[1], entry[2])] = kind
    return out


def write_passed(spool: SpoolDir, passed: dict[tuple[str, str, int], str]) -> None:
    """Replace ``workers/.passed`` (see read_passed); none when ``passed`` is empty."""
    by_kind: dict[str, list] = {}
    for (state, name, due_ns), kind in list(passed.items())[:PASSED_MAX]:
        by_kind.setdefault(kind, []).append([state, name, due_ns])
    if by_kind:
        spool.replace_file("workers", PASSED, (json.dumps(by_kind, separators=(",", ":")) + "\n").encode())
    else:
        spool.remove_file("workers", PASSED)
