"""The moves of jobs that wait for something other than their due time, in
a spool directory: a dependent released from waiting/ to new/ once every
job it names has succeeded, or sent to dead/ (with its own dependents)
once one ended dead or cancelled; a job held in held/ and released; and
recovery's look over waiting/, which puts right whatever a crash left
(the dependency edges of order/ are only a cache).

Each move is one rename of a locked file; a job found locked is another
process's to move, and is left to it (or to the next look).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .. import record
from ..errors import InvalidJob, JobNotFound, NotPossible
from .ordering import Order, outcome_state
from .protocol import Busy, Gone, NotRegular, file_name, id_of
from . import transitions
from .transitions import Context, check, quarantine

History = Callable[[str], "dict | None"]


def dependency_ended(ctx: Context, order: Order, dep: str, ended: str, history: History) -> None:
    """Job ``dep`` has just finished as ``ended`` (done, cancelled or dead):
    its dependents waiting are released or sent to dead/."""
    dependents = order.dependents(dep)
    if not dependents:
        return
    for job_id in dependents:
        if ended == "done":
            settle(ctx, order, job_id, history)
        else:
            _kill(ctx, order, job_id, f"its dependency {dep} ended {ended}", history)
    order.drop_edges(dep, dependents)


def cancel(ctx: Context, job_id: str, on_note: Callable[[str], None] | None = None,
           requester: int | None = None) -> None:
    """transitions.cancel, and the cancelled job's dependents waiting sent
    to dead/ (a cancel is an end they wait for in vain)."""
    transitions.cancel(ctx, job_id, on_note, requester=requester)
    dependency_ended(ctx, Order(ctx.spool), job_id, "cancelled", ctx.index_get)


def settle(ctx: Context, order: Order, job_id: str, history: History) -> str | None:
    """Look at a waiting job's dependencies: all succeeded, it goes to new/
    (due as it was: at once); one ended dead or cancelled, to dead/.
    Returns where it went (None: it stays)."""
    held = _hold(ctx, "waiting", job_id)
    if held is None:
        return None
    try:
        try:
            job = check(ctx, held.st, held.read, held.name)
        except InvalidJob as e:
            quarantine(ctx, held, str(e))
            return "dead"
        states = {dep: outcome_state(ctx.spool, history, dep) for dep in record.after_of(job)}
        ended = next(((dep, s) for dep, s in states.items() if s in ("dead", "cancelled")), None)
        if ended is not None:
            quarantine(ctx, held, f"its dependency {ended[0]} ended {ended[1]}")
            dependency_ended(ctx, order, job_id, "dead", history)
            return "dead"
        if all(s in ("done", None) for s in states.values()):  # (None: gone from the history since: it had finished)
            held.move("new", keep_name=True)
            return "new"
        return None
    finally:
        held.release()


def _kill(ctx: Context, order: Order, job_id: str, reason: str, history: History) -> None:
    for folder in ("waiting", "held"):
        held = _hold(ctx, folder, job_id)
        if held is not None:
            try:
                quarantine(ctx, held, reason)
            finally:
                held.release()
            dependency_ended(ctx, order, job_id, "dead", history)
            return


def _hold(ctx: Context, folder: str, job_id: str) -> Any:
    try:
        return ctx.spool.hold(folder, file_name(job_id))
    except (FileNotFoundError, Gone, NotRegular, Busy):
        return None


def recover_waiting(ctx: Context, order: Order, history: History) -> int:
    """Every job in waiting/ looked at once: released or sent to dead/ as
    its dependencies say, its edges made again. Returns how many moved."""
    moved = 0
    for name in list(ctx.spool.names("waiting")):
        job_id = id_of(name)
        where = settle(ctx, order, job_id, history)
        if where is not None:
            moved += 1
            continue
        held = _hold(ctx, "waiting", job_id)
        if held is None:
            continue
        try:
            job = check(ctx, held.st, held.read, held.name)
            order.add_edges(job_id, [d for d in record.after_of(job)
                                     if outcome_state(ctx.spool, history, d) == "unfinished"])
        except InvalidJob:
            pass
        finally:
            held.release()
    return moved


def hold(ctx: Context, job_id: str) -> None:
    """A waiting job (new/, failed/ or waiting/) to held/: never claimed until released."""
    for folder in ("new", "failed", "waiting"):
        held = _hold_waiting(ctx, folder, job_id)
        if held is not None:
            try:
                held.move("held", keep_name=True)
            finally:
                held.release()
            return
    _not_there(ctx, job_id, "held", "only a waiting job can be held")


def release(ctx: Context, order: Order, job_id: str, now: bool, history: History) -> str:
    """A held job back: to failed/ if it was held from there, to waiting/
    while a dependency is unfinished, else to new/; due when it was, or
    now. Its record no longer says held. Returns the folder."""
    held = _hold_waiting(ctx, "held", job_id)
    if held is None:
        _not_there(ctx, job_id, None, "not held")
    try:
        try:
            job = check(ctx, held.st, held.read, held.name)
        except InvalidJob as e:
            raise NotPossible(f"job {job_id} is not a valid job ({e}); cancel it or fix it by hand") from None
        deps = record.after_of(job)
        waits = [d for d in deps if outcome_state(ctx.spool, history, d) == "unfinished"]
        dest = "failed" if job.get("state") == "failed" else ("waiting" if waits else "new")
        if job.get("held"):
            job["held"] = False
            held.rewrite(record.dumps(job))
        if now:
            held.set_mtime(time.time_ns())
        if dest == "waiting":
            order.add_edges(job_id, waits)
        held.move(dest, keep_name=True)
    finally:
        held.release()
    if dest == "waiting":
        settle(ctx, order, job_id, history)  # a dependency may have finished meanwhile
    return dest


def _hold_waiting(ctx: Context, folder: str, job_id: str) -> Any:
    deadline = time.monotonic() + 1.0
    while True:
        try:
            return ctx.spool.hold(folder, file_name(job_id))
        except (FileNotFoundError, Gone, NotRegular):
            return None
        except Busy:
            if time.monotonic() > deadline:
                raise NotPossible(f"job {job_id} is busy (a worker holds it); try again") from None
            time.sleep(0.001)


def _not_there(ctx: Context, job_id: str, already: str | None, why: str) -> None:
    where = ctx.spool.find((file_name(job_id),))
    if where is None:
        raise JobNotFound(f"no job {job_id} in this spool")
    if where[0] == already:
        return
    shown = "running" if where[0] == "cur" else where[0]
    raise NotPossible(f"job {job_id} is {shown}; {why}")


def enqueue(ctx: Context, order: Order, job_id: str, job: dict, publish: Callable[[str], None],
            history: History) -> str | None:
    """Publish a new job where its ordering fields put it: held/ (held),
    waiting/ (a dependency unfinished; its edges made first, and looked at
    again after, in case the dependency finished meanwhile) or new/, its
    priority marked first; under its unique key's lock when it has one.
    ``publish(folder)`` writes it there. Returns the id of the unfinished
    job that holds its unique key instead (nothing is published then).
    InvalidJob for a dependency unknown, dead or cancelled."""
    from .ordering import check_dependencies

    deps = record.after_of(job)
    ready = check_dependencies(lambda dep: outcome_state(ctx.spool, history, dep), job_id, deps)
    folder = "held" if job.get("held") else ("new" if ready else "waiting")

    def put() -> None:
        order.mark_priority(job_id, record.priority_of(job))
        if not ready:
            order.add_edges(job_id, deps)
        publish(folder)

    key = job.get("unique")
    if key is not None:
        holder = order.with_key(key, job_id, put)
        if holder is not None:
            return holder
    else:
        put()
    if folder == "waiting":
        settle(ctx, order, job_id, history)
    return None


def park(ctx: Context, order: Order, ready: Any, history: History) -> str | None:
    """A prepared job (locked in its waiting folder) that names
    dependencies: None when all have succeeded (it may run); else it is
    moved to waiting/ (its edges made first) or, for a dependency unknown,
    dead or cancelled, to dead/ with the reason; returns what was done."""
    states = {dep: outcome_state(ctx.spool, history, dep) for dep in record.after_of(ready.job)}
    for dep, state in states.items():
        if state is None or state in ("dead", "cancelled"):
            reason = f"its dependency {dep} ended {state}" if state else f"after: no job {dep} in this spool"
            quarantine(ctx, ready.held, reason)
            dependency_ended(ctx, order, ready.job_id, "dead", history)
            return f"outcome=dead state=dead error={reason!r}"
    waits = [dep for dep, state in states.items() if state == "unfinished"]
    if not waits:
        return None
    order.add_edges(ready.job_id, waits)
    ready.held.move("waiting", keep_name=True)
    ready.held.release()
    settle(ctx, order, ready.job_id, history)
    return f"state=waiting after={','.join(waits)}"
