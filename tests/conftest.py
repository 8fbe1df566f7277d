"""Test helpers: every test drives the real ``spoolq`` command in a
subprocess against a real spool directory on the real filesystem."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from users import users  # noqa: F401 - the throwaway users of a shared spool's tests

ROOT = Path(__file__).resolve().parent.parent
_script = shutil.which("spoolq", path=os.path.dirname(sys.executable))
SPOOLQ = [_script] if _script else [sys.executable, "-m", "spoolq"]
STATES = ("new", "cur", "failed", "dead", "done")


def wait_for(condition, timeout: float = 30.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``condition`` until it returns something true; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # (gone between the open and the read: ESRCH)
        return False


def strace_filters() -> bool:
    """Whether strace runs here, with seccomp-bpf filtering (ptrace may be refused)."""
    if shutil.which("strace") is None:
        return False
    return subprocess.run(["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=execve", "-o", os.devnull, "true"],
                          capture_output=True).returncode == 0


def has_tuning_seam() -> bool:
    """Whether ``Spool.work`` takes ``tuning=Tuning(...)``: the timings a
    test may steer (how long -j 1 holds a prepared job, how long finished
    jobs wait for their group sync, how long it polls for a short job's
    exit, the load average it sees)."""
    try:
        from spoolq.worker import Tuning  # noqa: F401
    except ImportError:
        return False
    import inspect

    from spoolq import Spool

    return "tuning" in inspect.signature(Spool.work).parameters


needs_tuning = pytest.mark.skipif(not has_tuning_seam(), reason="needs the Tuning seam: Spool.work(tuning=Tuning(...))")

_TUNED = """
import json, sys
from spoolq import Spool
from spoolq.worker import Tuning
tuning = json.loads(sys.argv[2])
if "load_average" in tuning:
    load = tuning.pop("load_average")
    tuning["load_average"] = lambda: load
try:
    Spool(sys.argv[1]).work(jobs=int(sys.argv[3]), tuning=Tuning(**tuning), **json.loads(sys.argv[4]))
except KeyboardInterrupt:
    pass
"""


def tuned_worker(spool: "SpoolFixture", tuning: dict, jobs: int = 1, prefix: list[str] | None = None,
                 **work) -> subprocess.Popen:
    """A worker started by ``Spool(spool).work(jobs=jobs, tuning=Tuning(**tuning), **work)``
    in a Python process of its own (under ``prefix``: taskset, a cgroup);
    ``load_average`` in ``tuning`` is the number the worker is to see."""
    env = dict(os.environ)
    env.pop("SPOOLQ_DIR", None)
    proc = subprocess.Popen((prefix or []) + [sys.executable, "-c", _TUNED, str(spool.path), json.dumps(tuning), str(jobs),
                                              json.dumps(work)], env=env, stderr=subprocess.DEVNULL)
    _started.append(proc)
    return proc


class SpoolFixture:
    """A spool directory plus shortcuts to run spoolq against it."""

    def __init__(self, path: Path):
        self.path = path

    def run(self, *args: str, input: str | None = None, timeout: float = 120, env: dict | None = None,
            check: bool = True, cwd: str | None = None, open_files: int | None = None) -> subprocess.CompletedProcess:
        """``spoolq -s SPOOL ARGS``; with ``open_files``, under that soft limit of open descriptors."""
        full_env = dict(os.environ)
        full_env.pop("SPOOLQ_DIR", None)
        if env:
            full_env.update(env)
        limit = ["sh", "-c", f'ulimit -n {open_files} && exec "$@"', "sh"] if open_files else []
        proc = subprocess.run(
            limit + SPOOLQ + ["-s", str(self.path), *args], input=input, capture_output=True, text=True,
            timeout=timeout, env=full_env, cwd=cwd,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"spoolq {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def popen(self, *args: str, **kw) -> subprocess.Popen:
        env = dict(os.environ)
        env.pop("SPOOLQ_DIR", None)
        env.update(kw.pop("env", {}) or {})
        proc = subprocess.Popen(SPOOLQ + ["-s", str(self.path), *args], env=env, **kw)
        _started.append(proc)
        return proc

    def enqueue(self, *args: str, **kw) -> str:
        return self.run("enqueue", *args, **kw).stdout.strip()

    def work(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.run("work", *args, **kw)

    def names(self, state: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.path / state) if not n.startswith("."))
        except FileNotFoundError:
            return []

    def ids(self, state: str) -> list[str]:
        return [n[:-5] if n.endswith(".json") else n for n in self.names(state)]

    def where(self, job_id: str) -> list[str]:
        """Every state folder holding the job (a correct spool: exactly one)."""
        return [s for s in STATES if (self.path / s / f"{job_id}.json").exists() or (self.path / s / job_id).exists()]

    def record(self, state: str, job_id: str) -> dict:
        return json.loads((self.path / state / f"{job_id}.json").read_text())

    def show(self, job_id: str) -> dict:
        return json.loads(self.run("show", job_id, "--json").stdout)

    def status(self) -> dict:
        return json.loads(self.run("status", "--json").stdout)

    def config(self, key: str, value) -> None:
        self.run("config", "set", key, str(value))

    def drop(self, name: str, content: bytes | str, folder: str = "new") -> Path:
        """Drop a file the Maildir way: write in tmp/, rename into the folder."""
        data = content.encode() if isinstance(content, str) else content
        tmp = self.path / "tmp" / ("drop." + name.replace("/", "_"))
        tmp.write_bytes(data)
        target = self.path / folder / name
        os.rename(tmp, target)
        return target


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_stray_workers():
    """Whatever a test started and did not stop (a failed assertion midway)
    is killed, so no worker outlives its test."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def spool(tmp_path: Path) -> SpoolFixture:
    """A fresh spool with fsync on (the default) in a temporary directory."""
    s = SpoolFixture(tmp_path / "spool")
    s.run("init")
    return s


@pytest.fixture
def fast_spool(tmp_path: Path) -> SpoolFixture:
    """A fresh spool with fsync off, for tests that move many jobs."""
    s = SpoolFixture(tmp_path / "spool")
    s.run("init")
    s.config("fsync", "false")
    return s


@contextlib.contextmanager
def watching(users, spool: Path, *args: str, stderr=subprocess.DEVNULL):
    """A watching worker of the shared spool's owner (it picks members'
    jobs up and answers their requests within milliseconds), running once
    its registration is in workers/, and stopped (SIGTERM) after."""
    workers = Path(spool) / "workers"
    before = set(os.listdir(workers))
    proc = users.popen(users.owner, "-s", str(spool), "work", "--watch", *args, stdout=subprocess.DEVNULL,
                       stderr=stderr)
    _started.append(proc)
    try:
        wait_for(lambda: set(os.listdir(workers)) - before or proc.poll() is not None, what="the worker to start")
        assert proc.poll() is None, "the worker exited at once"
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(60)
