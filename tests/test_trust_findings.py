"""What a member of a shared spool's group cannot do to other users, tried
with real users as a hostile member would (docs/design.md, "Security"):
``owner`` owns the spool and runs its workers, ``web`` is a trusted
member, ``evil`` an untrusted one. Each test states what must hold, with
the member trying everything its permissions might allow: it reaches only
the drop, so it can neither create, replace nor lock anything the owner's
side relies on, and what it drops costs other users at most a bounded
delay."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from conftest import ROOT, alive, wait_for, watching

#: The most drop/ entries one pass takes in (docs/design.md, "Security"):
#: another user's job waits behind one user's flood for at most these.
PICKUP_BATCH = 256


def _ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _locker(users, user, path: str, marker: Path, shared: bool = True, wait: bool = False) -> subprocess.Popen:
    """``user`` trying to hold a flock on ``path`` (writing ``marker`` once
    it holds it); returns the process, which sleeps while it holds it.
    With ``wait``, armed in advance: it opens the file now and waits for
    the lock (whoever holds it now, say a worker, may die)."""
    return subprocess.Popen(user.prefix() + ["flock", "-s" if shared else "-x", "-w" if wait else "-n",
                                             *(["120"] if wait else []), path, "sh", "-c",
                                             f"echo locked > {marker}; exec sleep 300"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _settled(proc: subprocess.Popen, marker: Path) -> bool:
    """Wait until the locker holds its lock or gave up; whether it holds it."""
    wait_for(lambda: marker.exists() or proc.poll() is not None, what="the member's flock to hold or fail")
    return proc.poll() is None


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


SQUAT = r"""
import ctypes, os, re, select, struct, sys, time
spool, ready, ids = sys.argv[1], sys.argv[2], sys.argv[3:]
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
for folder in ("workers", "tmp", "cur"):
    libc.inotify_add_watch(fd, f"{spool}/{folder}".encode(), 0x100 | 0x80)  # IN_CREATE, IN_MOVED_TO: where it may look
open(ready, "w").close()
# A writer's names end in .<pid>.<12 hex digits>.<n>: take the next ones in tmp/.
tag = re.compile(r"\.(\d+\.[0-9a-f]{12})\.(\d+)$")
seen, deadline = set(), time.time() + 120
while time.time() < deadline:
    if not select.select([fd], [], [], 1)[0]:
        continue
    data, i = os.read(fd, 65536), 0
    while i < len(data):
        length = struct.unpack_from("iIII", data, i)[3]
        name = data[i + 16:i + 16 + length].rstrip(b"\0").decode()
        i += 16 + length
        m = tag.search(name)
        if not m or m.group(1) in seen:
            continue
        seen.add(m.group(1))
        for k in range(int(m.group(2)) + 1, int(m.group(2)) + 500):
            for base in ["spare", "reason"] + [f"{j}.json" for j in ids]:
                try:
                    os.close(os.open(f"{spool}/tmp/{base}.{m.group(1)}.{k}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                except OSError:
                    pass
"""


def test_a_member_cannot_make_a_worker_fail_to_record_outcomes(users):
    """A member who watches the worker's names go by (its registration's,
    made under a dot-name) and takes the next ones in tmp/ first would make
    it fail to record outcomes and stop claiming, and a later worker run
    the finished jobs again: no member can create a name in tmp/."""
    spool = users.shared_spool()
    _ok(users.spoolq(users.owner, "-s", str(spool), "config", "set", "fsync", "true"))  # spares and staged records
    out = users.open_folder("out")
    script = users.folder("bin") / "squat.py"
    script.write_text(SQUAT)
    os.chmod(script, 0o644)
    ids = [f"j{i}" for i in range(5)]
    squatter = subprocess.Popen(users.evil.prefix() + [users.python, str(script), str(spool), str(out / "ready"), *ids],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = users.folder("log") / "worker.log"
    try:
        wait_for(lambda: (out / "ready").exists(), what="the member's watch")
        with open(log, "w") as stderr, watching(users, spool, stderr=stderr) as worker:
            for job_id in ids:
                _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--id", job_id, f"echo {job_id} >> {out}/ran"))
            wait_for(lambda: all((spool / "done" / f"{i}.json").exists() for i in ids), timeout=60,
                     what="every job to finish")
            assert worker.poll() is None
    finally:
        _stop(squatter)
    assert sorted((out / "ran").read_text().split()) == ids
    assert "cannot record" not in log.read_text(), log.read_text()
    # Another worker runs nothing again.
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert sorted((out / "ran").read_text().split()) == ids


def test_a_member_cannot_make_a_dead_workers_job_run_beside_its_first_run(users):
    """A shared flock on a dead worker's registration would make it look
    alive, so recovery would kill nothing of its run, yet move its job on
    (to run again while the first run still runs): no member can open a
    registration."""
    spool = users.shared_spool()
    out = users.open_folder("out")
    _ok(users.spoolq(users.owner, "-s", str(spool), "enqueue", "--id", "long", f"echo $$ > {out}/pid; exec sleep 300"))
    worker = users.popen(users.owner, "-s", str(spool), "work", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    locker = None
    try:
        pid = int(wait_for(lambda: (out / "pid").exists() and (out / "pid").read_text().strip(), what="the job"))
        registration = wait_for(lambda: [p for p in (spool / "workers").glob("*.json") if '"pgid"' in p.read_text()],
                                what="the run on record")[0]
        locker = _locker(users, users.evil, str(registration), out / "locked", wait=True)
        time.sleep(0.5)  # (armed: it has the file open, or it has given up)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        _settled(locker, out / "locked")
        _ok(users.spoolq(users.owner, "-s", str(spool), "sweep"))
        if not (spool / "cur" / "long.json").exists():
            # The job may go on (to run again) only once its first run is over.
            assert wait_for(lambda: not alive(pid), timeout=10, what="the first run to end"), "it still runs"
    finally:
        _stop(worker, *([locker] if locker else []))
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_member_cannot_put_a_file_under_another_users_job_id(users):
    """A member's file written as cur/<id>.json or done/<id>.json would send
    another user's waiting job to dead/ as a duplicate, and show would show
    the member's file as that job: no member can create a file there."""
    spool = users.shared_spool()
    out = users.open_folder("out")
    _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--id", "theirs", "--in", "1h", f"echo real >> {out}/ran"))
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))  # waits in new/ (picked up, where there is a drop)
    forged = json.dumps({"command": f"echo forged >> {out}/ran", "state": "done", "outcome": "succeeded",
                         "stdout": "FORGED\n"})
    for folder in ("cur", "done", "failed", "dead"):
        users.sh(users.evil, f"printf '%s' '{forged}' > {spool}/{folder}/theirs.json")
    waiting = spool / "new" / "theirs.json"
    os.utime(waiting, (time.time() - 1, time.time() - 1))  # due now
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert (out / "ran").read_text() == "real\n"
    job = json.loads(_ok(users.spoolq(users.owner, "-s", str(spool), "show", "theirs", "--json")))
    assert (job["state"], job["command"], job.get("stdout")) == ("done", f"echo real >> {out}/ran", None), job


def test_a_member_cannot_stall_a_job_by_locking_its_file(users):
    """A read-only shared flock on a waiting job's file would make every
    worker pass it by (and cancel call it running); on a dead worker's
    file in cur/, the job would never be recovered, nor its processes
    killed: no member can open a record."""
    spool = users.shared_spool()
    out = users.open_folder("out")
    _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--id", "waiting", f"echo ran >> {out}/ran"))
    _ok(users.spoolq(users.owner, "-s", str(spool), "sweep"))  # picked up into new/, where there is a drop
    lockers = [_locker(users, users.evil, str(spool / "new" / "waiting.json"), out / "locked1")]
    _settled(lockers[0], out / "locked1")
    try:
        _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
        assert (out / "ran").read_text() == "ran\n"
        # A dead worker's job in cur/.
        _ok(users.spoolq(users.owner, "-s", str(spool), "enqueue", "--id", "running",
                         f"echo $$ > {out}/pid; exec sleep 300"))
        worker = users.popen(users.owner, "-s", str(spool), "work", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        lockers.append(worker)
        pid = int(wait_for(lambda: (out / "pid").exists() and (out / "pid").read_text().strip(), what="the job"))
        lockers.append(_locker(users, users.evil, str(spool / "cur" / "running.json"), out / "locked2", wait=True))
        time.sleep(0.5)  # (armed: it has the file open, or it has given up)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        _settled(lockers[-1], out / "locked2")
        sweep = _ok(users.spoolq(users.owner, "-s", str(spool), "sweep"))
        assert "recovered 1 to failed/" in sweep, sweep
        assert wait_for(lambda: not alive(pid), timeout=10, what="the run to be killed")
    finally:
        _stop(*lockers)


def _cron_line(spool: Path) -> tuple[str, str]:
    """The command of contrib/cron/spoolq.crontab's worker line for
    ``spool`` (with a short --max-time), and the path its flock locks."""
    for line in (ROOT / "contrib" / "cron" / "spoolq.crontab").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and "spoolq work" in line:
            command = line.split(None, 5)[5].replace("/var/spool/app", str(spool))
            command = re.sub(r"--max-time \S+", "--max-time 1s", command)
            return command, re.search(r"flock -n (\S+)", command).group(1)
    raise AssertionError("no worker line in contrib/cron/spoolq.crontab")


def test_a_member_cannot_take_the_cron_recipes_lock(users):
    """The documented cron line's lock is one no member can take (a lock on
    the spool folder, which any member may open, would make every run of
    the line exit 1, silently)."""
    spool = users.shared_spool()
    out = users.open_folder("out")
    command, lock = _cron_line(spool)
    lockers = [_locker(users, users.evil, lock, out / "locked-s"),
               _locker(users, users.evil, lock, out / "locked-x", shared=False),
               _locker(users, users.web, lock, out / "locked-web")]
    try:
        for locker, marker in zip(lockers, ("locked-s", "locked-x", "locked-web")):
            _settled(locker, out / marker)
        _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", f"echo cron >> {out}/ran"))
        bin_dir = users.folder("bin")
        (bin_dir / "spoolq").write_text(f'#!/bin/sh\nexec {users.python} -m spoolq "$@"\n')
        os.chmod(bin_dir / "spoolq", 0o755)
        run = users.sh(users.owner, command, env={"SPOOLQ_DIR": str(spool), "PATH": f"{bin_dir}:/usr/bin:/bin"})
        assert run.returncode == 0, run.stderr
        assert (out / "ran").read_text() == "cron\n"
    finally:
        _stop(*lockers)


def test_a_member_cannot_block_an_id_but_can_take_one_first(users):
    """A member cannot keep an id (say invoice-1001) from everyone for ever
    by planting a file under it. What a member can do is enqueue a job with
    an id before someone else does, as anyone may: the id is then that
    job's."""
    spool = users.shared_spool()
    planted = json.dumps({"command": "true", "state": "done", "outcome": "succeeded"})
    for folder in ("done", "new", "cur", "failed", "dead", "tmp"):
        users.sh(users.evil, f"printf '%s' '{planted}' > {spool}/{folder}/invoice-1001.json")
    _ok(users.spoolq(users.owner, "-s", str(spool), "sweep"))
    _ok(users.spoolq(users.owner, "-s", str(spool), "enqueue", "--id", "invoice-1001", "true"))
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert json.loads(_ok(users.spoolq(users.owner, "-s", str(spool), "show", "invoice-1001", "--json")))["state"] == "done"
    # Taken first by dropping a job with it (evil's, untrusted, goes to dead/ unrun: still that id's).
    _ok(users.spoolq(users.evil, "-s", str(spool), "enqueue", "--id", "invoice-2002", "true"))
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    run = users.spoolq(users.owner, "-s", str(spool), "enqueue", "--id", "invoice-2002", "true")
    assert run.returncode == 1 and "id invoice-2002 is already in dead/" in run.stderr, run.stderr


def test_a_member_cannot_rewrite_another_users_history(users):
    """A trusted member's file in done/ under a finished job's id, with its
    created_at and a later finished_at, would replace that job's row in the
    history at the next compaction: no member can put it there, and a job
    it enqueues under that id is a duplicate."""
    spool = users.shared_spool()
    _ok(users.spoolq(users.owner, "-s", str(spool), "enqueue", "--id", "report", "echo real"))
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    _ok(users.spoolq(users.owner, "-s", str(spool), "compact"))
    real = json.loads(_ok(users.spoolq(users.web, "-s", str(spool), "show", "report", "--json")))
    assert real["stdout"] == "real\n"
    forged = dict(real, stdout="FORGED\n", finished_at="2100-01-01T00:00:00.000000Z")
    for key in ("file", "mtime", "state"):
        forged.pop(key, None)
    for folder in ("done", "dead", "new"):
        users.sh(users.web, f"printf '%s' '{json.dumps(forged)}' > {spool}/{folder}/report.json")
    users.spoolq(users.web, "-s", str(spool), "enqueue", "--json", json.dumps(forged))
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    _ok(users.spoolq(users.owner, "-s", str(spool), "compact"))
    for user in (users.owner, users.web):
        assert json.loads(_ok(users.spoolq(user, "-s", str(spool), "show", "report", "--json")))["stdout"] == "real\n"


FLOOD = """
import os, sys
spool, count = sys.argv[1], int(sys.argv[2])
drop = os.path.isdir(f"{spool}/drop")
for i in range(count):
    name = f"flood-{i}"
    tmp = f"{spool}/drop/.{name}" if drop else f"{spool}/tmp/{name}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    os.write(fd, b'{"command": "true"}')
    os.utime(fd, ns=(0, 0))
    os.close(fd)
    os.rename(tmp, f"{spool}/drop/{name}.json" if drop else f"{spool}/new/{name}.json")
"""


def test_a_members_flood_delays_others_by_one_batch_and_costs_the_owner_no_file_per_file(users):
    """Thousands of files of an untrusted member, due in 1970, delay another
    user's job by at most one batch of the pickup (round-robin between
    users), go to dead/ by renames only (no file of the owner's per file),
    and are told once. (20,000 files: the bound does not depend on the
    size, and a test run should not spend a minute making files.)"""
    spool = users.shared_spool()
    out = users.open_folder("out")
    script = users.folder("bin") / "flood.py"
    script.write_text(FLOOD)
    os.chmod(script, 0o644)
    flood = 20000
    _ok(users.sh(users.evil, f"{users.python} {script} {spool} {flood}", timeout=600))
    _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", f"echo web >> {out}/ran"))
    began = time.monotonic()
    _ok(users.spoolq(users.owner, "-s", str(spool), "work", "--max-jobs", "1", timeout=600))
    first = time.monotonic() - began
    assert (out / "ran").read_text() == "web\n"
    flood_handled = sum(1 for n in os.listdir(spool / "dead") if n.startswith("flood-"))
    assert flood_handled <= PICKUP_BATCH, f"{flood_handled} flood files before the other user's job ({first:.1f}s)"
    run = users.spoolq(users.owner, "-s", str(spool), "work", timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("sqtevil") == 1, run.stderr  # told once per run, not per file or per pass
    assert len(os.listdir(spool / "dead")) == flood
    owners = [str(p) for p in spool.rglob("*") if p.is_file() and p.stat().st_uid == users.owner.uid]
    assert len(owners) < 10, owners[:20]
    shutil.rmtree(spool)


def test_a_members_folder_in_the_drop_is_told_once_per_worker_run(users):
    """A folder a member makes where it drops jobs is told once per worker
    run, not at every pass (cron would mail it every minute)."""
    spool = users.shared_spool()
    for folder in ("drop", "new"):
        users.sh(users.evil, f"mkdir {spool}/{folder}/folder.json")
    run = users.spoolq(users.owner, "-s", str(spool), "work", "--watch", "--poll", "0.05", "--max-time", "3", "-v")
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("scan due=") >= 3, run.stderr  # several passes
    assert run.stderr.count("folder.json") == 1, run.stderr
