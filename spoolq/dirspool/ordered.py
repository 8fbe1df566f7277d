"""The ordering half of the directory backend (``OrderSide``, a part of
``DirBackend``): an enqueue of jobs with a priority, dependencies, a
unique key, locks or held, and the operator's hold and release. The
moves are waits.py's, the files of order/ ordering.py's.

A member of a shared spool enqueues into drop/, from which the owner's
worker takes jobs in: priority, lock and held are honoured there (the
pickup marks a priority as it takes the job in; lock and held are read as
the job is claimed, as from any dropped file);
dependencies and unique keys are refused, since what they promise at
enqueue (an unknown dependency refused, a key's holder's id printed)
cannot be known from the member's side.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import record
from ..errors import DuplicateId, Exists, InvalidJob, PartlyEnqueued, SpoolError

#: Fields that send a job elsewhere than plainly into new/ (priority and
#: lock only order it among the due jobs: a worker reads them as it claims).
_PLACED = ("after", "unique", "held")

OnExisting = Callable[[str, str], None]


def ordered(data: bytes) -> dict[str, Any] | None:
    """The record of a job with ordering fields that put it anywhere but
    plainly in new/ (priority, dependencies, a unique key, held), or None."""
    if not record.may_order(data):  # (most jobs: known without parsing the record again)
        return None
    job = record.loads(data.decode("utf-8"))
    if any(job.get(field) is not None for field in _PLACED) or record.priority_of(job):
        return job
    return None


class OrderSide:
    """The ordering verbs of the port over a spool directory. It relies on
    what ``DirBackend`` gives: ``dir``, ``context()``, ``index()``,
    ``_open()`` and ``_publish_one()``."""

    _order: Any = None

    @property
    def order(self) -> Any:
        """The order/ folder's files (priorities, dependencies, unique keys, locks)."""
        if self._order is None:
            from .ordering import Order  # imported here: start-up speed (an enqueue without ordering never needs it)

            self._order = Order(self.dir)
        return self._order

    def _history(self, job_id: str) -> dict | None:
        """A compacted job's record (the index's), or None."""
        index = self.index(create=False)
        return index.get(job_id) if index is not None else None

    def hold(self, job_id: str) -> None:
        """Hold a waiting job: it stays in the spool (held/) and is never
        claimed until released. JobNotFound or NotPossible say why not."""
        from . import waits

        self._open()
        self.dir.require_owner("hold jobs")
        waits.hold(self.context(), job_id)

    def release_held(self, job_id: str, now: bool = False) -> str:
        """Release a held job: waiting again as before it was held (due when
        it was, or ``now``). Returns the state it is in now."""
        from . import waits

        self._open()
        self.dir.require_owner("release jobs")
        return waits.release(self.context(), self.order, job_id, now, self._history)

    def _enqueue_ordered(self, items: list[tuple[str, bytes, int | None]], jobs: list[dict | None],
                         on_existing: OnExisting | None) -> list[str]:
        """A batch of which some have ordering fields: enqueued one at a
        time, in order (a dependency may name a job before it); a job whose
        unique key an unfinished job holds is not added, that job's id
        stands in for it (told to ``on_existing(id, holder)``)."""
        if self.dir.drops_in:
            asked = [field for job in jobs if job for field in ("after", "unique") if job.get(field) is not None]
            if asked:
                raise SpoolError(f"a member of a shared spool cannot enqueue with {asked[0]} (its job is taken "
                                  "in by the owner's worker, too late to check it); priority, lock and held it may")
            self.dir.drops.put(items)
            return [job_id for job_id, _, _ in items]
        ids: list[str] = []
        for i, ((name, data, mtime_ns), job) in enumerate(zip(items, jobs)):
            try:
                ids.append(self._enqueue_one(name, data, mtime_ns, job, on_existing))
            except (InvalidJob, DuplicateId) as e:
                if not ids:
                    raise type(e)(f"job {i + 1}: {e}" if len(items) > 1 else str(e)) from None
                raise PartlyEnqueued(ids, len(items), f"job {i + 1}: {e}") from e
        return ids

    def _enqueue_one(self, name: str, data: bytes, mtime_ns: int | None, job: dict | None,
                     on_existing: OnExisting | None) -> str:
        job_id = job["id"] if job is not None else None
        if job is None:  # no ordering field of its own, in a batch with some
            return self._publish_one(name, data, mtime_ns)
        from . import waits

        def publish(folder: str) -> None:
            try:
                self.dir.publish(name, data, mtime_ns, folder=folder)
            except Exists:
                raise DuplicateId(f"id {job_id} is already in {folder}/") from None

        holder = waits.enqueue(self.context(), self.order, job_id, job, publish, self._history)
        if holder is not None:
            if on_existing is not None:
                on_existing(job_id, holder)
            return holder
        return job_id

