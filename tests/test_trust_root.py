"""A worker running as root (on a spool of root's) runs each job as the user
who enqueued it, and what a spool accepts can be limited (allow_commands,
allowed_kinds)."""

from __future__ import annotations

import json
import os
import time

import pytest

from conftest import wait_for
from users import users  # noqa: F401 - the throwaway users

APP = (
    "import os\n"
    "def who(payload):\n"
    "    return os.geteuid()\n"
    "HANDLERS = {'who': who, 'other': who}\n"
)


def _ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _shared(users, trusted="sqtweb"):
    """A shared spool root made and owns, with web trusted."""
    path = str(users.folder("root") / "spool")
    _ok(users.spoolq(None, "-s", path, "init", "--group", users.group))
    if trusted:
        _ok(users.spoolq(None, "-s", path, "config", "set", "trusted_users", trusted))
    return path


def _enqueue(users, user, path, *args):
    return _ok(users.spoolq(user, "-s", path, "enqueue", *args, umask="027")).strip()


def _work(users, path, *args, cwd=None):
    return _ok(users.spoolq(None, "-s", path, "work", *args, cwd=cwd))


def _show(users, path, job_id):
    return json.loads(_ok(users.spoolq(None, "-s", path, "show", job_id, "--json")))


def _where(path, job_id):
    return [s for s in ("new", "cur", "failed", "dead", "done") if os.path.exists(os.path.join(path, s, f"{job_id}.json"))]


def _drop(path, name, job, uid, gid):
    """A job file written by hand (0640) and owned by ``uid``."""
    tmp = os.path.join(path, "tmp", name)
    with open(tmp, "w") as f:
        json.dump(job, f)
    os.chmod(tmp, 0o640)
    os.chown(tmp, uid, gid)
    os.rename(tmp, os.path.join(path, "new", name))


def test_a_root_worker_runs_a_members_command_as_that_member(users):
    path = _shared(users)
    web = users.web
    # Dropped without a cwd (enqueue gives its own): it runs in the member's home.
    job_id = "dropped"
    _drop(path, "dropped.json", {"command": 'id -u; id -G; echo "$HOME $USER $LOGNAME $SHELL"; pwd',
                                 "env": {"USER": "chosen"}}, web.uid, users.gid)
    _work(users, path)
    job = _show(users, path, job_id)
    assert job["state"] == "done", job
    uid, groups, names, cwd = job["stdout"].splitlines()
    assert uid == str(web.uid)
    assert set(groups.split()) == {str(web.gid), str(users.gid)}  # its groups, the spool's among them; not root's
    assert names == f"{web.home} chosen {web.name} /bin/sh"  # the job's own env on top
    assert cwd == web.home


def test_a_root_worker_runs_a_members_argv_job_as_that_member(users):
    path = _shared(users)
    web = users.web
    job_id = _enqueue(users, web, path, "--argv", "sh", "-c", 'id -u; id -G; echo "$HOME $USER"')
    _work(users, path)
    job = _show(users, path, job_id)
    assert job["state"] == "done", job
    uid, groups, home = job["stdout"].splitlines()
    assert uid == str(web.uid)
    assert set(groups.split()) == {str(web.gid), str(users.gid)}
    assert home == f"{web.home} {web.name}"


def test_a_root_owned_job_runs_as_root(users):
    path = _shared(users)
    job_id = _enqueue(users, None, path, "id -u; id -g")
    _work(users, path)
    job = _show(users, path, job_id)
    assert job["state"] == "done" and job["stdout"] == "0\n0\n", job


def test_a_members_job_stays_the_members_after_the_root_worker_rewrites_it(users):
    """Each run of a failing job rewrites its record, as root: the next run
    is still the member's, whatever the member wrote in its file."""
    path = _shared(users)
    _ok(users.spoolq(None, "-s", path, "config", "set", "backoff_initial", "0"))
    job_id = _enqueue(users, users.web, path, "--json", json.dumps(
        {"command": "id -u >&2; exit 1", "max_attempts": 3, "run_as": 0}))
    _work(users, path)
    job = _show(users, path, job_id)
    assert job["state"] == "dead" and job["attempts"] == 3, job
    assert job["stderr"] == f"{users.web.uid}\n"  # the last run's
    assert os.stat(os.path.join(path, "dead", f"{job_id}.json")).st_uid == 0
    # Root retries it: still the member's.
    _ok(users.spoolq(None, "-s", path, "retry", job_id))
    _ok(users.spoolq(None, "-s", path, "config", "set", "max_attempts", "1"))
    _work(users, path)
    assert _show(users, path, job_id)["stderr"] == f"{users.web.uid}\n"


def test_a_file_of_a_uid_without_a_password_entry_goes_to_dead(users):
    path = _shared(users, trusted="sqtweb,4242")
    ran = users.folder("ghost") / "ran"
    _drop(path, "ghost.json", {"command": f"touch {ran}"}, 4242, users.gid)
    _work(users, path)
    assert _where(path, "ghost") == ["dead"]
    assert _show(users, path, "ghost")["error"] == (
        "owned by uid 4242, which has no entry in the password database; "
        "a root worker runs each job as the user who enqueued it")
    assert not ran.exists()


def test_a_members_handler_job_goes_to_dead_under_a_root_worker_unless_root_handlers(users):
    path = _shared(users)
    app = users.folder("app")
    (app / "rootapp.py").write_text(APP)
    member = _enqueue(users, users.web, path, "--kind", "who")
    roots = _enqueue(users, None, path, "--kind", "who")
    _work(users, path, "--app", "rootapp:HANDLERS", cwd=str(app))
    assert _where(path, roots) == ["done"] and _show(users, path, roots)["result"] == 0
    assert _where(path, member) == ["dead"]
    reason = _show(users, path, member)["error"]
    assert reason == (f"a handler job owned by {users.web.name} (uid {users.web.uid}): a root worker runs handlers "
                      "as root, so it runs only root's handler jobs unless root sets the root_handlers setting to true")
    _ok(users.spoolq(None, "-s", path, "config", "set", "root_handlers", "true"))
    _ok(users.spoolq(None, "-s", path, "retry", member))
    _work(users, path, "--app", "rootapp:HANDLERS", cwd=str(app))
    assert _where(path, member) == ["done"] and _show(users, path, member)["result"] == 0


def test_a_timeout_kills_a_job_running_as_a_member(users):
    path = _shared(users)
    scratch = users.folder("scratch", owner=users.web)
    pid_file = scratch / "pid"
    job_id = _enqueue(users, users.web, path, "--timeout", "1", "--max-attempts", "1",
                      f"sleep 300 & echo $! > {pid_file}; echo started; sleep 300")
    began = time.monotonic()
    _work(users, path)
    assert time.monotonic() - began < 30
    job = _show(users, path, job_id)
    assert job["state"] == "dead" and job["error"] == "timed out after 1s" and job["stdout"] == "started\n", job
    pid = int(pid_file.read_text())
    assert os.stat(pid_file).st_uid == users.web.uid

    def gone():
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    assert wait_for(gone, timeout=10), "the job's background process outlived its timeout"


@pytest.mark.parametrize("how", ["command", "argv"])
def test_allow_commands_false_refuses_command_jobs(fast_spool, tmp_path, how):
    s = fast_spool
    ran = tmp_path / "ran"
    job = {"command": f"touch {ran}"} if how == "command" else {"argv": ["touch", str(ran)]}
    s.config("allow_commands", "false")
    what = "argv" if "argv" in job else "command"
    message = f"{what} jobs are not allowed in this spool (allow_commands is false)"
    args = ("--json", json.dumps(job))
    refused = s.run("enqueue", *args, check=False)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and message in refused.stderr, refused.stderr
    assert s.names("new") == []
    s.drop("dropped.json", json.dumps(job))
    s.work()
    assert s.where("dropped") == ["dead"]
    assert s.show("dropped")["error"] == message
    assert not ran.exists()
    s.enqueue("--kind", "anything")  # handler jobs are still taken


def test_allowed_kinds_limits_the_handler_jobs_that_run(fast_spool, tmp_path):
    s = fast_spool
    (tmp_path / "kindsapp.py").write_text(APP)
    s.config("allowed_kinds", "who,third")
    refused = s.run("enqueue", "--kind", "other", check=False)
    message = "kind 'other' is not in this spool's allowed_kinds (who, third)"
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and message in refused.stderr, refused.stderr
    allowed = s.enqueue("--kind", "who")
    command = s.enqueue("true")
    s.drop("dropped.json", json.dumps({"kind": "other"}))
    s.work("--app", "kindsapp:HANDLERS", cwd=str(tmp_path))
    assert s.where("dropped") == ["dead"] and s.show("dropped")["error"] == message
    assert s.where(allowed) == ["done"] and s.where(command) == ["done"]


def test_no_retry_changes_whose_job_it_is(users):
    """On a spool of the owner's, a member's job is the member's whoever
    retries it: the record the owner's side writes keeps who enqueued it
    (run_as), and root's retry writes a record the owner's worker can
    read, still the member's job."""
    path = str(users.folder("owned", owner=users.owner) / "spool")
    _ok(users.spoolq(users.owner, "-s", path, "init", "--group", users.group))
    _ok(users.spoolq(users.owner, "-s", path, "config", "set", "trusted_users", users.web.name))
    job_id = _enqueue(users, users.web, path, "--max-attempts", "1", "id -un; exit 3")
    for retrier in (None, users.owner, None):
        _ok(users.spoolq(users.owner, "-s", path, "work"))
        job = _show(users, path, job_id)
        assert (job["state"], job["run_as"], job["stdout"]) == ("dead", users.web.uid, f"{users.owner.name}\n"), job
        record = os.stat(os.path.join(path, "dead", f"{job_id}.json"))
        assert (record.st_uid, record.st_mode & 0o777) == (users.owner.uid, 0o600)
        _ok(users.spoolq(retrier, "-s", path, "retry", job_id))
    new = os.stat(os.path.join(path, "new", f"{job_id}.json"))
    assert (new.st_uid, new.st_mode & 0o777) == (users.owner.uid, 0o600)
    assert _show(users, path, job_id)["run_as"] == users.web.uid
