"""``Ordering``: the facade's verbs for what decides when a job of a
spool directory runs -- an enqueue with a priority, dependencies, a unique
key or held, and hold and release -- a mixin of ``Spool``. The moves are
dirspool/waits.py's, the files of order/ dirspool/ordering.py's.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from .errors import DuplicateId, Exists, InvalidJob, NotPossible, PartlyEnqueued
from .ids import file_name


def ordered(fields: Mapping[str, Any]) -> bool:
    """Whether a job's fields put it anywhere but plainly in new/."""
    return (fields.get("after") is not None or fields.get("unique") is not None or bool(fields.get("held"))
            or bool(fields.get("priority")))


class Ordering:
    """Spool's ordering verbs (``self`` is the Spool)."""

    dir: Any
    _order: Any = None

    def _enqueue_ordered(self, job_id: str, job: dict, data: bytes, mtime_ns: int | None) -> str | None:
        """A job with dependencies, a unique key, a priority or held: see dirspool/waits.enqueue."""
        from .dirspool import waits  # imported here: start-up speed (as in context())

        if self.dir.drops_in:
            raise NotPossible("a member of a shared spool enqueues no priority, dependency, unique key or held "
                              "job (its drop is taken in plainly); ask the spool's owner")

        def publish(folder: str) -> None:
            try:
                self.dir.publish(file_name(job_id), data, mtime_ns, folder=folder)
            except Exists:
                raise DuplicateId(f"id {job_id} is already in {folder}/") from None

        return waits.enqueue(self.context(), self.order, job_id, job, publish, self._history)

    @property
    def order(self):
        """The order/ folder's files (priorities, dependencies, unique keys, locks)."""
        if getattr(self, "_order", None) is None:
            from .dirspool.ordering import Order  # imported here: start-up speed

            self._order = Order(self.dir)
        return self._order

    def _history(self, job_id: str) -> dict | None:
        index = self.index(create=False)
        return index.get(job_id) if index is not None else None

    def hold(self, job_id: str) -> None:
        """Hold a waiting job: it stays in the spool (held/) and is never
        claimed until released. JobNotFound or NotPossible say why not."""
        from .dirspool import waits  # imported here: start-up speed (as in context())

        self._open()
        self.dir.require_owner("hold jobs")
        waits.hold(self.context(), job_id)

    def release(self, job_id: str, now: bool = False) -> str:
        """Release a held job: waiting again as before it was held (due when
        it was, or ``now``). Returns the state it is in now."""
        from .dirspool import waits  # imported here: start-up speed (as in context())

        self._open()
        self.dir.require_owner("release jobs")
        return waits.release(self.context(), self.order, job_id, now, self._history)

    def _enqueue_each(self, jobs: list[Mapping[str, Any]]) -> list[str]:
        """A batch with ordering fields: every job checked first, then
        enqueued one at a time (a dependency may name a job before it)."""
        now = time.time()
        for i, fields in enumerate(jobs):
            if not isinstance(fields, Mapping):
                raise InvalidJob(f"job {i + 1}: not a JSON object")
            try:
                self._prepare(fields, now)
            except InvalidJob as e:
                raise InvalidJob(f"job {i + 1}: {e}") from None
        ids: list[str] = []
        for i, fields in enumerate(jobs):
            try:
                ids.append(self.enqueue_job(fields))
            except (InvalidJob, DuplicateId) as e:
                if not ids:
                    raise type(e)(f"job {i + 1}: {e}") from None
                raise PartlyEnqueued(ids, len(jobs), f"job {i + 1}: {e}") from e
        return ids

