"""A shared spool's drop (docs/design.md, "Security"), with real users:
members drop jobs and requests into drop/, the owner's side picks them up
into records of its own that say who enqueued them, carries out and
answers the requests, and tells once what it cannot take; ``init --group``
checks the set-up and converts a spool of the older layout. ``owner`` owns
the spool and runs its workers, ``web`` is a trusted member, ``evil`` an
untrusted one."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import stat
import subprocess
import time

from conftest import ROOT, wait_for, watching


def _ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _show(users, user, spool, job_id) -> dict:
    return json.loads(_ok(users.spoolq(user, "-s", str(spool), "show", job_id, "--json")))


def test_a_dropped_job_becomes_a_record_of_the_owners_side_saying_who_dropped_it(users):
    spool = users.shared_spool()
    out = users.open_folder("out")
    web = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", f"id -un >> {out}/who")).strip()
    by_root = _ok(users.spoolq(None, "-s", str(spool), "enqueue", f"id -un >> {out}/who")).strip()
    assert sorted(os.listdir(spool / "drop")) == sorted([f"{web}.json", f"{by_root}.json"])
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert os.listdir(spool / "drop") == []
    # Under the owner's worker every job runs as the owner; who enqueued it is kept.
    assert (out / "who").read_text() == f"{users.owner.name}\n" * 2
    for job_id, uid in ((web, users.web.uid), (by_root, 0)):
        st = os.stat(spool / "done" / f"{job_id}.json")
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (users.owner.uid, 0o600)
        job = _show(users, users.owner, spool, job_id)
        assert job["run_as"] == uid and isinstance(job["dropped"], str), job


def test_a_watching_worker_picks_a_dropped_job_up_at_once(users):
    spool = users.shared_spool()
    _ok(users.spoolq(users.owner, "-s", str(spool), "config", "set", "rescan_interval", "1h"))
    with watching(users, spool):
        job_id = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "true")).strip()
        wait_for(lambda: (spool / "done" / f"{job_id}.json").exists(), timeout=60, what="the job (no rescan for an hour)")


def test_a_members_cancel_and_retry_do_what_the_owners_do_for_its_own_jobs_only(users):
    spool = users.shared_spool()
    _ok(users.spoolq(users.owner, "-s", str(spool), "config", "set", "backoff_initial", "1h"))
    flag = users.open_folder("out") / "flag"
    args = ("--max-attempts", "1", f"test -e {flag} || exit 3")  # fails until the flag is there
    mine = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", *args)).strip()
    owners = _ok(users.spoolq(users.owner, "-s", str(spool), "enqueue", *args)).strip()
    waiting = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--in", "1h", "true")).strip()
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    flag.touch()
    with watching(users, spool):
        # Its own: as the owner's command says it.
        run = users.spoolq(users.web, "-s", str(spool), "retry", mine)
        assert (run.returncode, run.stdout, run.stderr) == (0, f"{mine}\n", "")
        run = users.spoolq(users.web, "-s", str(spool), "cancel", waiting)
        assert (run.returncode, run.stdout, run.stderr) == (0, f"cancelled {waiting}\n", "")
        # Not found, not possible: the owner's words and exit status.
        for command, job_id in (("cancel", "no-such-job"), ("retry", waiting), ("cancel", waiting)):
            member = users.spoolq(users.web, "-s", str(spool), command, job_id)
            owner = users.spoolq(users.owner, "-s", str(spool), command, job_id)
            assert (member.returncode, member.stdout, member.stderr) == (owner.returncode, owner.stdout, owner.stderr)
            assert member.returncode == 1 and member.stderr.count("\n") == 1
        # Another user's job: refused, and left as it is.
        run = users.spoolq(users.web, "-s", str(spool), "retry", owners)
        assert run.returncode == 1 and f"was enqueued by {users.owner.name}, not by {users.web.name}" in run.stderr
        run = users.spoolq(users.evil, "-s", str(spool), "retry", owners)
        assert run.returncode == 1 and "refused: sqtevil is not trusted" in run.stderr, run.stderr
        run = users.spoolq(users.web, "-s", str(spool), "retry", "--all")
        assert (run.returncode, run.stdout) == (0, ""), run.stderr  # (none of its own is dead now)
        wait_for(lambda: (spool / "done" / f"{mine}.json").exists(), timeout=60, what="the retried job to run")
    assert (spool / "dead" / f"{owners}.json").exists() and (spool / "done" / f"{waiting}.json").exists()
    assert _show(users, users.owner, spool, mine)["run_as"] == users.web.uid


def test_a_members_request_no_worker_answers_waits_and_is_carried_out_later(users):
    spool = users.shared_spool()
    job_id = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--in", "1h", "true")).strip()
    began = time.monotonic()
    run = users.spoolq(users.web, "-s", str(spool), "cancel", job_id)
    assert run.returncode == 75 and run.stdout == "" and run.stderr.count("\n") == 1, run.stderr
    assert "no worker of sqtowner answered within 10s" in run.stderr and "carried out when one runs" in run.stderr
    assert time.monotonic() - began >= 10
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert _show(users, users.owner, spool, job_id)["outcome"] == "cancelled"


def test_a_drop_the_owners_side_cannot_read_waits_and_the_worker_says_why_once(users):
    spool = users.shared_spool()
    out = users.open_folder("out")
    # A member's file only it may read (umask 077, by hand).
    script = 'printf \'{"command": "echo %s >> %s"}\' "$3" "$2" > "$1/drop/.$3" && mv "$1/drop/.$3" "$1/drop/$3.json"'
    for name in ("private1", "private2"):
        _ok(users.sh(users.web, script, str(spool), f"{out}/ran", name, umask="077"))
    run = users.spoolq(users.owner, "-s", str(spool), "work", "--watch", "--poll", "0.05", "--max-time", "2", "-q")
    assert run.returncode == 0
    lines = [line for line in run.stderr.splitlines() if "cannot read" in line]
    assert len(lines) == 1 and "sqtweb" in lines[0] and "umask 027" in lines[0] and "(600)" in lines[0], run.stderr
    assert sorted(os.listdir(spool / "drop")) == ["private1.json", "private2.json"]
    for name in ("private1.json", "private2.json"):
        os.unlink(spool / "drop" / name)
    # A worker whose process is not in the spool's group (its user not in it, or
    # added since it started): told the group and the fix, and the job waits.
    job_id = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", f"echo grouped >> {out}/ran")).strip()
    owner = users.owner
    prefix = ["setpriv", f"--reuid={owner.uid}", f"--regid={owner.gid}", "--clear-groups"]
    run = subprocess.run(prefix + [*users.command(), "-s", str(spool), "work", "-q"], capture_output=True, text=True,
                         env=users.env(owner), cwd=str(users.base), timeout=120)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if "cannot read" in line]
    assert len(lines) == 1, run.stderr
    assert "not in the spool's group sqtgrp" in lines[0] and "usermod -aG sqtgrp sqtowner" in lines[0], lines[0]
    assert (spool / "drop" / f"{job_id}.json").exists()
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert (out / "ran").read_text() == "grouped\n"


def test_init_refuses_a_group_its_owner_is_not_in_before_making_anything(users):
    base = users.folder("notin", owner=users.owner)
    spool = base / "spool"
    run = users.spoolq(users.owner, "-s", str(spool), "init", "--group", users.out.name)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert f"sqtowner, who owns the spool {spool}, is not in group sqtout" in run.stderr
    assert "usermod -aG sqtout sqtowner" in run.stderr
    assert not spool.exists()
    spool.mkdir()
    os.chown(spool, users.owner.uid, users.owner.gid)
    run = users.spoolq(None, "-s", str(spool), "init", "--group", users.out.name)
    assert run.returncode == 1 and "usermod -aG sqtout sqtowner" in run.stderr
    assert os.listdir(spool) == []


def test_init_converts_a_shared_spool_of_the_older_layout_and_says_what_it_changed(users):
    spool = users.shared_spool()
    out = users.open_folder("out")
    # The older layout: members wrote into the state folders, records were 0640.
    for folder in ("tmp", "new", "cur", "failed", "dead", "done"):
        os.chmod(spool / folder, 0o3770)
    os.chmod(spool / "workers", 0o2750)
    os.rmdir(spool / "drop")
    _ok(users.spoolq(users.owner, "-s", str(spool), "init"))  # (recreates drop/ in a shared spool ...)
    os.rmdir(spool / "drop")  # (... so it goes again)
    for folder in ("tmp", "new", "cur", "failed", "dead", "done"):
        os.chmod(spool / folder, 0o3770)
    os.chmod(spool / "workers", 0o2750)

    def put(folder, name, user, job, mode=0o640):
        path = spool / folder / name
        path.write_text(json.dumps(job))
        os.chown(path, user.uid, users.gid)
        os.chmod(path, mode)

    put("new", "waiting.json", users.web, {"command": f"echo waiting >> {out}/ran"})
    put("failed", "retrying.json", users.web, {"command": f"echo retrying >> {out}/ran"})
    put("done", "finished.json", users.owner, {"command": "true", "state": "done", "outcome": "succeeded"})
    put("done", "planted.json", users.evil, {"command": "true", "state": "done"})
    put("tmp", "squat.1", users.evil, {})
    error = users.spoolq(users.web, "-s", str(spool), "status")
    assert error.returncode == 1 and "of an older layout" in error.stderr and "init --group sqtgrp" in error.stderr
    run = users.spoolq(None, "-s", str(spool), "init", "--group", users.group)
    assert run.returncode == 0, run.stderr
    said = run.stderr
    assert f"made {spool}/drop/ (3730)" in said and "2750 (it was 3770)" in said and "0700 (it was 2750)" in said, said
    assert "moved 2 jobs of members (waiting in new/, failed/ or cur/) into drop/" in said, said
    assert "moved 1 file of members from done/ to dead/" in said
    assert "made 1 file of sqtowner readable by sqtowner alone (0600)" in said  # (config.json is 0640: members read it)
    assert "removed 1 file of members" in said
    assert stat.S_IMODE(os.stat(spool / "done" / "finished.json").st_mode) == 0o600
    assert sorted(os.listdir(spool / "drop")) == ["retrying.json", "waiting.json"]
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert sorted((out / "ran").read_text().split()) == ["retrying", "waiting"]
    again = users.spoolq(None, "-s", str(spool), "init", "--group", users.group)
    assert (again.returncode, again.stderr) == (0, ""), again.stderr


def test_the_readmes_systemd_recipe_for_a_shared_spool_runs_a_web_servers_job(users):
    """README, "Running the worker": the worker's user owns the spool and
    is in the web server's group; the web server's group is trusted."""
    srv = users.folder("srv")
    spool = srv / "spool"
    out = users.open_folder("out")
    _ok(users.sh(None, f"install -d -o {users.owner.name} {spool}"))
    _ok(users.sh(None, f"usermod -aG {users.group} {users.owner.name}"))
    _ok(users.spoolq(None, "-s", str(spool), "init", "--group", users.group))
    _ok(users.spoolq(users.owner, "-s", str(spool), "config", "set", "trusted_users", users.web.name))
    unit = (ROOT / "contrib" / "systemd" / "spoolq-worker.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    args = exec_start.split()[1:]  # spoolq work --watch -j 4
    assert args[:2] == ["work", "--watch"], exec_start
    with watching(users, spool, *args[2:]):
        job_id = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", f"id -un > {out}/who")).strip()
        wait_for(lambda: (out / "who").exists() and (out / "who").read_text(), timeout=60, what="the job to run")
    assert (out / "who").read_text() == f"{users.owner.name}\n"
    assert (spool / "done" / f"{job_id}.json").exists()


def test_a_member_reads_listings_settings_and_history_but_no_record_of_the_owners_side(users):
    spool = users.shared_spool()
    job_id = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "echo out")).strip()
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    status = json.loads(_ok(users.spoolq(users.web, "-s", str(spool), "status", "--json")))
    assert status["done"] == 1 and status["workers"] == [] and status["workers_seen"] is False
    assert "trusted_users = [\"sqtweb\"]" in _ok(users.spoolq(users.web, "-s", str(spool), "config", "list"))
    job = _show(users, users.web, spool, job_id)
    assert job["readable"] is False and job["state"] == "done" and "stdout" not in job, job
    for user in (users.web, users.evil):
        assert users.sh(user, f"cat {spool}/done/{job_id}.json").returncode != 0
        assert users.sh(user, f"ls {spool}/drop {spool}/workers").returncode != 0
    _ok(users.spoolq(users.owner, "-s", str(spool), "compact"))
    job = _show(users, users.web, spool, job_id)
    assert job["stdout"] == "out\n" and job["state"] == "done", job


def test_a_worker_killed_at_any_instant_of_a_pickup_loses_and_doubles_no_job(users):
    """kill -9 of a worker in the middle of its pickups, again and again:
    every dropped job ends in new/ exactly once (never in dead/ as a
    duplicate of itself, never lost), whatever instant the kill hit."""
    spool = users.shared_spool()
    _ok(users.spoolq(users.owner, "-s", str(spool), "config", "set", "fsync", "true"))
    jobs = users.folder("jobs") / "jobs.jsonl"
    count = 3000
    jobs.write_text("".join(json.dumps({"command": "true", "id": f"j{i}"}) + "\n" for i in range(count)))
    os.chmod(jobs, 0o644)
    _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--in", "1h", "--jsonl", str(jobs), timeout=300))
    assert len(os.listdir(spool / "drop")) == count
    rng = random.Random(27)
    for _ in range(12):
        worker = users.popen(users.owner, "-s", str(spool), "work", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.2, 1.2))
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        dropped = {n[:-5] for n in os.listdir(spool / "drop") if not n.startswith(".")}
        queued = {n[:-5] for n in os.listdir(spool / "new")}
        assert dropped | queued == {f"j{i}" for i in range(count)}  # none lost
        assert os.listdir(spool / "dead") == [] and os.listdir(spool / "cur") == []
    _ok(users.spoolq(users.owner, "-s", str(spool), "work", timeout=300))
    assert [n for n in os.listdir(spool / "drop") if not n.startswith(".")] == []
    assert sorted(os.listdir(spool / "new")) == sorted(f"j{i}.json" for i in range(count))
    assert os.listdir(spool / "dead") == []
    for name in rng.sample(sorted(os.listdir(spool / "new")), 20):
        job = json.loads(subprocess.run(["cat", str(spool / "new" / name)], capture_output=True, text=True).stdout)
        assert job["run_as"] == users.web.uid and job["id"] == name[:-5]


def test_the_readmes_member_drop_recipe_drops_a_job_the_owners_worker_takes_in(users):
    section = (ROOT / "README.md").read_text().split("## Drop a job from any shell", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    owners, member = blocks[0], next(b for b in blocks if "/drop/" in b)
    setup = "\n".join(line for line in owners.splitlines() if line.startswith(("SPOOL=", "f=")))
    spool = users.shared_spool()
    run = users.sh(users.web, setup + "\n" + member, env={"SPOOLQ_DIR": str(spool)}, umask="077")
    assert run.returncode == 0, run.stderr
    [dropped] = os.listdir(spool / "drop")
    assert stat.S_IMODE(os.stat(spool / "drop" / dropped).st_mode) == 0o640  # the owner's side reads it
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert os.listdir(spool / "drop") == []
    job = _show(users, users.owner, spool, dropped[:-5])
    assert (job["command"], job["run_as"]) == ("make report", users.web.uid), job


def test_what_a_member_puts_in_the_drop_never_stops_the_pickup_of_others(users):
    """Symlinks, FIFOs, folders (one where its own reply goes), files
    with other names, malformed requests: each goes to dead/, is left, or
    is refused, and the other users' jobs and requests go on."""
    spool = users.shared_spool()
    secret = users.folder("secret", owner=users.owner) / "secret.json"
    secret.write_text('{"command": "echo secret"}')
    os.chown(secret, users.owner.uid, users.owner.gid)
    for user in (users.evil, users.web):
        token = "ab" * 12
        _ok(users.sh(user, f"""cd {spool}/drop &&
            ln -s {secret} link.json && mkfifo fifo.json && mkdir folder.json &&
            mkdir {token}.reply && printf '{{"request": "cancel", "id": "x"}}' > {token}.request &&
            printf 'not json' > bad.request && printf '{{"request": "rm -rf"}}' > odd.request &&
            ln {secret} hardlink.json 2>/dev/null; true""", umask="027"))
        token_named = users.sh(user, f"ls -d {spool}/drop/{token}.reply")
        assert token_named.returncode == 0
        mine = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--in", "1h", "true")).strip()
        run = users.spoolq(users.owner, "-s", str(spool), "work")
        assert run.returncode == 0 and "Traceback" not in run.stderr and "pickup failed" not in run.stderr, run.stderr
        assert (spool / "new" / f"{mine}.json").exists()
        with watching(users, spool):
            run = users.spoolq(users.web, "-s", str(spool), "cancel", mine)
            assert (run.returncode, run.stdout) == (0, f"cancelled {mine}\n"), run.stderr
        left = sorted(n for n in os.listdir(spool / "drop") if os.lstat(spool / "drop" / n).st_uid == user.uid)
        assert set(left) <= {"folder.json", f"{token}.reply", f"{token}.request"}, left
        for name in left:
            _ok(users.sh(user, f"rm -rf {spool}/drop/{name}"))
    assert secret.read_text() == '{"command": "echo secret"}'
    assert not any("secret" in name for name in os.listdir(spool / "done"))


def test_a_job_runs_only_while_whoever_enqueued_it_is_trusted_under_any_worker(users):
    """Who enqueued a job (run_as, kept in the record of the owner's side)
    is checked against trusted_users at every claim, under the owner's
    worker and under root's on root's spool alike: a member no longer
    trusted when its picked-up job comes due gets it to dead/, unrun."""
    out = users.open_folder("out")
    for worker, spool in ((users.owner, users.shared_spool()), (None, users.root_spool())):
        ran = out / ("root" if worker is None else worker.name)
        job_id = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--in", "1h", f"touch {ran}")).strip()
        _ok(users.spoolq(worker, "-s", str(spool), "sweep"))  # picked up: a record of the owner's side, due later
        assert _show(users, worker, spool, job_id)["run_as"] == users.web.uid
        _ok(users.spoolq(worker, "-s", str(spool), "config", "set", "trusted_users", "[]"))
        os.utime(spool / "new" / f"{job_id}.json", (0, 0))  # due now
        _ok(users.spoolq(worker, "-s", str(spool), "work"))
        job = _show(users, worker, spool, job_id)
        assert job["state"] == "dead" and not ran.exists(), job
        assert f"enqueued by untrusted user {users.web.name}" in job["error"], job
