"""How a job moves between states: claim, finish, cancel, retry, quarantine
and recovery. Every move happens while holding the file's flock, with the
record rewritten first and then one rename, so a crash at any instant leaves
the job in exactly one folder with a whole record.

The worker loop, ``spoolq sweep``, ``cancel``, ``retry`` and the Python API
all come through here.
"""

from __future__ import annotations

import os
import random
import stat
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import config, procs, record, registry
from .errors import Busy, Exists, Gone, Incomplete, InvalidJob, JobNotFound, NotPossible, NotRegular  # noqa: F401 - JobNotFound, NotPossible: importable from here too
from .protocol import (
    Entry,
    Held,
    SpoolDir,
    duplicate_name,
    file_name,
    id_of,
    id_problem,
    kind_of,
    listed_names,
    staged_intact,
)
from .record import rfc3339
from .runner import Outcome


@dataclass
class Context:
    """What every transition needs to know about the spool."""

    spool: SpoolDir
    settings: dict[str, Any]  # a config.Settings, whose reload() the context sees
    index_has: Callable[[str], bool] = lambda job_id: False
    _trusted: frozenset[int] | None = None
    _trusted_generation: int = -1

    @property
    def trusted_uids(self) -> frozenset[int]:
        generation = getattr(self.settings, "generation", 0)
        if self._trusted is None or self._trusted_generation != generation:
            uids = {os.geteuid(), 0}
            for user in self.settings.get("trusted_users", []):
                uid = _uid_of(user)
                if uid is not None:
                    uids.add(uid)
            self._trusted = frozenset(uids)
            self._trusted_generation = generation
        return self._trusted


def _uid_of(user: str) -> int | None:
    import pwd

    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        try:
            return int(user)
        except ValueError:
            return None


def _user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@dataclass
class Claimed:
    """A job this process holds and is about to run: locked in its waiting
    folder once prepared, in cur/ once taken."""

    held: Held
    job: dict
    job_id: str
    due_ns: int
    origin: str
    prepared_mtime_ns: int = 0  # the file's mtime when prepare() was done with it

    @property
    def attempt(self) -> int:
        return int(self.job.get("attempts") or 0) + 1


# --------------------------------------------------------------------------
# checking a file


ERROR_LIMIT = 2000  # characters of a run's error message kept in the record

#: A file in new/ that does not parse yet (empty, or cut short) and changed
#: less than this many seconds ago may still be being written by someone who
#: writes straight into new/ instead of renaming a finished file in: it is
#: left for a later look, and goes to dead/ only if it is still unfinished
#: once it has been left alone this long.
WRITER_GRACE = 5.0


def check(ctx: Context, st: os.stat_result, read: Callable[[int], bytes], name: str) -> dict:
    """The job a file holds, or InvalidJob with the reason it can never run."""
    if not stat.S_ISREG(st.st_mode):
        raise InvalidJob(f"{kind_of(st.st_mode)}, not a regular file")
    if st.st_uid not in ctx.trusted_uids:
        raise InvalidJob(
            f"owned by untrusted user {_user_name(st.st_uid)} (uid {st.st_uid}); "
            "add it to the trusted_users setting to run its jobs"
        )
    limit = int(ctx.settings["max_job_bytes"])
    if st.st_size > limit + record.RECORD_SLACK:
        raise InvalidJob(f"{st.st_size} bytes, larger than max_job_bytes ({limit})")
    job_id = id_of(name)
    problem = id_problem(job_id)
    if problem:
        raise InvalidJob(f"bad file name: {problem}")
    return record.parse_sized(read(limit + record.RECORD_SLACK + 1), job_id, limit)


def dead_reason(ctx: Context, folder: str, name: str) -> str | None:
    """Why a file can never run, worked out again from the file (its bytes
    are kept unchanged in dead/), or None if it is a valid job."""
    sp = ctx.spool
    try:
        st = sp.lstat(folder, name)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return f"{kind_of(st.st_mode)}, not a regular file"
    try:
        check(ctx, st, lambda n: sp.read(folder, name, n)[0], name)
    except InvalidJob as e:
        return str(e)
    except NotRegular as e:
        return f"{e.kind}, not a regular file"
    except OSError as e:
        return f"unreadable: {e.strerror}"
    return None


# --------------------------------------------------------------------------
# claim


def quarantine(ctx: Context, held: Held, reason: str) -> str:
    """Move a file that can never run to dead/, bytes unchanged. Its mtime
    becomes now, as for every job that dies: dead/ is listed and purged
    by the time each file got there."""
    try:
        held.set_mtime(time.time_ns())
    except OSError:
        pass  # another user's file we may not touch: it keeps its own time
    name = held.move("dead")
    held.release()
    ctx.spool.note_reason(name, reason, held.st)
    return name


def claim(ctx: Context, entry: Entry, now_ns: int, on_quarantine: Callable[[str, str], None] | None = None,
          on_busy: Callable[[], None] | None = None, on_later: Callable[[str, int], None] | None = None) -> Claimed | None:
    """Take one waiting file: lock it, check it is still due, validate it,
    and rename it into cur/. Returns None when the race was lost, the file
    is not due, or it was quarantined to dead/ (``on_quarantine(name, reason)``).
    ``on_busy()`` is called when another process holds the file's lock, and
    ``on_later(name, when_ns)`` when a file that may still be being written
    is left until ``when_ns`` (see WRITER_GRACE)."""
    ready = prepare(ctx, entry, now_ns, on_quarantine, on_busy, on_later)
    return take(ready, now_ns, on_quarantine) if ready is not None else None


def prepare(ctx: Context, entry: Entry, now_ns: int, on_quarantine: Callable[[str, str], None] | None = None,
            on_busy: Callable[[], None] | None = None, on_later: Callable[[str, int], None] | None = None) -> Claimed | None:
    """All of a claim but the rename: lock the waiting file, check it is
    due, validate it. The file stays where it is, held only by the lock, so
    a crash (or ``held.release()``) leaves nothing to recover; other
    workers skip it meanwhile. None as for ``claim``."""
    sp = ctx.spool
    try:
        held = sp.hold(entry.state, entry.name, mode=entry.mode)
    except Busy:
        if on_busy:
            on_busy()
        return None
    except (Gone, FileNotFoundError):
        return None
    except NotRegular as e:
        try:
            name = sp.move_entry(entry.state, entry.name, "dead")
        except FileNotFoundError:
            return None
        sp.note_reason(name, f"{e.kind}, not a regular file")
        if on_quarantine:
            on_quarantine(name, f"{e.kind}, not a regular file")
        return None
    except PermissionError as e:
        return _quarantine_unheld(ctx, entry, f"unreadable: {e.strerror}", on_quarantine)
    due_ns = held.st.st_mtime_ns
    rewritten = False
    try:
        if due_ns > now_ns:  # postponed since the scan
            held.release()
            return None
        try:
            job = check(ctx, held.st, held.read, entry.name)
        except InvalidJob as e:
            settled_ns = held.st.st_mtime_ns + int(WRITER_GRACE * 1e9)
            if isinstance(e, Incomplete) and entry.state == "new" and now_ns < settled_ns:
                held.release()
                if on_later:
                    on_later(entry.name, settled_ns)
                return None
            name = quarantine(ctx, held, str(e))
            if on_quarantine:
                on_quarantine(name, str(e))
            return None
        job_id = job["id"]
        if job.get("state") is None:
            # A file dropped by hand, seen for the first time.
            duplicate = _duplicate_of(ctx, job_id, entry)
            if duplicate:
                # Renamed, so the id keeps meaning the job that had it first;
                # moved first and annotated after, so no crash leaves it runnable.
                reason = f"duplicate id: a job {job_id} is already in {duplicate}"
                new_name = duplicate_name(file_name(job_id))
                held.move("dead", new_name)
                job.update(state="dead", error=reason, id=id_of(new_name))
                held.rewrite(record.dumps(job))
                held.release()
                if on_quarantine:
                    on_quarantine(new_name, reason)
                return None
            job.setdefault("created_at", rfc3339(held.st.st_mtime))
            run_at = job.get("run_at")
            if run_at is not None:
                when = record.parse_time(run_at)
                # Honour run_at once, by the mtime; from now on only the mtime
                # counts. The marked record and its mtime land in one rename.
                job["state"] = "new"
                if when * 1e9 > now_ns:
                    held.rewrite(record.dumps(job), mtime_ns=int(when * 1e9))
                    held.release()
                    return None
                held.rewrite(record.dumps(job))
                rewritten = True
        if job.get("state") == "dead":
            # Moved back from dead/ by hand (or by a retry killed before its
            # rewrite): a fresh round, noted as `spoolq retry` notes it.
            # Written down now, so a crash during the run is counted
            # against the new round.
            job["attempts"] = 0
            job["state"] = "new"
            job["retried_at"] = rfc3339()
            held.rewrite(record.dumps(job))
            rewritten = True
        # take() tells a postponement (touch -d) from our own rewrite by this
        # mtime; without a rewrite it is still the one found when locked.
        mtime_ns = os.fstat(held.fd).st_mtime_ns if rewritten else due_ns
        return Claimed(held, job, job_id, due_ns, entry.state, mtime_ns)
    except BaseException:
        held.release()
        raise


def take(ready: Claimed, now_ns: int, on_quarantine: Callable[[str, str], None] | None = None) -> Claimed | None:
    """Rename a prepared job into cur/: the claim itself. None (and the
    lock let go) if since it was prepared it was postponed (``touch -d``),
    moved away, or replaced under its name (an editor saving by rename):
    the file renamed is always the one locked and read."""
    held, job, job_id = ready.held, ready.job, ready.job_id
    try:
        st = held.still_named()
        if st is None or (st.st_mtime_ns != ready.prepared_mtime_ns and st.st_mtime_ns > now_ns):
            held.release()
            return None
        try:
            # Not synced now: a claim lost to a power cut only means the job
            # runs again. The folders are synced with the next group commit.
            held.move("cur", file_name(job_id), keep_name=True, defer_sync=True)
        except Exists:
            reason = f"duplicate id: a job {job_id} is running"
            new_name = duplicate_name(file_name(job_id))
            held.move("dead", new_name)
            job.update(state="dead", error=reason, id=id_of(new_name))
            held.rewrite(record.dumps(job))
            held.release()
            if on_quarantine:
                on_quarantine(new_name, reason)
            return None
        except FileNotFoundError:
            held.release()
            return None
        return ready
    except BaseException:
        held.release()
        raise


def _quarantine_unheld(ctx, entry, reason, on_quarantine):
    try:
        name = ctx.spool.move_entry(entry.state, entry.name, "dead")
    except FileNotFoundError:
        return None
    ctx.spool.note_reason(name, reason)
    if on_quarantine:
        on_quarantine(name, reason)
    return None


def _duplicate_of(ctx: Context, job_id: str, entry: Entry) -> str | None:
    name = file_name(job_id)
    # Every folder but the file's own (unless it was dropped under another name).
    states = tuple(st for st in ("cur", "failed", "done", "dead", "new") if (st, name) != (entry.state, entry.name))
    found = ctx.spool.find((name,), states)
    if found:
        return found[0] + "/"
    try:
        if ctx.index_has(job_id):
            return "the index (a compacted job)"
    except Exception:  # an unreadable index.db must not stop claims; it is history
        pass
    return None


# --------------------------------------------------------------------------
# finish


_RUN_FIELDS = frozenset(("exit_code", "error", "stdout", "stderr", "result", "result_dropped", "outcome"))


def _clear_run_fields(job: dict) -> None:
    for key in _RUN_FIELDS.intersection(job):
        del job[key]


def decide(ctx: Context, job: dict, out: Outcome, attempt: int) -> str:
    """Where a job goes after a run: done, failed or dead."""
    if out.ok:
        return "done"
    if out.permanent:
        return "dead"
    max_attempts = job.get("max_attempts") or ctx.settings["max_attempts"]
    return "dead" if attempt >= max_attempts else "failed"


def finish(ctx: Context, claimed: Claimed, out: Outcome, worker_id: str, due_now: bool = False,
           defer_sync: bool = False, stage: bool = False) -> tuple[str, float | None]:
    """Record a run's outcome and move the job on: done/, failed/ (due after
    the backoff) or dead/. Returns (state, due time for failed/). With
    ``defer_sync`` the folders are fsynced later by the caller (group commit;
    the record itself is always synced before it replaces the old one).

    With ``stage`` (and a spare to write into) the new record is only staged
    beside the job in cur/ (``claimed.held.staged`` is then set): the caller
    makes it durable with ``SpoolDir.sync_data``, for many jobs at once, and
    then calls ``complete``. Should the caller die first, recovery finds the
    staged record and completes the finish."""
    job = claimed.job
    attempt = claimed.attempt
    now = time.time()
    end = rfc3339(out.end or now)
    error = out.error
    if error is not None and len(error) > ERROR_LIMIT:  # an exception's message has no bound of its own
        error = error[:ERROR_LIMIT] + f"... ({len(error)} characters)"
    entry: dict[str, Any] = {
        "attempt": attempt,
        "worker": worker_id,
        "due": rfc3339(claimed.due_ns / 1e9),
        "start": rfc3339(out.start),
        "end": end,
    }
    if out.exit_code is not None:
        entry["exit_code"] = out.exit_code
    if error is not None:
        entry["error"] = error
    history = job.get("history")
    if not isinstance(history, list):
        history = []
    history.append(entry)
    job["history"] = history
    job["attempts"] = attempt
    _clear_run_fields(job)
    if out.exit_code is not None:
        job["exit_code"] = out.exit_code
    if error is not None:
        job["error"] = error
    if out.stdout:
        job["stdout"] = out.stdout
    if out.stderr:
        job["stderr"] = out.stderr
    if out.has_result:
        job["result"] = out.result
    dest = decide(ctx, job, out, attempt)
    due: float | None = None
    if dest == "done":
        job["outcome"] = "succeeded"
    if dest == "failed":
        if due_now or out.interrupted:
            due = now
        else:
            due = now + _backoff(ctx, attempt)
    job["state"] = dest
    job["finished_at" if dest != "failed" else "failed_at"] = end
    data = _fitted(job, int(ctx.settings["max_job_bytes"]))
    if stage and claimed.held.stage(data):
        return dest, due
    _write_and_move(claimed.held, job, dest, due, defer_sync, data)
    return dest, due


def unclaim(claimed: Claimed) -> str:
    """Move a claimed job that never started back to the folder it was
    taken from, record and due time unchanged (a claim rewrites neither in
    cur/), and let it go. One rename: a crash before it leaves the job in
    cur/ for recovery, which counts an interrupted run, as for any job a
    dead worker held. Returns the folder."""
    claimed.held.move(claimed.origin, keep_name=True)
    claimed.held.release()
    return claimed.origin


def _fitted(job: dict, limit: int) -> bytes:
    """The record, trimmed of what runs added until it fits in max_job_bytes:
    a record spoolq writes must never be one it refuses to read (a job
    enqueued near the limit would go dead for its own stderr tail). Cut in
    turn: the output tails (their starts), the result (noted as dropped),
    the oldest history entries (counted). The job's own fields are never
    cut: for a job that leaves no room, see record.RECORD_SLACK."""
    data = record.dumps(job)
    for key in ("stdout", "stderr"):
        while len(data) > limit and isinstance(job.get(key), str):
            text = job[key]
            keep = len(text) - (len(data) - limit) - 256
            if keep > 0:
                job[key] = text[-keep:]
            else:
                del job[key]
            data = record.dumps(job)
    if len(data) > limit and "result" in job:
        size = len(record.dumps(job["result"]))
        del job["result"]
        job["result_dropped"] = f"a result of {size} bytes does not fit in max_job_bytes ({limit})"
        data = record.dumps(job)
    history = job.get("history")
    while len(data) > limit and isinstance(history, list) and len(history) > 1:
        cut, freed = 0, 0
        while freed < len(data) - limit and cut < len(history) - 1:
            freed += len(record.dumps(history[cut]))
            cut += 1
        del history[:cut]
        job["history_dropped"] = dropped_runs(job) + cut
        data = record.dumps(job)
    return data


def dropped_runs(job: dict) -> int:
    """How many history entries trimming has dropped from ``job`` (0 unless
    the field is a count: a job file may hold anything there)."""
    value = job.get("history_dropped")
    return value if type(value) is int and value > 0 else 0


def _backoff(ctx: Context, failures: int) -> float:
    """Seconds until the retry after the ``failures``-th failed run (with jitter)."""
    return config.backoff(ctx.settings, failures, random.uniform(-0.1, 0.1))


def complete(held: Held, dest: str, due: float | None) -> None:
    """The second half of a staged finish, once ``SpoolDir.sync_data`` made
    the record durable: swap it in and move the job to ``dest`` (the folder
    fsyncs deferred, as with ``finish(defer_sync=True)``)."""
    held.commit_staged()
    if due is not None:
        held.set_mtime(int(due * 1e9))
    held.move(dest, defer_sync=True)
    held.release()


def _write_and_move(held: Held, job: dict, dest: str, due: float | None, defer_sync: bool = False,
                    data: bytes | None = None) -> None:
    held.rewrite(record.dumps(job) if data is None else data)
    if due is not None:
        held.set_mtime(int(due * 1e9))
    held.move(dest, defer_sync=defer_sync)
    held.release()


# --------------------------------------------------------------------------
# cancel and retry


def _find_held(ctx: Context, job_id: str, states: tuple[str, ...]) -> Held | None:
    """Hold the file of ``job_id`` in one of ``states`` (None if in none)."""
    problem = id_problem(job_id)
    if problem:
        raise JobNotFound(problem)
    for _ in range(3):  # the file may move while we look; look again
        for state in states:
            for name in (file_name(job_id), job_id):
                try:
                    return ctx.spool.hold(state, name)
                except (FileNotFoundError, Gone):
                    continue
                except NotRegular:
                    continue
    return None


def locate(ctx: Context, job_id: str) -> tuple[str, str] | None:
    """(state, file name) of a job's file, if it is in a state folder."""
    if id_problem(job_id):
        return None
    return ctx.spool.find((file_name(job_id), job_id))


def cancel(ctx: Context, job_id: str, on_note: Callable[[str], None] | None = None) -> None:
    """A waiting job (new/ or failed/) goes to done/ with outcome cancelled.
    Raises JobNotFound, or NotPossible for a running or finished job.
    ``on_note(message)`` hears of a record that could not be rewritten
    after the move (a full disk): the job is cancelled all the same."""
    # A waiting file is locked only for a moment: while a worker claims it
    # (then it is in cur/ and running) or prepares it ahead of the job it is
    # running (then it is let go within LOOK_AHEAD_HOLD). Wait that out.
    deadline = time.monotonic() + 1.0
    while True:
        try:
            held = _find_held(ctx, job_id, ("new", "failed"))
            break
        except Busy:
            if time.monotonic() > deadline:
                raise NotPossible(f"job {job_id} is running (a worker holds it); it cannot be cancelled") from None
            time.sleep(0.001)
    if held is None:
        where = locate(ctx, job_id)
        if where is None:
            if ctx.index_has(job_id):
                raise NotPossible(f"job {job_id} has finished (done, compacted); nothing to cancel")
            raise JobNotFound(f"no job {job_id} in this spool")
        state = where[0]
        if state == "cur":
            raise NotPossible(f"job {job_id} is running; it cannot be cancelled")
        raise NotPossible(f"job {job_id} is in {state}/, not waiting; nothing to cancel")
    try:
        try:
            job = check(ctx, held.st, held.read, held.name)
        except InvalidJob as e:
            raise NotPossible(f"job {job_id} is not a valid job ({e}); a worker will move it to dead/") from None
        _clear_run_fields(job)
        job["state"] = "done"
        job["outcome"] = "cancelled"
        job["finished_at"] = rfc3339()
        # Moved first, rewritten after (locked throughout): a crash in between
        # leaves a job in done/ that never runs, its record not yet saying
        # so (one without an outcome reads as cancelled: record.as_done). Rewritten
        # first, a crash left a record saying done in new/, which a worker
        # would run and its recovery then take for a recorded finish.
        data = record.dumps(job)
        try:
            held.move("done")
        except FileNotFoundError:  # a lock does not stop `mv`
            raise NotPossible(f"job {job_id} was moved away meanwhile (by hand?); nothing was cancelled") from None
        _rewrite_after_move(ctx, held, data, "done", on_note,
                            f"job {job_id} is cancelled, but its record could not be updated", "it reads as cancelled")
    finally:
        held.release()


def retry(ctx: Context, job_id: str, on_note: Callable[[str], None] | None = None) -> None:
    """A dead job back to new/, due now, with a fresh round of attempts
    (its history is kept). Raises JobNotFound or NotPossible. ``on_note``
    as for ``cancel``."""
    if id_problem(job_id) and listed_names(job_id):
        # A file `list` shows under a name that is no valid id: say how to name it.
        where = ctx.spool.find(listed_names(job_id))
        if where is not None and where[0] == "dead":
            raise NotPossible(_rename_hint(ctx, where[1]))
        if where is not None:
            raise NotPossible(f"{job_id!r} is in {where[0]}/, not dead/")
    try:
        held = _find_held(ctx, job_id, ("dead",))
    except Busy:
        raise NotPossible(f"job {job_id} is busy (another command holds it); try again") from None
    if held is None:
        where = locate(ctx, job_id)
        if where is None:
            raise JobNotFound(f"no job {job_id} in dead/")
        if where[0] == "dead":
            try:
                regular = stat.S_ISREG(ctx.spool.lstat("dead", where[1]).st_mode)
            except FileNotFoundError:
                regular = True
            if not regular:
                raise NotPossible(f"dead/{where[1]} is not a regular file, so not a job to retry; move or remove it by hand")
            raise NotPossible(f"job {job_id} is moving (it just reached dead/); try again")
        raise NotPossible(f"job {job_id} is in {where[0]}/, not dead/")
    try:
        _retry_held(ctx, held, on_note)
    finally:
        held.release()


def _rename_hint(ctx: Context, name: str) -> str:
    """Why a dead file under a name that is no valid id cannot be retried,
    and the command that gives it a free, valid one."""
    import re
    import shlex

    job_id = id_of(name)
    base = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "_", job_id)).lstrip(".")[:120] or "job"
    fresh, n = base, 1
    while ctx.spool.find((file_name(fresh), fresh)) or ctx.index_has(fresh):
        n += 1
        fresh = f"{base}-{n}"
    folder = os.path.join(ctx.spool.root, "dead")
    return (f"cannot retry {job_id!r}: {id_problem(job_id)}; give it a valid id, e.g. "
            f"mv {shlex.quote(os.path.join(folder, name))} {shlex.quote(os.path.join(folder, file_name(fresh)))}, "
            f"then retry {fresh}")


def _retry_held(ctx: Context, held: Held, on_note: Callable[[str], None] | None) -> None:
    if id_problem(id_of(held.name)):
        raise NotPossible(_rename_hint(ctx, held.name))
    try:
        job = check(ctx, held.st, held.read, held.name)
    except InvalidJob as e:
        # Back in new/ as it is, it would only die again: say what to change.
        if held.st.st_uid not in ctx.trusted_uids:
            raise NotPossible(f"cannot retry {id_of(held.name)}: {e}") from None
        path = os.path.join(ctx.spool.root, "dead", held.name)
        raise NotPossible(f"cannot retry {id_of(held.name)}: {e}; fix the file ({path}) or remove it") from None
    target = file_name(job["id"])
    elsewhere = ctx.spool.find((target,), ("new", "cur", "failed", "done"))
    if elsewhere:
        raise NotPossible(f"a job {id_of(target)} is already in {elsewhere[0]}/; the dead job stays in dead/")
    # Moved first, rewritten after: a refused move leaves the dead file as it
    # was, and a crash in between leaves it in new/ still marked dead, which
    # a claim takes as a fresh round (as for `mv dead/x.json new/`). Locked
    # throughout, so no worker runs it before the rewrite.
    try:
        held.move("new", target, keep_name=True)
    except Exists:
        raise NotPossible(f"new/{target} already exists; the dead job stays in dead/") from None
    except FileNotFoundError:  # a lock does not stop `mv`
        raise NotPossible(f"dead/{held.name} was moved away meanwhile (by hand?); it was not retried") from None
    _clear_run_fields(job)
    job["state"] = "new"
    job["attempts"] = 0
    job["retried_at"] = rfc3339()
    _rewrite_after_move(ctx, held, record.dumps(job), "new", on_note,
                        f"job {id_of(target)} is back in new/, but its record could not be updated",
                        "a worker still gives it a fresh round")
    try:
        held.set_mtime(time.time_ns())  # due now (its mtime, from when it died, is past anyway)
    except OSError:
        pass  # another user's file we may not touch


def _rewrite_after_move(ctx: Context, held: Held, data: bytes, folder: str, on_note: Callable[[str], None] | None,
                        what: str, meaning: str) -> None:
    """The rewrite that follows the move of a cancel or a retry. The move
    was the change itself, so an error now (a full disk) does not undo it:
    the record stays as it was, which reads right (``meaning``), and
    ``on_note`` hears of it rather than the caller being told it failed."""
    try:
        held.rewrite(data)
        ctx.spool.sync_dir(folder)  # the rewrite's rename (fsync on) as durable as the move was
    except OSError as e:
        if on_note:
            on_note(f"{what} ({e.strerror or e}); {meaning}")


def retry_all(ctx: Context, on_problem: Callable[[str], None] | None = None,
              on_note: Callable[[str], None] | None = None) -> list[str]:
    """Every dead job back to new/; returns the ids moved. A job that
    cannot go is left in dead/ unchanged, and ``on_problem(message)`` says
    why; ``on_note`` as for ``cancel``."""
    moved = []
    for name in sorted(ctx.spool.names("dead")):
        try:
            held = ctx.spool.hold("dead", name)
        except (Gone, FileNotFoundError):
            continue  # moved on meanwhile
        except Busy:
            problem = f"dead/{name} is busy (another command holds it); try again"
        except NotRegular:
            problem = f"dead/{name} is not a regular file, so not a job to retry; move or remove it by hand"
        except PermissionError as e:
            problem = f"dead/{name} cannot be opened: {e.strerror}"
        else:
            try:
                _retry_held(ctx, held, on_note)
                moved.append(id_of(name))
                continue
            except NotPossible as e:
                problem = str(e)
            except OSError as e:  # e.g. new/ cannot grow on a full disk: the others may still go
                problem = f"dead/{name} cannot be moved: {e.strerror or e}"
            finally:
                held.release()
        if on_problem:
            on_problem(problem)
    return moved


# --------------------------------------------------------------------------
# recovery


@dataclass
class RecoveryReport:
    recovered: int = 0  # jobs returned to failed/
    dead: int = 0  # jobs out of attempts, moved to dead/
    completed: int = 0  # runs that had finished but not moved on
    quarantined: int = 0
    killed: int = 0  # leftover processes killed
    left_running: int = 0  # jobs left in cur/: their runs' processes live on, not ours to kill
    workers: int = 0  # dead worker registrations cleared
    tmp_removed: int = 0  # stale tmp/ files removed (sweep)


def recover(ctx: Context) -> RecoveryReport:
    """Return every job a dead worker left in cur/ to failed/ (due now), its
    interrupted run counted as an attempt, or to dead/ when none are left.
    First kill the processes those runs left alive. Jobs are held a batch
    at a time, at most a quarter of the open-file limit (a crash of many
    worker processes can leave more jobs in cur/ than a low limit allows
    open at once); each is tried once."""
    report = RecoveryReport()
    batch = max(1, procs.open_file_limit() // 4)
    tried: set[str] = set()
    while _recover_batch(ctx, report, batch, tried) >= batch:
        pass
    return report


def _recover_batch(ctx: Context, report: RecoveryReport, batch: int, tried: set[str]) -> int:
    """Recover up to ``batch`` unlocked cur/ jobs not in ``tried``; returns how many it held."""
    sp = ctx.spool
    held: list[Held] = []
    for name in sorted(sp.names("cur")):
        if len(held) >= batch:
            break
        if name in tried:
            continue
        tried.add(name)
        try:
            held.append(sp.hold("cur", name))
        except (Busy, Gone, FileNotFoundError):
            continue
        except (NotRegular, PermissionError):
            try:
                sp.move_entry("cur", name, "dead")
                report.quarantined += 1
            except FileNotFoundError:
                pass
    held_ids = {id_of(h.name) for h in held}
    staged = sp.staged_records() if held else {}
    dead_workers: list[registry.DeadRegistration] = []
    try:
        dead_workers = registry.take_dead(sp, wait_for=held_ids, trusted=ctx.trusted_uids)
        runs: dict[str, tuple[registry.DeadRegistration, dict]] = {}
        for reg in dead_workers:
            report.killed += reg.kill_processes()
            for job_id, entry in reg.jobs.items():
                if not isinstance(entry, dict) or not isinstance(entry.get("attempt"), int):
                    continue
                # Two dead workers may both list a job (one entry stale): the
                # latest attempt is the run that was interrupted.
                if job_id not in runs or entry["attempt"] > runs[job_id][1]["attempt"]:
                    runs[job_id] = (reg, entry)
        # A run whose processes live on and are not ours to kill (a worker of
        # another user died) keeps its job in cur/, and its registration
        # entry, until they end: recovered now, it would run twice at once.
        # (A run that had finished is completed all the same: it runs no more.)
        still_running = set().union(*(reg.unkillable for reg in dead_workers))
        recovered_ids = set(held_ids)
        for h in held:
            if _recover_one(ctx, h, runs.get(id_of(h.name)), staged.get(h.name, ()), report,
                            dead_workers[0] if dead_workers else None, id_of(h.name) in still_running):
                recovered_ids.discard(id_of(h.name))
        for reg in dead_workers:
            # Clear a registration only when none of its jobs is left in cur/
            # for another recovery (which holds it right now) to handle, or
            # for a later one; else just forget the runs recovered here.
            if any(job_id not in recovered_ids and sp.find((file_name(job_id),), ("cur",)) for job_id in reg.jobs):
                reg.forget(recovered_ids)
            else:
                reg.remove()
                report.workers += 1
    finally:
        # Whatever failed, hold nothing: a worker lives on after its recovery.
        for h in held:
            h.release()
        for reg in dead_workers:
            reg.release()
    return len(held)


def _recover_one(ctx: Context, held: Held, run: tuple | None, staged: tuple[str, ...] | list[str],
                 report: RecoveryReport, spare_reg: registry.DeadRegistration | None = None,
                 processes_live: bool = False) -> bool:
    """Recover one job; True if it was left in cur/ (see _recover_held)."""
    staged_held: list[Held] = []
    try:
        if _recover_held(ctx, held, run, staged, staged_held, report, spare_reg, processes_live):
            return True
        # Only now, with the job out of cur/, are its staged records spent.
        for h in staged_held:
            h.unlink()
        return False
    finally:
        for h in staged_held:
            h.release()


def _recover_held(ctx: Context, held: Held, run: tuple | None, staged: tuple[str, ...] | list[str],
                  staged_held: list[Held], report: RecoveryReport,
                  spare_reg: registry.DeadRegistration | None = None, processes_live: bool = False) -> bool:
    """Move a dead worker's job on; True if it is left in cur/ instead: an
    interrupted run whose processes live on (``processes_live``)."""
    try:
        job = check(ctx, held.st, held.read, held.name)
    except InvalidJob as e:
        quarantine(ctx, held, str(e))
        report.quarantined += 1
        return False
    attempts = int(job.get("attempts") or 0)
    reg, entry = run if run else (None, None)
    run_attempt = entry.get("attempt") if entry and isinstance(entry.get("attempt"), int) else attempts + 1
    finished = job.get("state") in ("done", "dead")  # never claimed in that state: a recorded finish
    if not finished:
        outcome = _staged_outcome(ctx, staged, job, run_attempt, staged_held)
        if outcome is not None:
            # The run finished and its record was staged, but not swapped in.
            job, finished = outcome, True
    if finished or (attempts >= run_attempt and job.get("state") == "failed"):
        # The run finished and was recorded; only the last rename was lost.
        # A failed run's retry waits its backoff, as it would have.
        due = None
        if job["state"] == "failed":
            due = time.time() + _backoff(ctx, int(job.get("attempts") or 1))
        _write_and_move(held, job, job["state"], due)
        report.completed += 1
        return False
    if processes_live:
        report.left_running += 1
        return True
    worker_id = str(reg.info.get("worker")) if reg else None
    started = entry.get("started_at") if entry else None
    start = time.time()
    if isinstance(started, str):
        try:
            start = record.parse_time(started)
        except ValueError:
            pass
    if entry is None and spare_reg is not None:
        # No registration lists this run (its worker died before writing it
        # down). The interrupted record written next says it is run
        # ``run_attempt``; should this recovery die before moving it on, the
        # next one must find the run listed, or it counts it a second time.
        try:
            spare_reg.note_run(job["id"], run_attempt)
        except OSError:
            pass
    job["attempts"] = run_attempt - 1
    out = Outcome(start=start, end=time.time(), error="interrupted: the worker running it died", interrupted=True)
    claimed = Claimed(held, job, job["id"], held.st.st_mtime_ns, "cur")
    dest, _ = finish(ctx, claimed, out, worker_id or "unknown", due_now=True)
    if dest == "dead":
        report.dead += 1
    else:
        report.recovered += 1
    return False


def _continues(job: dict, outcome: dict) -> bool:
    """Whether ``outcome``'s history is ``job``'s plus one run: the job's
    entries, less any oldest ones trimming dropped (and counted), then one."""
    history, previous = outcome.get("history"), job.get("history") or []
    if not isinstance(history, list) or not history or not isinstance(previous, list):
        return False
    kept = history[:-1]
    dropped = len(previous) - len(kept)
    return dropped >= 0 and previous[dropped:] == kept and dropped_runs(outcome) == dropped_runs(job) + dropped


def _staged_outcome(ctx: Context, names: tuple[str, ...] | list[str], job: dict, run_attempt: int,
                    staged_held: list[Held]) -> dict | None:
    """The finished record of run ``run_attempt`` of ``job`` among the
    staged records ``names`` (each held and added to ``staged_held``):
    whole (its CRC matches), valid, and the outcome of exactly that run
    (its history is the job's plus that run's entry)."""
    sp = ctx.spool
    found = None
    for name in names:
        try:
            h = sp.hold("cur", name)
        except (Busy, Gone, NotRegular):
            continue  # a live process's, or gone: not ours to judge
        staged_held.append(h)
        limit = int(ctx.settings["max_job_bytes"])
        if found is not None or h.st.st_uid not in ctx.trusted_uids or h.st.st_size > limit + record.RECORD_SLACK:
            continue
        data = h.read(limit + record.RECORD_SLACK)
        if not staged_intact(name, data):
            continue  # torn by a power cut, or an old inode left under this name
        try:
            outcome = record.parse_sized(data, job["id"], limit)
        except InvalidJob:
            continue
        if outcome.get("attempts") == run_attempt and outcome.get("state") in ("done", "failed", "dead") \
                and _continues(job, outcome):
            found = outcome
    return found
