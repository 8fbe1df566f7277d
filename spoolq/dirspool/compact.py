"""Compaction and purge: finished files folded from their folders into the
index. ``compact`` folds done/ (and drops old history, and stale tmp/
files); ``purge_dead`` folds the dead/ files older than a cutoff, a
deliberate act compaction never takes on its own; ``retry_purged`` puts a
purged dead job back into new/ from its row.

Each file is locked, read with the checks every transition makes, its row
committed, and only then removed (still locked): a crash at any point
leaves every record in the index, in its folder, or in both, and the next
fold skips what the index holds already (see Index.add).
"""

from __future__ import annotations

import base64
import errno
import os
import time
from typing import Any, Callable

from .. import config, procs, record
from ..errors import Exists, InvalidJob, JobNotFound, NotPossible
from .index import Index
from .protocol import Busy, Gone, Held, NotRegular, SpoolDir, file_name, id_of, user_name
from .transitions import Context, check, locate

FOLD_BATCH = 2000  # files a fold holds and commits at once, where the descriptor limit allows
BESIDE_BATCH = 200  # ... and a fold that may be told to stop (see compact)


def fold(spool: SpoolDir, index: Index, folder: str, names: list[str], settings: dict,
         stop: Callable[[], bool] | None = None, batch: int = FOLD_BATCH) -> tuple[int, int]:
    """Move the given files of ``folder`` into the index, a batch at a time
    (see _held_at_once): lock each file, commit its row, then remove it
    (still locked). Files that are busy, gone or unreadable are left where
    they are. ``stop``, asked after each batch, ends the fold early when it
    says so (the files not reached stay for the next one). Returns (jobs
    folded, files left)."""
    ctx = Context(spool, settings)
    batch = _held_at_once(batch)
    folded = left = 0
    pos = 0
    while pos < len(names) and not (folded and stop is not None and stop()):
        held_batch = []
        rows = []
        try:
            while pos < len(names) and len(held_batch) < batch:
                name = names[pos]
                try:
                    held = spool.hold(folder, name)
                except (Busy, Gone, FileNotFoundError, NotRegular, PermissionError):
                    left += 1
                    pos += 1
                    continue
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE) and held_batch:
                        break  # out of descriptors after all: fold what is held, then go on
                    raise
                pos += 1
                row = _row(ctx, folder, name, held)
                if row is None:
                    held.release()
                    left += 1
                    continue
                held_batch.append(held)
                rows.append(row)
            if not rows:
                continue
            # A worker's move into the folder may not be synced yet (its
            # group commit syncs the folders a moment later): the row must
            # not outlive a move that a power cut could undo.
            spool.sync_dir(folder)
            index.add(rows)
            for held in held_batch:
                held.unlink()
            spool.sync_dir(folder)
            folded += len(rows)
        finally:
            for held in held_batch:
                held.release()
    return folded, left


def _row(ctx: Context, folder: str, name: str, held: Held) -> tuple[dict, str, float] | None:
    """What the index stores of a held file: (record, state, finish time),
    or None for a file to leave where it is (only a deliberate purge takes
    an invalid one)."""
    try:
        job = check(ctx, held.st, held.read, name)
    except (record.InvalidJob, OSError) as e:
        if folder != "dead":
            return None
        job = _invalid_record(name, held, e, int(ctx.settings["max_job_bytes"]), ctx.trusted_uids)
    kept = ctx.spool.noted_reason(name) if folder == "dead" else None
    if kept is not None and (job.get("invalid") or job.get("error") is None):
        job["error"] = kept  # why it went to dead/, whatever was written into it since
    if folder == "done":
        job = record.as_done(job)
    finished = record.time_or_none(job.get("finished_at")) or held.st.st_mtime
    return job, "done" if folder == "done" else "dead", finished


def _invalid_record(name: str, held: Held, problem: Exception, limit: int, trusted: frozenset[int]) -> dict:
    """What the index keeps of a dead file that is no valid job: why it is
    invalid and its bytes exactly (``raw`` when they are UTF-8, else
    ``raw_base64``), the first ``limit`` (max_job_bytes) of them only, with
    its size, when it is larger. The bytes only of a trusted user's file
    with no other name: the index is readable by the spool's group, and a
    member may have linked another user's file into dead/ for the owner's
    (or root's) purge to read."""
    reason = str(problem) if isinstance(problem, record.InvalidJob) else f"unreadable: {problem}"
    job: dict[str, Any] = {"id": id_of(name), "invalid": True, "error": reason}
    if held.st.st_nlink != 1 or held.st.st_uid not in trusted:
        why = f"{held.st.st_nlink} links" if held.st.st_nlink != 1 else f"owned by untrusted user {user_name(held.st.st_uid)}"
        return dict(job, raw_error=f"not kept: {why}")
    try:
        raw = held.read(limit)
    except OSError as e:
        return dict(job, raw_error=f"unreadable: {e.strerror}")
    try:
        job["raw"] = raw.decode("utf-8")
    except UnicodeDecodeError:
        job["raw_base64"] = base64.b64encode(raw).decode("ascii")
    if held.size > len(raw):
        job.update(raw_bytes=held.size, raw_truncated=True)
    return job


def _held_at_once(batch: int) -> int:
    """How many files a fold may hold open at once: each is a descriptor,
    and a soft limit of 1024 (the usual default, systemd's too) would fail
    a batch of 2,000. A quarter of the limit leaves the rest to SQLite and
    the worker."""
    return max(1, min(batch, procs.open_file_limit() // 4))


def compact(spool: SpoolDir, index: Index, settings: dict, keep: float | None = None,
            stop: Callable[[], bool] | None = None) -> dict[str, int]:
    """Fold done/ into the index, drop history older than ``keep`` seconds,
    and remove tmp/ files older than 36 hours. ``stop``: see fold (a
    compaction beside a worker folds in smaller batches, so that a stop
    waits for less)."""
    started = time.monotonic()
    names = sorted(spool.names("done"))
    folded, left = fold(spool, index, "done", names, settings, stop, FOLD_BATCH if stop is None else BESIDE_BATCH)
    dropped = index.drop_older(time.time() - keep) if keep is not None else 0
    tmp_removed = spool.remove_tmp() + index.remove_stale_tmp()
    return {"folded": folded, "left": left, "dropped": dropped, "tmp_removed": tmp_removed,
            "seconds": round(time.monotonic() - started, 3)}


def purge_dead(spool: SpoolDir, index: Index, settings: dict, older_than: float) -> dict[str, int]:
    """Clear dead jobs whose file is older than ``older_than`` seconds into the
    index (a deliberate act: compaction never touches dead/)."""
    cutoff = time.time() - older_than
    names = sorted(n for n, st in spool.entries("dead") if st.st_mtime < cutoff)
    folded, left = fold(spool, index, "dead", names, settings)
    return {"purged": folded, "left": left}



def retry_purged(ctx: Context, index: Index, job_id: str, on_note: Callable[[str], None] | None = None) -> None:
    """A dead job purged into the index back to new/, due now, with a fresh
    round of attempts, from the record its row keeps (as ``retry`` does for
    a file in dead/). Raises JobNotFound, or NotPossible saying why it
    cannot go. Published first, then the row marked retried (see
    Index.mark_retried): a crash in between leaves the job in new/ and its
    old row, which listings leave out while the file is in a folder."""
    stored = index.get(job_id)
    if stored is None or stored.get("state") not in ("dead", "retried"):
        if stored is not None:
            raise NotPossible(f"job {job_id} has finished (done, compacted); only a dead job is retried")
        raise JobNotFound(f"no job {job_id} in dead/")
    ctx.spool.require_owner("retry a job purged into index.db")
    where = locate(ctx, job_id)
    if where is not None:
        raise NotPossible(f"a job {job_id} is already in {where[0]}/; the purged one stays in index.db")
    job = {k: v for k, v in stored.items() if k not in ("state", "compacted")}
    if job.get("invalid"):
        raise NotPossible(f"cannot retry {job_id}: it was purged from dead/ as no valid job ({job.get('error')}), "
                          "so there is no job to run; index.db keeps what the file held (record.raw)")
    try:
        record.validate(job, job_id)
    except InvalidJob as e:
        raise NotPossible(f"cannot retry {job_id}: its record in index.db is no valid job ({e})") from None
    problem = config.refusal(ctx.settings, job)
    if problem:
        raise NotPossible(f"cannot retry {job_id}: {problem}")
    owner = job.get("run_as")
    if not ctx.as_root and isinstance(owner, int) and owner not in (0, os.geteuid()):
        raise NotPossible(f"cannot retry {job_id}: a root worker ran it as {user_name(owner)}, and a retry by "
                          f"{user_name(os.geteuid())} would make it run as {user_name(os.geteuid())}; retry it as root")
    record.retry(job)
    try:
        ctx.spool.publish(file_name(job_id), record.dumps(job))
    except Exists:
        raise NotPossible(f"new/{file_name(job_id)} already exists; the purged job stays in index.db") from None
    try:
        index.mark_retried(job_id)
    except Exception as e:  # the job is in new/: that is the retry, whatever the index says
        if on_note:
            on_note(f"job {job_id} is back in new/, but index.db could not be updated ({e}); "
                    "it still counts it among the purged jobs")
