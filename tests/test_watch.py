"""``spoolq work --watch``: wakes on files renamed, moved or linked into
new/, on due times and on rescans; signals; two watchers; lost events."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import SpoolFixture, wait_for


class Watcher:
    """A ``spoolq work --watch`` process logging to a file, stopped at the end
    of the test."""

    count = 0

    def __init__(self, spool: SpoolFixture, *args: str, env: dict | None = None):
        Watcher.count += 1
        self.spool = spool
        self.log_path = spool.path.parent / f"watcher-{Watcher.count}.log"
        self.log_file = open(self.log_path, "w")
        self.proc = spool.popen("work", "--watch", *args, stderr=self.log_file, env=env)
        # `-j N` (N > 1) is N worker processes, children of this one.
        self.processes = int(args[args.index("-j") + 1]) if "-j" in args else 1
        # Ready once registered (its first scan comes right after the watch starts).
        wait_for(lambda: len(self.workers()) == self.processes or self.proc.poll() is not None,
                 what="the watcher to register")
        assert self.proc.poll() is None, self.log()
        self.worker_ids = {w["worker"] for w in self.workers()}

    def workers(self) -> list[dict]:
        """The registered workers that are this command's process or its children."""
        return [w for w in self.spool.status()["workers"] if w["pid"] == self.proc.pid or _parent_of(w["pid"]) == self.proc.pid]

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_log(self, text: str) -> None:
        wait_for(lambda: text in self.log(), what=f"the log line {text!r}")

    def stop(self, timeout: float = 60) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=timeout)
        self.log_file.close()
        return self.log()


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture
def watcher_factory(fast_spool):
    started = []

    def make(*args, **kw):
        w = Watcher(fast_spool, *args, **kw)
        started.append(w)
        return w

    yield make
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()
        w.log_file.close()


def _done(s, job_id):
    return s.where(job_id) == ["done"]


def test_files_dropped_by_rename_mv_and_link_are_picked_up(fast_spool, watcher_factory, tmp_path):
    s = fast_spool
    watcher_factory()
    by_cli = s.enqueue("true")
    s.drop("by-rename.json", '{"command": "true"}')
    tmp = s.path / "tmp" / "shell-mv"
    tmp.write_text('{"command": "true"}')
    subprocess.run(["mv", str(tmp), str(s.path / "new" / "by-mv.json")], check=True)
    tmp.write_text('{"command": "true"}')
    os.link(tmp, s.path / "new" / "by-link.json")
    os.unlink(tmp)
    for job_id in (by_cli, "by-rename", "by-mv", "by-link"):
        wait_for(lambda: _done(s, job_id), timeout=20, what=f"{job_id} to run")


def test_a_delayed_job_runs_on_time(fast_spool, watcher_factory):
    s = fast_spool
    watcher_factory()
    job_id = s.enqueue("--in", "2", "true")
    due = os.stat(s.path / "new" / f"{job_id}.json").st_mtime
    wait_for(lambda: _done(s, job_id), timeout=20, what="the delayed job to run")
    h = s.record("done", job_id)["history"][0]
    from spoolq.record import parse_time

    started = parse_time(h["start"])
    assert 0 <= started - due < 1.0, started - due


def test_a_retry_runs_after_its_backoff_without_a_new_event(fast_spool, watcher_factory):
    s = fast_spool
    s.config("backoff_initial", 1.5)
    watcher_factory()
    job_id = s.enqueue('test "$SPOOLQ_ATTEMPT" -ge 2')
    wait_for(lambda: _done(s, job_id), timeout=20, what="the retry to run")
    from spoolq.record import parse_time

    first, second = s.record("done", job_id)["history"]
    assert first["exit_code"] == 1 and second["exit_code"] == 0
    waited = parse_time(second["start"]) - parse_time(first["end"])
    assert 1.3 <= waited < 1.65 + 1.0, waited  # 1.5 s +-10 %, started within a second of due
    assert parse_time(second["start"]) - parse_time(second["due"]) < 1.0


def test_two_watchers_run_each_job_once(fast_spool, watcher_factory, tmp_path):
    s = fast_spool
    log = tmp_path / "ran.log"
    first = watcher_factory("-j", "2")
    second = watcher_factory("-j", "2")
    ids = s.run("enqueue", "--jsonl", "-",
                input="".join(json.dumps({"command": f"echo $SPOOLQ_JOB_ID >> {log}"}) + "\n" for _ in range(300))).stdout.split()
    ids += [s.enqueue(f"echo $SPOOLQ_JOB_ID >> {log}") for _ in range(20)]
    wait_for(lambda: len(s.ids("done")) == len(ids), timeout=120, what="all jobs to run")
    runs = collections.Counter(log.read_text().split())
    assert set(runs) == set(ids) and max(runs.values()) == 1
    workers = {s.record("done", i)["history"][0]["worker"] for i in ids}
    assert workers & first.worker_ids and workers & second.worker_ids  # both watchers took part
    assert workers <= first.worker_ids | second.worker_ids


def test_sigterm_lets_the_running_job_finish_then_exits(fast_spool, watcher_factory, tmp_path):
    s = fast_spool
    w = watcher_factory()
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; sleep 1; echo finished")
    wait_for(started.exists, what="the job to start")
    w.proc.send_signal(signal.SIGTERM)
    w.proc.wait(timeout=60)
    assert w.proc.returncode == 0
    assert s.show(job_id)["stdout"] == "finished\n"


def test_a_second_signal_kills_the_job_and_keeps_it(fast_spool, watcher_factory, tmp_path):
    s = fast_spool
    w = watcher_factory("-j", "2")
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; exec sleep 300")
    wait_for(started.exists, what="the job to start")
    w.proc.send_signal(signal.SIGTERM)
    w.wait_log("stopping on SIGTERM: no new jobs; running jobs finish")
    w.proc.send_signal(signal.SIGTERM)
    w.proc.wait(timeout=60)
    assert w.proc.returncode == 0
    assert s.where(job_id) == ["failed"] and s.record("failed", job_id)["attempts"] == 1


def test_an_idle_watcher_stops_at_once(fast_spool, watcher_factory):
    w = watcher_factory()
    asked = time.monotonic()
    w.proc.send_signal(signal.SIGTERM)
    w.proc.wait(timeout=30)
    assert w.proc.returncode == 0
    assert time.monotonic() - asked < 5
    assert fast_spool.status()["workers"] == []


def test_a_burst_of_2000_files_all_run(fast_spool, watcher_factory):
    s = fast_spool
    app = s.path.parent / "burst_app.py"
    app.write_text("HANDLERS = {'noop': lambda p: None}\n")
    watcher_factory("--app", "burst_app:HANDLERS", env={"PYTHONPATH": str(app.parent)})
    for i in range(2000):
        tmp = s.path / "tmp" / f"b{i}"
        tmp.write_text('{"kind": "noop"}')
        os.rename(tmp, s.path / "new" / f"burst-{i:04d}.json")
    wait_for(lambda: len(s.names("done")) == 2000, timeout=120, what="all 2000 to run")
    assert s.names("new") == [] and s.names("dead") == []


@pytest.mark.parametrize("mode", ["no-event", "poll"])
def test_without_events_every_job_is_still_found_by_rescan(fast_spool, watcher_factory, mode):
    """A job can become due with no event to say so: here an operator's
    `touch` makes waiting jobs due now (a change of time, not a file
    created or moved into new/), as a lost inotify event would leave a new
    one unseen. The rescan finds them all, within rescan_interval; so does
    --poll."""
    s = fast_spool
    s.config("rescan_interval", 0.5)
    waiting = [s.enqueue("--in", "1h", "true") for _ in range(5)]
    waiting += [s.enqueue("--in", "1h", "--max-attempts", "2", "true") for _ in range(5)]
    w = watcher_factory("--poll", "0.3", "-v") if mode == "poll" else watcher_factory("-v")
    w.wait_log("scan due=0")  # it has seen them, not due
    past = time.time() - 10
    for job_id in waiting:
        os.utime(s.path / "new" / f"{job_id}.json", (past, past))
    wait_for(lambda: all(_done(s, i) for i in waiting), timeout=30, what="rescans to find every job")


def test_status_lists_a_live_watcher_and_forgets_a_killed_one(fast_spool, watcher_factory):
    s = fast_spool
    w = watcher_factory("-j", "3")
    workers = s.status()["workers"]
    assert len(workers) == 3 and {_parent_of(x["pid"]) for x in workers} == {w.proc.pid}  # three worker processes
    assert all(x["host"] and x["started_at"] for x in workers)
    w.proc.send_signal(signal.SIGKILL)
    w.proc.wait()
    # Its worker processes stop when their parent dies; a killed one is forgotten.
    wait_for(lambda: s.status()["workers"] == [], what="the worker processes to stop")
    single = watcher_factory()
    assert [x["pid"] for x in s.status()["workers"]] == [single.proc.pid]
    single.proc.send_signal(signal.SIGKILL)
    single.proc.wait()
    assert s.status()["workers"] == []
    assert "workers" in s.run("status").stdout


def test_sighup_rereads_the_config(fast_spool, watcher_factory):
    s = fast_spool
    w = watcher_factory()
    s.config("output_limit", 5)
    w.proc.send_signal(signal.SIGHUP)
    w.wait_log("reloaded config.json")
    job_id = s.enqueue("echo 0123456789")
    wait_for(lambda: _done(s, job_id), what="the job to run")
    assert s.show(job_id)["stdout"] == "6789\n"


def test_log_levels(fast_spool, watcher_factory):
    s = fast_spool
    quiet = watcher_factory("--quiet")
    ok = s.enqueue("true")
    wait_for(lambda: _done(s, ok), what="the job to run")
    assert quiet.stop() == ""
    verbose = watcher_factory("--verbose")
    ok2 = s.enqueue("true")
    wait_for(lambda: _done(s, ok2), what="the job to run")
    err = verbose.stop()
    assert "scan due=" in err and f"job={ok2} outcome=succeeded" in err
