"""A spool on a filesystem that other machines mount: workers and recovery
refuse one whose locks stay on the client that took them (a real sshfs
mount), unless told that every worker runs on this machine; what decides
it is the mount's type and options, as /proc/self/mountinfo gives them."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sshfs

from spoolq.dirspool import mounts

SPOOLQ = [sys.executable, "-m", "spoolq"]


def spoolq(spool: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(SPOOLQ + ["-s", str(spool), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def over_sshfs(tmp_path):
    sshfs.require()
    with sshfs.mounted(tmp_path) as (served, mount):
        yield served, mount


def test_locks_taken_through_sshfs_are_not_seen_by_the_machine_that_serves_it(over_sshfs):
    """Why such a spool is refused: a lock held on the served folder does
    not stop a lock on the same file through the mount."""
    served, mount = over_sshfs
    (served / "f").write_text("x")
    with open(served / "f") as held, open(mount / "f") as other:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no BlockingIOError: the lock is not shared


def test_work_and_sweep_refuse_a_spool_on_sshfs_and_run_when_allowed(over_sshfs):
    _, mount = over_sshfs
    spool = mount / "spool"
    assert spoolq(spool, "init").returncode == 0
    assert spoolq(spool, "enqueue", "true").returncode == 0  # producers are not refused
    for command in (["work"], ["sweep"]):
        done = spoolq(spool, *command)
        assert done.returncode == 1, done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert str(spool) in lines[0] and "fuse.sshfs" in lines[0]
        assert "PostgreSQL" in lines[0] and "--allow-local-locks" in lines[0]
    assert "new " in spoolq(spool, "list").stdout  # nothing ran
    done = spoolq(spool, "work", "--allow-local-locks")
    assert done.returncode == 0, done.stderr
    assert json.loads(spoolq(spool, "status", "--json").stdout)["done"] == 1
    assert spoolq(spool, "sweep", "--allow-local-locks").returncode == 0


def test_a_spool_on_a_local_disk_is_not_refused(tmp_path):
    spool = tmp_path / "spool"
    assert spoolq(spool, "init").returncode == 0
    assert spoolq(spool, "enqueue", "true").returncode == 0
    done = spoolq(spool, "work")
    assert done.returncode == 0 and "network" not in done.stderr, done.stderr


MOUNTINFO = r"""22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
30 22 0:40 / /mnt/nfs-nolock rw,relatime - nfs srv:/e rw,vers=3,nolock,addr=10.0.0.1
31 22 0:41 / /mnt/nfs-local rw,relatime - nfs4 srv:/e rw,vers=4.2,local_lock=flock
32 22 0:42 / /mnt/nfs rw,relatime - nfs4 srv:/e rw,vers=4.2,local_lock=none
33 22 0:43 / /mnt/smb rw - cifs //srv/share rw,nobrl
34 22 0:44 / /mnt/gluster rw - fuse.glusterfs srv:/vol rw,user_id=0
35 22 0:45 / /mnt/sshfs rw - fuse.sshfs u@srv:/x rw,user_id=0
36 35 0:46 / /mnt/sshfs/local\040disk rw - ext4 /dev/sdb1 rw
"""


@pytest.mark.parametrize("path, refused, caution", [
    ("/srv/spool", False, False),
    ("/mnt/nfs-nolock/spool", True, False),
    ("/mnt/nfs-local/spool", True, False),
    ("/mnt/nfs/spool", False, True),
    ("/mnt/smb/spool", True, False),
    ("/mnt/gluster/spool", False, True),
    ("/mnt/sshfs/spool", True, False),
    ("/mnt/sshfs/local disk/spool", False, False),  # the innermost mount decides
])
def test_which_mounts_are_refused_and_which_get_a_caution(tmp_path, monkeypatch, path, refused, caution):
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    monkeypatch.setattr(mounts, "MOUNTINFO", str(info))
    monkeypatch.setattr(os.path, "realpath", lambda p: p)
    if refused:
        with pytest.raises(ValueError) as e:
            mounts.require_shared_locks(path, forced=False)
        assert path in str(e.value) and "\n" not in str(e.value)
        assert mounts.require_shared_locks(path, forced=True) is None
    else:
        said = mounts.require_shared_locks(path, forced=False)
        assert (said is not None) == caution
