"""Every exception class spoolq defines, in one leaf that imports nothing
from spoolq, so any module may raise or catch any of them.

The modules that raise them import them from here; the names stay
importable from those modules too (``from spoolq.dirspool.protocol import
NotASpool``) and the public ones from ``spoolq``.
"""

from __future__ import annotations


class SpoolError(Exception):
    """A problem with the spool itself (layout, permissions, filesystem)."""


class NotASpool(SpoolError):
    """The path holds no spool: missing, or a directory without the layout.
    Reading a spool never creates one, so a mistyped path is said, not
    turned into an empty spool."""

    def __init__(self, path: str):
        import shlex  # imported here: start-up speed (only this message quotes a path for a shell)

        super().__init__(f"{path} is not a spool (create one with: spoolq -s {shlex.quote(path)} init)")
        self.path = path


class InsideSpool(SpoolError):
    """The path given as a spool lies inside another spool (``-s spool/new``):
    a spool made there would put folders where workers expect job files, and
    reading it reads nothing a worker will ever run."""

    def __init__(self, path: str, root: str, folder: str | None):
        import shlex  # imported here: start-up speed (as in NotASpool)

        where = f"the {folder}/ folder of the spool {root}" if folder else f"inside the spool {root}"
        super().__init__(f"{path} is {where}, not a spool; did you mean -s {shlex.quote(root)}?")
        self.path = path
        self.root = root


class PartlyEnqueued(SpoolError):
    """``enqueue_many`` failed after it had published some of its jobs
    (a full disk, a duplicate id met at the last step): ``ids`` are the
    jobs that are in ``new/`` and will run, in order; the rest are not."""

    def __init__(self, ids: list[str], total: int, cause: str):
        if len(ids) < total:
            message = f"only the first {len(ids)} of {total} jobs were enqueued; the rest were not: {cause}"
        else:
            message = f"all {total} jobs are in new/ and will run, but new/ could not be synced: {cause}"
        super().__init__(message)
        self.ids = ids
        self.total = total


class RequestPending(SpoolError):
    """A member's request (cancel, retry) is waiting in drop/: no worker of
    the spool's owner answered it in time. It is carried out when one runs."""


class Busy(Exception):
    """The file is locked by someone else."""


class Gone(Exception):
    """The file moved away or was replaced before we could hold it."""


class NotRegular(Exception):
    """The entry is not a regular file (symlink, FIFO, directory, device)."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class NoSuchGroup(ValueError):
    """``init --group`` names a group this system does not have (invalid input)."""


class Exists(Exception):
    """The destination name is taken."""


class DuplicateId(Exception):
    """An id that is already present in the spool (a state folder or the index)."""


class InvalidJob(ValueError):
    """A job file or job description that can never run; the message is the reason."""


class Incomplete(InvalidJob):
    """Bytes that do not parse but that more bytes could still make a job:
    an empty file, UTF-8 cut in the middle of a character, or an object cut
    short. That is what a file still being written looks like."""


class ConfigError(ValueError):
    """A bad key or value; the message says which and why."""


class UnmetDependency(InvalidJob):
    """A job names a dependency the spool does not hold, or one that ended
    dead or cancelled: refused at enqueue (the request cannot be done: exit 1)."""


class JobNotFound(LookupError):
    """No job with that id in this spool."""


class NotPossible(Exception):
    """The job exists but the request does not apply to its state."""


class NotYours(NotPossible):
    """A member asked to cancel or retry a job another user enqueued."""


class Permanent(Exception):
    """Raise from a handler to fail its job for good: straight to dead/, no retries."""


class ForcedStop(BaseException):
    """Raised into an in-process handler when the worker must stop now."""


class JobFailed(AssertionError):
    """A job run by ``testing.run_jobs`` failed; the message carries its
    error and the tail of its traceback or stderr."""

    def __init__(self, job: dict):
        self.job = job
        detail = job.get("stderr") or ""
        super().__init__(f"job {job.get('id')} ({job.get('kind') or job.get('command') or job.get('argv')}) failed: "
                         f"{job.get('error')}\n{detail}".rstrip())


class ForkServerGone(OSError):
    """The worker's fork server has ended (killed from outside): no handler
    job with a timeout can start in this worker any more."""
