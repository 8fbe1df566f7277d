"""`spoolq top` on a spool directory with many waiting jobs and hostile
files among them: a look counts the waiting jobs without reading them, and
what it does read (the latest failures) cannot break it."""

from __future__ import annotations

import json
import os
import re
import time

WAITING = 3000


def _atime_kept_by_reads(folder) -> bool:
    """Whether this filesystem records a read in the file's access time
    (relatime does for a file read since its last change)."""
    probe = folder / "probe"
    probe.write_text("x")
    st = os.stat(probe)
    os.utime(probe, ns=(st.st_mtime_ns - 10**10, st.st_mtime_ns))
    probe.read_text()
    return os.stat(probe).st_atime_ns != st.st_mtime_ns - 10**10


def test_a_look_reads_no_waiting_job_and_hostile_files_do_not_break_it(spool, tmp_path):
    spool.run("config", "set", "fsync", "false")
    jobs = "".join(json.dumps({"command": f"echo {i}"}) + "\n" for i in range(WAITING))
    spool.run("enqueue", "--jsonl", "-", input=jobs)
    new = spool.path / "new"
    os.mkfifo(new / "fifo.json")  # read, it would block for ever
    os.symlink("/etc/shadow", new / "link.json")
    (new / "garbage.json").write_bytes(b"\xff{not json")
    os.mkfifo(spool.path / "dead" / "fifo.json")
    (spool.path / "dead" / "garbage.json").write_bytes(b"\x00" * 100)
    (spool.path / "failed" / "huge.json").write_bytes(b"[" * 2_000_000)
    os.symlink("/etc/passwd", spool.path / "failed" / "link.json")
    past = {}
    for entry in os.scandir(new):
        if entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            os.utime(entry.path, ns=(st.st_mtime_ns - 10**10, st.st_mtime_ns), follow_symlinks=False)
            past[entry.name] = st.st_mtime_ns - 10**10
    began = time.monotonic()
    run = spool.run("top", "-n", "2", "--interval", "0.1", check=False, timeout=120)
    took = time.monotonic() - began
    assert run.returncode == 0 and run.stderr == "", run.stderr
    blocks = run.stdout.split("\n\n")
    assert len(blocks) == 2
    for block in blocks:
        assert re.search(rf"^jobs\s+new {WAITING + 3}\s+running 0\s+failed 2\s+dead 2\b", block, re.M), block
        assert re.search(r"^failures\s+4 latest", block, re.M), block
    assert took < 60
    if _atime_kept_by_reads(tmp_path):
        read = [name for name, atime in past.items() if os.stat(new / name).st_atime_ns != atime]
        assert read == [], f"top read {len(read)} waiting jobs' files, such as {read[:3]}"

