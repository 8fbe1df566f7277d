"""The moves of one job between states: claim, finish, cancel, retry and
quarantine, and the checks of a file that decide them. Every move happens
while holding the file's flock, with the record rewritten and one rename,
in the order that lets a crash at any instant leave the job in exactly one
folder with a whole record.

The worker loop, ``cancel``, ``retry`` and the Python API come through
here; recovery.py moves a dead worker's jobs and compact.py reads files
with these same checks.
"""

from __future__ import annotations

import os
import pwd
import random
import re
import shlex
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import config, record
from ..errors import Busy, Exists, Gone, Incomplete, InvalidJob, JobNotFound, NotPossible, NotRegular, NotYours  # noqa: F401 - JobNotFound, NotPossible: importable from here too
from .protocol import (
    DROP,
    Entry,
    Held,
    SpoolDir,
    duplicate_name,
    file_name,
    id_of,
    id_problem,
    kind_of,
    listed_names,
)
from ..owners import user_name
from ..record import Outcome, rfc3339


@dataclass
class Context:
    """What every transition needs to know about the spool."""

    spool: SpoolDir
    settings: dict[str, Any]  # a config.Settings, whose reload() the context sees
    index_has: Callable[[str], bool] = lambda job_id: False
    index_get: Callable[[str], "dict | None"] = lambda job_id: None  # a compacted job's record
    as_root: bool = field(default_factory=lambda: os.geteuid() == 0)  # once: spoolq never changes its own ids
    _trusted: frozenset[int] | None = None
    _trusted_generation: int = -1

    @property
    def trusted_uids(self) -> frozenset[int]:
        generation = getattr(self.settings, "generation", 0)
        if self._trusted is None or self._trusted_generation != generation:
            # The spool's owner too: it writes config.json, so it could trust itself anyway.
            uids = {os.geteuid(), 0, self.spool.owner}
            for user in self.settings.get("trusted_users", []):
                uid = _uid_of(user)
                if uid is not None:
                    uids.add(uid)
            self._trusted = frozenset(uids)
            self._trusted_generation = generation
        return self._trusted


def _uid_of(user: str) -> int | None:
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        try:
            return int(user)
        except ValueError:
            return None


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
    locks: list[int] | None = None  # the lock slots held for the run (ordering.Locks)

    @property
    def attempt(self) -> int:
        return int(self.job.get("attempts") or 0) + 1


# --------------------------------------------------------------------------
# checking a file


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
            f"owned by untrusted user {user_name(st.st_uid)} (uid {st.st_uid}); "
            "add it to the trusted_users setting to run its jobs"
        )
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and ctx.spool.shared):
        # Then its owner is not the only one who could have written what it says.
        who = "every user" if st.st_mode & 0o002 else "the spool's group"
        raise InvalidJob(f"writable by {who} (mode {stat.S_IMODE(st.st_mode):o}), so anyone there could have "
                         "changed it; write job files with umask 027 (mode 0640)")
    if st.st_nlink != 1:
        # Through another name (a member's link to a record in done/, say)
        # a job runs again or changes behind this check. A maildir writer
        # (safecat) links into new/ and then removes its tmp/ name: what
        # is fresh in new/ is looked at again (see WRITER_GRACE).
        raise Incomplete(f"{st.st_nlink} links: a job file with other names could be run or changed through them; "
                         "give each job file one name")
    limit = int(ctx.settings["max_job_bytes"])
    if st.st_size > record.max_file_bytes(limit):
        raise InvalidJob(f"{st.st_size} bytes, larger than max_job_bytes ({limit})")
    job_id = id_of(name)
    problem = id_problem(job_id)
    if problem:
        raise InvalidJob(f"bad file name: {problem}")
    job = record.parse_sized(read(record.read_size(limit)), job_id, limit)
    _check_accepted(ctx, st, job)
    return job


def _check_accepted(ctx: Context, st: os.stat_result, job: dict) -> None:
    """Refuse what the settings refuse, and settle who enqueued the job
    (``run_as``, see enqueuer), which never changes: it is kept in every
    record the owner's side (or root) rewrites. Under a root worker the job
    runs as that user; under any other worker as the worker's user, and
    only if that user is trusted (checked at every claim, since
    trusted_users can change)."""
    problem = config.refusal(ctx.settings, job)
    if problem:
        raise InvalidJob(problem)
    who = enqueuer(ctx, st, job)
    if st.st_uid != ctx.spool.owner:
        # Rewritten by the owner's side (root's rewrite in another user's
        # spool is that user's file) the record must still say who it is.
        job["run_as"] = who
    if who not in ctx.trusted_uids:
        raise InvalidJob(f"enqueued by untrusted user {user_name(who)} (uid {who}); "
                         "add it to the trusted_users setting to run its jobs")
    if who == 0 or not ctx.as_root or ctx.spool.owner != 0:
        return  # what follows is a root worker's, and root runs workers only on a spool of its own
    if job.get("kind") is not None:
        # The setting is root's: only root writes the settings of root's spool.
        if not ctx.settings.get("root_handlers", False):
            raise InvalidJob(
                f"a handler job owned by {user_name(who)} (uid {who}): a root worker runs handlers as root, "
                "so it runs only root's handler jobs unless root sets the root_handlers setting to true"
            )
        return
    try:
        pwd.getpwuid(who)
    except KeyError:
        raise InvalidJob(
            f"owned by uid {who}, which has no entry in the password database; "
            "a root worker runs each job as the user who enqueued it"
        ) from None


def enqueuer(ctx: Context, st: os.stat_result, job: dict) -> int:
    """Who enqueued the job a file of ``st`` holds: the ``run_as`` of a
    record the owner's side wrote (a file of the spool's owner's, or of
    root's, which no one else can make), the file's owner when it has none;
    the owner of any other file, whatever it says (a producer can write the
    field, but cannot make the owner's side own its file). InvalidJob for a
    run_as that is no uid."""
    if st.st_uid not in (ctx.spool.owner, 0):
        return st.st_uid
    who = job.get("run_as", st.st_uid)
    if not isinstance(who, int) or isinstance(who, bool) or who < 0:
        raise InvalidJob(f"run_as must be a uid (an integer >= 0), not {repr(who)[:40]}")
    return who


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
    held = _hold_waiting(ctx, entry, on_quarantine, on_busy)
    if held is None:
        return None
    due_ns = held.st.st_mtime_ns
    try:
        if due_ns > now_ns:  # postponed since the scan
            held.release()
            return None
        try:
            job = check(ctx, held.st, held.read, entry.name)
        except InvalidJob as e:
            return _invalid_waiting(ctx, held, entry, e, now_ns, on_quarantine, on_later)
        rewritten = False
        if job.get("state") is None:
            rewritten = _first_sight(ctx, held, job, entry, now_ns, on_quarantine)
            if rewritten is None:
                return None
        if job.get("state") == "dead":
            # Moved back from dead/ by hand (or by a retry killed before its
            # rewrite): a fresh round, noted as `spoolq retry` notes it.
            # Written down now, so a crash during the run is counted
            # against the new round.
            record.fresh_round(job)
            held.rewrite(record.dumps(job))
            rewritten = True
        # take() tells a postponement (touch -d) from our own rewrite by this
        # mtime; without a rewrite it is still the one found when locked.
        mtime_ns = os.fstat(held.fd).st_mtime_ns if rewritten else due_ns
        return Claimed(held, job, job["id"], due_ns, entry.state, mtime_ns)
    except BaseException:
        held.release()
        raise


def _hold_waiting(ctx: Context, entry: Entry, on_quarantine: Callable[[str, str], None] | None,
                  on_busy: Callable[[], None] | None) -> Held | None:
    """The lock on a waiting file, or None: busy, gone, or no file a job
    can be read from (then moved to dead/ as it is)."""
    try:
        return ctx.spool.hold(entry.state, entry.name, mode=entry.mode)
    except Busy:
        if on_busy:
            on_busy()
        return None
    except (Gone, FileNotFoundError):
        return None
    except NotRegular as e:
        return _quarantine_unheld(ctx, entry, f"{e.kind}, not a regular file", on_quarantine)
    except PermissionError as e:
        return _quarantine_unheld(ctx, entry, f"unreadable: {e.strerror}", on_quarantine)


def _invalid_waiting(ctx: Context, held: Held, entry: Entry, problem: InvalidJob, now_ns: int,
                     on_quarantine: Callable[[str, str], None] | None,
                     on_later: Callable[[str, int], None] | None) -> None:
    """A held waiting file that is no valid job goes to dead/, unless it
    may still be being written (see WRITER_GRACE): then it is let go."""
    settled_ns = held.st.st_mtime_ns + int(WRITER_GRACE * 1e9)
    if isinstance(problem, Incomplete) and entry.state == "new" and now_ns < settled_ns:
        held.release()
        if on_later:
            on_later(entry.name, settled_ns)
        return None
    name = quarantine(ctx, held, str(problem))
    if on_quarantine:
        on_quarantine(name, str(problem))
    return None


def _first_sight(ctx: Context, held: Held, job: dict, entry: Entry, now_ns: int,
                 on_quarantine: Callable[[str, str], None] | None) -> bool | None:
    """Take in a file dropped by hand, seen for the first time (its record
    has no state). None if it is not to run now: a duplicate id (moved to
    dead/) or a run_at still ahead (the lock let go); else whether its
    record was rewritten."""
    job_id = job["id"]
    duplicate = _duplicate_of(ctx, job_id, entry)
    if duplicate:
        return _dead_as_duplicate(held, job, f"duplicate id: a job {job_id} is already in {duplicate}", on_quarantine)
    job.setdefault("created_at", rfc3339(held.st.st_mtime))
    run_at = job.get("run_at")
    if run_at is None:
        return False
    when = record.parse_time(run_at)
    # Honour run_at once, by the mtime; from now on only the mtime
    # counts. The marked record and its mtime land in one rename.
    job["state"] = "new"
    if when * 1e9 > now_ns:
        held.rewrite(record.dumps(job), mtime_ns=int(when * 1e9))
        held.release()
        return None
    held.rewrite(record.dumps(job))
    return True


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
            return _dead_as_duplicate(held, job, f"duplicate id: a job {job_id} is running", on_quarantine)
        except FileNotFoundError:
            held.release()
            return None
        return ready
    except BaseException:
        held.release()
        raise


def _dead_as_duplicate(held: Held, job: dict, reason: str,
                       on_quarantine: Callable[[str, str], None] | None) -> None:
    """Move a held job whose id another job has to dead/, under a
    ``.dup-`` name so the id keeps meaning the job that had it first. Moved
    first and annotated after, so no crash leaves it runnable."""
    new_name = duplicate_name(file_name(job["id"]))
    held.move("dead", new_name)
    job.update(state="dead", error=reason, id=id_of(new_name))
    held.rewrite(record.dumps(job))
    held.release()
    if on_quarantine:
        on_quarantine(new_name, reason)
    return None


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
    attempt = claimed.attempt  # (counted from the record, which the finish changes)
    now = time.time()
    dest = record.add_finish(job, out, attempt, claimed.due_ns / 1e9, worker_id, ctx.settings["max_attempts"])
    due: float | None = None
    if dest == "failed":
        due = now if (due_now or out.interrupted) else now + backoff(ctx, attempt)
    data = record.fitted(job, int(ctx.settings["max_job_bytes"]))
    if stage and claimed.held.stage(data):
        return dest, due
    write_and_move(claimed.held, job, dest, due, defer_sync, data)
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


def backoff(ctx: Context, failures: int) -> float:
    """Seconds until the retry after the ``failures``-th failed run (with jitter)."""
    return config.backoff(ctx.settings, failures, random.uniform(-0.1, 0.1))


def complete(held: Held, dest: str, due: float | None) -> None:
    """The second half of a staged finish, once ``SpoolDir.sync_data`` made
    the record durable: swap it in and move the job to ``dest`` (the folder
    fsyncs deferred, as with ``finish(defer_sync=True)``)."""
    held.commit_staged()
    _move_on(held, dest, due, defer_sync=True)


def write_and_move(held: Held, job: dict, dest: str, due: float | None, defer_sync: bool = False,
                   data: bytes | None = None) -> None:
    """Rewrite a held job's record (``data``, else ``job`` serialised) and
    move it to ``dest``, due at ``due`` when given."""
    held.rewrite(record.dumps(job) if data is None else data)
    _move_on(held, dest, due, defer_sync)


def _move_on(held: Held, dest: str, due: float | None, defer_sync: bool) -> None:
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
                except (FileNotFoundError, Gone, NotRegular):
                    continue
                except PermissionError:
                    try:
                        whose = user_name(ctx.spool.lstat(state, name).st_uid)
                    except FileNotFoundError:
                        continue
                    raise NotPossible(f"{state}/{name} belongs to {whose}, and {user_name(os.geteuid())} may not "
                                      f"open it; do this as {whose}") from None
    return None


def locate(ctx: Context, job_id: str) -> tuple[str, str] | None:
    """(state, file name) of a job's file, if it is in a state folder."""
    if id_problem(job_id):
        return None
    return ctx.spool.find((file_name(job_id), job_id))


def cancel(ctx: Context, job_id: str, on_note: Callable[[str], None] | None = None, requester: int | None = None) -> None:
    """A waiting job (new/ or failed/) goes to done/ with outcome cancelled.
    Raises JobNotFound, or NotPossible for a running or finished job.
    ``on_note(message)`` hears of a record that could not be rewritten
    after the move (a full disk): the job is cancelled all the same.
    ``requester``: the member (a uid) whose request this carries out; it
    may cancel only a job it enqueued (NotYours otherwise)."""
    # A waiting file is locked only for a moment: while a worker claims it
    # (then it is in cur/ and running) or prepares it ahead of the job it is
    # running (then it is let go within LOOK_AHEAD_HOLD). Wait that out.
    deadline = time.monotonic() + 1.0
    while True:
        try:
            held = _find_held(ctx, job_id, ("new", "failed", "held", "waiting"))
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
        _check_requester(ctx, held, job_id, requester, "cancel")
        try:
            job = check(ctx, held.st, held.read, held.name)
        except InvalidJob as e:
            raise NotPossible(f"job {job_id} is not a valid job ({e}); a worker will move it to dead/") from None
        record.cancel(job)
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


def retry(ctx: Context, job_id: str, on_note: Callable[[str], None] | None = None, requester: int | None = None) -> None:
    """A dead job back to new/, due now, with a fresh round of attempts
    (its history is kept). Raises JobNotFound or NotPossible. ``on_note``
    and ``requester`` as for ``cancel``."""
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
                raise NotPossible(_not_a_job_to_retry(where[1]))
            raise NotPossible(f"job {job_id} is moving (it just reached dead/); try again")
        raise NotPossible(f"job {job_id} is in {where[0]}/, not dead/")
    try:
        _check_requester(ctx, held, job_id, requester, "retry")
        _retry_held(ctx, held, on_note)
    finally:
        held.release()


def running_attempt(ctx: Context, job_id: str, requester: int | None = None) -> int:
    """The run number of a job in cur/ (for a kill request, which names the
    run it means). Raises JobNotFound, NotPossible when it is not running,
    or NotYours when ``requester`` (a member's uid) did not enqueue it."""
    if id_problem(job_id) or ctx.spool.find((file_name(job_id),), ("cur",)) is None:
        if locate(ctx, job_id) is None and not ctx.index_has(job_id):
            raise JobNotFound(f"no job {job_id} in this spool")
        raise NotPossible(f"job {job_id} is not running; nothing to kill")
    limit = int(ctx.settings["max_job_bytes"])
    data, st = ctx.spool.read("cur", file_name(job_id), record.read_size(limit))
    try:
        job = record.parse_sized(data, job_id, limit)
    except InvalidJob as e:
        raise NotPossible(f"job {job_id} is not a valid job ({e})") from None
    who = enqueuer(ctx, st, job) if st.st_uid in (ctx.spool.owner, 0) else st.st_uid
    if requester is not None and who != requester:
        raise NotYours(f"job {job_id} was enqueued by {user_name(who)}, not by {user_name(requester)}: "
                       "a member may kill only its own jobs")
    return int(job.get("attempts") or 0) + 1


def _check_requester(ctx: Context, held: Held, job_id: str, requester: int | None, what: str) -> None:
    """Refuse (NotYours) a member's request for a job another user
    enqueued: the user a record the owner's side wrote names in run_as
    (its own when none), or the owner of any other file."""
    if requester is None:
        return
    who = _record_user(ctx, held)
    if who != requester:
        raise NotYours(f"job {job_id} was enqueued by {user_name(who)}, not by {user_name(requester)}: "
                       f"a member may {what} only its own jobs")


def _record_user(ctx: Context, held: Held) -> int:
    """Who enqueued the job a held file is (see enqueuer); the file's owner
    when its record cannot be read."""
    st = held.st
    if st.st_uid not in (ctx.spool.owner, 0):
        return st.st_uid
    limit = int(ctx.settings["max_job_bytes"])
    try:
        return enqueuer(ctx, st, record.parse_sized(held.read(record.read_size(limit)), id_of(held.name), limit))
    except (InvalidJob, OSError):
        return st.st_uid


def _not_a_job_to_retry(name: str) -> str:
    return f"dead/{name} is not a regular file, so not a job to retry; move or remove it by hand"


def _rename_hint(ctx: Context, name: str) -> str:
    """Why a dead file under a name that is no valid id cannot be retried,
    and the command that gives it a free, valid one."""
    job_id = id_of(name)
    base = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "_", job_id)).lstrip(".")[:120] or "job"
    fresh, n = base, 1
    while ctx.spool.find((file_name(fresh), fresh)) or ctx.index_has(fresh):
        n += 1
        fresh = f"{base}-{n}"
    folder = os.path.join(ctx.spool.root, "dead")
    return (f"cannot retry {job_id!r}: {id_problem(job_id)}; give it a valid id, e.g. "
            f"{mv_command(os.path.join(folder, name), os.path.join(folder, file_name(fresh)))}, then retry {fresh}")


def mv_command(src: str, dst: str) -> str:
    """An ``mv`` of ``src`` to ``dst`` as one line of printable ASCII that
    pastes and works in sh and bash whatever bytes the names hold (a
    newline, a byte that is not UTF-8, a quote): a name with others than
    printable ASCII is spelt by printf's octal escapes, with an ``x`` after
    it that keeps ``$(...)`` from eating a newline at its end."""
    words = []
    for i, path in enumerate((src, dst)):
        raw = os.fsencode(path)
        if all(32 <= b < 127 for b in raw):
            words.append(shlex.quote(path))
            continue
        spelt = "".join(chr(b) if 32 <= b < 127 and chr(b) not in "'\\%" else f"\\{b:03o}" for b in raw)
        words.append((f"f{i}=$(printf '{spelt}x') && ", f'"${{f{i}%x}}"'))
    prefix = "".join(w[0] for w in words if isinstance(w, tuple))
    return prefix + "mv " + " ".join(w[1] if isinstance(w, tuple) else w for w in words)


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
    if ctx.spool.shared and held.st.st_uid not in (ctx.spool.owner, 0):
        # A member's own file, as it dropped it (it went to dead/ unread, or
        # invalid): back into drop/, to be picked up again, so that every
        # record in the owner's folders is the owner's side's.
        try:
            held.move(DROP, target, keep_name=True)
        except Exists:
            raise NotPossible(f"a job {id_of(target)} waits in drop/ already; the dead job stays in dead/") from None
        except FileNotFoundError:
            raise NotPossible(f"dead/{held.name} was moved away meanwhile (by hand?); it was not retried") from None
        return
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
    record.retry(job)
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
    ``on_note`` hears of it rather than the caller being told it failed.
    Root's rewrite in a spool another user owns is that user's file."""
    try:
        held.rewrite(data, for_owner=True)
        ctx.spool.sync_dir(folder)  # the rewrite's rename (fsync on) as durable as the move was
    except OSError as e:
        if on_note:
            on_note(f"{what} ({e.strerror or e}); {meaning}")


def retry_all(ctx: Context, on_problem: Callable[[str], None] | None = None,
              on_note: Callable[[str], None] | None = None, requester: int | None = None) -> list[str]:
    """Every dead job back to new/; returns the ids moved. A job that
    cannot go is left in dead/ unchanged, and ``on_problem(message)`` says
    why; ``on_note`` as for ``cancel``. With ``requester`` (a member's
    request), only the jobs that member enqueued."""
    moved = []
    for name in sorted(ctx.spool.names("dead")):
        try:
            held = ctx.spool.hold("dead", name)
        except (Gone, FileNotFoundError):
            continue  # moved on meanwhile
        except Busy:
            problem = f"dead/{name} is busy (another command holds it); try again"
        except NotRegular:
            problem = _not_a_job_to_retry(name)
        except PermissionError as e:
            problem = f"dead/{name} cannot be opened: {e.strerror}"
        else:
            try:
                _check_requester(ctx, held, id_of(name), requester, "retry")
                _retry_held(ctx, held, on_note)
                moved.append(id_of(name))
                continue
            except NotYours:
                continue  # another user's: not this member's business
            except NotPossible as e:
                problem = str(e)
            except OSError as e:  # e.g. new/ cannot grow on a full disk: the others may still go
                problem = f"dead/{name} cannot be moved: {e.strerror or e}"
            finally:
                held.release()
        if on_problem:
            on_problem(problem)
    return moved
