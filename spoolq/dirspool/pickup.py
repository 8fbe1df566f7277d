"""Pickup: the owner's side taking in what members put in a shared spool's
drop/ (docs/design.md, "Security"), once per worker pass and in ``spoolq
sweep``.

A dropped job is read once, without a lock, checked as any job file is,
and copied into new/ as a record of the owner's side, which says who
dropped it (``run_as``, the dropped file's owner, from the kernel) and
which file it was (``dropped``: inode, device, birth time), so that a
pickup cut short after the copy and before the drop file's removal is
recognised and finished, never run twice. A member's request (cancel or
retry of its own job) is carried out as the owner's command would, and
answered in a reply file the member reads.

What one user drops never costs another user much: a pass handles at most
``BATCH`` entries, taken round-robin over the users who dropped them; an
untrusted user's files go to dead/ by one rename each (no file of the
owner's per file); a cause is logged once per user per worker run.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from .. import record
from . import transitions
from ..errors import Incomplete, InvalidJob, JobNotFound, NotPossible, NotRegular
from ..output import ERROR, WARNING, field, quoted
from ..owners import user_name
from .protocol import DROP, REPLY_SUFFIX, REQUEST_SUFFIX, duplicate_name, file_name
from .transitions import Context

#: Entries of drop/ handled per pass, at most: with one user's thousands
#: waiting, another user's job is taken in the first pass after it was
#: dropped (round-robin), so it waits for at most one such batch.
BATCH = 256
#: Seconds a reply waits for its member (who cannot remove it) to read it.
REPLY_KEEP = 600.0
#: Seconds before an entry left waiting (unreadable, a member's folder) is
#: looked at again, in case its owner fixed it.
LEFT_RETRY = 60.0
REQUEST_MAX = 4096
_TOKEN = re.compile(r"[0-9a-f]{8,64}\Z")
REQUESTS = ("cancel", "retry", "retry_all", "kill")
# drop/'s flock keeps other processes out, not this process's other threads
# (a worker's control listener answers requests beside its dispatcher).
_IN_PROCESS = threading.Lock()

Log = Callable[[str, int, Any], None]  # (text, level, severity): a worker's Log.line


@dataclass
class PickupReport:
    picked: int = 0  # jobs copied into new/
    dead: int = 0  # entries moved to dead/
    answered: int = 0  # requests carried out and answered
    more: bool = False  # the batch was full: more entries wait for the next pass
    later_ns: int | None = None  # when an entry left for its writer is to be looked at again


class _Seen(NamedTuple):
    uid: int
    mtime_ns: int
    mode: int


class Pickup:
    """The pickup of one worker run (or one sweep): what it has seen of
    drop/, and what it has told, so that each cause is told once."""

    def __init__(self, ctx: Context, log: Log | None = None):
        self.ctx = ctx
        self.log = log
        self._known: dict[str, _Seen] = {}  # lstat of each name, taken once
        self._left: dict[str, int] = {}  # name -> when to look at it again (ns)
        self._told: set[tuple[str, int]] = set()  # (cause, uid) logged in this run

    def run(self, limit: int = BATCH) -> PickupReport:
        """One pass: take up to ``limit`` entries of drop/ round-robin over
        the users who dropped them. Nothing if another process of the
        owner's side is picking up right now (it takes these too)."""
        report = PickupReport()
        drops = self.ctx.spool.drops
        with _IN_PROCESS:
            if not drops.lock():
                return report
            try:
                chosen = self._choose(limit, report)
                self._take(chosen, report)
            finally:
                drops.unlock()
        return report

    def answer_requests(self) -> PickupReport:
        """Carry out and answer the members' requests alone, leaving their
        jobs for the next pass: a worker whose dispatcher is busy running
        jobs answers a member's kill while they run."""
        report = PickupReport()
        drops = self.ctx.spool.drops
        with _IN_PROCESS:
            if not drops.lock():
                return report
            try:
                names = [n for n in drops.names() if n[0] != "." and n.endswith(REQUEST_SUFFIX)]
                for name in names[:BATCH]:
                    seen = self._look(name)
                    if seen is None or not stat.S_ISREG(seen.mode):
                        continue  # (the next pass moves it on)
                    try:
                        self._request(name, report)
                    except OSError as e:
                        self._stuck(name, seen, e)
            finally:
                drops.unlock()
        return report

    def drain(self) -> PickupReport:
        """Passes until drop/ holds nothing more to take (``spoolq sweep``)."""
        total = PickupReport()
        while True:
            report = self.run()
            total.picked += report.picked
            total.dead += report.dead
            total.answered += report.answered
            if not report.more:
                return total

    # -- choosing ------------------------------------------------------------

    def _choose(self, limit: int, report: PickupReport) -> list[str]:
        sp = self.ctx.spool
        now_ns = time.time_ns()
        names = sp.drops.names()
        if len(self._known) > len(names):
            present = set(names)
            for name in [n for n in self._known if n not in present]:
                self._forget(name)
        queues: dict[int, list[str]] = {}
        requests: dict[int, list[str]] = {}
        for name in names:
            if name[0] == ".":
                continue  # still being written by its member
            again = self._left.get(name)
            if again is not None:
                if again > now_ns:
                    continue
                del self._left[name]
            seen = self._known.get(name) or self._look(name)
            if seen is None:
                continue
            if name.endswith(REPLY_SUFFIX):
                if seen.mtime_ns < now_ns - REPLY_KEEP * 1e9:
                    sp.drops.unlink(name)
                    self._forget(name)
                continue
            # A member waits for the answer to its request: those first.
            (requests if name.endswith(REQUEST_SUFFIX) else queues).setdefault(seen.uid, []).append(name)
        for uid, waiting in requests.items():
            queues[uid] = waiting + queues.get(uid, [])
        chosen: list[str] = []
        rounds = [queues[uid][::-1] for uid in sorted(queues)]
        while rounds and len(chosen) < limit:
            for waiting in rounds:
                chosen.append(waiting.pop())
                if len(chosen) >= limit:
                    break
            rounds = [w for w in rounds if w]
        report.more = bool(rounds)
        return chosen

    def _look(self, name: str) -> _Seen | None:
        try:
            st = self.ctx.spool.lstat(DROP, name)
        except FileNotFoundError:
            self._forget(name)
            return None
        seen = self._known[name] = _Seen(st.st_uid, st.st_mtime_ns, st.st_mode)
        return seen

    def _forget(self, name: str) -> None:
        self._known.pop(name, None)
        self._left.pop(name, None)

    def _leave(self, name: str, until_ns: int | None = None) -> None:
        """Leave an entry in drop/, not looked at again until ``until_ns``
        (by default LEFT_RETRY from now)."""
        self._left[name] = until_ns or time.time_ns() + int(LEFT_RETRY * 1e9)
        self._known.pop(name, None)

    # -- taking ---------------------------------------------------------------

    def _take(self, chosen: list[str], report: PickupReport) -> None:
        jobs: list[tuple[str, bytes, int, str]] = []
        ids: set[str] = set()
        requests = []
        for name in chosen:
            # Looked at again: the listing's is only for choosing (a name
            # may have been given to another file since).
            seen = self._look(name)
            if seen is None:
                continue
            if name.endswith(REQUEST_SUFFIX) and stat.S_ISREG(seen.mode):
                requests.append((name, seen))
                continue
            try:
                self._job(name, seen, jobs, ids, report)
            except OSError as e:
                self._stuck(name, seen, e)
        if jobs:
            self._copy(jobs, report)
        for name, seen in requests:
            try:
                self._request(name, report)
            except OSError as e:
                self._stuck(name, seen, e)
        if report.dead:
            self.ctx.spool.sync_dir("dead")

    def _open(self, name: str) -> tuple[int, os.stat_result] | None:
        """A dropped entry opened (descriptor, stat), or None: gone, replaced
        since it was listed (looked at anew next pass), or unreadable (left,
        and told)."""
        try:
            return self.ctx.spool.drops.open(name)
        except (FileNotFoundError, NotRegular):
            self._forget(name)
        except PermissionError:
            self._unreadable(name)
        return None

    def _stuck(self, name: str, seen: _Seen, error: OSError) -> None:
        """One entry that could not be taken (a member's folder where its
        reply goes, say): left and told, and the others go on."""
        self._leave(name)
        self._tell("stuck", seen.uid, f"cannot take {field('drop/' + name)} of {_who(seen.uid)}: "
                                      f"{error.strerror or error}; it is left there")

    def _job(self, name: str, seen: _Seen, jobs: list, ids: set[str], report: PickupReport) -> None:
        """Check one dropped entry: to dead/, left, or added to ``jobs``
        (record name, bytes, due time, drop name) for _copy."""
        ctx = self.ctx
        drops = ctx.spool.drops
        if not stat.S_ISREG(seen.mode) or seen.uid not in ctx.trusted_uids:
            self._to_dead(name, seen, report)
            return
        opened = self._open(name)
        if opened is None:
            return
        fd, st = opened
        try:
            if st.st_uid not in ctx.trusted_uids:
                self._to_dead(name, _Seen(st.st_uid, st.st_mtime_ns, st.st_mode), report)
                return
            try:
                job = transitions.check(ctx, st, lambda n: drops.read(fd, n, st.st_size), name)
            except InvalidJob as e:
                settled_ns = st.st_mtime_ns + int(transitions.WRITER_GRACE * 1e9)
                if isinstance(e, Incomplete) and time.time_ns() < settled_ns:
                    self._leave(name, settled_ns)  # its writer may not be done: looked at again then
                    report.later_ns = min(report.later_ns or settled_ns, settled_ns)
                    return
                dead = drops.to_dead(name)
                self._forget(name)
                report.dead += 1
                self._line(f"job={field(dead)} outcome=dead state=dead dropped_by={user_name(st.st_uid)} "
                           f"error={quoted(str(e))}", 0)
                return
            identity = drops.identity(fd, st)
        finally:
            os.close(fd)
        job_id = job["id"]
        kept = file_name(job_id)
        where = ctx.spool.find((kept,))
        if where is not None and self._dropped_as(where[0], kept, identity):
            drops.unlink(name)  # copied in by a pickup cut short before it removed the file
            self._forget(name)
            return
        taken = (f"{where[0]}/" if where else "drop/ twice" if job_id in ids
                 else "the index (a compacted job)" if _in_index(ctx, job_id) else None)
        if taken:
            self._duplicate(name, job_id, taken, report)
            return
        job["run_as"] = st.st_uid
        job["dropped"] = identity
        if record.priority_of(job):  # its place known before any pass reads it (the marker comes first)
            from .ordering import Order  # imported here: start-up speed (priorities are rare)

            Order(ctx.spool).mark_priority(job_id, record.priority_of(job))
        ids.add(job_id)
        jobs.append((kept, record.dumps(job), st.st_mtime_ns, name))

    def _copy(self, jobs: list[tuple[str, bytes, int, str]], report: PickupReport) -> None:
        """Copy the checked jobs into new/ (one sync for all), then remove
        their drop files: a crash in between leaves a drop file whose copy
        the next pickup recognises."""
        drops = self.ctx.spool.drops
        placed = drops.copy_in([(kept, data, due_ns) for kept, data, due_ns, _name in jobs])
        for (kept, _data, _due, name), ok in zip(jobs, placed):
            if ok:
                drops.unlink(name)
                self._forget(name)
                report.picked += 1
            else:  # a job of that id was enqueued meanwhile
                self._duplicate(name, kept[:-5], "new/", report)

    def _dropped_as(self, state: str, kept: str, identity: str) -> bool:
        """Whether the record ``state/kept`` is the copy of the dropped file ``identity``."""
        sp = self.ctx.spool
        limit = int(self.ctx.settings["max_job_bytes"])
        try:
            data, st = sp.read(state, kept, record.read_size(limit))
            if st.st_uid not in (sp.owner, os.geteuid()):
                return False
            return record.parse_sized(data, kept[:-5], limit).get("dropped") == identity
        except (OSError, NotRegular, InvalidJob):
            return False

    def _duplicate(self, name: str, job_id: str, where: str, report: PickupReport) -> None:
        sp = self.ctx.spool
        reason = f"duplicate id: a job {job_id} is already in {where}"
        dead = sp.drops.to_dead(name, duplicate_name(file_name(job_id)))
        self._forget(name)
        sp.note_reason(dead, reason)
        report.dead += 1
        self._line(f"job={field(dead)} outcome=dead state=dead error={quoted(reason)}", 0)

    def _to_dead(self, name: str, seen: _Seen, report: PickupReport) -> None:
        """An untrusted user's entry, or one no job can be read from, to
        dead/ as it is: one rename, no reason kept (it is worked out again
        from the file when shown); told once per user per run. A member's
        folder, which the owner may not move, is left and told once."""
        try:
            self.ctx.spool.drops.to_dead(name)
        except FileNotFoundError:
            self._forget(name)
            return
        except PermissionError:
            self._leave(name)
            self._tell("folder", seen.uid, f"drop/ holds a folder of {_who(seen.uid)} ({field(name)}): left there, "
                                          "since only that user or root may move or remove it")
            return
        self._forget(name)
        report.dead += 1
        if seen.uid not in self.ctx.trusted_uids:
            self._tell("untrusted", seen.uid, f"files {_who(seen.uid)} dropped go to dead/ unrun: it is not trusted "
                                             "(add it to the trusted_users setting to run its jobs)")
        else:
            self._tell("not regular", seen.uid, f"entries {_who(seen.uid)} dropped that are no regular files "
                                               "go to dead/ unopened")

    def _unreadable(self, name: str) -> None:
        """A trusted user's drop this process may not read: left waiting,
        and the reason (this set-up, or the file's mode) told once."""
        self._leave(name)
        sp = self.ctx.spool
        try:
            st = sp.lstat(DROP, name)
        except FileNotFoundError:
            return
        me = user_name(os.geteuid())
        group = _group_name(st.st_gid)
        if st.st_mode & 0o040 and st.st_gid != os.getegid() and st.st_gid not in os.getgroups():
            cause = "not in group"
            fix = (f"this worker's user {me} is not in the spool's group {group}, through which it reads them; "
                   f"add it (usermod -aG {group} {me}) and restart the worker")
        else:
            cause = "mode"
            fix = (f"their mode ({stat.S_IMODE(st.st_mode):o}) does not let the spool's group {group} read them; "
                   "drop files with umask 027 (spoolq enqueue and contrib/spoolq-drop do)")
        self._tell(cause, st.st_uid, f"cannot read the jobs {_who(st.st_uid)} dropped: {fix}; they wait in drop/",
                   severity=ERROR)

    # -- requests --------------------------------------------------------------

    def _request(self, name: str, report: PickupReport) -> None:
        """Carry out a member's request and answer it (reply first, then the
        request goes: a crash in between finds the reply and only removes
        the request)."""
        ctx = self.ctx
        drops = ctx.spool.drops
        token = name[:-len(REQUEST_SUFFIX)]
        if not _TOKEN.match(token) or drops.answered(token):
            drops.unlink(name)  # none can be answered, or it was already
            self._forget(name)
            return
        opened = self._open(name)
        if opened is None:
            return
        fd, st = opened
        try:
            data = drops.read(fd, REQUEST_MAX + 1, st.st_size)
        finally:
            os.close(fd)
        request, answer = _parse_request(data, st)
        if answer is None and st.st_uid not in ctx.trusted_uids:
            answer = _refused(f"{user_name(st.st_uid)} is not trusted on this spool (its trusted_users setting)")
        if answer is None:
            job_id = request.get("id")
            if request["request"] != "retry_all" and isinstance(job_id, str) and ctx.spool.find((file_name(job_id),)) \
                    is None and ctx.spool.find((file_name(job_id), job_id), (DROP,)) is not None:
                self._leave(name, time.time_ns())  # its job waits in drop/ still: answered once it is picked up
                return
            answer = self._carry_out(request, st.st_uid)
        drops.answer(token, json.dumps(answer).encode())
        drops.unlink(name)
        self._forget(name)
        report.answered += 1
        self._line(f"request={request.get('request', '-')} job={field(request.get('id', '-'))} "
                   f"user={user_name(st.st_uid)} answer={answer.get('error') or 'done'}", 1)

    def _carry_out(self, request: dict, uid: int) -> dict:
        """Do what the member asked, as the owner's command does it, for the
        member's own jobs only; the answer as its command is to say it."""
        ctx, kind, notes = self.ctx, request["request"], []
        try:
            if kind == "retry_all":
                problems: list[str] = []
                ids = transitions.retry_all(ctx, problems.append, notes.append, requester=uid)
                return {"ok": not problems, "ids": ids, "problems": problems, "notes": notes}
            if kind == "kill":
                return self._kill(request, uid)
            from . import waits  # imported here: start-up speed (a member's cancel is rare)

            action = waits.cancel if kind == "cancel" else transitions.retry
            action(ctx, request["id"], notes.append, requester=uid)
            return {"ok": True, "notes": notes}
        except JobNotFound as e:
            return {"ok": False, "error": "not_found", "message": str(e)}
        except NotPossible as e:
            return {"ok": False, "error": "not_possible", "message": str(e)}
        except OSError as e:
            return {"ok": False, "error": "not_possible", "message": f"the worker could not do it: {e.strerror or e}"}

    def _kill(self, request: dict, uid: int) -> dict:
        """A member's kill of its own running job: checked here, then handed
        to the worker running it as the owner's own kill is."""
        from .control import ControlDir  # imported here: start-up speed (as the pickup's users)

        job_id = request["id"]
        attempt = transitions.running_attempt(self.ctx, job_id, requester=uid)
        sig = request.get("signal")
        order = {"request": "kill", "id": job_id, "attempt": attempt, "by": user_name(uid)}
        if isinstance(sig, int) and not isinstance(sig, bool) and 0 < sig < 65:
            order["signal"] = sig
        ControlDir(self.ctx.spool).send(order)
        return {"ok": True, "attempt": attempt}

    # -- telling ---------------------------------------------------------------

    def _tell(self, cause: str, uid: int, text: str, severity: int = WARNING) -> None:
        if (cause, uid) in self._told:
            return
        self._told.add((cause, uid))
        self._line(text + " (told once per worker run)", 0, severity)

    def _line(self, text: str, level: int, severity: int | None = None) -> None:
        if self.log is not None:
            self.log(text, level, severity)


def _parse_request(data: bytes, st: os.stat_result) -> tuple[dict, dict | None]:
    """(the request, None), or (what is known of it, the refusal to answer)."""
    if st.st_nlink != 1 or st.st_mode & 0o022 or len(data) > REQUEST_MAX:
        return {}, _refused("not a request spoolq writes (other names, writable by others, or too large)")
    try:
        request = json.loads(data)
    except ValueError:
        return {}, _refused("not a request spoolq understands (not JSON)")
    if not isinstance(request, dict) or request.get("request") not in REQUESTS \
            or (request["request"] != "retry_all" and not isinstance(request.get("id"), str)):
        return {}, _refused("not a request spoolq understands")
    return request, None


def _refused(why: str) -> dict:
    return {"ok": False, "error": "refused", "message": f"refused: {why}"}


def _in_index(ctx: Context, job_id: str) -> bool:
    try:
        return ctx.index_has(job_id)
    except Exception:  # an unreadable index.db must not stop pickups; it is history
        return False


def _who(uid: int) -> str:
    return f"user {user_name(uid)} (uid {uid})"


def _group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
