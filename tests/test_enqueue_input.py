"""Bad input caught at enqueue, not five retries later; commands that
say what they mean."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

from conftest import ROOT, SPOOLQ

DROP = str(ROOT / "contrib" / "spoolq-drop")


def test_a_working_directory_that_is_not_there_is_refused_or_dead_at_once(fast_spool, tmp_path):
    s = fast_spool
    afile = tmp_path / "a-file"
    afile.write_text("")
    for args, says in ((["--cwd", "/no/such/dir", "true"], "cwd /no/such/dir does not exist"),
                       (["--cwd", str(afile), "true"], f"cwd {afile} is not a directory"),
                       (["--json", '{"command": "true", "cwd": "/no/such/dir"}'], "cwd /no/such/dir does not exist"),
                       (["--jsonl", "-"], "job 1: cwd /no/such/dir does not exist")):
        proc = s.run("enqueue", *args, input='{"argv": ["true"], "cwd": "/no/such/dir"}\n', check=False)
        assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"spoolq: {says}\n", ""), args
    gone = tmp_path / "gone"
    gone.mkdir()
    s.enqueue("--id", "enqueued", "--cwd", str(gone), "true")
    s.drop("dropped.json", json.dumps({"command": "true", "cwd": str(tmp_path / "never")}))
    gone.rmdir()
    s.work()
    for job_id, where in (("enqueued", gone), ("dropped", tmp_path / "never")):
        job = s.show(job_id)
        assert (job["state"], job["attempts"]) == ("dead", 1), job  # at once: retrying brings no directory back
        assert job["error"] == f"cannot start: its working directory {where} does not exist"


def test_at_in_the_past_is_noted_and_milliseconds_get_a_hint(fast_spool):
    s = fast_spool
    proc = s.run("enqueue", "--at", "2020-01-01T00:00:00Z", "true")
    assert proc.stderr == ("spoolq: note: --at 2020-01-01T00:00:00Z is in the past (2020-01-01T00:00:00Z): "
                           "the job is due now\n")
    assert s.ids("new") == [proc.stdout.strip()]
    now = s.run("enqueue", "--at", str(int(time.time())), "true")
    assert now.stderr == ""
    ms = s.run("enqueue", "--at", "1769850000000", "true", check=False)
    assert ms.returncode == 2 and ms.stderr == (
        "spoolq: --at: 1769850000000 is not a valid epoch time (0 to 7258118400); it looks like milliseconds: "
        "epoch times are in seconds (1769850000 is 2026-01-31T09:00:00Z)\n")
    s.drop("ms.json", '{"command": "true", "run_at": 1769850000000}')
    s.work()
    assert "it looks like milliseconds" in s.show("ms")["error"]


def test_a_job_dead_for_a_missing_or_wrong_field_names_the_fields_it_does_not_know(fast_spool):
    s = fast_spool
    s.drop("typo.json", '{"cmd": "true", "timout": 5}')
    s.drop("wrong.json", '{"command": 5, "args": ["x"]}')
    s.drop("fine.json", '{"command": "true", "colour": "blue"}')  # unknown fields in a valid job are kept
    s.work()
    assert s.show("typo")["error"] == ("a job needs exactly one of command, argv or kind; it has none; unknown field "
                                       "'cmd' (did you mean 'command'?); unknown field 'timout' (did you mean 'timeout'?)")
    assert s.show("wrong")["error"] == "command must be a non-empty string; unknown field 'args' (did you mean 'argv'?)"
    assert s.show("fine")["state"] == "done" and s.show("fine")["colour"] == "blue"
    proc = s.run("enqueue", "--json", '{"cmd": "true"}', check=False)
    assert proc.returncode == 2 and "unknown field 'cmd' (did you mean 'command'?)" in proc.stderr


def test_a_command_that_is_not_utf8_is_refused_everywhere_alike(fast_spool):
    s = fast_spool
    proc = subprocess.run(SPOOLQ + ["-s", str(s.path), "enqueue", b"echo \xff"], capture_output=True, text=True)
    assert (proc.returncode, proc.stderr) == (2, "spoolq: command is not valid UTF-8 (the byte 0xff at character 5)\n")
    proc = subprocess.run(SPOOLQ + ["-s", str(s.path), "enqueue", "printf", b"%s\xc3"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("spoolq: argv is not valid UTF-8")
    for words in ([b"echo \xff"], [b"printf", b"%s\xc3"], [b"echo", b"\xed\xa0\x80"]):  # the last: a surrogate's bytes
        drop = subprocess.run([DROP, "-s", str(s.path), *words], capture_output=True, text=True)
        assert (drop.returncode, drop.stderr) == (1, "spoolq-drop: the command is not valid UTF-8\n"), words
    assert s.ids("new") == []
    s.drop("escaped.json", '{"command": "echo \\udcff"}')  # how JSON spells the byte: a lone surrogate
    s.work()
    assert s.show("escaped")["error"] == "command is not valid UTF-8 (the byte 0xff at character 5)"
    ok = subprocess.run([DROP, "-s", str(s.path), "echo", "café ☕"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_the_suggested_rename_of_a_badly_named_dead_file_pastes_in_sh_and_bash(fast_spool, tmp_path):
    s = fast_spool
    for shell in ("sh", "bash"):
        name = os.fsdecode(b"bad\nname it's 100%\\\xff" + shell.encode())
        s.drop(name + ".json", '{"command": "true"}')
        s.work()
        proc = subprocess.run(SPOOLQ + ["-s", str(s.path), "retry", os.fsencode(name)], capture_output=True, text=True)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        command = re.search(r"e\.g\. (.*), then retry (\S+)$", proc.stderr.strip())
        assert command and command.group(1).isascii() and command.group(1).isprintable(), proc.stderr
        run = subprocess.run([shell, "-c", command.group(1)], capture_output=True, text=True, cwd=str(tmp_path))
        assert run.returncode == 0, (shell, run.stderr)
        assert s.run("retry", command.group(2)).stdout == f"{command.group(2)}\n"
        assert not (s.path / "dead" / (name + ".json")).exists()


def test_spoolq_drop_takes_one_word_as_a_shell_command_and_several_as_argv(fast_spool, tmp_path):
    s = fast_spool
    out = tmp_path / "out"
    one = subprocess.run([DROP, "-s", str(s.path), f"echo one > {out}-1"], capture_output=True, text=True, cwd=tmp_path)
    several = subprocess.run([DROP, "-s", str(s.path), "sh", "-c", f'echo "$0" > {out}-2', "two words"],
                             capture_output=True, text=True, cwd=tmp_path)
    assert one.returncode == 0 and several.returncode == 0, (one.stderr, several.stderr)
    records = {n: json.loads((s.path / "new" / n).read_text()) for n in s.names("new")}
    assert sorted(r.get("command") or "" for r in records.values()) == ["", f"echo one > {out}-1"]
    assert [r["argv"] for r in records.values() if "argv" in r] == [["sh", "-c", f'echo "$0" > {out}-2', "two words"]]
    s.work()
    assert (tmp_path / "out-1").read_text() == "one\n" and (tmp_path / "out-2").read_text() == "two words\n"


def test_the_spool_option_may_follow_the_command_name(fast_spool, tmp_path):
    s = fast_spool
    env = {k: v for k, v in os.environ.items() if k != "SPOOLQ_DIR"}
    env["SPOOLQ_DIR"] = str(tmp_path / "elsewhere")

    def spoolq(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(SPOOLQ + list(args), env=env, capture_output=True, text=True, timeout=120)

    job = spoolq("enqueue", "-s", str(s.path), "--id", "after", "true")
    assert job.returncode == 0 and s.ids("new") == ["after"], job.stderr
    assert spoolq("work", "--spool", str(s.path), "-q").returncode == 0
    assert json.loads(spoolq("show", "-s", str(s.path), "after", "--json").stdout)["state"] == "done"
    assert spoolq("config", "set", "-s", str(s.path), "timeout", "5").returncode == 0
    assert spoolq("config", "-s", str(s.path), "get", "timeout").stdout == "5\n"
    assert json.loads(spoolq("status", "-s", str(s.path), "--json").stdout)["done"] == 1
    assert "after" in spoolq("dlq", "list", "-s", str(s.path)).stdout + spoolq("list", "-s", str(s.path)).stdout
    assert not (tmp_path / "elsewhere").exists()


def test_show_cancel_and_retry_take_the_start_of_an_id(fast_spool):
    s = fast_spool
    s.enqueue("--id", "report-2026-01", "--in", "1h", "true")
    s.enqueue("--id", "report-2026-02", "--in", "1h", "true")
    s.enqueue("--id", "cleanup-a", "--max-attempts", "1", "false")
    s.work()
    assert s.run("show", "report-2026-01").stdout.startswith("command: true")
    assert json.loads(s.run("show", "clean", "--json").stdout)["id"] == "cleanup-a"
    ambiguous = s.run("show", "report", check=False)
    assert (ambiguous.returncode, ambiguous.stderr) == (
        1, "spoolq: report is the start of more than one job's id: report-2026-01, report-2026-02 (give more of it)\n")
    assert s.run("cancel", "report-2026-0", check=False).stderr.startswith(
        "spoolq: report-2026-0 is the start of more than one job's id")
    assert s.run("cancel", "report-2026-02").stdout == "cancelled report-2026-02\n"
    assert s.run("retry", "clean").stdout == "cleanup-a\n"
    assert s.run("show", "zz", check=False).stderr == "spoolq: no job zz in this spool\n"
    s.run("compact")
    assert "report-2026-01, report-2026-02" in s.run("show", "report-2026-0", check=False).stderr  # compacted too
    assert json.loads(s.run("show", "report-2026-02", "--json").stdout)["compacted"] is True
