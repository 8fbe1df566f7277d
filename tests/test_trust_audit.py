"""The trust model of a shared spool (docs/design.md, "Security") against a
member of the group who plants files where the owner's or root's worker
looks: staged records in cur/, job files with other names. ``owner`` owns
the spool, ``web`` is a trusted member, ``evil`` an untrusted one."""

from __future__ import annotations

import json
import os
from pathlib import Path

STAGE = r"""
import json, sys, zlib
spool, name, command, run_as = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with open(f"{spool}/cur/{name}.json", "w") as f:
    json.dump({"command": "true"}, f)
run = {"attempt": 1, "worker": "w", "due": "2020-01-01T00:00:00Z", "start": "2020-01-01T00:00:00Z",
       "end": "2020-01-01T00:00:01Z", "exit_code": 1, "error": "exit status 1"}
outcome = {"command": command, "id": name, "state": "failed", "attempts": 1, "run_as": run_as, "history": [run],
           "exit_code": 1, "error": "exit status 1", "failed_at": "2020-01-01T00:00:01Z"}
data = json.dumps(outcome).encode()
with open(f"{spool}/cur/.staged.{name}.json.{zlib.crc32(data):08x}", "wb") as f:
    f.write(data)
"""


def _ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _root_spool(users) -> str:
    """A shared spool root made and owns, web trusted, fsync on, retries at once."""
    return str(users.root_spool(("fsync", "true"), ("backoff_initial", "0")))


def test_a_staged_record_a_member_plants_in_cur_is_never_taken_as_a_runs_outcome(users):
    """A staged record is a worker's: recovery takes one only from a user
    who runs workers on the spool. A trusted member's would otherwise
    become a root-owned record, whose run_as a root worker believes. A
    member cannot write into cur/ at all; a member's file put there (root
    puts it here, as an older spool's layout let members) counts for
    nothing either."""
    path = _root_spool(users)
    out = users.folder("out")
    os.chmod(out, 0o1777)
    script = users.folder("bin") / "stage.py"
    script.write_text(STAGE)
    os.chmod(script, 0o644)
    attempt = users.sh(users.web, f"{users.python} {script} {path} forged 'id -u > {out}/who' 0", umask="027")
    assert attempt.returncode != 0 and "Permission denied" in attempt.stderr, attempt.stderr
    _ok(users.sh(None, f"{users.python} {script} {path} forged 'id -u > {out}/who' 0 && "
                       f"chown {users.web.uid}:{users.gid} {path}/cur/forged.json {path}/cur/.staged.forged.json.*",
                 umask="027"))
    _ok(users.spoolq(None, "-s", path, "work"))
    assert not (Path(out) / "who").exists(), "the member's forged command ran as " + (Path(out) / "who").read_text()
    assert not [n for n in os.listdir(Path(path) / "cur")], os.listdir(Path(path) / "cur")


def test_a_job_file_with_another_name_never_runs(users):
    """A file runs only with one link: where fs.protected_hardlinks is 0 a
    member may link any record it can see (a finished job's, in done/) into
    new/ and have it run again."""
    spool = users.shared_spool()
    out = users.folder("out")
    os.chmod(out, 0o1777)
    _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--id", "once", f"echo ran >> {out}/ran", umask="027"))
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert (Path(out) / "ran").read_text() == "ran\n"
    # Root makes the link, whatever fs.protected_hardlinks says here.
    os.link(spool / "done" / "once.json", spool / "new" / "again.json")
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))
    assert (Path(out) / "ran").read_text() == "ran\n"
    show = json.loads(_ok(users.spoolq(users.owner, "-s", str(spool), "show", "again", "--json")))
    assert show["state"] == "dead" and "2 links" in show["error"], show


def test_a_reason_a_member_writes_beside_another_users_dead_job_is_not_told(users):
    """Why a job is in dead/ is kept in a dot-file beside it, naming the
    file; a member can make such a file for another user's job, and its
    words would be shown (and purged into the index) as that job's error."""
    from spoolq import linux

    spool = users.shared_spool()
    job = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--id", "later", "--in", "1h", "true",
                           umask="027")).strip()
    _ok(users.spoolq(users.owner, "-s", str(spool), "work"))  # picked up: in new/, due in an hour
    os.rename(spool / "new" / f"{job}.json", spool / "dead" / f"{job}.json")  # as if it had died
    dead = os.open(spool / "dead", os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.stat(f"{job}.json", dir_fd=dead, follow_symlinks=False)
        identity = f"{st.st_ino} {st.st_dev} {linux.birth_ns(dead, f'{job}.json')}"
    finally:
        os.close(dead)
    forge = f"printf '%s\\nforged by evil' '{identity}' > {spool}/dead/.reason.{job}.json"
    assert users.sh(users.evil, forge).returncode != 0  # dead/ is the owner's side's
    # A member's dot-file there all the same (root puts it, as an older layout let members):
    _ok(users.sh(None, f"{forge} && chown {users.evil.uid}:{users.gid} {spool}/dead/.reason.{job}.json"))
    for user in (users.owner, None):
        show = json.loads(_ok(users.spoolq(user, "-s", str(spool), "show", job, "--json")))
        assert "forged" not in str(show.get("error")), show


def test_a_file_a_member_puts_under_a_jobs_name_in_done_or_failed_is_moved_aside(users):
    path = _root_spool(users)
    finishing = _ok(users.spoolq(users.web, "-s", path, "enqueue", "echo real")).strip()
    failing = _ok(users.spoolq(users.web, "-s", path, "enqueue", "--max-attempts", "2", "exit 3")).strip()
    _ok(users.spoolq(None, "-s", path, "sweep"))  # picked up: the jobs wait in new/
    forged = json.dumps({"command": "true", "state": "done", "outcome": "succeeded", "stdout": "FORGED\n"})
    for folder, job in (("done", finishing), ("failed", failing)):
        plant = f"printf '%s' '{forged}' > {path}/{folder}/{job}.json"
        assert users.sh(users.evil, plant).returncode != 0, folder  # the owner's side's folders
        # A member's file there all the same (root puts it, as an older layout let members):
        _ok(users.sh(None, f"{plant} && chown {users.evil.uid}:{users.gid} {path}/{folder}/{job}.json"))
    _ok(users.spoolq(None, "-s", path, "work", "--max-jobs", "2"))
    real = json.loads(_ok(users.spoolq(None, "-s", path, "show", finishing, "--json")))
    assert real["stdout"] == "real\n" and real["state"] == "done"
    again = json.loads(_ok(users.spoolq(None, "-s", path, "show", failing, "--json")))
    assert again["state"] == "failed" and again["exit_code"] == 3
    aside = sorted(n for n in os.listdir(Path(path) / "dead") if not n.startswith("."))
    assert len(aside) == 2 and all(".dup-" in n for n in aside), aside
    reason = json.loads(_ok(users.spoolq(None, "-s", path, "show", aside[0].removesuffix(".json"), "--json")))["error"]
    assert "a file of sqtevil in" in reason and "under the name of a job" in reason
