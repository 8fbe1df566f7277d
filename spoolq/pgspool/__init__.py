"""The PostgreSQL spool: a spool that is a PostgreSQL database, for workers
on many machines. ``PgBackend(url)`` is the whole of it; ``is_url`` tells
its locations (``postgresql://`` and ``postgres://`` URLs) from a spool
directory's path.

Importing this package needs nothing beyond spoolq: psycopg (the
``postgres`` extra) is imported on the first connection, and its absence
is one line that names the extra.
"""

from __future__ import annotations

from .connect import is_url, without_password

__all__ = ["PgBackend", "is_url", "without_password"]


def __getattr__(name: str):
    if name == "PgBackend":
        from .backend import PgBackend

        return PgBackend
    raise AttributeError(name)
