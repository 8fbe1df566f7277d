"""Real throwaway users for the tests of a shared spool.

As root (as CI runs), the ``users`` fixture makes a group and four users:

- ``owner``: owns the spool and runs its workers;
- ``web``: a trusted member of the spool's group (a producer);
- ``evil``: an untrusted member of the group;
- ``out``: not in the group.

Without root, or without ``useradd``/``setpriv``, every test that asks for
them is skipped with the reason.

spoolq runs as these users from a copy of the package and its dependencies
in a folder every user can read, with the system's interpreter, because the
checkout and its virtual environment may sit where only root can look.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GROUP = "sqtgrp"
NAMES = {"owner": "sqtowner", "web": "sqtweb", "evil": "sqtevil", "out": "sqtout"}


@dataclass
class User:
    name: str
    uid: int
    gid: int
    home: str

    def prefix(self) -> list[str]:
        """The words that run a command as this user, with its groups."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups"]


class Users:
    """The throwaway users, and ways to run things as them."""

    def __init__(self, lib: Path, base: Path, python: str):
        self.lib = lib
        self.python = python
        self.base = base  # a folder every user can reach, for spools and files
        self.group = GROUP
        self.gid = grp.getgrnam(GROUP).gr_gid
        for role, name in NAMES.items():
            p = pwd.getpwnam(name)
            setattr(self, role, User(name, p.pw_uid, p.pw_gid, p.pw_dir))

    def folder(self, name: str, owner: User | None = None) -> Path:
        """A fresh folder every user can reach (0755), root's or ``owner``'s."""
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.base))
        os.chmod(path, 0o755)
        if owner is not None:
            os.chown(path, owner.uid, owner.gid)
        return path

    def open_folder(self, name: str) -> Path:
        """A fresh folder every user may write in (1777), for what jobs and
        users write."""
        path = self.folder(name)
        os.chmod(path, 0o1777)
        return path

    def shared_spool(self, *settings: tuple[str, str]) -> Path:
        """A shared spool of ``owner`` (fsync off) in which ``web`` is
        trusted; ``settings`` are (key, value) to set too."""
        return self._spool(self.owner, self.folder("shared", owner=self.owner), settings)

    def root_spool(self, *settings: tuple[str, str]) -> Path:
        """A shared spool of root's (fsync off), made as a service would
        make one (root runs ``init --group`` in a folder of root's), in
        which ``web`` is trusted; ``settings`` are (key, value) to set too.
        Root runs workers only on a spool of root's."""
        return self._spool(None, self.folder("rootshared"), settings)

    def _spool(self, owner: User | None, folder: Path, settings: tuple[tuple[str, str], ...]) -> Path:
        spool = folder / "spool"
        for args in (["init", "--group", self.group], ["config", "set", "fsync", "false"],
                     ["config", "set", "trusted_users", self.web.name],
                     *(["config", "set", key, value] for key, value in settings)):
            run = self.spoolq(owner, "-s", str(spool), *args)
            assert run.returncode == 0, run.stderr
        return spool

    def env(self, user: User | None, extra: dict | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLQ_")}
        env["PYTHONPATH"] = str(self.lib)
        if user is not None:
            env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
        env.update(extra or {})
        return env

    def spoolq(self, user: User | None, *args: str, umask: str = "022", input: str | None = None,
               cwd: str | None = None, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        """``spoolq ARGS`` as ``user`` (None: as root), under ``umask``."""
        return self.sh(user, 'exec "$@"', *self.command(), *args, umask=umask, input=input, cwd=cwd,
                       timeout=timeout, env=env)

    def popen(self, user: User | None, *args: str, umask: str = "022", **kw) -> subprocess.Popen:
        prefix = user.prefix() if user else []
        return subprocess.Popen(prefix + ["sh", "-c", f'umask {umask}; exec "$@"', "sh", *self.command(), *args],
                                env=self.env(user, kw.pop("env", None)), cwd=kw.pop("cwd", str(self.base)), **kw)

    def sh(self, user: User | None, script: str, *args: str, umask: str = "022", input: str | None = None,
           cwd: str | None = None, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        """A shell script as ``user`` (None: as root), under ``umask``."""
        prefix = user.prefix() if user else []
        return subprocess.run(prefix + ["sh", "-c", f"umask {umask}; {script}", "sh", *args], input=input,
                              capture_output=True, text=True, timeout=timeout, env=self.env(user, env),
                              cwd=cwd or str(self.base))

    def command(self) -> list[str]:
        return [self.python, "-m", "spoolq"]


def _python_for(user: User) -> str | None:
    """An interpreter of 3.11 or later that ``user`` can run: this one, or
    the system's (this one may live in root's home)."""
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3", shutil.which("python3") or ""):
        if python and subprocess.run(user.prefix() + ["sh", "-c", 'exec "$@"', "sh", python, "-c",
                                                    "import sys; assert sys.version_info >= (3, 11)"],
                                     capture_output=True).returncode == 0:
            return python
    return None


def _make_users() -> None:
    subprocess.run(["groupadd", "-f", GROUP], check=True)
    for role, name in NAMES.items():
        try:
            pwd.getpwnam(name)
            continue
        except KeyError:
            pass
        groups = ["-G", GROUP] if role in ("owner", "web", "evil") else []
        subprocess.run(["useradd", "-m", "-U", *groups, "-s", "/bin/sh", name], check=True,
                       capture_output=True)


def _copy_lib(dest: Path) -> None:
    """spoolq and its dependencies, readable by everyone."""
    import click
    import watchdog

    shutil.copytree(ROOT / "spoolq", dest / "spoolq", ignore=shutil.ignore_patterns("__pycache__"))
    from importlib.metadata import distribution

    info = Path(distribution("spoolq")._path)  # the version spoolq --version prints
    shutil.copytree(info, dest / info.name)
    for module in (click, watchdog):
        src = Path(module.__file__).parent
        shutil.copytree(src, dest / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [dest, *dest.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


@pytest.fixture(scope="session")
def users():
    if os.geteuid() != 0:
        pytest.skip("needs root to make throwaway users")
    for tool in ("useradd", "groupadd", "setpriv"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} to make and become throwaway users")
    _make_users()
    base = Path(tempfile.mkdtemp(prefix="spoolq-users-"))
    os.chmod(base, 0o755)
    lib = base / "lib"
    lib.mkdir()
    _copy_lib(lib)
    p = pwd.getpwnam(NAMES["out"])
    python = _python_for(User(p.pw_name, p.pw_uid, p.pw_gid, p.pw_dir))
    if python is None:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip("no Python 3.11 or later that an ordinary user can run")
    try:
        yield Users(lib, base, python)
    finally:
        shutil.rmtree(base, ignore_errors=True)
