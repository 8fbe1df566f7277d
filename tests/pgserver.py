"""A PostgreSQL server of the tests' own, on a Unix socket in a temporary
folder, and a fresh database for each test that asks for one.

A test module loads these fixtures with ``pytest_plugins = ["pgserver"]``
(one server for the whole session, whichever modules ask for it):

- ``pg_server``: the running server (``PgServer``), started once per session
  with ``initdb`` and ``pg_ctl`` (as the ``postgres`` user when the tests run
  as root, since PostgreSQL refuses to run as root), tuned for tests
  (fsync off, small buffers, Unix socket only) and stopped at the end;
- ``pg_url``: a libpq URL (``postgresql:///db?host=/socket/dir&port=N&user=postgres``)
  of a fresh empty database;
- ``pg_spool_url``: the same with the spoolq schema already made (copied from a
  template database, which is much faster than making it each time).

The server is stopped and its folder removed by a watchdog process that
waits on a pipe from this one: whether the session ends well, fails, or is
killed, the pipe closes and the watchdog cleans up.

Where the server binaries are missing, the tests that need them are skipped
with the reason; under CI (``SPOOLQ_CI`` set, as ``.ci/run`` sets it) they
fail instead, so a PostgreSQL test can never pass by being skipped.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

PORT = 5432  # only names the socket file: the server listens on no TCP port
SUPERUSER = "postgres"

_WATCHDOG = r"""
import os, shutil, subprocess, sys
base, pg_ctl, prefix = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.stdin.read()  # until the test session closes the pipe (or dies)
subprocess.run(prefix + [pg_ctl, "-D", os.path.join(base, "data"), "-m", "immediate", "-w", "stop"],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
shutil.rmtree(base, ignore_errors=True)
"""


def find_bindir() -> str | None:
    """The folder of initdb, pg_ctl and postgres: on the PATH, else the
    newest of Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which("initdb")
    if found:
        folder = os.path.dirname(os.path.realpath(found))  # Debian links some of them into /usr/local/bin
        if all(os.access(os.path.join(folder, tool), os.X_OK) for tool in ("pg_ctl", "psql", "postgres")):
            return folder
    candidates = glob.glob("/usr/lib/postgresql/*/bin/initdb")

    def version(path: str) -> tuple:
        part = path.split("/")[-3]
        return tuple(int(x) for x in part.split(".") if x.isdigit())

    for path in sorted(candidates, key=version, reverse=True):
        if os.access(path, os.X_OK):
            return os.path.dirname(path)
    return None


# Tuned for tests: nothing waits for the disk.
TEST_SETTINGS = {"fsync": "off", "full_page_writes": "off", "shared_buffers": "32MB", "max_connections": "300",
                 "log_min_messages": "warning", "autovacuum_naptime": "5s"}


class PgServer:
    """One PostgreSQL server in a temporary folder (``settings``: the
    server's, over TEST_SETTINGS)."""

    def __init__(self, bindir: str, settings: dict[str, str] | None = None):
        self.bindir = bindir
        self.settings = dict(TEST_SETTINGS, **(settings or {}))
        self.base = ""
        self.as_root = os.geteuid() == 0
        self._watchdog: subprocess.Popen | None = None
        self._names = itertools.count(1)

    @property
    def prefix(self) -> list[str]:
        """The words that run a server binary as the user who owns the data."""
        return ["runuser", "-u", "postgres", "--"] if self.as_root else []

    def _run(self, *argv: str, timeout: float = 120) -> None:
        proc = subprocess.run(self.prefix + list(argv), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed: {(proc.stderr or proc.stdout).strip()[-2000:]}")

    def start(self) -> None:
        if self.as_root:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root, and there is no postgres user to run the server as") from None
        self.base = tempfile.mkdtemp(prefix="spoolq-pg-", dir="/tmp")
        if self.as_root:
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
        # The watchdog first: from here on, whatever happens, the folder goes.
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, self.base, os.path.join(self.bindir, "pg_ctl"), *self.prefix],
            stdin=subprocess.PIPE, start_new_session=True)
        data = os.path.join(self.base, "data")
        self._run(os.path.join(self.bindir, "initdb"), "-D", data, "-A", "trust", "-U", SUPERUSER,
                  "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions")
        self.resume()

    def resume(self) -> None:
        """Start the server (again, after ``pause``)."""
        options = " ".join(["-c listen_addresses=''", f"-c unix_socket_directories={self.base}", f"-c port={PORT}"]
                           + [f"-c {name}={value}" for name, value in self.settings.items()])
        self._run(os.path.join(self.bindir, "pg_ctl"), "-D", os.path.join(self.base, "data"),
                  "-l", os.path.join(self.base, "log"), "-o", options, "-w", "-t", "60", "start")

    def pause(self) -> None:
        """Stop the server (fast: sessions are ended, the data kept) until ``resume``."""
        self._run(os.path.join(self.bindir, "pg_ctl"), "-D", os.path.join(self.base, "data"), "-m", "fast", "-w", "stop")

    def restart(self) -> None:
        """Stop the server (fast: sessions are ended, the data kept) and start it again."""
        self._run(os.path.join(self.bindir, "pg_ctl"), "-D", os.path.join(self.base, "data"),
                  "-l", os.path.join(self.base, "log"), "-m", "fast", "-w", "-t", "60", "restart")

    def url(self, db: str = "postgres", user: str = SUPERUSER) -> str:
        return f"postgresql:///{db}?host={self.base}&port={PORT}&user={user}"

    def psql(self, sql: str, db: str = "postgres") -> str:
        """Run ``sql`` as the superuser; its output (unaligned, tuples only)."""
        proc = subprocess.run([os.path.join(self.bindir, "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
                               "-d", self.url(db), "-c", sql], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"psql failed: {proc.stderr.strip()}")
        return proc.stdout.strip()

    def new_database(self, template: str = "template1") -> str:
        name = f"t{os.getpid()}_{next(self._names)}"
        self.psql(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        return name

    def drop_database(self, name: str) -> None:
        try:
            self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        except (RuntimeError, subprocess.TimeoutExpired):
            pass  # the whole server goes at the end anyway

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stdin.close()
            self._watchdog.wait(timeout=120)
            self._watchdog = None


def _unavailable(reason: str):
    if os.environ.get("SPOOLQ_CI"):
        pytest.fail(f"PostgreSQL tests cannot run under CI: {reason}", pytrace=False)
    pytest.skip(f"no PostgreSQL server for the tests: {reason}")


@pytest.fixture(scope="session")
def pg_server():
    bindir = find_bindir()
    if bindir is None:
        _unavailable("initdb and pg_ctl not found (install Debian's postgresql package)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _unavailable("psycopg is not installed (pip install -e '.[test]')")
    server = PgServer(bindir)
    started = time.monotonic()
    try:
        server.start()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        server.stop()
        _unavailable(f"the server did not start: {e}")
    server.start_seconds = time.monotonic() - started
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _pg_spool_template(pg_server):
    """A database with the spoolq schema, to copy for each test."""
    from spoolq.pgspool import PgBackend

    name = pg_server.new_database()
    backend = PgBackend(pg_server.url(name))
    try:
        backend.init()
    finally:
        backend.close()
    pg_server.psql(f'ALTER DATABASE "{name}" WITH IS_TEMPLATE true')
    return name


@pytest.fixture
def pg_url(pg_server):
    name = pg_server.new_database()
    yield pg_server.url(name)
    pg_server.drop_database(name)


@pytest.fixture
def pg_spool_url(pg_server, _pg_spool_template):
    name = pg_server.new_database(template=_pg_spool_template)
    yield pg_server.url(name)
    pg_server.drop_database(name)
