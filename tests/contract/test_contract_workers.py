"""Workers as processes, on both backends: a worker killed with SIGKILL in
the middle of a job has that job run again once, its interrupted run
counted; two workers draining the same spool run each job exactly once."""

from __future__ import annotations

import json
import os
import signal
import time

from conftest import alive, wait_for

pytest_plugins = ["pgserver"]


def test_a_job_whose_worker_was_killed_runs_again_once_with_the_run_counted(sq, tmp_path):
    runs, pids = tmp_path / "runs", tmp_path / "pids"
    # The first run hangs; the next one finishes.
    job_id = sq.enqueue(f'echo "$SPOOLQ_ATTEMPT" >> {runs}; echo $$ >> {pids}; '
                        f'[ "$SPOOLQ_ATTEMPT" -gt 1 ] || sleep 600')
    worker = sq.popen("work", stderr=open(tmp_path / "log", "w"))
    wait_for(runs.exists, 60, what="the job to start")
    assert sq.show(job_id)["state"] == "cur"
    worker.kill()
    worker.wait(timeout=60)
    wait_for(lambda: sq.status()["abandoned"] == 1, 60, what="the job to be seen abandoned")
    assert sq.show(job_id).get("abandoned") is True
    sq.run("sweep")
    job = sq.show(job_id)
    assert job["state"] == "failed" and job["attempts"] == 1 and job["history"][0].get("error")
    # Recovery took the dead run's processes down with it.
    wait_for(lambda: not alive(int(pids.read_text().split()[0])), 30, what="the first run to be killed")
    sq.run("work")
    job = sq.show(job_id)
    assert (job["state"], job["attempts"]) == ("done", 2)
    assert runs.read_text().split() == ["1", "2"]
    sq.run("sweep")
    assert runs.read_text().split() == ["1", "2"]


def test_two_workers_draining_together_run_each_job_exactly_once(sq, tmp_path):
    log = tmp_path / "ran"
    n = 300
    lines = "\n".join(json.dumps({"command": f'echo "$SPOOLQ_JOB_ID" >> {log}'}) for _ in range(n))
    ids = sq.run("enqueue", "--jsonl", "-", input=lines).stdout.split()
    assert len(ids) == n
    workers = [sq.popen("work", "-q", stderr=open(tmp_path / f"log{i}", "w")) for i in range(2)]
    for worker in workers:
        assert worker.wait(timeout=300) == 0
    ran = log.read_text().split()
    assert sorted(ran) == sorted(ids)  # every job, none twice
    status = sq.status()
    assert status["done"] == n and status["new"] == status["cur"] == status["failed"] == status["dead"] == 0
    # Both took part (each registered, each claimed some), unless one was far slower to start.
    histories = {sq.api().get(ids[i])["history"][0]["worker"] for i in range(0, n, 7)}
    assert 1 <= len(histories) <= 2
