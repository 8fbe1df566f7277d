"""Connections to a PostgreSQL spool: what a location is (a libpq URL), the
same URL without its password (the only form spoolq ever prints or logs),
and opening a connection with the keepalive settings whose bounds
docs/postgres.md states.

psycopg is an optional dependency: it is imported here, on the first
connection, and its absence is one line naming the extra to install.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from ..errors import SpoolError
from .types import Unavailable

SCHEMES = ("postgresql://", "postgres://")

# The client notices a silent server after KEEPALIVE_IDLE seconds and
# KEEPALIVE_COUNT probes KEEPALIVE_INTERVAL apart (connections that wait on
# a reply; a worker's liveness connection has its own, shorter heartbeat).
KEEPALIVE_IDLE = 5
KEEPALIVE_INTERVAL = 2
KEEPALIVE_COUNT = 3

# The server ends the session of a host that vanished (no FIN, no RST) no
# sooner than SERVER_SILENCE seconds after the last packet it got from it:
# its keepalive probes start after SERVER_KEEPALIVE_IDLE seconds of silence
# and the connection is dropped after the last unanswered one, or after as
# long with data unacknowledged (tcp_user_timeout). Each session sets these
# for itself (they are ordinary settings); over a Unix socket they do not apply.
SERVER_KEEPALIVE_IDLE = 10
SERVER_KEEPALIVE_INTERVAL = 2
SERVER_KEEPALIVE_COUNT = 3
SERVER_SILENCE = SERVER_KEEPALIVE_IDLE + SERVER_KEEPALIVE_INTERVAL * SERVER_KEEPALIVE_COUNT

EXTRA = "pip install 'spoolq[postgres]'"


def is_url(location: Any) -> bool:
    """Whether a spool location names a PostgreSQL spool."""
    return isinstance(location, str) and location.startswith(SCHEMES)


def without_password(url: str) -> str:
    """The URL as it may be shown: no password in its user part or among
    its parameters; everything else as given."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, hosts = netloc.rpartition("@")
        user = user.split(":", 1)[0]
        netloc = f"{user}@{hosts}" if user else hosts
    query = "&".join(p for p in parts.query.split("&")
                     if p and urllib.parse.unquote_plus(p.split("=", 1)[0]).strip().lower() != "password")
    # Put together by hand: urlunsplit drops the empty host of postgresql:///db.
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "") + \
        (f"#{parts.fragment}" if parts.fragment else "")


def psycopg_module():
    """psycopg, or the one line that says how to get it."""
    try:
        import psycopg
    except ImportError:
        raise SpoolError(f"a PostgreSQL spool needs psycopg: {EXTRA}") from None
    return psycopg


def conninfo(url: str, application: str = "spoolq", synchronous_commit: str | None = None) -> str:
    """The connection string for ``url`` with spoolq's keepalives and
    server-side settings added (the URL's own ``options`` kept first)."""
    psycopg = psycopg_module()
    params = psycopg.conninfo.conninfo_to_dict(url)
    settings = [f"-c tcp_keepalives_idle={SERVER_KEEPALIVE_IDLE}",
                f"-c tcp_keepalives_interval={SERVER_KEEPALIVE_INTERVAL}",
                f"-c tcp_keepalives_count={SERVER_KEEPALIVE_COUNT}",
                f"-c tcp_user_timeout={SERVER_SILENCE * 1000}"]
    if synchronous_commit is not None:
        settings.append(f"-c synchronous_commit={synchronous_commit}")
    own = params.get("options")
    params["options"] = " ".join(([own] if own else []) + settings)
    params.setdefault("application_name", application)
    params.setdefault("connect_timeout", "10")
    params.setdefault("keepalives", "1")
    params.setdefault("keepalives_idle", str(KEEPALIVE_IDLE))
    params.setdefault("keepalives_interval", str(KEEPALIVE_INTERVAL))
    params.setdefault("keepalives_count", str(KEEPALIVE_COUNT))
    return psycopg.conninfo.make_conninfo(**params)


def connect(url: str, autocommit: bool = True, application: str = "spoolq",
            synchronous_commit: str | None = None):
    """A new connection, or the reason why not naming the location (never
    the password): Unavailable when the server cannot be reached (or
    refuses the connection), SpoolError for a URL libpq cannot use."""
    psycopg = psycopg_module()
    try:
        info = conninfo(url, application, synchronous_commit)
    except psycopg.ProgrammingError as e:
        raise SpoolError(f"{without_password(url)} is not a valid PostgreSQL URL: {first_line(e)}") from None
    try:
        return psycopg.connect(info, autocommit=autocommit)
    except psycopg.OperationalError as e:  # the server cannot be reached, or refuses us
        raise Unavailable(f"cannot connect to {without_password(url)}: {first_line(e)}") from None
    except psycopg.Error as e:
        raise SpoolError(f"cannot connect to {without_password(url)}: {first_line(e)}") from None


def first_line(error: BaseException) -> str:
    """A database error as one line: libpq's messages run over several,
    and the first that says something is the one to show."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if not line.startswith("connection to server"):
            return line
    return lines[0] if lines else type(error).__name__
