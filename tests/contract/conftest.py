"""The contract suite's fixtures: every test here runs once per backend,
against a spool given by its location only, the way a user gives one
(``Spool(location)`` in process, ``spoolq -s LOCATION ...`` in a
subprocess).

- ``spool_location``: a fresh, empty spool, parametrized ``dir`` (a folder
  in the test's temporary directory) and ``pg`` (a fresh database, copied
  from a template that holds the schema, on the one PostgreSQL server the
  session shares; see tests/pgserver.py). Where no server can be started
  the ``pg`` half is skipped with the reason, and fails under CI
  (``SPOOLQ_CI``).
- ``sq``: the same spool with shortcuts (``run``, ``enqueue``, ``work``,
  ``show``, ``status``, ``api``) and fsync off, so the tests move jobs
  fast; what fsync guards is proven elsewhere.

A test module loads the server fixtures with ``pytest_plugins = ["pgserver"]``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from conftest import SPOOLQ, SpoolFixture

BACKENDS = ("dir", "pg")


class Contract(SpoolFixture):
    """A spool of either backend, driven through its location alone."""

    def __init__(self, kind: str, location: str):
        super().__init__(location)  # type: ignore[arg-type]  # run() only ever uses str(path)
        self.kind = kind
        self.location = location
        self._procs: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"Contract({self.kind})"

    def api(self):
        from spoolq import Spool

        return Spool(self.location)

    def popen(self, *args: str, **kw) -> subprocess.Popen:
        env = dict(os.environ)
        env.pop("SPOOLQ_DIR", None)
        env.update(kw.pop("env", {}) or {})
        kw.setdefault("start_new_session", True)  # so the test can end it and its jobs together
        proc = subprocess.Popen(SPOOLQ + ["-s", self.location, *args], env=env, **kw)
        self._procs.append(proc)
        return proc

    def fail(self, *args: str, **kw) -> subprocess.CompletedProcess:
        """A command that must fail: its CompletedProcess, to check the status and the line."""
        proc = self.run(*args, check=False, **kw)
        assert proc.returncode != 0, f"spoolq {' '.join(args)} succeeded: {proc.stdout}"
        return proc

    def listing(self, *args: str) -> list[dict]:
        return [json.loads(line) for line in self.run("list", "--json", *args).stdout.splitlines() if line.strip()]

    def stop_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=60)


def _facade_opens(url: str) -> bool:
    """Whether ``Spool(url)`` opens the PostgreSQL spool at ``url``
    (rather than taking the URL for a folder's path)."""
    from spoolq import Spool

    try:
        Spool(url).status()
    except Exception:  # noqa: BLE001 - any failure: it does not open it
        return False
    return True


@pytest.fixture(params=BACKENDS)
def spool_location(request, tmp_path) -> str:
    """A fresh, empty spool's location (a path, or a postgresql:// URL)."""
    if request.param == "dir":
        location = str(tmp_path / "spool")
        SpoolFixture(location).run("init")  # type: ignore[arg-type]
        return location
    url = request.getfixturevalue("pg_spool_url")
    if not _facade_opens(url):
        pytest.skip("the facade does not open a postgresql:// spool yet")
    return url


@pytest.fixture
def sq(request, spool_location) -> Contract:
    spool = Contract(request.node.callspec.params["spool_location"], spool_location)
    spool.run("config", "set", "fsync", "false")
    yield spool
    spool.stop_all()
