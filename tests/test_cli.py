"""The command line: init, every form of enqueue, status, list, show, config
and the exit codes of section 7."""

from __future__ import annotations

import json
import shutil
import os
import stat
import subprocess
import sys
import time

import pytest

from conftest import SPOOLQ, STATES, SpoolFixture


def test_init_creates_private_layout_and_is_idempotent(tmp_path):
    s = SpoolFixture(tmp_path / "q")
    out = s.run("init").stdout.strip()
    assert out == str(s.path)
    for folder in ("tmp",) + STATES:
        st = os.stat(s.path / folder)
        assert stat.S_ISDIR(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o700
    s.run("init")  # again: no error, nothing changes
    assert sorted(os.listdir(s.path)) == sorted(["tmp", "workers", "order", "held", "waiting", *STATES])


def test_enqueue_writes_a_private_job_file(tmp_path):
    s = SpoolFixture(tmp_path / "fresh")
    s.run("init")
    job_id = s.enqueue("true")
    assert s.ids("new") == [job_id]
    assert stat.S_IMODE(os.stat(s.path / "new" / f"{job_id}.json").st_mode) == 0o600


def test_spool_from_environment(tmp_path):
    import subprocess

    from conftest import SPOOLQ

    env = dict(os.environ, SPOOLQ_DIR=str(tmp_path / "envspool"))
    subprocess.run(SPOOLQ + ["init"], env=env, capture_output=True, check=True)
    out = subprocess.run(SPOOLQ + ["enqueue", "true"], env=env, capture_output=True, text=True, check=True)
    assert (tmp_path / "envspool" / "new" / f"{out.stdout.strip()}.json").exists()


def test_enqueue_shell_command(spool):
    job_id = spool.enqueue("echo 'a b' | tr a-z A-Z")
    job = spool.record("new", job_id)
    assert job["command"] == "echo 'a b' | tr a-z A-Z"
    assert job["id"] == job_id and job["state"] == "new" and job["attempts"] == 0
    assert job["created_at"].endswith("Z")


def test_enqueue_argv(spool):
    job_id = spool.enqueue("--argv", "--", "printf", "%s\n", "--not-an-option")
    assert spool.record("new", job_id)["argv"] == ["printf", "%s\n", "--not-an-option"]


def test_enqueue_kind_with_payload(spool):
    job_id = spool.enqueue("--kind", "send_email", "--payload", '{"to": "a@example.com"}')
    job = spool.record("new", job_id)
    assert job["kind"] == "send_email" and job["payload"] == {"to": "a@example.com"}


def test_enqueue_json_and_stdin(spool):
    a = spool.enqueue("--json", '{"command": "true", "max_attempts": 3, "custom": [1, 2]}')
    b = spool.enqueue("--json", "-", input='{"argv": ["true"], "timeout": 5}')
    ja, jb = spool.record("new", a), spool.record("new", b)
    assert ja["max_attempts"] == 3 and ja["custom"] == [1, 2]  # unknown fields are kept
    assert jb["argv"] == ["true"] and jb["timeout"] == 5


def test_enqueue_jsonl_from_file_and_stdin(spool, tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text('{"command": "true"}\n\n{"kind": "k", "id": "fixed-1"}\n')
    ids = spool.run("enqueue", "--jsonl", str(path)).stdout.split()
    assert len(ids) == 2 and ids[1] == "fixed-1"
    more = spool.run("enqueue", "--jsonl", "-", "--max-attempts", "2",
                     input="".join(json.dumps({"command": f"echo {i}"}) + "\n" for i in range(50))).stdout.split()
    assert len(more) == 50 and len(set(more)) == 50
    assert all(spool.record("new", i)["max_attempts"] == 2 for i in more)
    assert set(spool.ids("new")) == set(ids + more)
    bom = tmp_path / "bom.jsonl"  # as some editors save it; a job file may start so too
    bom.write_bytes(b'\xef\xbb\xbf{"command": "true", "id": "after-bom"}\n')
    assert spool.run("enqueue", "--jsonl", str(bom)).stdout == "after-bom\n"


def test_enqueue_jsonl_rejects_a_bad_line_and_enqueues_nothing(spool):
    proc = spool.run("enqueue", "--jsonl", "-", input='{"command": "true"}\n{"command": 1}\n', check=False)
    assert proc.returncode == 2
    assert "job 2" in proc.stderr and "command must be" in proc.stderr
    assert spool.ids("new") == []


def test_enqueue_options(spool, tmp_path):
    job_id = spool.enqueue(
        "--id", "report-42", "--max-attempts", "3", "--timeout", "1.5", "--env", "A=1", "--env", "B=x=y",
        "--cwd", str(tmp_path), "--payload", "[1, 2]", "cat",
    )
    assert job_id == "report-42"
    job = spool.record("new", job_id)
    assert job["max_attempts"] == 3 and job["timeout"] == 1.5
    assert job["env"] == {"A": "1", "B": "x=y"} and job["cwd"] == str(tmp_path) and job["payload"] == [1, 2]


def test_enqueue_delay_sets_the_due_time(spool):
    before = time.time()
    a = spool.enqueue("--in", "2h", "true")
    b = spool.enqueue("--at", "2030-01-02T03:04:05Z", "true")
    c = spool.enqueue("--at", str(int(before) + 90), "true")
    assert abs(os.stat(spool.path / "new" / f"{a}.json").st_mtime - (before + 7200)) < 30
    assert os.stat(spool.path / "new" / f"{b}.json").st_mtime == 1893553445
    assert os.stat(spool.path / "new" / f"{c}.json").st_mtime == int(before) + 90
    assert spool.record("new", b)["run_at"] == "2030-01-02T03:04:05.000000Z"


def test_a_delay_or_timeout_out_of_range_is_named_as_given(spool):
    """Not as the epoch seconds or the number of seconds it became."""
    for args, message in [
        (["--in", "99999999999"], "--in 99999999999 is too far ahead: a job can be due at the latest at 2200-01-01T00:00:00Z"),
        (["--in", "70000d"], "--in 70000d is too far ahead: a job can be due at the latest at 2200-01-01T00:00:00Z"),
        (["--timeout", "3651d"], "--timeout 3651d is too long: a timeout is at most 315360000 seconds (3650d)"),
    ]:
        proc = spool.run("enqueue", *args, "true", check=False)
        assert (proc.returncode, proc.stderr) == (2, f"spoolq: {message}\n"), args
    assert spool.ids("new") == []


def test_generated_ids_are_unique_and_sort_in_creation_order(spool):
    ids = spool.run("enqueue", "--jsonl", "-", input='{"command": "true"}\n' * 300).stdout.split()
    ids += [spool.enqueue("true") for _ in range(3)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)


def test_duplicate_id_is_refused_in_any_state(spool):
    spool.enqueue("--id", "once", "true")
    proc = spool.run("enqueue", "--id", "once", "true", check=False)
    assert proc.returncode == 1 and "already in new/" in proc.stderr
    spool.work()
    proc = spool.run("enqueue", "--id", "once", "true", check=False)
    assert proc.returncode == 1 and "already in done/" in proc.stderr
    assert spool.where("once") == ["done"]


def test_usage_errors_exit_2_with_one_line(spool):
    cases = [
        ["enqueue"],
        ["enqueue", "--kind", "k", "a", "b"],
        ["enqueue", "--kind", "k", "--json", "{}"],
        ["enqueue", "--json", "[1]"],
        ["enqueue", "--json", "{nope"],
        ["enqueue", "--payload", "{bad", "true"],
        ["enqueue", "--max-attempts", "0", "true"],
        ["enqueue", "--in", "soon", "true"],
        ["enqueue", "--at", "yesterday", "true"],
        ["enqueue", "--at", "9999-12-31T23:59:59Z", "true"],
        ["enqueue", "--in", "5m", "--at", "2030-01-01T00:00:00Z", "true"],
        ["enqueue", "--env", "NOEQUALS", "true"],
        ["enqueue", "--id", "../x", "true"],
        ["enqueue", "--id", ".hidden", "true"],
        ["enqueue", "--id", "a/b", "true"],
        ["enqueue", "--json", '{"command": "true", "env": {"A": 1}}'],
        ["enqueue", "--json", '{"command": "true", "argv": ["x"]}'],
        ["work", "-j", "0"],
        ["work", "--max-time", "forever"],
        ["list", "--state", "bogus"],
        ["config", "set", "max_attempts", "zero"],
        ["config", "set", "no_such_key", "1"],
        ["config", "get", "no_such_key"],
        ["retry"],
        ["show"],
        ["bogus"],
        ["compact", "--keep", "1x"],
        ["list", "--limit", "-1"],
        ["init", "--group", "no-such-group-here"],
        ["status", "--json", "--prometheus"],
    ]
    for args in cases:
        proc = spool.run(*args, check=False)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr, args
        # click's own errors too: one line, not usage + hint + error.
        assert proc.stderr.startswith("spoolq: ") and proc.stderr.count("\n") == 1, (args, proc.stderr)
    assert "see 'spoolq list --help'" in spool.run("list", "--state", "bogus", check=False).stderr
    assert spool.ids("new") == []
    # Help is still help, and plain `spoolq` still shows it (exit 2, as click does).
    assert spool.run("enqueue", "--help").stdout.startswith("Usage: spoolq enqueue")
    bare = subprocess.run(SPOOLQ, capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and bare.stderr.startswith("Usage: spoolq")


def test_requests_that_cannot_be_done_exit_1(spool):
    for args in (["show", "nope"], ["cancel", "nope"], ["retry", "nope"]):
        proc = spool.run(*args, check=False)
        assert proc.returncode == 1, args
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_commands_on_a_missing_spool_say_so(tmp_path):
    s = SpoolFixture(tmp_path / "missing")
    for args in (["status"], ["list"], ["show", "x"], ["sweep"]):
        proc = s.run(*args, check=False)
        assert proc.returncode == 1 and "is not a spool (create one with: spoolq -s" in proc.stderr, args


def test_a_spool_path_that_is_a_file_or_not_a_spool_says_which(tmp_path):
    """Regression (audit): a file as the spool gave 'cannot read
    FILE/config.json: Not a directory' (exit 2); a spool without new/ was
    called missing."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    s = SpoolFixture(afile)
    for args in (["enqueue", "true"], ["status"], ["list"], ["work"], ["config", "list"]):
        proc = s.run(*args, check=False)
        assert proc.returncode == 1 and proc.stderr == f"spoolq: {afile} exists and is not a directory\n", (args, proc.stderr)
    assert afile.read_text() == "keep me"
    s = SpoolFixture(tmp_path / "spool")
    s.run("init")
    os.rmdir(s.path / "new")
    for args in (["status"], ["list"]):
        proc = s.run(*args, check=False)
        assert proc.returncode == 1 and "is not a spool (create one with: spoolq -s" in proc.stderr, args


def test_enqueue_says_the_job_is_in_when_stdout_cannot_take_its_id(spool):
    """Regression (audit): with stdout closed or full, enqueue queued the job
    and then failed with 'internal error'; a producer retrying that would
    queue it twice."""
    for redirect in (">&-", "> /dev/full"):
        proc = subprocess.run(["/bin/sh", "-c", f'"$@" -s "$SPOOL" enqueue true {redirect}', "sh", *SPOOLQ],
                              capture_output=True, text=True, timeout=60, env=dict(os.environ, SPOOL=str(spool.path)))
        assert proc.returncode == 1, (redirect, proc.stderr)
        assert proc.stderr.startswith("spoolq: enqueued ") and "but cannot print the id" in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1
        job_id = proc.stderr.split()[2].rstrip(",")
        assert spool.where(job_id) == ["new"]
    assert len(spool.ids("new")) == 2


def test_odd_names_cannot_break_line_output(fast_spool):
    """Regression (audit): a dropped file named with a newline split its line
    in `list` and `retry --all` output."""
    s = fast_spool
    s.drop("a\nb.json", '{"command": "true"}')
    s.work()
    assert s.names("dead") == ["a\nb.json"]
    lines = s.run("list").stdout.splitlines()
    assert len(lines) == 1 and "a\\nb" in lines[0]
    proc = s.run("retry", "--all", check=False)  # refused (no valid id), said on one line
    assert proc.returncode == 1 and proc.stdout == "" and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("spoolq: cannot retry 'a\\nb': ")


def test_retry_of_an_entry_in_dead_that_is_not_a_file_says_so(fast_spool):
    s = fast_spool
    (s.path / "new" / "dirjob").mkdir()
    s.work()
    assert s.names("dead") == ["dirjob"]
    proc = s.run("retry", "dirjob", check=False)
    assert proc.returncode == 1
    assert proc.stderr == "spoolq: dead/dirjob is not a regular file, so not a job to retry; move or remove it by hand\n"


def test_retry_of_an_invalid_dead_file_says_why_and_how_to_fix_it(fast_spool):
    """A dead file that can never run is not moved back to new/ (it would
    only die again): retry says why and what to do, exit 1, and --all goes
    on with the others. A file under a name that is no valid id is shown by
    the name `list` prints, and retry says how to give it a valid one."""
    s = fast_spool
    s.drop("broken.json", '{"command": ')
    s.drop("badfield.json", '{"command": "true", "max_attempts": 0}')
    s.drop("bad name.json", '{"command": "echo renamed"}')
    good = s.enqueue("--max-attempts", "1", "false")
    s.work()
    assert sorted(s.ids("dead")) == sorted(["broken", "badfield", "bad name", good])
    dead = s.path / "dead"
    before = {n: (dead / n).read_bytes() for n in os.listdir(dead)}
    proc = s.run("retry", "broken", check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (f"spoolq: cannot retry broken: not valid JSON: Expecting value at line 1 column 13; "
                           f"fix the file ({dead / 'broken.json'}) or remove it\n")
    listed = [line.split()[1:3] for line in s.run("list", "--state", "dead").stdout.splitlines()]
    assert ["bad", "name"] in listed
    shown = s.show("bad name")
    assert shown["state"] == "dead" and "bad file name" in shown["error"]
    assert s.run("show", "bad name").stdout.startswith("command: echo renamed")
    rename = (f"spoolq: cannot retry 'bad name': id 'bad name' is not 1-128 characters of A-Z a-z 0-9 . _ -; "
              f"give it a valid id, e.g. mv '{dead / 'bad name.json'}' {dead / 'bad_name.json'}, then retry bad_name\n")
    proc = s.run("retry", "bad name", check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", rename)
    proc = s.run("retry", "--all", check=False)
    assert proc.returncode == 1 and proc.stdout == f"{good}\n"
    assert proc.stderr.splitlines() == [
        rename.rstrip("\n"),
        f"spoolq: cannot retry badfield: max_attempts must be an integer >= 1, not 0; fix the file ({dead / 'badfield.json'}) or remove it",
        f"spoolq: cannot retry broken: not valid JSON: Expecting value at line 1 column 13; fix the file ({dead / 'broken.json'}) or remove it",
    ]
    assert {n: (dead / n).read_bytes() for n in os.listdir(dead)} == {n: b for n, b in before.items() if n != f"{good}.json"}
    # As told: renamed, retried, run.
    os.rename(dead / "bad name.json", dead / "bad_name.json")
    assert s.run("retry", "bad_name").stdout == "bad_name\n"
    s.work()
    assert s.show("bad_name")["stdout"] == "renamed\n"
    # A name that no file has is still invalid input.
    proc = s.run("retry", "no such", check=False)
    assert proc.returncode == 2 and proc.stderr == "spoolq: id 'no such' is not 1-128 characters of A-Z a-z 0-9 . _ -\n"


def test_status_list_and_show(fast_spool):
    s = fast_spool
    ok = s.enqueue("echo out; echo err >&2")
    bad = s.enqueue("--max-attempts", "1", "exit 7")
    later = s.enqueue("--in", "1h", "true")
    s.work()
    st = s.status()
    assert {k: st[k] for k in STATES} == {"new": 1, "cur": 0, "failed": 0, "dead": 1, "done": 1}
    assert st["workers"] == []
    human = s.run("status").stdout
    assert "new" in human and "dead" in human
    lines = [json.loads(line) for line in s.run("list", "--json").stdout.splitlines()]
    assert {j["id"]: j["state"] for j in lines} == {ok: "done", bad: "dead", later: "new"}
    assert [j["id"] for j in lines][-1] == later  # oldest first by due/finish time: the delayed one last
    assert [j["id"] for j in map(json.loads, s.run("list", "--json", "--state", "dead").stdout.splitlines())] == [bad]
    assert len(s.run("list", "--limit", "2").stdout.splitlines()) == 2
    done = s.show(ok)
    assert done["state"] == "done" and done["outcome"] == "succeeded"
    assert done["stdout"] == "out\n" and done["stderr"] == "err\n" and done["exit_code"] == 0
    dead = s.show(bad)
    assert dead["state"] == "dead" and dead["exit_code"] == 7 and dead["error"] == "exit status 7"
    assert len(dead["history"]) == 1 and dead["history"][0]["attempt"] == 1
    text = s.run("show", ok).stdout
    assert "outcome: succeeded" in text and "| out" in text


def test_config_list_get_set(spool):
    spool.run("config", "set", "max_attempts", "7")
    spool.run("config", "set", "fsync", "off")
    spool.run("config", "set", "trusted_users", "www-data,nobody")
    spool.run("config", "set", "backoff_initial", "1.5")
    assert spool.run("config", "get", "max_attempts").stdout.strip() == "7"
    assert spool.run("config", "get", "fsync").stdout.strip() == "false"
    assert json.loads(spool.run("config", "get", "trusted_users").stdout) == ["www-data", "nobody"]
    listing = spool.run("config", "list").stdout
    assert "backoff_initial = 1.5" in listing and "rescan_interval = 30" in listing
    stored = json.loads((spool.path / "config.json").read_text())
    assert stored == {"max_attempts": 7, "fsync": False, "trusted_users": ["www-data", "nobody"], "backoff_initial": 1.5}
    for key, value in [("max_attempts", "0"), ("backoff_factor", "0.5"), ("fsync", "maybe"),
                       ("output_limit", "-1"), ("rescan_interval", "0"), ("timeout", "abc")]:
        proc = spool.run("config", "set", key, value, check=False)
        assert proc.returncode == 2 and key in proc.stderr


def test_duration_settings_take_the_duration_syntax_of_the_options(fast_spool):
    """Settings in seconds accept what --timeout and --in accept (5m, 1h30m),
    from `config set` and from a config.json written by hand; config.json
    and `config get` hold plain seconds."""
    s = fast_spool
    for key, value, seconds in [("timeout", "5m", 300), ("timeout_grace", "1.5s", 1.5), ("backoff_initial", "1m30s", 90),
                                ("backoff_max", "2h", 7200), ("rescan_interval", "10 min", 600)]:
        proc = s.run("config", "set", key, value)
        assert proc.stdout == f"{key} = {json.dumps(seconds)}\n"
        assert s.run("config", "get", key).stdout.strip() == json.dumps(seconds)
        assert json.loads((s.path / "config.json").read_text())[key] == seconds
    proc = s.run("config", "set", "timeout", "5 parsecs", check=False)
    assert proc.returncode == 2
    assert proc.stderr == "spoolq: timeout must be a duration (like 90, 5m, 1h30m, 7d), not '5 parsecs'\n"
    proc = s.run("config", "set", "timeout", "3651d", check=False)
    assert proc.returncode == 2 and "(given as '3651d')" in proc.stderr and proc.stderr.count("\n") == 1
    # Written by hand: the same syntax, and it takes effect.
    stored = json.loads((s.path / "config.json").read_text())
    (s.path / "config.json").write_text(json.dumps(dict(stored, timeout="1s", timeout_grace="1s")))
    assert s.run("config", "get", "timeout").stdout.strip() == "1"
    job = s.enqueue("--max-attempts", "1", "sleep 60")
    began = time.monotonic()
    s.work()
    assert time.monotonic() - began < 30
    assert s.where(job) == ["dead"] and "timed out" in s.show(job)["error"]


def test_trusted_users_must_exist_here_or_be_numeric_uids(spool):
    """A misspelt user name would trust nobody without a word: refused.
    A numeric uid need not have a name on this system."""
    proc = spool.run("config", "set", "trusted_users", "nobody,no-such-user", check=False)
    assert proc.returncode == 2
    assert proc.stderr == "spoolq: trusted_users: no user 'no-such-user' on this system (give a user name or a numeric uid)\n"
    assert not (spool.path / "config.json").exists() or "trusted_users" not in json.loads((spool.path / "config.json").read_text())
    assert spool.run("config", "set", "trusted_users", "nobody,64999").stdout == 'trusted_users = ["nobody", "64999"]\n'
    # One written by hand that no longer resolves does not stop the spool.
    (spool.path / "config.json").write_text('{"trusted_users": ["gone-user"]}')
    assert spool.status()["new"] == 0


def test_a_broken_config_file_is_a_clear_error(spool):
    (spool.path / "config.json").write_text("{not json")
    proc = spool.run("work", check=False)
    assert proc.returncode == 2 and "config.json" in proc.stderr and "Traceback" not in proc.stderr
    (spool.path / "config.json").write_text('{"max_attempts": -3}')
    proc = spool.run("enqueue", "true", check=False)
    assert proc.returncode == 2 and "max_attempts" in proc.stderr


def test_list_pipe_closed_early_is_quiet(fast_spool):
    import subprocess

    from conftest import SPOOLQ

    fast_spool.run("enqueue", "--jsonl", "-", input='{"command": "true"}\n' * 200)
    proc = subprocess.run(" ".join(SPOOLQ) + f" -s {fast_spool.path} list | head -1", shell=True,
                          capture_output=True, text=True)
    assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr
    assert len(proc.stdout.splitlines()) == 1


def _via_click(*args: str, env: dict | None = None):
    """The same command line parsed by the click CLI, not the quick path."""
    code = "import sys; from spoolq.cli import main; sys.argv[0] = 'spoolq'; main()"
    full_env = {k: v for k, v in os.environ.items() if k != "SPOOLQ_DIR"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=full_env, timeout=60)


def test_plain_show_skips_click_and_prints_what_click_prints(fast_spool, tmp_path):
    s = fast_spool
    done = s.enqueue("printf 'line1\\nline2\\n'; echo oops >&2")
    dead = s.enqueue("--max-attempts", "1", "exit 3")
    s.work()
    s.run("compact")  # `done` is now only in index.db
    waiting = s.enqueue("--in", "1h", "--id", "later", "true")
    (s.path / "new" / "broken.json").write_bytes(b"{not json")
    (s.path / "new" / "moved.json").write_bytes(b'{"command": "true"}')
    os.rename(s.path / "new" / "moved.json", s.path / "dead" / "moved.json")
    spool = str(s.path)
    lines = [
        ["-s", spool, "show", job] for job in (done, dead, waiting, "broken", "moved")
    ] + [
        ["-s", spool, "show", done, "--json"],
        ["-s", spool, "show", "--json", dead],
        [f"--spool={spool}", "show", waiting],
        [f"-s{spool}", "show", "broken", "--json"],
        ["-s", spool, "show", "no-such-job"],
        ["-s", spool, "show", "../etc"],
        ["-s", str(tmp_path / "missing"), "show", done],
    ]
    for args in lines:
        quick = subprocess.run(SPOOLQ + args, capture_output=True, text=True, timeout=60)
        slow = _via_click(*args)
        assert (quick.returncode, quick.stdout, quick.stderr) == (slow.returncode, slow.stdout, slow.stderr), args
        assert "Traceback" not in quick.stderr
    assert "compacted: true" in quick_show(s, done) and "  | line2" in quick_show(s, done)
    # $SPOOLQ_DIR is honoured the same way.
    env = {k: v for k, v in os.environ.items() if k != "SPOOLQ_DIR"} | {"SPOOLQ_DIR": spool}
    quick = subprocess.run(SPOOLQ + ["show", dead], capture_output=True, text=True, env=env, timeout=60)
    assert quick.returncode == 0 and quick.stdout == _via_click("show", dead, env={"SPOOLQ_DIR": spool}).stdout
    # The quick path really does not import click; other forms still go through it.
    importtime = subprocess.run([sys.executable, "-X", "importtime", "-m", "spoolq", "-s", spool, "show", done],
                                capture_output=True, text=True, timeout=60)
    assert importtime.returncode == 0 and "spoolq.dirspool.index" in importtime.stderr
    assert " click" not in importtime.stderr
    usage = subprocess.run(SPOOLQ + ["-s", spool, "show", "--nope", done], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "No such option" in usage.stderr


def quick_show(s: SpoolFixture, job_id: str) -> str:
    return s.run("show", job_id).stdout


def test_an_empty_spool_path_is_refused_not_taken_for_the_current_directory(tmp_path):
    """`spoolq -s "$UNSET" init` must not lay a spool out in the cwd."""
    for args in (["init"], ["show", "x"], ["enqueue", "true"]):
        proc = subprocess.run(SPOOLQ + ["-s", "", *args], capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert proc.returncode == 2 and "must not be empty" in proc.stderr, args
    assert os.listdir(tmp_path) == []


def test_a_hostile_id_is_invalid_input_said_on_one_line(spool):
    """An id no job can have is invalid input (exit 2, as for enqueue --id),
    not a job that was not found (1); retry acts on none of its ids then."""
    dead = spool.enqueue("--max-attempts", "1", "false")
    spool.work()
    for job_id in ("a\nb", "../etc", "x" * 300):
        for args in (["show", job_id], ["cancel", job_id], ["retry", dead, job_id]):
            proc = spool.run(*args, check=False)
            assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, args
            assert proc.stderr.startswith("spoolq: id ") and proc.stdout == ""
    assert spool.where(dead) == ["dead"]


def test_a_worker_started_with_stdout_and_stderr_closed_still_works(spool):
    """Regression (audit follow-up): logging to a closed stderr made `work`
    exit 1 after it had run the jobs."""
    spool.enqueue("--id", "ok", "true")
    spool.enqueue("--id", "bad", "--max-attempts", "1", "exit 3")
    proc = subprocess.run(["/bin/sh", "-c", '"$@" -s "$SPOOL" work >&- 2>&-', "sh", *SPOOLQ],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, SPOOL=str(spool.path)))
    assert proc.returncode == 0
    assert spool.where("ok") == ["done"] and spool.where("bad") == ["dead"]


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def _module_files_of_the_command(module: str) -> list[str]:
    """The files the spoolq command opens to import ``module`` (its source
    and its compiled form), asked of the command's interpreter started as
    the command is: the script's folder first on its path, or this
    directory for ``python -m``. Not this process's: run from a checkout
    (``python -m pytest``), it imports the checkout's copy while the command
    may run an installed one."""
    where = os.path.dirname(SPOOLQ[0]) if len(SPOOLQ) == 1 else None
    code = ("import importlib.util as u, sys\n"
            "origin = u.find_spec(sys.argv[1]).origin\n"
            "print(origin)\n"
            "print(u.cache_from_source(origin))\n")
    proc = subprocess.run([sys.executable, "-c", code, module], cwd=where, capture_output=True, text=True, check=True)
    return proc.stdout.splitlines()


def test_ctrl_c_while_the_command_starts_up_is_one_line(spool):
    """Audit: SIGINT in the first few hundred milliseconds, while Python
    imports the CLI, printed a KeyboardInterrupt traceback. strace sends it
    as the command opens the CLI's module (whichever of its source and its
    compiled form Python opens)."""
    source, compiled = _module_files_of_the_command("spoolq.cli")
    proc = subprocess.run(["strace", "-qq", "-o", os.devnull, "-P", source, "-P", compiled,
                           "-e", "trace=openat", "-e",
                           "inject=openat:signal=INT:when=1", *SPOOLQ, "-s", str(spool.path), "status"],
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (130, "spoolq: interrupted\n")


def test_list_marks_cancelled_jobs_and_status_counts_purged_dead_ones(fast_spool):
    """Audit: in `list --state done` a cancelled job looked like one that
    succeeded, and dead jobs purged into the index vanished from `status`."""
    s = fast_spool
    s.enqueue("--id", "ran", "true")
    s.enqueue("--id", "called-off", "--in", "1h", "true")
    s.enqueue("--id", "broken", "--max-attempts", "1", "false")
    s.run("cancel", "called-off")
    s.work()
    lines = {line.split()[1]: line for line in s.run("list", "--state", "done").stdout.splitlines()}
    assert lines["called-off"].endswith("[cancelled]") and "[" not in lines["ran"]
    s.run("purge", "--dead", "--older-than", "0", "--yes")
    dead_line = next(line for line in s.run("status").stdout.splitlines() if line.startswith("dead"))
    assert dead_line.split() == ["dead", "0", "(and", "1", "purged", "into", "index.db)"]


def test_a_json_object_given_as_the_command_is_refused(fast_spool):
    """Audit: `spoolq enqueue '{"command": "true", "bogus": }'` (a typo in a
    job meant for --json) was enqueued as a shell command and failed five
    times. A shell group, "{ cmd; }", still runs."""
    s = fast_spool
    proc = s.run("enqueue", '{"command": "true", "bogus": }', check=False)
    assert (proc.returncode, proc.stderr) == (2, "spoolq: the command looks like a JSON job object; give it with --json\n")
    assert s.ids("new") == []
    job_id = s.enqueue("{ echo grouped; }")
    s.work()
    assert s.show(job_id)["stdout"] == "grouped\n"


def test_prometheus_reports_a_broken_config_as_a_metric_and_still_prints_the_others(fast_spool):
    """The metrics cron job must not go stale on a broken config.json:
    status --prometheus says what is wrong on one stderr line, exports
    spoolq_config_ok 0 with every other metric (read with the default
    settings), and exits 0, so the cron line still publishes the file."""
    from prometheus_client.parser import text_string_to_metric_families

    s = fast_spool
    s.enqueue("true")
    s.work("-q")

    def scrape(config: str | None):
        if config is not None:
            (s.path / "config.json").write_text(config)
        proc = s.run("status", "--prometheus", check=False)
        fam = {f.name: f for f in text_string_to_metric_families(proc.stdout)}
        return proc, fam

    for broken in ('{"fsync": false,', '{"max_attempts": "many"}', "[1, 2]"):
        proc, fam = scrape(broken)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.startswith("spoolq: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert "config.json" in proc.stderr and "default settings" in proc.stderr
        assert fam["spoolq_config_ok"].samples[0].value == 0
        assert {x.labels["state"]: x.value for x in fam["spoolq_jobs"].samples}["done"] == 1
        assert {x.labels["result"]: x.value for x in fam["spoolq_runs"].samples} == {"succeeded": 1, "failed": 0}
        assert s.run("status", check=False).returncode == 2  # other commands still refuse it
    proc, fam = scrape('{"fsync": false}')
    assert proc.returncode == 0 and proc.stderr == ""
    assert fam["spoolq_config_ok"].samples[0].value == 1


def _app_in(folder, mode: int) -> str:
    folder.mkdir()
    (folder / "planted_app.py").write_text(
        "import os\nopen(os.path.join(os.path.dirname(__file__), 'imported'), 'w').close()\n"
        "HANDLERS = {'hello': lambda p: 'hello ' + p}\n")
    os.chmod(folder, mode)
    return str(folder)


def test_app_is_not_imported_from_a_current_directory_others_can_write(tmp_path):
    """A module another user planted in a shared folder (/tmp, a group's
    folder) would run as the worker: --app does not import from there."""
    s = SpoolFixture(tmp_path / "spool")
    s.run("init")
    shared = _app_in(tmp_path / "shared", 0o777)
    job_id = s.enqueue("--kind", "hello", "--payload", '"you"')
    proc = s.run("work", "--app", "planted_app:HANDLERS", cwd=shared, check=False)
    assert not os.path.exists(os.path.join(shared, "imported"))
    assert proc.returncode == 2 and s.where(job_id) == ["new"]
    assert proc.stderr == (f"spoolq: --app: {shared} is writable by others, so it is not put on the import path; "
                           "run from a directory only you can write, or install the module\n")
    # Installed (here: on PYTHONPATH, which the user chose), it is imported wherever the worker runs.
    proc = s.run("work", "--app", "planted_app:HANDLERS", cwd=str(tmp_path), env={"PYTHONPATH": shared})
    assert s.show(job_id)["result"] == "hello you"


def test_app_is_imported_from_the_users_own_0755_current_directory(tmp_path):
    s = SpoolFixture(tmp_path / "spool")
    s.run("init")
    own = _app_in(tmp_path / "app", 0o755)
    job_id = s.enqueue("--kind", "hello", "--payload", '"me"')
    s.run("work", "--app", "planted_app:HANDLERS", cwd=own)
    assert s.show(job_id)["result"] == "hello me" and os.path.exists(os.path.join(own, "imported"))


def test_init_names_a_group_that_does_not_exist_even_an_empty_one(tmp_path):
    from conftest import SpoolFixture

    s = SpoolFixture(tmp_path / "spool")
    for group in ("", "no-such-group-here"):
        proc = s.run("init", "--group", group, check=False)
        assert proc.returncode == 2 and proc.stderr == f"spoolq: --group: no such group: {group!r}\n", proc.stderr
