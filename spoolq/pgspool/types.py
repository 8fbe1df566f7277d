"""The values the PostgreSQL spool hands to the worker and the facade: a
claim, what a finish did, recovery's report, and the error for a database
that cannot be reached. They mirror the storage port's neutral types
(``Claim``, ``Finished``, ``Report``), field for field, so that the port
can take them over; nothing in them names a table or a connection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import SpoolError


class Unavailable(SpoolError):
    """The database cannot be reached now (or this worker has lost its
    liveness session and is reconnecting): try again later."""


@dataclass
class Claim:
    """A job this worker holds. ``token`` fences every later change: a
    change carrying a token the row no longer has changes nothing."""

    job: dict
    job_id: str
    attempt: int  # the run number this claim is (the record's attempts + 1)
    due: float  # epoch seconds it was due
    token: int
    origin: str  # the state it was claimed from (new or failed): where unclaim puts it back
    worker: int  # the workers row it was claimed under


@dataclass
class Finished:
    """What ``finish`` did. ``pending``: durable only once ``commit`` has
    run. ``lost``: the claim had been lost (another process recovered the
    job), so this finish changed nothing and its run must not be counted."""

    state: str | None  # done | failed | dead (None when lost)
    due: float | None  # when a failed job is due again (epoch seconds)
    pending: bool = True
    lost: bool = False
    claim: Claim | None = None
    params: dict[str, Any] = field(default_factory=dict, repr=False)  # the statement, to send again after a reconnect


@dataclass
class Report:
    """What one recovery did (the directory spool's fields; those that do
    not apply to a database stay 0)."""

    recovered: int = 0  # jobs back to failed, due now, their interrupted run counted
    dead: int = 0  # jobs out of attempts
    completed: int = 0
    quarantined: int = 0
    killed: int = 0  # processes of dead workers' runs killed (same host only)
    left_running: int = 0  # jobs left running: their processes live on and are not ours to kill
    left_for_root: int = 0
    workers: int = 0  # registrations of dead workers removed
    tmp_removed: int = 0
    waiting: int = 0  # jobs of workers lost less than the grace ago: taken by a later recovery
