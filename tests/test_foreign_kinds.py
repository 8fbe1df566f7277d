"""A worker without a handler for a job's kind leaves the job waiting, no
attempt used, for a worker that has one, and says so; status, list and
show tell what the job waits for."""

from __future__ import annotations

import json
import textwrap


def _app(tmp_path) -> str:
    (tmp_path / "mailer.py").write_text(textwrap.dedent("""
        def send_email(payload):
            print("sent to", payload["to"])
            return {"sent": True}

        HANDLERS = {"send_email": send_email}
    """))
    return str(tmp_path)


def test_a_worker_without_the_handler_leaves_the_job_waiting_and_everyone_says_why(fast_spool, tmp_path):
    s = fast_spool
    mail = s.enqueue("--kind", "send_email", "--payload", '{"to": "a@example.com"}')
    other = s.enqueue("--kind", "resize", "--max-attempts", "1")
    cmd = s.enqueue("true")
    for args in ([], ["-j", "2"], ["-q"]):
        proc = s.work(*args)
        assert s.ids("new") == sorted([mail, other]) and s.ids("dead") == [] and s.ids("failed") == []
        for job_id in (mail, other):
            job = s.show(job_id)
            assert (job["state"], job["attempts"], job.get("history")) == ("new", 0, None), job
            assert job["waits_for_handler"] is True
    log = s.work().stderr
    assert "kind=send_email waiting=1 left waiting: this worker has no handler for that kind" in log
    assert "kind=resize waiting=1 left waiting" in log
    assert s.show(cmd)["state"] == "done"

    status = s.status()
    assert status["unhandled"] == {"resize": 1, "send_email": 1}
    new_line = s.run("status").stdout.splitlines()[0]
    assert new_line.split(None, 2)[:2] == ["new", "2"]
    assert new_line.endswith("(2 wait for a worker with a handler for their kind: resize 1, send_email 1)")
    lines = {line.split()[1]: line for line in s.run("list").stdout.splitlines()}
    assert lines[mail].endswith("[waits for a worker with a handler for kind send_email]")
    assert "waits for" not in lines[cmd]
    shown = s.run("show", mail).stdout
    assert "note: waits for a worker with a handler for kind send_email; no worker of this spool has one" in shown

    # a worker with the handler takes it; then nobody says it waits
    proc = s.work("--app", "mailer:HANDLERS", cwd=_app(tmp_path))
    assert s.show(mail)["state"] == "done" and s.show(mail)["result"] == {"sent": True}
    assert s.ids("new") == [other] and "kind=resize waiting=1" in proc.stderr
    assert s.status()["unhandled"] == {"resize": 1}
    assert "waits_for_handler" not in s.show(mail)


def test_a_job_passed_over_and_changed_since_is_looked_at_again(fast_spool):
    """The next worker passes over what the last one left waiting without
    reading it again, unless the file changed (its due time with it)."""
    s = fast_spool
    job = s.enqueue("--kind", "resize")
    s.work()
    s.work()
    assert s.show(job)["attempts"] == 0
    s.drop(f"{job}.json", '{"command": "true"}')  # replaced: a command job now, under the same name
    s.work()
    assert s.show(job)["state"] == "done"


def test_the_python_api_leaves_a_kind_it_has_no_handler_for_waiting(fast_spool):
    s = fast_spool
    job = s.enqueue("--kind", "ping")
    code = f"""
from spoolq import Spool
q = Spool({str(s.path)!r})
print(q.work(handlers={{"pong": print}}, signals=False))
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr
    record = s.show(job)
    assert (record["state"], record["attempts"]) == ("new", 0)
    assert json.loads(s.run("status", "--json").stdout)["unhandled"] == {"ping": 1}
