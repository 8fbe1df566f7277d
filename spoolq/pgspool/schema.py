"""The spoolq schema in a PostgreSQL database: making it (idempotent, under
a lock so that two inits at once make it once), its version and the
migrations from older ones, the grants to spoolq's roles, and the check
every open makes that the database holds a spool this spoolq can use.
"""

from __future__ import annotations

import functools
from importlib import resources

from ..errors import NotASpool, SpoolError

SCHEMA_VERSION = 2

# version -> the SQL file that brings a schema of the version before it to
# it (schema.sql makes version 1).
MIGRATIONS: dict[int, str] = {2: "ordering.sql"}

# The advisory lock class of every lock spoolq takes; (LOCK_CLASS, 0)
# serialises inits, (LOCK_CLASS, workers.id) is a worker's liveness.
LOCK_CLASS = 1397772113


@functools.lru_cache(maxsize=None)
def sql(name: str) -> str:
    """One of the package's SQL files."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def installed_version(conn) -> int | None:
    """The schema version in the database (None: no spoolq schema)."""
    row = conn.execute("SELECT to_regclass('spoolq.schema_version') IS NOT NULL").fetchone()
    if not row[0]:
        return None
    return conn.execute("SELECT max(version) FROM spoolq.schema_version").fetchone()[0]


def init(conn, location: str) -> int | None:
    """Make the schema, or bring it up to this version; grant what each of
    spoolq's roles that exists may do. Returns the version found (None for
    a database without one). ``conn`` is in autocommit mode."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (LOCK_CLASS,))
        found = installed_version(conn)
        if found is not None and found > SCHEMA_VERSION:
            raise _newer(location, found)
        if found is None:
            conn.execute(sql("schema.sql"))
            conn.execute("INSERT INTO spoolq.schema_version (version) VALUES (1)")
        for version in range((found or 1) + 1, SCHEMA_VERSION + 1):
            conn.execute(sql(MIGRATIONS[version]))
            conn.execute("INSERT INTO spoolq.schema_version (version) VALUES (%s)", (version,))
        conn.execute(sql("grants.sql"))
    return found


def check(conn, location: str) -> None:
    """Raise unless the database holds a spoolq schema of this version:
    NotASpool when it has none, SpoolError when it is of another version."""
    found = installed_version(conn)
    if found is None:
        raise NotASpool(location)
    if found > SCHEMA_VERSION:
        raise _newer(location, found)
    if found < SCHEMA_VERSION:
        raise SpoolError(f"{location} holds spoolq's schema version {found}; this spoolq uses version "
                         f"{SCHEMA_VERSION}: upgrade it with spoolq init")


def _newer(location: str, found: int) -> SpoolError:
    return SpoolError(f"{location} holds spoolq's schema version {found}, newer than this spoolq knows "
                      f"({SCHEMA_VERSION}): upgrade spoolq")
