"""Running jobs, on both backends: a drain, outcomes and what a run
leaves in its record, -j N, a watching worker, retries with backoff,
dead jobs, timeouts and handler jobs, through ``spoolq work`` in a
subprocess and ``Spool.work`` in process."""

from __future__ import annotations

import time

import pytest

from conftest import wait_for
from spoolq import Permanent
from spoolq.record import parse_time

pytest_plugins = ["pgserver"]


def test_a_drain_runs_every_due_job_once_and_exits_0(sq, tmp_path):
    log = tmp_path / "ran"
    ids = [sq.enqueue(f'echo "$SPOOLQ_JOB_ID $SPOOLQ_ATTEMPT" >> {log}') for _ in range(4)]
    proc = sq.run("work")
    assert proc.returncode == 0
    assert sorted(log.read_text().split("\n")[:-1]) == sorted(f"{i} 1" for i in ids)
    assert all(sq.show(i)["state"] == "done" for i in ids)
    assert "outcome=succeeded" in proc.stderr
    assert sq.run("work").returncode == 0  # nothing due: still 0
    assert len(log.read_text().splitlines()) == 4


def test_jobs_see_the_spool_and_their_attempt(sq, tmp_path):
    out = tmp_path / "env"
    sq.enqueue(f'printf "%s|%s|%s" "$SPOOLQ_SPOOL" "$SPOOLQ_ATTEMPT" "$SPOOLQ_WORKER" > {out}')
    sq.work()
    spool, attempt, worker = out.read_text().split("|")
    assert attempt == "1" and worker
    # A PostgreSQL spool's location is its URL, never with a password.
    assert spool == (sq.location if sq.kind == "dir" else sq.location.split("password=")[0])


def test_j_n_runs_jobs_at_once(sq, tmp_path):
    # Each job waits for the other to have started: only two at once finish.
    a, b = tmp_path / "a", tmp_path / "b"
    wait = "i=0; while [ ! -e {other} ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; [ -e {other} ]"
    sq.enqueue(f"touch {a}; " + wait.format(other=b))
    sq.enqueue(f"touch {b}; " + wait.format(other=a))
    sq.run("work", "-j", "2", timeout=120)
    assert [j["outcome"] for j in sq.listing("--state", "done")] == ["succeeded", "succeeded"]


def test_a_failing_job_is_retried_after_a_backoff_then_dead_with_the_reason(sq):
    sq.run("config", "set", "backoff_initial", "1h")
    job_id = sq.enqueue("--max-attempts", "2", "echo bad >&2; exit 3")
    started = time.time()
    proc = sq.run("work")
    assert "outcome=failed" in proc.stderr
    job = sq.show(job_id)
    assert (job["state"], job["attempts"], job["exit_code"]) == ("failed", 1, 3)
    assert job["error"] == "exit status 3" and job["stderr"] == "bad\n"
    due = parse_time(job["due_at"]) - started
    assert 3600 * 0.9 - 5 <= due <= 3600 * 1.1 + 60  # the backoff, with its jitter
    assert sq.status()["failed"] == 1
    assert sq.api().retry(job_id) is False  # only a dead job is retried
    _make_due(sq, job_id)  # the second run, the last
    sq.run("work")
    job = sq.show(job_id)
    assert (job["state"], job["attempts"]) == ("dead", 2)
    assert [run["exit_code"] for run in job["history"]] == [3, 3]
    assert job["error"] == "exit status 3"
    assert [j["id"] for j in sq.listing("--state", "dead")] == [job_id]


def _make_due(sq, job_id: str) -> None:
    """Make a failed job due now, the way an operator does: cancel is no
    use, so through each backend's documented hand move."""
    if sq.kind == "dir":
        import os

        os.utime(os.path.join(sq.location, "failed", f"{job_id}.json"), (0, 0))
    else:
        import psycopg

        with psycopg.connect(sq.location, autocommit=True) as conn:
            conn.execute("UPDATE spoolq.jobs SET at = now() - interval '1 second' WHERE id = %s", (job_id,))


def test_exit_100_is_dead_at_once(sq):
    job_id = sq.enqueue("exit 100")
    sq.work()
    job = sq.show(job_id)
    assert (job["state"], job["attempts"], job["exit_code"]) == ("dead", 1, 100)


def test_a_run_over_its_timeout_is_killed_and_fails(sq, tmp_path):
    sq.run("config", "set", "timeout_grace", "1")
    job_id = sq.enqueue("--timeout", "1", "--max-attempts", "1", "sleep 60")
    started = time.monotonic()
    sq.run("work", timeout=60)
    assert time.monotonic() - started < 30
    job = sq.show(job_id)
    assert job["state"] == "dead" and "timed out" in job["error"]


def test_handler_jobs_run_in_process_with_result_permanent_and_exception(sq):
    q = sq.api()
    ok = q.enqueue(kind="add", payload=[1, 2])
    perm = q.enqueue(kind="refuse", payload=None)
    boom = q.enqueue(kind="boom", payload=None, max_attempts=1)

    def refuse(payload):
        raise Permanent("no such address")

    def boom_(payload):
        raise ValueError("it broke")

    ran = q.work(handlers={"add": lambda p: print("adding") or sum(p), "refuse": refuse, "boom": boom_})
    assert ran == 3
    done = q.get(ok)
    assert (done["state"], done["result"], done["stdout"]) == ("done", 3, "adding\n")
    assert q.get(perm)["state"] == "dead" and "no such address" in q.get(perm)["error"]
    failed = q.get(boom)
    assert failed["state"] == "dead" and "it broke" in failed["error"] and "ValueError" in failed["stderr"]


def test_a_handler_job_with_no_handler_waits_without_using_an_attempt(sq):
    job_id = sq.enqueue("--kind", "send_email", "--payload", "{}")
    other = sq.enqueue("true")
    sq.work()
    job = sq.show(job_id)
    assert job["state"] == "new" and job.get("attempts", 0) == 0 and not job.get("history")
    assert sq.show(other)["state"] == "done"
    assert sq.status()["dead"] == 0
    assert "send_email" in sq.run("show", job_id).stdout
    # A worker with the handler runs it.
    assert sq.api().work(handlers={"send_email": lambda p: "sent"}) == 1
    assert sq.show(job_id)["result"] == "sent"


def test_a_watching_worker_runs_a_job_enqueued_while_it_waits_promptly(sq, tmp_path):
    worker = sq.popen("work", "--watch", stderr=open(tmp_path / "log", "w"))
    wait_for(lambda: sq.status()["workers"], 60, what="the worker to register")
    time.sleep(0.2)  # into its wait
    marker = tmp_path / "ran"
    started = time.monotonic()
    sq.enqueue(f"touch {marker}")
    wait_for(marker.exists, 30, interval=0.01, what="the job to run")
    assert time.monotonic() - started < 5  # prompt (under 0.1 s unloaded); well within the rescan interval
    worker.terminate()
    assert worker.wait(timeout=60) == 0


@pytest.mark.parametrize("jobs", [1, 2])
def test_work_limits_stop_after_max_jobs(sq, jobs):
    for _ in range(5):
        sq.enqueue("true")
    sq.run("work", "-j", str(jobs), "--max-jobs", "2")
    status = sq.status()
    assert status["done"] == 2 and status["new"] == 3
