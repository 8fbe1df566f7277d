"""Enqueueing, on both backends: the three kinds of job, ids (given,
duplicate, invalid), due times, and the fields a producer sets, through
the CLI and through ``Spool``."""

from __future__ import annotations

import json
import time

import pytest

from spoolq import DuplicateId, InvalidJob

pytest_plugins = ["pgserver"]


def test_a_shell_command_an_argv_job_and_a_handler_job_each_get_an_id_and_wait(sq, tmp_path):
    command = sq.enqueue("echo hello")
    argv = sq.enqueue("printf", "%s", "two words")
    handler = sq.enqueue("--kind", "send_email", "--payload", '{"to": "a@example.com"}')
    assert len({command, argv, handler}) == 3
    shown = {job_id: sq.show(job_id) for job_id in (command, argv, handler)}
    assert shown[command]["command"] == "echo hello"
    assert shown[argv]["argv"] == ["printf", "%s", "two words"]
    assert shown[handler]["kind"] == "send_email" and shown[handler]["payload"] == {"to": "a@example.com"}
    for job_id, job in shown.items():
        assert job["id"] == job_id and job["state"] == "new"
        assert "created_at" in job and job.get("attempts", 0) == 0
    # A command or argv job runs where it was enqueued; a handler job has no cwd.
    assert shown[command]["cwd"] == shown[argv]["cwd"] and "cwd" not in shown[handler]
    assert sq.status()["new"] == 3


def test_the_python_api_enqueues_the_same_jobs(sq):
    q = sq.api()
    a = q.enqueue(command="true", max_attempts=3, timeout=30, env={"LANG": "C"})
    b = q.enqueue(argv=["true"], id="argv-1")
    c = q.enqueue(kind="ping", payload=[1, 2])
    assert b == "argv-1"
    job = q.get(a)
    assert (job["state"], job["max_attempts"], job["timeout"], job["env"]) == ("new", 3, 30, {"LANG": "C"})
    assert q.get(c)["payload"] == [1, 2]
    ids = q.enqueue_many([{"command": "true"}, {"kind": "ping", "id": "many-2"}])
    assert ids[1] == "many-2"
    assert sorted(j["id"] for j in q.list(state="new")) == sorted([a, b, c, *ids])
    assert q.get("no-such-job") is None


def test_a_given_id_is_used_once_and_a_duplicate_is_refused(sq):
    assert sq.enqueue("--id", "report-1", "true") == "report-1"
    proc = sq.fail("enqueue", "--id", "report-1", "false")
    assert proc.returncode == 1 and "report-1" in proc.stderr and "already" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert sq.show("report-1")["command"] == "true"  # the first one kept
    with pytest.raises(DuplicateId):
        sq.api().enqueue(command="false", id="report-1")
    # The id stays taken once its job has run.
    sq.work()
    assert sq.fail("enqueue", "--id", "report-1", "true").returncode == 1


def test_an_invalid_id_or_job_is_refused_with_one_line(sq):
    proc = sq.fail("enqueue", "--id", "../x", "true")
    assert proc.returncode == 2 and "../x" in proc.stderr and "Traceback" not in proc.stderr
    proc = sq.fail("enqueue", "--json", '{"cmd": "true"}')
    assert proc.returncode == 2 and "cmd" in proc.stderr
    with pytest.raises(InvalidJob):
        sq.api().enqueue(command="true", max_attempts=0)
    assert sq.status()["new"] == 0


def test_a_delayed_job_waits_until_it_is_due(sq):
    later = sq.enqueue("--in", "1h", "true")
    at = sq.enqueue("--at", str(int(time.time()) + 7200), "true")
    now = sq.enqueue("true")
    sq.work()
    assert sq.show(now)["state"] == "done"
    for job_id, ahead in ((later, 3600), (at, 7200)):
        job = sq.show(job_id)
        assert job["state"] == "new" and job.get("attempts", 0) == 0
        due = job["due_at"]
        from spoolq.record import parse_time

        assert abs(parse_time(due) - (time.time() + ahead)) < 120
    assert sq.status()["new"] == 2


def test_jsonl_enqueues_every_line_or_none(sq, tmp_path):
    good = "\n".join(json.dumps({"command": f"echo {i}"}) for i in range(5))
    ids = sq.run("enqueue", "--jsonl", "-", input=good).stdout.split()
    assert len(ids) == 5 and sq.status()["new"] == 5
    bad = good + "\n" + json.dumps({"command": 5})
    proc = sq.fail("enqueue", "--jsonl", "-", input=bad)
    assert proc.returncode == 2 and sq.status()["new"] == 5
