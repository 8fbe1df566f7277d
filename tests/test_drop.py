"""Enqueueing without spoolq: plain sh (printf + mv), contrib/spoolq-drop,
safecat; and the due-time rules for dropped files (run_at, touch -d)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from conftest import ROOT

DROP = str(ROOT / "contrib" / "spoolq-drop")


def test_drop_with_printf_and_mv(fast_spool, tmp_path):
    s = fast_spool
    out = tmp_path / "out"
    script = f'''
        set -e
        SPOOL={s.path}
        f="$(date +%s%N).$$.$(hostname)"
        printf '{{"command": "echo dropped > {out}"}}\\n' > "$SPOOL/tmp/$f"
        mv "$SPOOL/tmp/$f" "$SPOOL/new/$f.json"
        echo "$f"
    '''
    name = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    s.work()
    assert out.read_text() == "dropped\n"
    job = s.show(name)
    assert job["state"] == "done" and job["id"] == name and job["created_at"]


def test_spoolq_drop_script_command_and_stdin(fast_spool, tmp_path):
    s = fast_spool
    out = tmp_path / "out"
    env = dict(os.environ, SPOOLQ_DIR=str(s.path))
    tricky = 'printf "%s\\n" "quote\\" back\\\\slash	tab" >> ' + str(out)
    a = subprocess.run([DROP, tricky], env=env, capture_output=True, text=True, check=True).stdout.strip()
    b = subprocess.run([DROP, "-s", str(s.path), "-"], input=json.dumps({"argv": ["sh", "-c", f"echo b >> {out}"]}),
                       capture_output=True, text=True, check=True).stdout.strip()
    assert s.record("new", a)["command"] == tricky
    s.work()
    assert out.read_text() == 'quote" back\\slash\ttab\nb\n'
    assert s.where(a) == ["done"] and s.where(b) == ["done"]


_SHELLS = [sh for sh in (["sh"], ["dash"], ["bash"], ["busybox", "sh"]) if shutil.which(sh[0])]


@pytest.mark.parametrize("shell", _SHELLS, ids=[" ".join(sh) for sh in _SHELLS])
def test_spoolq_drop_writes_valid_json_for_any_command(fast_spool, shell):
    """Audit: control characters (a terminal colour code) were written
    raw, so the job went to dead/ as invalid JSON though the script said it
    was enqueued; trailing newlines were dropped; a command starting with
    "-" could not be given. Every command now comes back byte for byte."""
    s = fast_spool
    commands = ["printf '\\033[31mred\\033[0m'\x07", "a\nb\n\nc\n\n", 'q"uo\\te\t\r\x7f', "é ü 日本 \U0001F600",
                "-n hi", "x" * 20000]
    for command in commands:
        proc = subprocess.run([*shell, DROP, "-s", str(s.path), "--", command], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert s.record("new", proc.stdout.strip())["command"] == command
    assert s.names("tmp") == []


def test_spoolq_drop_refuses_what_cannot_be_a_job(fast_spool):
    s = fast_spool
    for args, stdin, message in [(["", " "], None, "the command is empty"), (["-"], "", "nothing on standard input")]:
        proc = subprocess.run([DROP, "-s", str(s.path), *args], input=stdin, capture_output=True, text=True)
        assert (proc.returncode, proc.stderr) == (1, f"spoolq-drop: {message}\n")
    if shutil.which("iconv"):
        proc = subprocess.run([DROP, "-s", str(s.path), b"echo \xff\xfe"], capture_output=True, text=True)
        assert (proc.returncode, proc.stderr) == (1, "spoolq-drop: the command is not valid UTF-8\n")
    assert s.names("new") == [] and s.names("tmp") == []


def test_spoolq_drop_refuses_a_missing_spool(tmp_path):
    proc = subprocess.run([DROP, "-s", str(tmp_path / "nope"), "true"], capture_output=True, text=True)
    assert proc.returncode == 1 and "not a spool" in proc.stderr


@pytest.mark.skipif(shutil.which("safecat") is None, reason="safecat is not installed (apt-get install safecat)")
def test_safecat_delivers_into_new(fast_spool, tmp_path):
    s = fast_spool
    out = tmp_path / "out"
    proc = subprocess.run(["safecat", str(s.path / "tmp"), str(s.path / "new")],
                          input=json.dumps({"command": f"echo safecat > {out}"}), capture_output=True, text=True, check=True)
    name = proc.stdout.strip()
    assert s.names("new") == [name]
    s.work()
    assert out.read_text() == "safecat\n"
    assert s.show(name)["state"] == "done"
    assert s.names("done") == [f"{name}.json"]  # every state folder names it <id>.json


def test_a_dropped_file_with_run_at_waits_for_it_once(fast_spool, tmp_path):
    s = fast_spool
    out = tmp_path / "out"
    when = time.time() + 3600
    s.drop("later.json", json.dumps({"command": f"echo ran >> {out}", "run_at": when}))
    s.work()
    assert not out.exists()
    path = s.path / "new" / "later.json"
    assert abs(os.stat(path).st_mtime - when) < 1  # applied as the due time
    # After that only the mtime counts: touching it to now runs it.
    os.utime(path, None)
    s.work()
    assert out.read_text() == "ran\n"


def test_run_at_in_the_past_or_rfc3339(fast_spool, tmp_path):
    s = fast_spool
    s.drop("past.json", json.dumps({"command": "true", "run_at": "2001-01-01T00:00:00Z"}))
    s.drop("future.json", json.dumps({"command": "true", "run_at": "2099-01-01T00:00:00+02:00"}))
    s.work()
    assert s.where("past") == ["done"]
    assert s.where("future") == ["new"]
    assert os.stat(s.path / "new" / "future.json").st_mtime == 4070901600


def test_touch_postpones_and_delayed_jobs_run_when_due(fast_spool, tmp_path):
    s = fast_spool
    job_id = s.enqueue("true")
    subprocess.run(["touch", "-d", "+1 hour", str(s.path / "new" / f"{job_id}.json")], check=True)
    s.work()
    assert s.where(job_id) == ["new"]
    soon = s.enqueue("--in", "1", "true")
    s.work()
    assert s.where(soon) == ["new"]
    # Wait until it is due by its own clock, then a drain takes it.
    due = os.stat(s.path / "new" / f"{soon}.json").st_mtime
    time.sleep(max(0.0, due - time.time()) + 0.05)
    s.work()
    assert s.where(soon) == ["done"]


def test_dropped_name_without_json_suffix(fast_spool):
    s = fast_spool
    s.drop("plain-name", '{"command": "true"}')
    s.work()
    assert s.names("done") == ["plain-name.json"]
    assert s.show("plain-name")["state"] == "done"


def test_dot_files_are_ignored_everywhere(fast_spool):
    s = fast_spool
    (s.path / "new" / ".hidden.json").write_text('{"command": "false"}')
    (s.path / "new" / ".partial").write_text("{")
    s.enqueue("true")
    s.work()
    assert sorted(os.listdir(s.path / "new")) == [".hidden.json", ".partial"]
    assert s.status()["new"] == 0


def test_the_file_name_wins_over_the_id_field(fast_spool):
    s = fast_spool
    s.drop("real-name.json", json.dumps({"command": "true", "id": "other-name"}))
    s.work()
    job = s.show("real-name")
    assert job["id"] == "real-name" and job["state"] == "done"
    assert s.run("show", "other-name", check=False).returncode == 1


def test_a_dropped_duplicate_id_goes_to_dead(fast_spool):
    s = fast_spool
    first = s.enqueue("--id", "dup", "true")
    s.work()
    s.drop("dup.json", '{"command": "echo second"}')
    s.work()
    assert s.where(first) == ["done"]
    dead = [json.loads(line) for line in s.run("list", "--state", "dead", "--json").stdout.splitlines()]
    assert len(dead) == 1 and "duplicate id" in dead[0]["error"]
    assert json.loads((s.path / "done" / "dup.json").read_text())["command"] == "true"


def test_many_dropped_files_with_a_past_run_at_all_run_in_one_drain(fast_spool):
    """Honouring run_at rewrites the file while it is being claimed; the
    claim must still go ahead (it once saw its own rewrite as a postponement)."""
    s = fast_spool
    for i in range(300):
        s.drop(f"past-{i:03d}.json", json.dumps({"command": "true", "run_at": "2001-01-01T00:00:00Z"}))
    s.work()
    assert len(s.ids("done")) == 300 and s.ids("new") == []


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_spoolq_drop_help_prints_usage_and_exits_0(flag):
    proc = subprocess.run(["sh", str(DROP), flag], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: spoolq-drop"), proc
