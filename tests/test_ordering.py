"""Which job runs when, in a spool directory: files dropped by hand with a
priority, dependencies or held; a dependency folded into the history; a
lock freed once its worker and its job are killed; a member of a shared
spool's ordering fields. (The CLI's contract on both backends, kill -9 at
random moments included, is tests/contract/test_contract_ordering.py.)"""

from __future__ import annotations

import json
import os
import signal

from conftest import wait_for


def _drop(spool, name: str, job: dict) -> None:
    spool.drop(f"{name}.json", json.dumps(job))


def _ran(log) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_dropped_files_keep_their_priority_dependencies_and_hold(spool, tmp_path):
    spool.config("fsync", "false")
    log = tmp_path / "log"
    for n in range(3):
        spool.enqueue("--id", f"plain{n}", f"echo plain{n} >> {log}")
    _drop(spool, "late", {"command": f"echo late >> {log}", "priority": -1})
    # Its place known before any read: the marker the reference gives, made first.
    (spool.path / "order" / "prio").mkdir(exist_ok=True)
    (spool.path / "order" / "prio" / "7~urgent").touch()
    _drop(spool, "urgent", {"command": f"echo urgent >> {log}", "priority": 7})
    _drop(spool, "second", {"command": f"echo second >> {log}", "after": "plain2"})
    _drop(spool, "ghost", {"command": "true", "after": ["nosuch"]})
    _drop(spool, "stay", {"command": f"echo stay >> {log}", "held": True})
    spool.work()
    ran = _ran(log)
    assert ran.index("second") > ran.index("plain2") and ran[-1] == "late"
    assert ran[0] == "urgent"
    assert "stay" not in ran and spool.show("stay")["state"] == "held"
    ghost = spool.show("ghost")
    assert ghost["state"] == "dead" and "no job nosuch" in ghost["error"]
    assert spool.show("late")["attempts"] == 1


def test_a_dependency_folded_into_the_history_counts_by_its_outcome(spool, tmp_path):
    spool.config("fsync", "false")
    spool.enqueue("--id", "old", "true")
    spool.enqueue("--id", "old-dead", "--max-attempts", "1", "false")
    spool.work()
    spool.run("compact", "--keep", "1d")
    spool.run("purge", "--older-than", "0s", check=False)
    assert spool.names("done") == []
    job_id = spool.enqueue("--after", "old", "true")
    assert spool.show(job_id)["state"] == "new"
    proc = spool.run("enqueue", "--after", "old-dead", "true", check=False)
    assert proc.returncode == 1 and "old-dead ended dead" in proc.stderr


def test_a_killed_workers_lock_is_free_at_once(spool, tmp_path):
    spool.config("fsync", "false")
    started = tmp_path / "started"
    spool.enqueue("--lock", "db", f"touch {started}; sleep 60")
    worker = spool.popen("work", "--watch", start_new_session=True)
    wait_for(started.exists, timeout=60, what="the first job to start")
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    second = tmp_path / "second"
    job_id = spool.enqueue("--lock", "db", f"touch {second}")
    other = spool.popen("work", "--watch", start_new_session=True)
    try:
        wait_for(second.exists, timeout=60, what="a job holding the same lock to start")
        wait_for(lambda: spool.show(job_id)["state"] == "done", timeout=60, what="it to finish")
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()


def test_a_dropped_file_whose_unique_key_is_taken_goes_to_dead(spool):
    spool.config("fsync", "false")
    first = spool.enqueue("--unique", "k", "--in", "1h", "true")
    _drop(spool, "copy", {"command": "true", "unique": "k"})
    _drop(spool, "other", {"command": "true", "unique": "other-key"})
    spool.work()
    copy = spool.show("copy")
    assert copy["state"] == "dead" and f"held by job {first}" in copy["error"]
    assert spool.show("other")["state"] == "done"
    assert spool.run("enqueue", "--unique", "other-key", "true").stdout.strip() != "other"  # done: free


def test_a_member_orders_its_jobs_by_priority_lock_and_hold_and_is_told_what_it_cannot(users):
    """A member's job reaches the spool through drop/, taken in by the
    owner's worker: priority, lock and held are honoured (from enqueue and
    from a dropped file alike); a dependency or unique key it cannot have
    checked at enqueue is refused there in one line, and a dropped file's
    is applied as the worker takes the job in."""
    spool = users.shared_spool()
    out = users.open_folder("out")
    log = out / "log"

    def member(*args):
        return users.spoolq(users.web, "-s", str(spool), *args)

    def owner(*args):
        run = users.spoolq(users.owner, "-s", str(spool), *args)
        assert run.returncode == 0, run.stderr
        return run

    first = owner("enqueue", "--id", "first", f"echo first >> {log}").stdout.strip()
    assert member("enqueue", "--id", "plain", f"echo plain >> {log}").returncode == 0
    assert member("enqueue", "--id", "urgent", "--priority", "5", "--lock", "m", f"echo urgent >> {log}").returncode == 0
    assert member("enqueue", "--id", "kept", "--hold", f"echo kept >> {log}").returncode == 0
    for args in (["--after", first], ["--unique", "k"]):
        run = member("enqueue", *args, "true")
        assert run.returncode == 1 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
        assert "member" in run.stderr and args[0].lstrip("-") in run.stderr
    for name, job in (("second", {"command": f"echo second >> {log}", "after": ["plain"]}),
                      ("copy", {"command": "true", "unique": "taken"})):
        dropped = users.sh(users.web, 'printf "%s\\n" "$2" > "$1/drop/.$3" && mv "$1/drop/.$3" "$1/drop/$3.json"',
                           str(spool), json.dumps(job), name)
        assert dropped.returncode == 0, dropped.stderr
    owner("enqueue", "--unique", "taken", "--hold", "true")
    owner("work")
    ran = _ran(log)
    assert ran[0] == "urgent" and ran.index("second") > ran.index("plain") and "kept" not in ran, ran
    assert json.loads(owner("show", "--json", "kept").stdout)["state"] == "held"
    copy = json.loads(owner("show", "--json", "copy").stdout)
    assert copy["state"] == "dead" and "unique key is held by job" in copy["error"]
    run = member("release", "kept")
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    owner("release", "kept")
    owner("work")
    assert _ran(log)[-1] == "kept"
