"""Recovery never kills what it must not: in a shared spool, a file in
workers/ that the recovering user may not take the word of (another user's,
or one the group can write) gets nothing signalled, and even a believed
registration gets a process killed only if it runs as the registration's
owner (any user under root's), carries that worker's SPOOLQ_WORKER and
started after the worker did. A worker killed mid-job still has what its
job left killed by recovery. Root recovers only a spool of root's; every
other spool only its owner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest

from conftest import alive, wait_for


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _shared_spool(users, name: str) -> str:
    """A spool of ``owner`` shared with the group, ``web`` trusted."""
    spool = str(users.folder(name, owner=users.owner) / "spool")
    for args in (("init", "--group", users.group), ("config", "set", "trusted_users", users.web.name)):
        proc = users.spoolq(users.owner, "-s", spool, *args)
        assert proc.returncode == 0, proc.stderr
    return spool


class Victims:
    """``sleep 300`` processes of given users, each in a session of its own."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, user, env: dict | None = None) -> int:
        proc = subprocess.Popen(user.prefix() + ["sleep", "300"], start_new_session=True,
                                env={"PATH": os.environ["PATH"], **(env or {})})
        self.procs.append(proc)
        # setpriv execs sleep: wait for it, so the environment read is sleep's.
        wait_for(lambda: os.readlink(f"/proc/{proc.pid}/exe").endswith("sleep"), what="the victim to start")
        return proc.pid

    def alive(self) -> list[bool]:
        return [alive(p.pid) for p in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def victims():
    v = Victims()
    yield v
    v.stop()


def _marker(worker: str, job: str) -> dict:
    return {"SPOOLQ_WORKER": worker, "SPOOLQ_JOB_ID": job}


def _registration(worker: str, proc_start: int, runs: dict[str, int]) -> str:
    """A registration as a worker writes it: each job in ``runs`` spawned as
    the process given, its spawn window exactly that process's start."""
    jobs = {job: {"attempt": 1, "started_at": "2020-01-01T00:00:00Z", "pgid": pid,
                  "spawned": [_start_time(pid), _start_time(pid)]} for job, pid in runs.items()}
    return json.dumps({"worker": worker, "host": os.uname().nodename, "pid": 7, "boot_id": _boot_id(),
                       "proc_start": proc_start, "started_at": "2020-01-01T00:00:00Z", "jobs": jobs})


def _plant(users, spool: str, name: str, text: str, owner, mode: int) -> Path:
    """Put a file in workers/ owned by ``owner`` (None: root) with ``mode``:
    written by root, since workers/ may be closed to the members."""
    path = Path(spool) / "workers" / name
    path.write_text(text)
    os.chown(path, owner.uid if owner else 0, users.gid)
    os.chmod(path, mode)
    return path


def _recover_as_everyone(users, spools: list, plant: Callable[[str], object]) -> Iterator[str]:
    """``sweep`` and ``work`` as root and as the owner, each on its own
    spool in ``spools`` ((user, spool), None: root) after ``plant(spool)``
    (one that believed the file may have removed it), yielding what each said."""
    for user, spool in spools:
        for args in (("sweep",), ("work",)):
            plant(spool)
            proc = users.spoolq(user, "-s", spool, *args)
            assert proc.returncode == 0, (user, args, proc.stderr)
            yield f"{args[0]} as {user.name if user else 'root'}: {proc.stdout}{proc.stderr}"


FORGERIES = {
    # A member's own file (workers/ open to the group, or written there by root).
    "evil's file": lambda users: (users.evil, 0o640),
    # A trusted producer's file: trusted_users vouch for jobs, not for kills.
    "web's file": lambda users: (users.web, 0o640),
    # A registration the group can write: any member could have rewritten it.
    "root's file the group can write": lambda users: (None, 0o660),
    "the owner's file the group can write": lambda users: (users.owner, 0o660),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_registration_recovery_may_not_believe_gets_no_process_killed(users, victims, forgery):
    """The victims run as a user outside the group, as a trusted member and
    as the owner, and carry the forged worker's marker: every check on the
    process holds, only the file's owner or mode gives the forgery away."""
    spools = [(None, str(users.root_spool())), (users.owner, _shared_spool(users, "forged"))]
    worker, proc_start = "ghost.7.abcdef", _start_time(os.getpid())
    runs = {f"job-{user.name}": victims.start(user, _marker(worker, f"job-{user.name}"))
            for user in (users.out, users.web, users.owner)}
    owner, mode = FORGERIES[forgery](users)
    text = _registration(worker, proc_start, runs)
    for out in _recover_as_everyone(users, spools, lambda spool: _plant(users, spool, f"{worker}.json", text, owner, mode)):
        assert victims.alive() == [True, True, True], out


@pytest.mark.parametrize("registration_owner", ["root", "owner"])
def test_a_believed_registration_gets_only_its_workers_processes_killed(users, victims, registration_owner):
    """A registration the spool's owner wrote (0640, one link: root's in a
    spool of root's) names processes that are not its worker's: of another
    user (with the marker; under root's registration any user may be its
    worker's, so without), of the owner without the marker, of the owner
    with the marker but started before the worker. None is killed, by the
    owner's sweep (nor, in the owner's spool, by root's, which is refused)."""
    owner = None if registration_owner == "root" else users.owner
    spool = str(users.root_spool()) if owner is None else _shared_spool(users, "believed")
    worker, proc_start = "ghost.8.abcdef", _start_time(os.getpid())
    others_env = {} if owner is None else None
    runs = {
        "job-out": victims.start(users.out, others_env if owner is None else _marker(worker, "job-out")),
        "job-web": victims.start(users.web, others_env if owner is None else _marker(worker, "job-web")),
        "job-owner": victims.start(users.owner),
    }
    _plant(users, spool, f"{worker}.json", _registration(worker, proc_start, runs), owner, 0o640)
    # The same worker id's marker on a process that started before that worker.
    early_worker = "ghost.9.abcdef"
    early = victims.start(users.owner, _marker(early_worker, "job-early"))
    _plant(users, spool, f"{early_worker}.json", _registration(early_worker, _start_time(early) + 1, {}), owner, 0o640)
    for user in (users.owner, None):
        proc = users.spoolq(user, "-s", spool, "sweep")
        if user == owner:
            assert proc.returncode == 0 and "killed 0 processes" in proc.stdout, (user, proc.stdout, proc.stderr)
        else:
            assert proc.returncode == 1 and proc.stderr.count("\n") == 1, (user, proc.stdout, proc.stderr)
    assert victims.alive() == [True, True, True, True]


def _run_job_and_kill_its_worker(users, spool: str, user, folder: Path) -> tuple[int, int]:
    """Start a worker as ``user`` (None: root) on a job of ``user``'s that
    leaves a process in its group and one in a session of its own, SIGKILL
    the worker mid-job; the two processes' pids."""
    group_pid, session_pid = folder / "group.pid", folder / "session.pid"
    script = (f"setsid sh -c 'echo $$ > {session_pid}; exec sleep 300' & "
              f"echo $$ > {group_pid}; exec sleep 300")
    proc = users.spoolq(user, "-s", spool, "enqueue", "--id", "long", script)
    assert proc.returncode == 0, proc.stderr
    worker = users.popen(user, "-s", spool, "work", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = wait_for(lambda: all(p.exists() and p.read_text().strip() for p in (group_pid, session_pid))
                        and [int(p.read_text()) for p in (group_pid, session_pid)], what="the job's processes")
        workers = Path(spool) / "workers"
        wait_for(lambda: any('"pgid"' in p.read_text() for p in workers.glob("*.json")), what="the run on record")
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    assert all(alive(pid) for pid in pids)
    return pids[0], pids[1]


def test_a_worker_killed_mid_job_has_what_its_job_left_killed_by_its_users_recovery(users):
    folder = users.folder("genuine", owner=users.owner)
    spool = _shared_spool(users, "genuine")
    pids = _run_job_and_kill_its_worker(users, spool, users.owner, folder)
    try:
        # Root does not take the owner's word for which processes to kill:
        # it sweeps no spool but root's, and the job stays in cur/ untouched.
        proc = users.spoolq(None, "-s", spool, "sweep")
        assert proc.returncode == 1 and proc.stderr == (
            f"spoolq: {spool} belongs to sqtowner: root sweeps only a spool root owns; run it as sqtowner "
            f"(runuser -u sqtowner -- spoolq -s {spool} sweep), or make a spool of root's\n"), proc.stderr
        assert all(alive(pid) for pid in pids) and os.listdir(Path(spool) / "cur") == ["long.json"]
        proc = users.spoolq(users.owner, "-s", spool, "sweep")
        assert "recovered 1 to failed/" in proc.stdout and "killed 2 processes" in proc.stdout, proc.stdout + proc.stderr
        wait_for(lambda: not any(alive(pid) for pid in pids), what="the job's processes to die")
        show = json.loads(users.spoolq(users.owner, "-s", spool, "show", "long", "--json").stdout)
        assert show["state"] == "failed" and show["history"][-1]["error"] == "interrupted: the worker running it died"
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_root_worker_killed_mid_job_has_what_its_job_left_killed_by_roots_recovery(users):
    folder = users.folder("genuine-root")
    spool = str(users.root_spool())
    pids = _run_job_and_kill_its_worker(users, spool, None, folder)
    try:
        # A member may not sweep root's spool: the job stays in cur/.
        proc = users.spoolq(users.owner, "-s", spool, "sweep")
        assert proc.returncode == 1 and "may sweep it" in proc.stderr, proc.stdout + proc.stderr
        assert all(alive(pid) for pid in pids) and os.listdir(Path(spool) / "cur") == ["long.json"]
        proc = users.spoolq(None, "-s", spool, "sweep")
        assert "recovered 1 to failed/" in proc.stdout and "killed 2 processes" in proc.stdout, proc.stdout + proc.stderr
        wait_for(lambda: not any(alive(pid) for pid in pids), what="the job's processes to die")
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_another_users_process_with_a_dead_workers_marker_neither_dies_nor_holds_its_job(users, victims):
    """Anyone may start a process that carries a worker's marker (the
    registration tells the worker id): one of a user other than the
    registration's owner is not that worker's, so it is not signalled, and
    the dead worker's job is recovered, not kept in cur/ as still running."""
    spool = _shared_spool(users, "copied-marker")
    proc = users.spoolq(users.owner, "-s", spool, "enqueue", "--id", "j", "true")
    assert proc.returncode == 0, proc.stderr
    os.rename(Path(spool) / "new" / "j.json", Path(spool) / "cur" / "j.json")  # claimed by the worker below
    worker = "ghost.10.abcdef"
    copier = victims.start(users.out, _marker(worker, "j"))
    text = json.loads(_registration(worker, _start_time(os.getpid()), {}))
    text["jobs"] = {"j": {"attempt": 1, "started_at": "2020-01-01T00:00:00Z"}}
    _plant(users, spool, f"{worker}.json", json.dumps(text), users.owner, 0o640)
    proc = users.spoolq(users.owner, "-s", spool, "sweep")
    assert "recovered 1 to failed/" in proc.stdout and "left" not in proc.stdout, proc.stdout + proc.stderr
    assert alive(copier)
