"""A running job's output in a shared spool, with real users: the group
reads it (as it reads every finished job's output once compacted), through
`spoolq logs` and its files in out/, which only the owner's side writes;
a user outside the group reads nothing of it."""

from __future__ import annotations

import os
import select
import stat
import subprocess

from conftest import wait_for, watching


def _ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_members_follow_a_running_jobs_output_others_cannot_and_nobody_but_the_owner_writes_it(users):
    spool = users.shared_spool()
    gate = users.open_folder("gates") / "gate"
    script = f'echo "first line"; while [ ! -e {gate} ]; do sleep 0.05; done; echo "second line"'
    with watching(users, spool):
        job = _ok(users.spoolq(users.web, "-s", str(spool), "enqueue", "--max-attempts", "1", script)).strip()
        follower = users.popen(users.evil, "-s", str(spool), "logs", "-f", job, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        ready, _, _ = select.select([follower.stdout], [], [], 60)
        assert ready and follower.stdout.readline() == b"first line\n"  # another member's job, while it runs
        wait_for(lambda: _ok(users.spoolq(users.web, "-s", str(spool), "logs", job)) == "first line\n",
                 what="the member's own look")
        out = spool / "out"
        st = os.stat(out)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (users.owner.uid, users.gid, 0o2750)
        for name in os.listdir(out):
            st = os.stat(out / name)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (users.owner.uid, 0o640), name
        run = users.sh(users.web, f'echo forged >> {out}/{job}.stdout')
        assert run.returncode != 0  # members read it, never write it
        run = users.spoolq(users.out, "-s", str(spool), "logs", job)
        assert run.returncode != 0 and run.stdout == "" and run.stderr.count("\n") == 1
        run = users.sh(users.out, f'cat {out}/{job}.stdout')
        assert run.returncode != 0 and run.stdout == ""
        gate.touch()
        rest, _ = follower.communicate(timeout=60)
        assert rest == b"second line\n"
    assert os.listdir(out) == []
