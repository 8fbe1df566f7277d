"""The Python API (SPEC section 8) and handler jobs; the same spool from the
CLI and from Python in two processes."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

import spoolq
from spoolq import DuplicateId, InvalidJob, Permanent, Spool
from spoolq.testing import JobFailed, run_jobs, temporary_spool

from conftest import SPOOLQ, SpoolFixture


@pytest.fixture
def q(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.init()
    spool.config_set("fsync", False)
    return Spool(spool.path)


def test_section_8_round_trip(q, tmp_path):
    out = tmp_path / "out"
    a = q.enqueue(command=f"echo report >> {out}")
    b = q.enqueue(argv=["sh", "-c", f"echo argv >> {out}"], timeout=30)
    c = q.enqueue(kind="send_email", payload={"to": "a@example.com"}, run_at=time.time() + 3600, max_attempts=3)
    ids = q.enqueue_many([{"command": "true"}, {"kind": "ping"}])
    assert len(ids) == 2 and len(set([a, b, c, *ids])) == 5
    assert q.get(a)["state"] == "new" and q.get(a)["command"].startswith("echo report")
    assert q.get(c)["max_attempts"] == 3 and q.get(c)["payload"] == {"to": "a@example.com"}
    assert q.get("no-such-job") is None and q.get("../x") is None
    assert q.status()["new"] == 5
    sent = []
    ran = q.work(handlers={"send_email": sent.append, "ping": lambda p: "pong"})
    assert ran == 4  # the delayed job is not due
    assert out.read_text() == "report\nargv\n"
    assert q.get(ids[1])["result"] == "pong" and q.get(ids[1])["state"] == "done"
    assert q.cancel(c) is True and q.get(c)["outcome"] == "cancelled"
    assert q.cancel(c) is False  # not waiting any more
    assert q.cancel("unknown") is False
    d = q.enqueue(command="exit 3", max_attempts=1)
    q.work()
    assert q.get(d)["state"] == "dead"
    assert q.retry(d) is True and q.get(d)["state"] == "new" and q.get(d)["attempts"] == 0
    assert q.retry(d) is False
    st = q.status()
    assert {k: st[k] for k in ("new", "cur", "failed", "dead", "done")} == {"new": 1, "cur": 0, "failed": 0, "dead": 0, "done": 5}
    assert sent == []  # send_email was never due


def test_spool_defaults_to_env_then_cwd(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOOLQ_DIR", str(tmp_path / "from-env"))
    assert Spool().path == str(tmp_path / "from-env")
    monkeypatch.delenv("SPOOLQ_DIR")
    monkeypatch.chdir(tmp_path)
    assert Spool().path == str(tmp_path / "spool")


def test_enqueue_errors(q):
    with pytest.raises(InvalidJob, match="exactly one of command, argv or kind"):
        q.enqueue()
    with pytest.raises(InvalidJob, match="max_attempts"):
        q.enqueue(command="true", max_attempts=0)
    with pytest.raises(InvalidJob, match="run_at"):
        q.enqueue(command="true", run_at="tomorrow")
    q.enqueue(command="true", id="unique")
    with pytest.raises(DuplicateId):
        q.enqueue(command="true", id="unique")
    with pytest.raises(InvalidJob, match="job 2"):
        q.enqueue_many([{"command": "true"}, {"command": 5}])
    with pytest.raises(InvalidJob, match="env name 1 must be a string"):  # was a bare TypeError (audit)
        q.enqueue(command="true", env={1: "x"})
    assert q.status()["new"] == 1


def test_results_exceptions_permanent_and_unknown_kinds(q):
    class Boom(Exception):
        pass

    def explode(payload):
        raise Boom(f"cannot handle {payload['n']}")

    def refuse(payload):
        raise Permanent("bad address")

    q.config_set("max_attempts", 2)
    q.config_set("backoff_initial", 0)
    ok = q.enqueue(kind="add", payload={"a": 2, "b": 3})
    boom = q.enqueue(kind="explode", payload={"n": 7})
    perm = q.enqueue(kind="refuse")
    unknown = q.enqueue(kind="nobody-handles-this")
    weird = q.enqueue(kind="weird")
    handlers = {"add": lambda p: {"sum": p["a"] + p["b"]}, "explode": explode, "refuse": refuse, "weird": lambda p: {1, 2}}
    q.work(handlers=handlers)
    assert q.get(ok)["result"] == {"sum": 5} and q.get(ok)["state"] == "done"
    b = q.get(boom)
    assert b["state"] == "dead" and b["attempts"] == 2 and b["error"] == "Boom: cannot handle 7"
    assert "Traceback" in b["stderr"] and "raise Boom" in b["stderr"]
    p = q.get(perm)
    assert p["state"] == "dead" and p["attempts"] == 1 and p["error"] == "Permanent: bad address"
    u = q.get(unknown)
    assert u["state"] == "new" and u["attempts"] == 0 and u["waits_for_handler"] is True  # no attempt used
    w = q.get(weird)
    assert w["state"] == "dead" and "not JSON" in w["error"]
    # A handler deployed later takes the unknown kind.
    q.work(handlers={"nobody-handles-this": lambda p: "finally"})
    assert q.get(unknown)["result"] == "finally"


def test_handlers_running_side_by_side_in_threads_each_keep_what_they_print(q, capsys):
    """Spool.work(jobs=2) runs handlers in threads of the caller's process:
    each job gets what its own handler printed, even while both print at
    once, and the caller's output gets none of it."""
    import sys
    import threading

    both_running = threading.Barrier(2, timeout=60)

    def talk(name):
        print(f"{name} before")
        both_running.wait()  # the other handler is running (and printing) too
        print(f"{name} after")
        print(f"{name} warns", file=sys.stderr)

    a = q.enqueue(kind="talk", payload="a")
    b = q.enqueue(kind="talk", payload="b")
    stdout_before = sys.stdout
    q.work(handlers={"talk": talk}, jobs=2)
    for job_id, name in ((a, "a"), (b, "b")):
        job = q.get(job_id)
        assert job["state"] == "done", job
        assert job["stdout"] == f"{name} before\n{name} after\n" and job["stderr"] == f"{name} warns\n", job
    assert sys.stdout is stdout_before
    printed = capsys.readouterr()
    assert "before" not in printed.out and "warns" not in printed.err


def test_work_logs_to_a_logging_logger_with_levels(q):
    """Spool.work(log=a logging.Logger): the worker's lines are that
    logger's records, with levels: ERROR for a job gone dead, WARNING for a
    failed run, INFO for a success."""
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("test_work_logs_to_a_logging_logger")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    logger.propagate = False
    q.config_set("backoff_initial", 0)
    ok = q.enqueue(command="true")
    bad = q.enqueue(command="exit 3", max_attempts=2)
    q.work(log=logger)
    levels = {(r.levelno, m) for r in records for m in (r.getMessage(),)}
    assert any(level == logging.INFO and f"job={ok} outcome=succeeded" in m for level, m in levels), levels
    assert any(level == logging.WARNING and f"job={bad} outcome=failed" in m for level, m in levels), levels
    assert any(level == logging.ERROR and f"job={bad} outcome=dead" in m for level, m in levels), levels


def test_work_logs_through_the_spoolq_logger_by_default(q, caplog):
    import logging

    q.enqueue(command="exit 3", max_attempts=1, id="doomed")
    with caplog.at_level(logging.INFO, logger="spoolq"):
        q.work()
    assert [(r.name, r.levelno) for r in caplog.records if "job=doomed outcome=dead" in r.getMessage()] == [
        ("spoolq", logging.ERROR)]


def test_a_handler_that_loops_forever_is_stopped_by_its_timeout(q):
    def spin(payload):
        while True:
            pass

    q.config_set("timeout_grace", 0.5)
    job = q.enqueue(kind="spin", timeout=1, max_attempts=1)
    fine = q.enqueue(kind="fine", timeout=5, payload=[1, 2, 3])
    started = time.monotonic()
    q.work(handlers={"spin": spin, "fine": lambda p: sum(p)})
    assert time.monotonic() - started < 20
    j = q.get(job)
    assert j["state"] == "dead" and j["error"] == "timed out after 1s"
    assert q.get(fine)["result"] == 6  # a forked handler's result comes back


def test_a_forked_handler_that_crashes_is_a_failure(q):
    q.enqueue(kind="die", timeout=10, max_attempts=1, id="dies")
    q.work(handlers={"die": lambda p: os._exit(3)})
    job = q.get("dies")
    assert job["state"] == "dead" and "handler process died" in job["error"]


def test_handlers_with_a_timeout_run_side_by_side_each_in_a_process_of_its_own(q, tmp_path):
    """Work with three threads runs three handler jobs with a timeout at
    once, each in its own process, with the handlers it was given (a
    closure over this test's state): each waits until all three have
    started, which they could not if they ran one after another."""
    met = tmp_path / "met"
    met.mkdir()
    seen_by_closure = {"word": "closure"}

    def meet(payload):
        (met / str(os.getpid())).touch()
        deadline = time.monotonic() + 60
        while len(os.listdir(met)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        return [seen_by_closure["word"], len(os.listdir(met)), os.getpid()]

    ids = [q.enqueue(kind="meet", timeout=120, max_attempts=1) for _ in range(3)]
    assert q.work(handlers={"meet": meet}, jobs=3) == 3
    results = [q.get(job_id)["result"] for job_id in ids]
    assert [r[:2] for r in results] == [["closure", 3]] * 3, results
    assert len({r[2] for r in results} | {os.getpid()}) == 4


def test_a_handler_that_calls_sys_exit_fails_its_job_not_the_worker(tmp_path):
    """Regression (audit): SystemExit from an in-process handler ended the
    worker silently (exit 3), leaving the job in cur/ and the rest unrun."""
    s = SpoolFixture(tmp_path / "spool")
    s.run("init")
    (tmp_path / "exitapp.py").write_text("import sys\nHANDLERS = {'leave': lambda p: sys.exit(3)}\n")
    inline = s.enqueue("--kind", "leave", "--max-attempts", "1")
    forked = s.enqueue("--kind", "leave", "--max-attempts", "1", "--timeout", "30")
    after = s.enqueue("echo still here")
    proc = s.run("work", "--app", "exitapp:HANDLERS", cwd=str(tmp_path), check=False)
    assert proc.returncode == 0, proc.stderr
    for job_id in (inline, forked):
        job = s.show(job_id)
        assert job["state"] == "dead" and job["error"] == "the handler called sys.exit(3)", job
    assert s.show(after)["stdout"] == "still here\n" and s.names("cur") == []


def test_cli_worker_runs_handler_command_and_argv_jobs_from_one_spool(tmp_path):
    s = SpoolFixture(tmp_path / "spool")
    s.run("init")
    app = tmp_path / "myapp.py"
    app.write_text("HANDLERS = {'double': lambda p: p * 2}\n")
    h = s.enqueue("--kind", "double", "--payload", "21")
    c = s.enqueue("echo command")
    a = s.enqueue("--argv", "--", "echo", "argv")
    t = s.enqueue("--kind", "double", "--payload", "[1]", "--timeout", "10")
    s.run("work", "--app", "myapp:HANDLERS", cwd=str(tmp_path))
    assert s.show(h)["result"] == 42
    assert s.show(c)["stdout"] == "command\n" and s.show(a)["stdout"] == "argv\n"
    assert s.show(t)["result"] == [1, 1]


def test_app_loading_errors_are_one_line(tmp_path):
    s = SpoolFixture(tmp_path / "spool")
    s.run("init")
    (tmp_path / "notmapping.py").write_text("HANDLERS = 5\n")
    (tmp_path / "badhandler.py").write_text("HANDLERS = {'x': 5}\n")
    for spec, message in [("nomodule:X", "cannot import nomodule"), ("notmapping:HANDLERS", "must be a mapping"),
                          ("notmapping:MISSING", "has no attribute"), ("badhandler:HANDLERS", "not callable"),
                          ("nocolon", "cannot import nocolon"), ("nocolon:", "MODULE:ATTR")]:
        proc = s.run("work", "--app", spec, cwd=str(tmp_path), check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, spec


def test_cli_and_api_on_one_spool_from_two_processes(tmp_path):
    """Python enqueues in one process, the CLI worker runs the jobs in another,
    and the Python side sees the results."""
    path = tmp_path / "shared"
    q = Spool(path)
    ids = [q.enqueue(kind="square", payload=i) for i in range(20)] + [q.enqueue(command="echo from-api")]
    (tmp_path / "sqapp.py").write_text("HANDLERS = {'square': lambda n: n * n}\n")
    worker = subprocess.Popen(SPOOLQ + ["-s", str(path), "work", "--watch", "--app", "sqapp:HANDLERS", "-q"],
                              cwd=str(tmp_path))
    try:
        more = [q.enqueue(kind="square", payload=i) for i in range(20, 30)]  # while it runs
        from conftest import wait_for

        wait_for(lambda: all((q.get(i) or {}).get("state") == "done" for i in ids + more), what="the CLI worker to run them")
    finally:
        worker.terminate()
        worker.wait(30)
    assert [q.get(i)["result"] for i in ids[:20] + more] == [i * i for i in range(30)]
    assert q.get(ids[20])["stdout"] == "from-api\n"
    # And the other way round: the CLI enqueues, Python works.
    out = subprocess.run(SPOOLQ + ["-s", str(path), "enqueue", "--kind", "square", "--payload", "9"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert q.work(handlers={"square": lambda n: n * n}) == 1
    assert q.get(out)["result"] == 81


def test_a_forked_process_writes_under_tmp_names_of_its_own(q):
    """A program that forks after using a spool (a pre-fork web server, a
    multiprocessing pool) goes on from both sides: the child names its
    tmp/ files after itself, not after the parent it was copied from (its
    pid and a random tag of its own), and both sides' enqueues all land."""
    q.enqueue(command="true")  # the parent has written before the fork
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            os.write(write_end, q.dir.tmp_name("spare").encode())  # a name that is not a job's
            os.close(write_end)
            for _ in range(300):
                q.enqueue(command="true")
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        childs = pipe.read().decode()
    mine = q.dir.tmp_name("spare")
    for _ in range(300):
        q.enqueue(command="true")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert childs.split(".")[1] == str(pid) and mine.split(".")[1] == str(os.getpid())
    assert childs.split(".")[2] != mine.split(".")[2]  # the random tag is drawn again in the child
    assert q.status()["new"] == 601 and os.listdir(os.path.join(q.path, "tmp")) == []


def test_work_with_several_jobs_and_limits(q):
    import threading

    seen = set()
    lock = threading.Lock()

    def record(p):
        with lock:
            seen.add(threading.get_ident())
        time.sleep(0.05)

    for i in range(8):
        q.enqueue(kind="rec", payload=i)
    assert q.work(handlers={"rec": record}, jobs=4) == 8
    assert len(seen) > 1  # ran in more than one slot
    for i in range(5):
        q.enqueue(kind="rec", payload=i)
    assert q.work(handlers={"rec": record}, max_jobs=2) == 2
    assert q.work(handlers={"rec": record}, max_time=0) == 0


def test_the_testing_helper(tmp_path):
    def send(p):
        return {"sent": p["to"]}

    with temporary_spool() as q:
        q.enqueue(kind="send", payload={"to": "a@example.com"})
        q.enqueue(kind="send", payload={"to": "b@example.com"}, run_at=time.time() + 3600)
        done = run_jobs(q, handlers={"send": send})
        assert [j["result"] for j in done] == [{"sent": "a@example.com"}]
        done = run_jobs(q, handlers={"send": send}, include_scheduled=True)
        assert [j["result"] for j in done] == [{"sent": "b@example.com"}]
        q.enqueue(kind="send", payload={})
        with pytest.raises(JobFailed, match="KeyError"):
            run_jobs(q, handlers={"send": send})
        assert run_jobs(q, handlers={"send": send}, raise_errors=False) == []  # failed/ is not due yet
        path = q.path
    assert not os.path.exists(path)


def test_public_names():
    assert spoolq.Permanent is Permanent
    assert {"Spool", "Permanent", "InvalidJob", "DuplicateId"} <= set(spoolq.__all__)


def test_an_empty_spool_path_is_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="empty"):
        Spool("")
    assert os.listdir(tmp_path) == []


def test_cancel_and_retry_with_check_raise_exceptions_the_package_exports(q):
    """Audit: with check=True they raised classes only spoolq.transitions had."""
    with pytest.raises(spoolq.JobNotFound):
        q.cancel("no-such-job", check=True)
    job_id = q.enqueue(command="true")
    q.work()
    with pytest.raises(spoolq.NotPossible, match="is in done/"):
        q.cancel(job_id, check=True)
    with pytest.raises(spoolq.NotPossible):
        q.retry(job_id, check=True)


def test_work_logs_to_any_object_with_a_line_method(q):
    """Spool.work(log=obj) with only a line() method, no level: it gets
    every line, outcomes included."""
    lines: list[str] = []

    class Lines:
        def line(self, text, level=1, severity=None):
            lines.append(text)

    job_id = q.enqueue(command="true")
    assert q.work(log=Lines()) == 1
    assert any(f"job={job_id} outcome=succeeded" in line for line in lines), lines
