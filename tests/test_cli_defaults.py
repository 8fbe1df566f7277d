"""What a user meets first: where jobs run, how `enqueue` reads its
arguments, which spool a command uses and what it says when that is no spool,
and shell completion of job ids."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import SPOOLQ, SpoolFixture


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SPOOLQ_DIR", None)
    env.update(extra)
    return env


def test_help_shows_the_spool_in_use(tmp_path):
    where = "/srv/queue-from-env"  # only shown, never opened
    proc = subprocess.run(SPOOLQ + ["--help"], env=_env(SPOOLQ_DIR=where), capture_output=True, text=True)
    assert proc.returncode == 0 and f"[default: {where}]" in proc.stdout and "[default: spool]" not in proc.stdout
    proc = subprocess.run(SPOOLQ + ["--help"], env=_env(), capture_output=True, text=True)
    assert "[default: spool]" in proc.stdout


def test_several_words_are_an_argv_job_and_one_is_a_shell_command(fast_spool, tmp_path):
    """`spoolq enqueue make report`, as nq and tsp users type it: a program
    and its arguments; everything after the first word is the command's,
    options included."""
    s = fast_spool
    several = s.enqueue("printf", "%s|", "a b", "-l")
    assert s.record("new", several)["argv"] == ["printf", "%s|", "a b", "-l"]
    listing = s.enqueue("--id", "ls-l", "ls", "-l", "--id", "x")
    assert s.record("new", listing)["argv"] == ["ls", "-l", "--id", "x"] and listing == "ls-l"
    one = s.enqueue("echo one; echo two")
    assert s.record("new", one)["command"] == "echo one; echo two" and "argv" not in s.record("new", one)
    dashed = s.enqueue("--", "-x", "y")
    assert s.record("new", dashed)["argv"] == ["-x", "y"]
    assert s.record("new", s.enqueue("--argv", "true"))["argv"] == ["true"]
    s.work(check=False)
    assert s.show(several)["stdout"] == "a b|-l|" and s.show(several)["state"] == "done"
    assert s.show(one)["stdout"] == "one\ntwo\n"
    proc = s.run("enqueue", '{"command": "true"}', "x", check=False)
    assert (proc.returncode, proc.stderr) == (2, "spoolq: the command looks like a JSON job object; give it with --json\n")
    proc = s.run("enqueue", "--kind", "k", "a", "b", check=False)
    assert (proc.returncode, proc.stderr) == (2, "spoolq: give exactly one of: a command (a shell command, or PROG ARG...), "
                                                 "--kind K, --json JSON, --jsonl FILE\n")


def test_a_shell_command_starting_with_a_dash_runs_as_a_command(fast_spool, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "-hello"
    script.write_text("#!/bin/sh\necho hello from a dash\n")
    script.chmod(0o755)
    s = fast_spool
    job_id = s.enqueue("--env", f"PATH={bin_dir}:/usr/bin:/bin", "--max-attempts", "1", "--", "-hello")
    assert s.record("new", job_id)["command"] == "-hello"
    s.work(check=False)
    job = s.show(job_id)
    assert (job["state"], job.get("stdout")) == ("done", "hello from a dash\n"), job


_PRINT_CWD = ["python3", "-c", "import os; print(os.getcwd())"]


def test_enqueue_records_the_directory_it_ran_in(fast_spool, tmp_path):
    """As at, nq and tsp do: `./nightly.sh` runs where it was enqueued, not
    wherever the worker was started. A relative --cwd, or cwd in --json and
    --jsonl input, is taken from the enqueuer's directory."""
    s = fast_spool
    here, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (here / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    plain = s.enqueue(*_PRINT_CWD, cwd=str(here))
    shell = s.enqueue("pwd -P", cwd=str(here))
    relative = s.enqueue("--cwd", "sub", *_PRINT_CWD, cwd=str(here))
    given = s.enqueue("--cwd", str(elsewhere), *_PRINT_CWD, cwd=str(here))
    in_json = s.enqueue("--json", json.dumps({"argv": _PRINT_CWD, "cwd": "sub"}), cwd=str(here))
    json_default = s.enqueue("--json", json.dumps({"argv": _PRINT_CWD}), cwd=str(here))
    in_jsonl = s.run("enqueue", "--jsonl", "-", input=json.dumps({"argv": _PRINT_CWD, "cwd": "./sub/"}) + "\n",
                     cwd=str(here)).stdout.strip()
    handler = s.enqueue("--kind", "k", cwd=str(here))
    assert s.record("new", plain)["cwd"] == str(here)
    assert s.record("new", relative)["cwd"] == s.record("new", in_json)["cwd"] == str(here / "sub")
    assert s.record("new", in_jsonl)["cwd"] == str(here / "sub")
    assert "cwd" not in s.record("new", handler)  # a handler runs in the worker: no directory of its own
    s.run("cancel", handler)
    s.work(cwd=str(elsewhere))
    for job_id, where in ((plain, here), (shell, here), (relative, here / "sub"), (given, elsewhere),
                          (in_json, here / "sub"), (json_default, here), (in_jsonl, here / "sub")):
        assert s.show(job_id)["stdout"] == f"{where}\n", job_id


def test_the_api_makes_a_relative_cwd_absolute_and_leaves_a_missing_one_out(tmp_path, monkeypatch):
    from spoolq import Spool

    q = Spool(tmp_path / "spool")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    relative = q.enqueue(command="true", cwd="sub")
    many = q.enqueue_many([{"command": "true", "cwd": "sub"}, {"command": "true"}])
    missing = q.enqueue(command="true")
    assert q.get(relative)["cwd"] == q.get(many[0])["cwd"] == str(tmp_path / "sub")
    assert "cwd" not in q.get(many[1]) and "cwd" not in q.get(missing)


def _home() -> str:
    import pwd

    try:
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        return "/"
    return os.path.realpath(home) if home and os.path.isdir(home) else "/"


def test_a_job_without_cwd_runs_in_the_users_home_wherever_the_worker_started(fast_spool, tmp_path):
    """A file dropped from a plain shell has no cwd: it runs in the home
    directory of the user the worker runs as (from the password database,
    not $HOME), not in whatever directory the worker was started in."""
    s = fast_spool
    ids = []
    for i, start in enumerate((tmp_path, tmp_path / "spool" / "new", tmp_path)):
        s.drop(f"plain-{i}.json", json.dumps({"argv": _PRINT_CWD}))
        s.drop(f"shell-{i}.json", json.dumps({"command": "pwd -P"}))
        s.drop(f"dot-{i}.json", json.dumps({"argv": _PRINT_CWD, "cwd": "."}))
        ids += [f"plain-{i}", f"shell-{i}", f"dot-{i}"]
        s.work(cwd=str(start), env={"HOME": str(tmp_path)})
    for job_id in ids:
        job = s.show(job_id)
        assert (job["state"], os.path.realpath(job["stdout"].strip())) == ("done", _home()), job


READERS = (["work"], ["work", "--watch", "--max-time", "1"], ["work", "-j", "2"], ["status"], ["status", "--prometheus"],
           ["list"], ["show", "x"], ["show", "x", "--json"], ["sweep"], ["compact"], ["stats"],
           ["purge", "--dead", "--older-than", "1d"], ["cancel", "x"], ["retry", "x"], ["retry", "--all"],
           ["dlq", "list"], ["dlq", "retry", "x"], ["config", "list"], ["config", "get", "timeout"],
           ["config", "set", "timeout", "5"])


def test_commands_that_read_or_consume_refuse_a_path_that_is_not_a_spool(tmp_path):
    """`spoolq work` in the wrong directory made an empty spool and exited 0,
    so a cron line without SPOOLQ_DIR never ran a job and never said why."""
    missing, empty = tmp_path / "missing", tmp_path / "empty dir"
    empty.mkdir()
    for path in (missing, empty):
        expected = f"spoolq: {path} is not a spool (create one with: spoolq -s '{path}' init)\n".replace(
            f"'{missing}'", str(missing))
        for args in READERS:
            for how in ("-s", "env") if args[0] in ("work", "show") else ("-s",):
                if how == "-s":
                    proc = SpoolFixture(path).run(*args, check=False)
                else:  # SPOOLQ_DIR, and the quick path of `show`
                    proc = subprocess.run(SPOOLQ + args, env=_env(SPOOLQ_DIR=str(path)), capture_output=True,
                                          text=True, timeout=60)
                assert (proc.returncode, proc.stderr, proc.stdout) == (1, expected, ""), (path, args, how)
        assert not missing.exists() and os.listdir(empty) == []
    cron_like = subprocess.run(SPOOLQ + ["work", "-q"], env=_env(), cwd=str(empty), capture_output=True, text=True)
    assert cron_like.returncode == 1 and cron_like.stderr == (
        f"spoolq: {empty / 'spool'} is not a spool (create one with: spoolq -s '{empty / 'spool'}' init)\n")


def test_the_api_raises_not_a_spool_when_reading_and_creates_when_writing(tmp_path):
    import pytest

    from spoolq import Spool
    from spoolq.protocol import NotASpool, SpoolError

    for path in (tmp_path / "missing", tmp_path):
        q = Spool(path)
        for call in (q.status, lambda: q.get("x"), lambda: list(q.list()), q.stats, lambda: q.cancel("x")):
            with pytest.raises(NotASpool, match="is not a spool \\(create one with: spoolq -s .* init\\)") as e:
                call()
            assert isinstance(e.value, SpoolError) and e.value.path == str(path)
    q = Spool(tmp_path / "made")
    q.enqueue(command="true")
    assert q.status()["new"] == 1


def _complete(words: str, cword: int, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(SPOOLQ, env=_env(_SPOOLQ_COMPLETE="bash_complete", COMP_WORDS=words, COMP_CWORD=str(cword), **env),
                          capture_output=True, text=True, timeout=60)


def test_shell_completion_offers_the_job_ids_a_command_can_take(fast_spool, tmp_path):
    s = fast_spool
    for job_id in ("ab-waiting", "ab-broken", "ab-ran", "other"):
        s.enqueue("--id", job_id, "--max-attempts", "1", "false" if job_id == "ab-broken" else "true")
    s.work("--max-jobs", "2", check=False)  # ab-waiting and ab-broken run first (oldest)
    s.drop(".hidden.json", '{"command": "true"}')
    assert s.where("ab-broken") == ["dead"] and s.where("ab-waiting") == ["done"]
    cases = [
        (f"spoolq -s {s.path} show ab", 4, {}, ["ab-broken", "ab-ran", "ab-waiting"]),
        ("spoolq show ab", 2, {"SPOOLQ_DIR": str(s.path)}, ["ab-broken", "ab-ran", "ab-waiting"]),
        (f"spoolq -s {s.path} cancel ", 4, {}, ["ab-ran", "other"]),  # only waiting jobs can be cancelled
        (f"spoolq -s {s.path} retry ab", 4, {}, ["ab-broken"]),  # only dead ones retried
        (f"spoolq -s {s.path} retry ab-broken ab", 5, {}, ["ab-broken"]),
        (f"spoolq -s {s.path} dlq retry a", 5, {}, ["ab-broken"]),
    ]
    for words, cword, env, expected in cases:
        proc = _complete(words, cword, **env)
        assert (proc.returncode, proc.stderr) == (0, ""), words
        assert proc.stdout.splitlines() == [f"plain,{i}" for i in expected], words
    for words, cword in ((f"spoolq -s {tmp_path / 'missing'} show a", 4), ("spoolq -s '' show a", 4)):
        proc = _complete(words, cword)
        assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "", ""), words


def test_spoolq_drop_records_the_directory_it_ran_in(fast_spool, tmp_path):
    from conftest import ROOT

    here = tmp_path / 'odd "dir"\\ name'
    here.mkdir()
    proc = subprocess.run([str(ROOT / "contrib" / "spoolq-drop"), "-s", str(fast_spool.path), "pwd", "-P"],
                          cwd=str(here), capture_output=True, text=True, check=True)
    job_id = proc.stdout.strip()
    assert fast_spool.record("new", job_id)["cwd"] == str(here)
    fast_spool.work(cwd=str(tmp_path))
    assert fast_spool.show(job_id)["stdout"] == f"{here}\n"


def test_a_quoted_command_followed_by_more_words_is_refused(spool):
    """`spoolq enqueue 'echo a' --in 5m`: options given after a quoted shell
    command would become argv words of a job that fails at every run."""
    proc = spool.run("enqueue", "echo a", "--in", "5m", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "'echo a' is a quoted shell command" in proc.stderr and "options go before the command" in proc.stderr
    assert spool.names("new") == []
    job_id = spool.enqueue("--argv", "my program", "arg")  # explicitly an argv job: allowed
    assert spool.record("new", job_id)["argv"] == ["my program", "arg"]
