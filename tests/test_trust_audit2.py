"""The trust model of a shared spool (docs/design.md, "Security") against
an untrusted member who plants directories where the owner's worker moves
jobs: ``owner`` owns the spool and runs its workers, ``web`` is a trusted
member, ``evil`` an untrusted one. A non-root owner cannot move a member's
directory to another folder (that needs write permission on the directory
itself), so such a directory must never wedge a job or stop a worker."""

from __future__ import annotations

import json
import os


def _ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_members_directory_under_a_jobs_name_in_done_never_wedges_the_job(users):
    """A member may create any name in done/, a directory included; the
    job that finishes under that name still reaches done/ (under a .dup-
    name) and the worker goes on with the next job."""
    spool = users.shared_spool()
    _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--id", "first", "true", umask="027"))
    _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--id", "second", "--in", "0", "true", umask="027"))
    _ok(users.spoolq(users.owner, "-s", str(spool), "sweep"))  # picked up: the ids are in new/
    assert users.sh(users.evil, f"mkdir -m 700 {spool}/done/first.json").returncode != 0  # the owner's side's folder
    # A member's folder there all the same (root makes it, as an older layout let members):
    _ok(users.sh(None, f"mkdir -m 700 {spool}/done/first.json && chown {users.evil.uid} {spool}/done/first.json"))
    proc = users.spoolq(users.owner, "-s", str(spool), "work")
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(spool / "cur") == []
    records = [json.loads((spool / "done" / n).read_text()) for n in os.listdir(spool / "done")
               if (spool / "done" / n).is_file()]
    assert sorted(r["outcome"] for r in records) == ["succeeded", "succeeded"], records
    assert any(r["id"] == "second" for r in records), records


def test_a_members_directory_in_cur_never_stops_recovery(users):
    """Recovery leaves in cur/ a member's directory it may not move, and
    recovers the abandoned jobs beside it."""
    spool = users.shared_spool()
    assert users.sh(users.evil, f"mkdir -m 700 {spool}/cur/0.json").returncode != 0  # the owner's side's folder
    _ok(users.sh(None, f"mkdir -m 700 {spool}/cur/0.json && chown {users.evil.uid} {spool}/cur/0.json"))
    # A job whose worker died without a trace: in cur/, unlocked, unregistered.
    _ok(users.sh(users.owner, f"printf '{{\"command\": \"true\"}}' > {spool}/cur/abandoned.json", umask="027"))
    proc = users.spoolq(users.owner, "-s", str(spool), "sweep")
    assert proc.returncode == 0, proc.stderr
    assert "abandoned.json" not in os.listdir(spool / "cur")
    assert "abandoned.json" in os.listdir(spool / "failed")


def test_a_spool_path_that_is_a_dangling_symlink_is_told_as_one(users):
    """A symlink made before its target (``ln -s /data/spool spool``) is
    not "a file that is not a directory": the error says what to create."""
    home = users.folder("home", owner=users.out)
    _ok(users.sh(users.out, "ln -s data/spool spool", cwd=str(home)))
    proc = users.spoolq(users.out, "enqueue", "true", cwd=str(home))
    assert proc.returncode == 1
    assert proc.stderr == f"spoolq: {home}/spool is a symlink to data/spool, which does not exist; " \
                          "create that folder first (mkdir), then run spoolq again\n"
    _ok(users.sh(users.out, "mkdir -p data/spool", cwd=str(home)))
    _ok(users.spoolq(users.out, "init", cwd=str(home)))
    _ok(users.spoolq(users.out, "enqueue", "true", cwd=str(home)))
    assert (home / "data" / "spool" / "new").is_dir()
