"""What root does with a spool, against the users who could have written
what it holds (docs/design.md, "A worker running as root"): root runs
workers and ``sweep`` only on a spool of root's; a job root runs as another
user runs as the user who enqueued it, whoever rewrote its record since,
and what root does for it (changing folder, the environment) happens as
that user; a spool path someone else could swap is refused before
anything is made. ``owner`` owns a spool of its own, ``web`` is a trusted
member, ``evil`` an untrusted one, ``out`` an outsider."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

from conftest import alive, wait_for
from test_trust_audit import STAGE
from test_trust_recovery import _marker, _registration, _start_time, victims  # noqa: F401 - the victims fixture


def _ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _one_line_error(proc) -> str:
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("spoolq: "), \
        (proc.returncode, proc.stdout, proc.stderr)
    return proc.stderr


def _show(users, spool, job_id: str) -> dict:
    return json.loads(_ok(users.spoolq(None, "-s", str(spool), "show", job_id, "--json")))


def test_root_runs_workers_and_sweeps_only_on_a_spool_of_roots(users):
    """On another user's spool, root's ``work`` and ``sweep`` are refused
    with one line naming the owner and the fix; the other commands root
    may run there still work."""
    spool = users.shared_spool()
    job = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--in", "1h", "true", umask="027")).strip()
    for command in ("work", "sweep"):
        doing = "runs workers only on a spool" if command == "work" else "sweeps only a spool"
        error = _one_line_error(users.spoolq(None, "-s", str(spool), command))
        assert error == (f"spoolq: {spool} belongs to sqtowner: root {doing} root owns; run it as sqtowner "
                         f"(runuser -u sqtowner -- spoolq -s {spool} {command}), or make a spool of root's\n")
    assert os.listdir(spool / "workers") == []
    assert (spool / "drop" / f"{job}.json").exists()  # not picked up either
    # The owner's own worker runs there as before; root's other commands do too.
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    for args in (["status"], ["list"], ["show", job], ["config", "set", "max_attempts", "2"], ["compact"],
                 ["cancel", job], ["retry", "--all"]):
        _ok(users.spoolq(None, "-s", str(spool), *args))
    assert _show(users, spool, job)["outcome"] == "cancelled"


def test_no_file_a_non_root_user_writes_makes_root_run_anything_as_root(users):
    """The spool's owner (in its own spool) or a member (in root's) plants
    a job in cur/ with a staged outcome saying ``"run_as": 0`` and a command
    of its choosing; root then sweeps, works, retries every dead job and
    works again on each spool: nothing runs as uid 0."""
    out = users.open_folder("who")
    script = users.folder("bin") / "stage.py"
    script.write_text(STAGE)
    os.chmod(script, 0o644)
    # fsync on: root's rewrite of a record is a new file of root's, not the old one written in place.
    owners = users.shared_spool(("fsync", "true"), ("backoff_initial", "0"))
    roots = users.root_spool(("backoff_initial", "0"), ("fsync", "true"))
    _ok(users.sh(users.owner, f"{users.python} {script} {owners} x1 'id -u >> {out}/who' 0", umask="027"))
    for member in (users.web, users.evil):  # if a member can write cur/ at all
        users.sh(member, f"{users.python} {script} {roots} x1-{member.name} 'id -u >> {out}/who' 0", umask="027")
    for spool in (owners, roots):
        for args in (["sweep"], ["work"], ["retry", "--all"], ["work"]):
            users.spoolq(None, "-s", str(spool), *args)  # refused on the owner's spool
    ran = (out / "who").read_text().split() if (out / "who").exists() else []
    assert "0" not in ran, ran


def _runs_as(users, spool, job_id: str) -> list[str]:
    """The uids each run of ``job_id`` printed (its command is ``id -u``)."""
    job = _show(users, spool, job_id)
    return [line for line in (job.get("stdout") or "").split() if line.isdigit()]


def _own_file_in_dead(users, spool, job_id: str, command: str) -> None:
    """A file of the member's own in dead/: a drop no worker could take
    (dead/ as it is), which the member, owning it, then rewrites."""
    bad = json.dumps({"command": command, "timeout": "soon"})
    _ok(users.sh(users.web, f"printf '%s' '{bad}' > {spool}/drop/.{job_id} && mv {spool}/drop/.{job_id} "
                            f"{spool}/drop/{job_id}.json", umask="027"))
    _ok(users.spoolq(users.owner if os.stat(spool).st_uid == users.owner.uid else None, "-s", str(spool), "sweep"))
    assert os.stat(spool / "dead" / f"{job_id}.json").st_uid == users.web.uid
    good = json.dumps({"command": command, "run_as": 0})  # (a run_as the member writes: never believed)
    _ok(users.sh(users.web, f"printf '%s' '{good}' > {spool}/dead/{job_id}.json"))


def test_a_members_job_runs_as_the_member_whatever_root_or_the_owner_does_with_it(users):
    """Under a root worker a trusted member's job runs as that member: after
    it died and root retried it (``retry ID``, ``retry --all``), after the
    member rewrote its own file in dead/ and root retried every dead job,
    and after a file the member wrote into cur/ was swept by root. A file of
    the member's in dead/ of the owner's spool, retried by the owner, never
    runs under a root worker as the owner (root runs no worker there)."""
    spool = users.root_spool(("backoff_initial", "0"), ("max_attempts", "1"), ("fsync", "true"))
    web = str(users.web.uid)
    died = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--id", "died", "id -u; exit 3", umask="027")).strip()
    _ok(users.spoolq(None, "-s", str(spool), "work"))
    assert _show(users, spool, died)["state"] == "dead" and _runs_as(users, spool, died) == [web]
    assert os.stat(spool / "dead" / "died.json").st_uid == 0  # root's record now (fsync on: a new file)
    _ok(users.spoolq(None, "-s", str(spool), "retry", died))
    _ok(users.spoolq(None, "-s", str(spool), "work"))
    assert _runs_as(users, spool, died) == [web]
    # The member's own file, moved to dead/ unchanged, and one written into
    # cur/ (each if the member may put a file there at all).
    _own_file_in_dead(users, spool, "moved", "id -u")
    # (max_attempts 2: recovery counts the run it finds cut short as one)
    planted = json.dumps({"command": "id -u", "max_attempts": 2})
    users.sh(users.web, f"printf '%s' '{planted}' > {spool}/cur/planted.json", umask="027")
    _ok(users.spoolq(None, "-s", str(spool), "retry", "--all"))
    _ok(users.spoolq(None, "-s", str(spool), "sweep"))
    _ok(users.spoolq(None, "-s", str(spool), "work"))
    assert _runs_as(users, spool, died) == [web]
    assert _runs_as(users, spool, "moved") == [web], _show(users, spool, "moved")
    if users.spoolq(None, "-s", str(spool), "show", "planted").returncode == 0:
        assert _runs_as(users, spool, "planted") == [web], _show(users, spool, "planted")
    # The owner's spool: the owner's routine retry rewrites the member's file as the owner's.
    owners = users.shared_spool()
    out = users.open_folder("runs")
    _own_file_in_dead(users, owners, "theirs", f"id -u >> {out}/runs")
    _ok(users.spoolq(users.owner, "-s", str(owners), "retry", "--all"))
    users.spoolq(None, "-s", str(owners), "work")  # refused
    ran = (out / "runs").read_text().split() if (out / "runs").exists() else []
    assert ran in ([], [web]), ran


APP = (
    "import os, sys\n"
    "def who(payload):\n"
    "    with open(payload, 'a') as f:\n"
    "        f.write(f'{os.geteuid()}\\n')\n"
    "HANDLERS = {'who': who}\n"
)


def test_root_handlers_set_by_anyone_but_root_never_runs_a_members_handler_job_as_root(users):
    """The owner sets ``root_handlers`` in its own spool, and root then
    changes another setting there (so config.json is root's, the owner's
    choice kept): a member's handler job still never runs as root. In
    root's spool a member cannot set it; root can, and only then do the
    members' handler jobs run (as root, by root's consent)."""
    app = users.folder("app")
    (app / "rootapp.py").write_text(APP)
    ran = users.open_folder("handlers") / "ran"
    owners = users.shared_spool()
    _ok(users.spoolq(users.owner, "-s", str(owners), "config", "set", "root_handlers", "true"))
    _ok(users.spoolq(None, "-s", str(owners), "config", "set", "max_attempts", "1"))
    _ok(users.spoolq(users.web, "-s", str(owners), "enqueue", "--kind", "who", "--payload", json.dumps(str(ran)),
                     umask="027"))
    users.spoolq(None, "-s", str(owners), "work", "--app", "rootapp:HANDLERS", cwd=str(app))  # refused
    assert not ran.exists() or "0" not in ran.read_text().split(), ran.read_text()
    roots = users.root_spool(("max_attempts", "1"))
    refused = _one_line_error(users.spoolq(users.web, "-s", str(roots), "config", "set", "root_handlers", "true"))
    assert "who owns" in refused
    job = _ok(users.spoolq(users.web, "-s", str(roots), "enqueue", "--kind", "who", "--payload", json.dumps(str(ran)),
                           umask="027")).strip()
    _ok(users.spoolq(None, "-s", str(roots), "work", "--app", "rootapp:HANDLERS", cwd=str(app)))
    assert not ran.exists() or "0" not in ran.read_text().split(), ran.read_text()
    assert _show(users, roots, job)["error"] == (
        f"a handler job owned by sqtweb (uid {users.web.uid}): a root worker runs handlers as root, so it runs "
        "only root's handler jobs unless root sets the root_handlers setting to true")
    _ok(users.spoolq(None, "-s", str(roots), "config", "set", "root_handlers", "true"))
    _ok(users.spoolq(None, "-s", str(roots), "retry", job))
    _ok(users.spoolq(None, "-s", str(roots), "work", "--app", "rootapp:HANDLERS", cwd=str(app)))
    assert _show(users, roots, job)["state"] == "done" and ran.read_text().split() == ["0"]


def test_nothing_a_non_root_user_writes_makes_roots_sweep_signal_a_process(users, victims):
    """An outsider's process carries a worker's marker. The owner gets root
    to write a record shaped like that worker's registration (root cancels
    the owner's job, whose fields say so) and moves it into workers/: root's
    sweep kills nothing (it sweeps no spool but root's). In root's spool
    members cannot put anything into workers/."""
    worker = "ghost.11.abcdef"
    victim = victims.start(users.out, _marker(worker, "j"))
    registration = json.loads(_registration(worker, _start_time(os.getpid()), {"j": victim}))
    owners = users.shared_spool(("fsync", "true"))  # root's rewrite: a new file
    job = _ok(users.spoolq(users.owner, "-s", str(owners), "enqueue", "--in", "1h", "--json",
                           json.dumps({"command": "true", **registration}))).strip()
    _ok(users.spoolq(None, "-s", str(owners), "cancel", job))
    assert os.stat(owners / "done" / f"{job}.json").st_uid == users.owner.uid  # root writes the owner's records there
    _ok(users.sh(users.owner, f"mv {owners}/done/{job}.json {owners}/workers/{worker}.json"))
    users.spoolq(None, "-s", str(owners), "sweep")  # refused
    roots = users.root_spool()
    planted = users.folder("planted", owner=users.web)
    (planted / "reg.json").write_text(json.dumps(registration))
    os.chown(planted / "reg.json", users.web.uid, users.gid)
    for member in (users.web, users.evil):
        assert users.sh(member, f"cp {planted}/reg.json {roots}/workers/{worker}.json").returncode != 0
    assert users.sh(users.web, f"mv {planted}/reg.json {roots}/workers/{worker}.json").returncode != 0
    assert os.listdir(roots / "workers") == []
    _ok(users.spoolq(None, "-s", str(roots), "sweep"))
    assert alive(victim)


def test_a_job_run_as_a_member_enters_its_folder_only_as_the_member(users):
    """``--cwd`` of a folder only root may enter: the job never runs there
    (it would read root's files as the member); it ends in dead/ at once,
    saying why. A folder the member may enter works as before."""
    secret = users.folder("secret")
    os.chmod(secret, 0o700)
    (secret / "secret.txt").write_text("root's secret\n")
    mine = users.folder("mine", owner=users.web)
    (mine / "mine.txt").write_text("the member's\n")
    spool = users.root_spool()
    denied = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--cwd", str(secret), "cat secret.txt",
                              umask="027")).strip()
    # One the member could reach when it enqueued (enqueue refuses a cwd
    # that does not exist), then shut to it.
    hidden = users.folder("hidden") / "inner"
    hidden.mkdir()
    (hidden / "secret.txt").write_text("root's secret\n")
    shut = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--cwd", str(hidden),
                            "--argv", "--", "cat", "secret.txt", umask="027")).strip()
    os.chmod(hidden.parent, 0o700)
    allowed = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--cwd", str(mine), "cat mine.txt; id -u",
                               umask="027")).strip()
    _ok(users.spoolq(None, "-s", str(spool), "work"))
    for job_id, folder, why in ((denied, secret, "cannot be entered as sqtweb"),
                                (shut, hidden, "does not exist or sqtweb cannot reach it")):
        job = _show(users, spool, job_id)
        assert job["state"] == "dead" and job["attempts"] == 1, job
        assert job["error"] == f"cannot start: its working directory {folder} {why}", job
        assert "secret" not in (job.get("stdout") or "")
    job = _show(users, spool, allowed)
    assert job["state"] == "done" and job["stdout"] == f"the member's\n{users.web.uid}\n", job


def test_a_job_run_as_a_member_gets_none_of_the_root_workers_environment(users):
    spool = users.root_spool()
    job = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--env", "MINE=kept", "env", umask="027")).strip()
    roots = _ok(users.spoolq(None, "-s", str(spool), "enqueue", "env")).strip()
    _ok(users.spoolq(None, "-s", str(spool), "work", env={"DB_PASSWORD": "hunter2"}))
    env = dict(line.split("=", 1) for line in _show(users, spool, job)["stdout"].splitlines() if "=" in line)
    assert "DB_PASSWORD" not in env, env
    web = users.web
    assert {k: env.get(k) for k in ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "MINE")} == {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": web.home, "USER": web.name, "LOGNAME": web.name,
        "SHELL": "/bin/sh", "MINE": "kept"}, env
    assert {k for k in env if k not in ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "MINE", "PWD", "SHLVL", "_")} == {
        "SPOOLQ_JOB_ID", "SPOOLQ_ATTEMPT", "SPOOLQ_SPOOL", "SPOOLQ_WORKER", "SPOOLQ_COMMAND", "SPOOLQ_HEARTBEAT"}, env
    # Root's own jobs run in the worker's environment, as every worker's jobs do.
    assert "DB_PASSWORD=hunter2" in _show(users, spool, roots)["stdout"]


def _cmdlines() -> str:
    """Every process's argv, as ps shows it."""
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_an_outsider_sees_no_running_jobs_command_in_ps(users):
    """Under the owner's worker and under root's (which runs the job as the
    member), ``ps`` run by an outsider shows the job's shell but not its
    command."""
    started = users.open_folder("started")
    for user, spool in ((users.owner, users.shared_spool()), (None, users.root_spool())):
        flag = started / f"{user.name if user else 'root'}"
        _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--max-attempts", "1", "--timeout", "10",
                         f"touch {flag}; sleep 300; echo secret-argument-{os.getpid()}", umask="027"))
        worker = users.popen(user, "-s", str(spool), "work", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(flag.exists, what="the job to start")
            seen = _ok(users.sh(users.out, "ps -eo args"))
            assert "sleep 300" in seen and f"secret-argument-{os.getpid()}" not in seen, seen
            assert f"secret-argument-{os.getpid()}" not in _cmdlines()  # nor for root's ps
        finally:
            assert worker.wait(timeout=120) == 0  # the job timed out


def _snapshot(path: Path) -> tuple:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, sorted(os.listdir(path))


def test_a_spool_path_someone_else_could_swap_is_refused_before_anything_changes(users):
    """Another user's symlink where root (or anyone) names a spool, and a
    spool path inside another user's folder: ``init --group`` and
    ``enqueue`` refuse it and change nothing at the link's target (enqueue,
    which makes no spool, refuses a path without one as such)."""
    target = users.folder("target")
    (target / "kept").write_text("root's\n")
    before = _snapshot(target)
    evils = users.folder("evils", owner=users.evil)
    sticky = users.open_folder("sticky")
    real = users.root_spool()  # a spool the link may name too: enqueue writes into nothing there
    jobs = os.listdir(real / "new")
    for folder in (evils, sticky):
        _ok(users.sh(users.evil, f"ln -s {target} {folder}/spool"))
        _ok(users.sh(users.evil, f"ln -s {real} {folder}/real"))
        for args in (["init", "--group", users.group], ["enqueue", "true"]):
            for user in (None, users.owner):
                error = _one_line_error(users.spoolq(user, "-s", f"{folder}/spool", *args))
                swapped = f"{folder}/spool is a symlink of sqtevil" in error or "sqtevil owns" in error
                # enqueue makes no spool: a path without one is refused as such
                assert swapped or (args[0] == "enqueue" and f"{folder}/spool is not a spool" in error), error
                assert _snapshot(target) == before
                error = _one_line_error(users.spoolq(user, "-s", f"{folder}/real", *args))
                assert f"{folder}/real is a symlink of sqtevil" in error or "sqtevil owns" in error \
                    or f"reached through {folder}" in error, error
                assert os.listdir(real / "new") == jobs
    # Inside a folder of another user's: nothing made there.
    for args in (["init", "--group", users.group], ["enqueue", "true"]):
        error = _one_line_error(users.spoolq(None, "-s", f"{evils}/made", *args))
        assert f"is reached through {evils}, which sqtevil owns" in error \
            or (args[0] == "enqueue" and f"{evils}/made is not a spool" in error), error
        assert sorted(os.listdir(evils)) == ["real", "spool"]
    # A symlink of root's (or the caller's own) is the folder it names, as before.
    mine = users.folder("mine")
    os.symlink(target, mine / "spool")
    _ok(users.spoolq(None, "-s", str(mine / "spool"), "init", "--group", users.group))
    assert (target / "new").is_dir()
