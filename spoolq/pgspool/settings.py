"""A PostgreSQL spool's settings: stored in its ``spoolq.settings`` table,
validated by config.py as ``config.json``'s are, and held in the same
``config.Settings`` object the worker and everything else read (reloaded
in place). Who may change them is the database's grants: the role that
owns the schema.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from .. import config
from ..errors import ConfigError


class PgSettings(config.Settings):
    """``config.Settings`` whose values come from the settings table."""

    def __init__(self, location: str, conn: Callable[[], Any]):
        super().__init__(location)
        self._conn = conn

    def reload(self) -> None:
        """Read the table again; on an error (raised) the values stay as they were."""
        self.use(load(self._conn(), self.root))


def stored(conn) -> dict[str, Any]:
    """Only the settings stored in the table (no defaults)."""
    return {key: value for key, value in conn.execute("SELECT key, value FROM spoolq.settings ORDER BY key")}


def load(conn, location: str) -> dict[str, Any]:
    """The defaults with the stored settings over them. A stored value
    that does not validate is an error (a worker must not run with settings
    nobody chose), named as config.json's would be."""
    settings = dict(config.DEFAULTS)
    for key, value in stored(conn).items():
        try:
            settings[key] = config.check(key, value, stored=True)
        except ConfigError as e:
            raise ConfigError(f"{location} settings: {e}") from None
    return settings


def put(conn, key: str, value: Any) -> Any:
    """Validate and store one setting; returns the stored value."""
    checked = config.check(key, value)
    conn.execute("INSERT INTO spoolq.settings (key, value) VALUES (%s, %s::jsonb) "
                 "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value", (key, json.dumps(checked)))
    return checked


def remove(conn, key: str) -> bool:
    """Forget a stored setting (its default applies again); whether one was stored."""
    if key not in config.DEFAULTS:
        config.check(key, None)  # raises the unknown-key error
    return conn.execute("DELETE FROM spoolq.settings WHERE key = %s", (key,)).rowcount > 0
