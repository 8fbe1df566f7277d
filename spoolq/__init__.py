"""spoolq: a background job queue that is nothing but a directory.

    from spoolq import Spool, Permanent

    q = Spool("/var/spool/app")
    job_id = q.enqueue(command="make report")
    q.work(handlers={"send_email": send_email})
"""

from .record import InvalidJob
from .spool import DuplicateId, PartlyEnqueued, Spool

__all__ = ["Spool", "Permanent", "InvalidJob", "DuplicateId", "PartlyEnqueued", "JobNotFound", "NotPossible"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported lazily: the runner pulls in subprocess and select, which a
    # program that only enqueues does not need.
    if name == "Permanent":
        from .runner import Permanent

        return Permanent
    if name in ("JobNotFound", "NotPossible"):  # what cancel() and retry() raise with check=True
        from . import transitions

        return getattr(transitions, name)
    raise AttributeError(f"module 'spoolq' has no attribute {name!r}")
