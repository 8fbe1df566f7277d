"""What spoolq prints cannot act on a terminal or forge a log line, and
what other users may leave in workers/ cannot crash what reads it."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

import conftest
from conftest import SpoolFixture, wait_for

HOSTILE = "\x1b[2J\x1b]0;pwned\x07\x08\r\x9b31m\u202e"
RAW = ("\x1b", "\x07", "\x08", "\r", "\x9b", "\u202e")


def assert_no_raw_controls(text: str, what: str) -> None:
    found = [c for c in RAW if c in text]
    assert not found, f"{what} prints {found!r} raw: {text!r}"


def hold_lock(path) -> subprocess.Popen:
    """A process holding an exclusive flock on ``path``, as a live worker
    holds its registration."""
    proc = subprocess.Popen(["flock", "-x", str(path), "sleep", "300"])
    conftest._started.append(proc)
    wait_for(lambda: subprocess.run(["flock", "-n", "-s", str(path), "true"]).returncode != 0, what="the lock")
    return proc


def register(spool: SpoolFixture, name: str, content: str) -> subprocess.Popen:
    path = spool.path / "workers" / name
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(content)
    return hold_lock(path)


def registration(**changes) -> str:
    info = {"worker": "w1", "host": os.uname().nodename, "pid": 1, "boot_id": "b", "proc_start": 1,
            "started_at": "2026-01-01T00:00:00Z", "jobs": {}}
    info.update(changes)
    return json.dumps(info)


def test_text_output_escapes_terminal_controls_from_job_content(fast_spool):
    s = fast_spool
    s.config("max_attempts", 1)
    command = f"printf '%s\\n' \"$X\" \"two\tcolumns $X\"; printf '%s\\n' \"$X\" >&2; exit 3 # {HOSTILE}"
    s.enqueue("--id", "evil", "--env", f"X={HOSTILE}", command)
    argv_id = s.enqueue("--argv", f"prog{HOSTILE}", "arg")
    s.work()
    assert s.ids("dead") == sorted(["evil", argv_id])
    # The job's content really holds the controls: the JSON says so, escaped.
    record = s.show("evil")
    assert HOSTILE in record["command"] and HOSTILE in record["stdout"] and HOSTILE in record["stderr"]
    assert HOSTILE in s.show(argv_id)["error"]

    shown = s.run("show", "evil").stdout
    assert_no_raw_controls(shown, "show")
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in shown
    # The output keeps its lines, each escaped; a tab stays a tab.
    out_lines = shown.split("stdout:\n", 1)[1].split("stderr:\n", 1)[0].splitlines()
    assert len(out_lines) == 2 and out_lines[1].startswith("  | two\tcolumns \\x1b[2J")
    assert_no_raw_controls(s.run("show", argv_id).stdout, "show of an argv job")
    listed = s.run("list").stdout
    assert_no_raw_controls(listed, "list")
    assert len(listed.splitlines()) == 2
    stats = s.run("stats").stdout
    assert_no_raw_controls(stats, "stats")
    assert "prog\\x1b[2J" in stats

    # JSON escapes them too (the C1 CSI and the bidi override included).
    for args in (("show", "evil", "--json"), ("list", "--json"), ("stats", "--json"), ("status", "--json")):
        text = s.run(*args).stdout
        assert_no_raw_controls(text, " ".join(args))
    assert s.show("evil")["stdout"] == record["stdout"]


def test_status_escapes_what_a_live_registration_says(fast_spool):
    s = fast_spool
    register(s, "w1.json", registration(worker=f"w{HOSTILE}", started_at=HOSTILE, jobs={f"j{HOSTILE}": {"attempt": 1}}))
    proc = s.run("status")
    assert_no_raw_controls(proc.stdout, "status")
    assert "w\\x1b[2J" in proc.stdout and "j\\x1b[2J" in proc.stdout


@pytest.mark.parametrize("content, problem", [
    (registration(jobs=5), "jobs is not an object"),
    (registration(jobs={"a": 5}), "an entry of jobs is not an object"),
    (registration(pid="1"), "pid is not a number"),
    (registration(worker=["w"]), "worker is not a string"),
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
])
def test_a_malformed_live_registration_is_skipped_with_a_warning(fast_spool, content, problem):
    s = fast_spool
    register(s, "good.json", registration(worker="good", jobs={"x": {"attempt": 1}}))
    register(s, "bad.json", content)
    warning = f"spoolq: workers/bad.json: not a worker registration ({problem}); skipped"
    for args in (("status",), ("status", "--json"), ("status", "--prometheus")):
        proc = s.run(*args, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.strip() == warning, args
    assert [w["worker"] for w in s.status()["workers"]] == ["good"]
    prometheus = s.run("status", "--prometheus").stdout
    assert f'spoolq_workers{{spool="{s.path}"}} 1' in prometheus
    assert f'spoolq_running_jobs{{spool="{s.path}"}} 1' in prometheus
    text = s.run("status").stdout
    assert "workers          1" in text and "good" in text


def test_a_file_name_cannot_forge_a_field_of_a_log_line(fast_spool):
    s = fast_spool
    s.drop("x outcome=succeeded.json", '{"command": "true"}')
    proc = s.work()
    lines = [line for line in proc.stderr.splitlines() if "x outcome" in line]
    assert lines, proc.stderr
    for line in lines:
        # key=value fields as a logfmt reader splits them: a quoted value is one value.
        fields = re.findall(r'(?:^|\s)([A-Za-z_]+)=("[^"]*"|[^\s"]*)', line)
        assert [key for key, _ in fields].count("outcome") == 1, line
    assert any('file="x outcome=succeeded.json"' in line for line in lines), lines
