"""Python handlers run by `work --app`: where what they print goes, and
processes they fork."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import SPOOLQ, wait_for


def test_handler_output_of_worker_processes_is_flushed_once(fast_spool, tmp_path):
    """Handlers that print, under -j 2 with stdout a pipe: each line once,
    and what the app printed on import not repeated by each process."""
    s = fast_spool
    (tmp_path / "printing_app.py").write_text(
        "print('imported')\n"
        "def say(payload):\n"
        "    print('job', payload)\n"
        "HANDLERS = {'say': say}\n"
    )
    for i in range(4):
        s.enqueue("--kind", "say", "--payload", str(i))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.pop("SPOOLQ_DIR", None)
    proc = subprocess.run(SPOOLQ + ["-s", str(s.path), "work", "-j", "2", "--app", "printing_app:HANDLERS"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["imported"], proc.stdout  # what the handlers print is their jobs'
    assert sorted(s.show(i)["stdout"] for i in s.ids("done")) == [f"job {i}\n" for i in range(4)]


def test_a_process_a_handler_forks_does_not_go_on_as_a_second_worker(fast_spool, tmp_path):
    """Audit: a handler that forked and let its child return from it (as
    code that forks and forgets to exit does) had that child carry on as a
    second worker: it ran jobs the worker had already run, or failed with
    "Bad file descriptor". Such a child now exits on its return."""
    s = fast_spool
    runs, child_pid = tmp_path / "runs", tmp_path / "child.pid"
    (tmp_path / "forkapp.py").write_text(
        "import os, time\n"
        "def forker(payload):\n"
        "    if os.fork() == 0:\n"
        f"        open({str(child_pid)!r}, 'w').write(str(os.getpid()))\n"
        "        time.sleep(0.2)  # the worker is running the next jobs meanwhile\n"
        "        return 'from the child'\n"
        "    return 'from the worker'\n"
        "def ok(payload):\n"
        f"    open({str(runs)!r}, 'a').write(f'{{payload}}\\n')\n"
        "HANDLERS = {'fork': forker, 'ok': ok}\n")
    s.enqueue("--kind", "fork")
    for i in range(3):
        s.enqueue("--kind", "ok", "--payload", str(i))
    s.enqueue("--kind", "ok", "--payload", '"late"', "--in", "1s")
    proc = s.popen("work", "--app", "forkapp:HANDLERS", "--watch", "--max-time", "3", cwd=str(tmp_path),
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    pid = int(child_pid.read_text())
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z",
             what="the forked child to end")
    assert proc.returncode == 0, err
    assert sorted(runs.read_text().split()) == ["0", "1", "2", "late"]  # each once
    assert "spoolq:" not in err and "Bad file descriptor" not in err, err
    assert [n for n in os.listdir(s.path / "cur")] == []
    assert {s.show(i)["state"] for i in s.ids("done")} == {"done"} and len(s.ids("done")) == 5


def test_a_forked_child_that_exits_from_a_handler_keeps_its_status_and_output(fast_spool, tmp_path):
    """Review: the fork guard ended such a child with status 1 for the usual
    `sys.exit(0)` (the handler's SystemExit is caught as a failure) and
    lost what it had printed (os._exit flushes nothing)."""
    s = fast_spool
    status = tmp_path / "status"
    (tmp_path / "exitapp.py").write_text(
        "import os, sys\n"
        "def forker(payload):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        print('printed by the child')\n"
        "        sys.exit(payload)\n"
        "    _, code = os.waitpid(pid, 0)\n"
        f"    open({str(status)!r}, 'a').write(f'{{os.waitstatus_to_exitcode(code)}}\\n')\n"
        "HANDLERS = {'fork': forker}\n")
    for code in ("0", "3"):
        s.enqueue("--kind", "fork", "--payload", code)
    proc = s.run("work", "--app", "exitapp:HANDLERS", cwd=str(tmp_path))
    assert status.read_text().split() == ["0", "3"]
    assert proc.stdout.count("printed by the child") == 2


@pytest.mark.parametrize("processes", ["1", "2"])
def test_what_a_handler_prints_is_its_jobs_output_not_the_workers(fast_spool, tmp_path, processes):
    """A handler's print() and writes to sys.stderr land in its job's
    stdout and stderr tails, as a command's output does, whether it runs in
    the worker or forked (a timeout), and not in the worker's own output
    (cron's mail); the tails keep to output_limit."""
    s = fast_spool
    s.config("output_limit", 100)
    (tmp_path / "talkapp.py").write_text(
        "import sys, time\n"
        "def say(payload):\n"
        "    print('said', payload)\n"
        "    print('warned', payload, file=sys.stderr)\n"
        "    sys.stdout.buffer.write(b'raw\\n')\n"
        "    sys.stdout.write('no newline')\n"
        "    return payload\n"
        "def fail(payload):\n"
        "    print('before failing', payload)\n"
        "    raise ValueError('bad payload')\n"
        "def flood(payload):\n"
        "    for i in range(20000):\n"
        "        print(i)\n"
        "    print('end', payload)\n"
        "def hang(payload):\n"
        "    print('about to hang')\n"
        "    time.sleep(600)\n"
        "HANDLERS = {'say': say, 'fail': fail, 'flood': flood, 'hang': hang}\n")
    jobs = {}
    for where, options in (("inline", []), ("forked", ["--timeout", "60"])):
        for kind in ("say", "fail", "flood"):
            jobs[where, kind] = s.enqueue("--kind", kind, "--payload", f'"{where}"', "--max-attempts", "1", *options)
    hung = s.enqueue("--kind", "hang", "--max-attempts", "1", "--timeout", "1")
    proc = s.run("work", "-j", processes, "--app", "talkapp:HANDLERS", cwd=str(tmp_path))
    for where in ("inline", "forked"):
        said = s.show(jobs[where, "say"])
        assert said["state"] == "done" and said["result"] == where, said
        assert said["stdout"] == f"said {where}\nraw\nno newline" and said["stderr"] == f"warned {where}\n", said
        failed = s.show(jobs[where, "fail"])
        assert failed["state"] == "dead" and failed["stdout"] == f"before failing {where}\n", failed
        assert failed["stderr"].endswith("ValueError: bad payload\n"), failed
        flooded = s.show(jobs[where, "flood"])
        assert flooded["stdout"].endswith(f"19999\nend {where}\n") and len(flooded["stdout"].encode()) == 100, flooded
    hung = s.show(hung)
    assert hung["error"] == "timed out after 1s" and hung["stdout"] == "about to hang\n", hung  # what it printed before
    assert proc.stdout == ""
    for text in ("said", "warned", "before failing", "19999"):
        assert text not in proc.stderr, proc.stderr


def test_handler_processes_start_while_another_thread_holds_an_import_lock(fast_spool, tmp_path):
    """A handler job with a timeout runs in a process of its own. Forked
    from the worker, which has threads, that process would get every lock
    as it was at that instant: here a thread of the worker is in the middle
    of importing a module (holding that module's import lock, for good), and
    a child that imports the module too would wait for that lock until its
    timeout killed it. The handler processes start without that lock held
    (and the worker forks no process that has threads: Python 3.12 and
    later would warn that it may deadlock)."""
    s = fast_spool
    importing, release = tmp_path / "importing", tmp_path / "release"
    (tmp_path / "slowmod.py").write_text(
        "import pathlib, threading, time\n"
        "if threading.current_thread().name == 'importer':  # only the worker's thread is slow\n"
        f"    pathlib.Path({str(importing)!r}).touch()\n"
        f"    while not pathlib.Path({str(release)!r}).exists():\n"
        "        time.sleep(0.05)\n"
        "VALUE = 'imported'\n")
    (tmp_path / "lockapp.py").write_text(
        "import os, pathlib, threading, time\n"
        "def hold(payload):  # in the worker (no timeout): a thread starts importing slowmod, and stays in it\n"
        "    threading.Thread(target=lambda: __import__('slowmod'), name='importer', daemon=True).start()\n"
        f"    while not pathlib.Path({str(importing)!r}).exists():\n"
        "        time.sleep(0.01)\n"
        "def use(payload):  # in a process of its own (a timeout)\n"
        "    import slowmod\n"
        "    return [slowmod.VALUE, os.getpid()]\n"
        "HANDLERS = {'hold': hold, 'use': use}\n")
    held = s.enqueue("--kind", "hold", "--max-attempts", "1")
    uses = [s.enqueue("--kind", "use", "--in", "1s", "--timeout", "30", "--max-attempts", "1") for _ in range(3)]
    try:
        proc = s.run("work", "--app", "lockapp:HANDLERS", "--watch", "--max-time", "3", cwd=str(tmp_path),
                     env={"PYTHONWARNINGS": "always::DeprecationWarning"}, timeout=180)
    finally:
        release.touch()
    assert proc.returncode == 0, proc.stderr
    assert s.show(held)["state"] == "done"
    results = [s.show(job_id) for job_id in uses]
    assert [(r["state"], (r.get("result") or [None])[0]) for r in results] == [("done", "imported")] * 3, \
        [(r["state"], r.get("error")) for r in results]
    assert len({r["result"][1] for r in results}) == 3  # each in a process of its own
    assert "fork()" not in proc.stderr, proc.stderr


def test_a_worker_whose_fork_server_was_killed_stops_and_loses_no_job(fast_spool, tmp_path):
    """The process that handler jobs with a timeout are forked from is
    killed from outside: the handler running in it dies with it (a failed
    run), the next such job goes back to new/ without a run counted, and
    the worker stops with exit status 1 and a line saying why, so that
    whoever restarts it (systemd, cron) gets a worker that can run them."""
    s = fast_spool
    parent = tmp_path / "parent"
    (tmp_path / "serverapp.py").write_text(
        "import os, pathlib, time\n"
        "def slow(payload):\n"
        f"    pathlib.Path({str(parent)!r}).write_text(str(os.getppid()))\n"
        "    time.sleep(600)\n"
        "HANDLERS = {'slow': slow, 'quick': lambda payload: payload}\n")
    slow = s.enqueue("--kind", "slow", "--timeout", "10m", "--max-attempts", "2")
    later = s.enqueue("--kind", "quick", "--timeout", "10m", "--payload", "1")
    worker = s.popen("work", "--app", "serverapp:HANDLERS", cwd=str(tmp_path), stderr=subprocess.PIPE, text=True)
    wait_for(lambda: parent.exists() and parent.read_text(), what="the handler to start")
    server = int(parent.read_text())
    assert server != worker.pid
    os.kill(server, 9)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 1, err
    ran = s.show(slow)
    assert ran["state"] == "failed" and ran["error"] == "the handler process died (signal 9)", ran
    assert s.where(later) == ["new"] and not s.show(later).get("history"), s.show(later)
    assert f"fork server (pid {server}) has ended" in err and "the worker stops claiming" in err, err
    assert f"job={later} not started: the fork server (pid {server}) has ended; back in new/" in err, err
