"""spoolq: a background job queue that is nothing but a directory.

    from spoolq import Spool, Permanent

    q = Spool("/var/spool/app")
    job_id = q.enqueue(command="make report")
    q.work(handlers={"send_email": send_email})
"""

from .errors import DuplicateId, InvalidJob, JobNotFound, NotPossible, PartlyEnqueued, Permanent
from .spool import Spool

__all__ = ["Spool", "Permanent", "InvalidJob", "DuplicateId", "PartlyEnqueued", "JobNotFound", "NotPossible"]
__version__ = "0.1.0"
