"""``Spool.work``: the one way to run workers, threads or processes, for
the Python API and ``spoolq work`` alike."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import json, sys
from spoolq import Spool
q = Spool(sys.argv[1])
ran = q.work(jobs=int(sys.argv[2]), processes=sys.argv[3] == "processes", log=None)
print(json.dumps({"ran": ran, "int": isinstance(ran, int), "clean": ran.clean}))
"""


def _work(spool, jobs: int, how: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(spool.path), str(jobs), how],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_work_with_processes_runs_every_job_and_counts_them(fast_spool):
    s = fast_spool
    ids = [s.enqueue("true") for _ in range(6)]
    assert _work(s, 3, "processes") == {"ran": 6, "int": True, "clean": True}
    assert sorted(s.ids("done")) == sorted(ids)


def test_work_with_threads_returns_the_jobs_run(fast_spool):
    s = fast_spool
    for _ in range(3):
        s.enqueue("true")
    assert _work(s, 2, "threads") == {"ran": 3, "int": True, "clean": True}
