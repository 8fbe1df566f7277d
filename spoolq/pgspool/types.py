"""The PostgreSQL spool's forms of the port's values: a claim carries the
row's claim token (which fences every later change), the state it was
claimed from and the workers row it was claimed under; a finish carries
the statement to send again after a reconnect. Recovery's report and the
error for a database out of reach are the port's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..backend import Claim as PortClaim
from ..backend import Finished as PortFinished
from ..backend import Report, Unavailable  # noqa: F401 - the port's, importable from here too


@dataclass
class Claim(PortClaim):
    """A job this worker holds. ``token`` fences every later change: a
    change carrying a token the row no longer has changes nothing."""

    token: int = 0
    origin: str = "new"  # the state it was claimed from (new or failed): where unclaim puts it back
    worker: int = 0  # the workers row it was claimed under


@dataclass
class Finished(PortFinished):
    """What ``finish`` did (see the port's ``Finished``); pending until the
    finishing transaction commits."""

    pending: bool = True
    params: dict[str, Any] = field(default_factory=dict, repr=False)  # the statement, to send again after a reconnect
