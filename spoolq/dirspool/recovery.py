"""Recovery of the jobs dead workers left in cur/: each goes on to failed/
(its interrupted run counted), dead/ (out of attempts), or where its
recorded finish sent it, and the processes those runs left are killed.
``spoolq sweep`` and every worker's start come through here.

It moves jobs with the moves of transitions.py: recovery is a finish the
dead worker did not get to.
"""

from __future__ import annotations

import os
import time

from .. import procs, record
from . import registry
from .protocol import Busy, Gone, Held, NotRegular, file_name, id_of, staged_intact
from ..backend import Report
from ..record import InvalidJob, Outcome
from .transitions import Claimed, Context, backoff, check, finish, quarantine, write_and_move


RecoveryReport = Report  # what a recovery did: the port's report



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
    held = _hold_batch(ctx, report, batch, tried)
    held_ids = {id_of(h.name) for h in held}
    staged = sp.staged_records() if held else {}
    dead_workers: list[registry.DeadRegistration] = []
    try:
        # Registrations are the spool owner's, who alone runs workers on it
        # (root, only on a spool of root's): trusted_users vouch for the
        # jobs a user enqueues, never for which processes get killed.
        dead_workers = registry.take_dead(sp, wait_for=held_ids, trusted=frozenset({os.geteuid()}))
        believed = [reg for reg in dead_workers if reg.believed]
        runs = _interrupted_runs(dead_workers, report)
        # A run whose processes live on and are not ours to kill (a worker of
        # another user died) keeps its job in cur/, and its registration
        # entry, until they end: recovered now, it would run twice at once.
        # (A run that had finished is completed all the same: it runs no more.)
        still_running = set().union(*(reg.unkillable for reg in dead_workers))
        recovered_ids = set(held_ids)
        for h in held:
            if _recover_one(ctx, h, runs.get(id_of(h.name)), staged.get(h.name, ()), report,
                            believed[0] if believed else None, id_of(h.name) in still_running):
                recovered_ids.discard(id_of(h.name))
        _clear_registrations(ctx, believed, recovered_ids, report)
    finally:
        # Whatever failed, hold nothing: a worker lives on after its recovery.
        for h in held:
            h.release()
        for reg in dead_workers:
            reg.release()
    return len(held)


def _hold_batch(ctx: Context, report: RecoveryReport, batch: int, tried: set[str]) -> list[Held]:
    """Lock up to ``batch`` cur/ files not in ``tried`` that no live worker
    holds; one that is no file a job can be read from goes to dead/."""
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
            # Only the owner's side (this user) writes into cur/: what it may
            # not open is no record of its workers, and goes to dead/.
            try:
                sp.move_entry("cur", name, "dead")
                report.quarantined += 1
            except FileNotFoundError:
                pass
            except PermissionError:
                # A member's directory, which only a user who may write it
                # moves to another folder: it names no job, so it stays.
                pass
    return held


def _interrupted_runs(dead_workers: list[registry.DeadRegistration],
                      report: RecoveryReport) -> dict[str, tuple[registry.DeadRegistration, dict]]:
    """Kill what the dead workers' runs left alive; returns the run each
    listed, by job id."""
    runs: dict[str, tuple[registry.DeadRegistration, dict]] = {}
    for reg in dead_workers:
        report.killed += reg.kill_processes()
        if not reg.believed:
            continue
        for job_id, entry in reg.jobs.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("attempt"), int):
                continue
            # Two dead workers may both list a job (one entry stale): the
            # latest attempt is the run that was interrupted.
            if job_id not in runs or entry["attempt"] > runs[job_id][1]["attempt"]:
                runs[job_id] = (reg, entry)
    return runs


def _clear_registrations(ctx: Context, dead_workers: list[registry.DeadRegistration], recovered_ids: set[str],
                         report: RecoveryReport) -> None:
    """Clear a registration only when none of its jobs is left in cur/ for
    another recovery (which holds it right now) to handle, or for a later
    one; else just forget the runs recovered here."""
    for reg in dead_workers:
        if any(job_id not in recovered_ids and ctx.spool.find((file_name(job_id),), ("cur",)) for job_id in reg.jobs):
            reg.forget(recovered_ids)
        else:
            reg.remove()
            report.workers += 1


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
    reg, entry = run if run else (None, None)
    attempts = int(job.get("attempts") or 0)
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
            due = time.time() + backoff(ctx, int(job.get("attempts") or 1))
        write_and_move(held, job, job["state"], due)
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
        # A staged record is a worker's, and only the spool's owner (this
        # user) runs workers: a member's (trusted_users vouch for the jobs
        # it enqueues) would set a whole record, run_as and command
        # included, that a root worker rewrites as root's and then believes.
        if found is not None or h.st.st_uid != os.geteuid() or h.st.st_nlink != 1 or h.st.st_mode & 0o022 \
                or h.st.st_size > record.max_file_bytes(limit):
            continue
        data = h.read(record.read_size(limit))
        if not staged_intact(name, data):
            continue  # torn by a power cut, or an old inode left under this name
        try:
            outcome = record.parse_sized(data, job["id"], limit)
        except InvalidJob:
            continue
        if outcome.get("attempts") == run_attempt and outcome.get("state") in ("done", "failed", "dead") \
                and record.continues(job, outcome):
            found = outcome
    return found
