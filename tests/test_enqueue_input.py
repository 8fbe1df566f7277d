"""Bad input caught at enqueue, not five retries later; commands that
say what they mean."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

from conftest import ROOT, SPOOLQ

DROP = str(ROOT / "contrib" / "spoolq-drop")


def test_a_working_directory_that_is_not_there_is_refused_or_dead_at_once(fast_spool, tmp_path):
    s = fast_spool
    afile = tmp_path / "a-file"
    afile.write_text("")
    for args, says in ((["--cwd", "/no/such/dir", "true"], "cwd /no/such/dir does not exist"),
                       (["--cwd", str(afile), "true"], f"cwd {afile} is not a directory"),
                       (["--json", '{"command": "true", "cwd": "/no/such/dir"}'], "cwd /no/such/dir does not exist"),
                       (["--jsonl", "-"], "job 1: cwd /no/such/dir does not exist")):
        proc = s.run("enqueue", *args, input='{"argv": ["true"], "cwd": "/no/such/dir"}\n', check=False)
        assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"spoolq: {says}\n", ""), args
    gone = tmp_path / "gone"
    gone.mkdir()
    s.enqueue("--id", "enqueued", "--cwd", str(gone), "true")
    s.drop("dropped.json", json.dumps({"command": "true", "cwd": str(tmp_path / "never")}))
    gone.rmdir()
    s.work()
    for job_id, where in (("enqueued", gone), ("dropped", tmp_path / "never")):
        job = s.show(job_id)
        assert (job["state"], job["attempts"]) == ("dead", 1), job  # at once: retrying brings no directory back
        assert job["error"] == f"cannot start: its working directory {where} does not exist"
