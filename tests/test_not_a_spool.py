"""Every command but `init` refuses a path that is not a spool, `enqueue`
included, and no command takes a path inside a spool for a spool: a
mistyped `-s` or SPOOLQ_DIR must fail loudly, not make a spool that no
worker reads."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

from conftest import ROOT, SPOOLQ, SpoolFixture

ENQUEUES = (["enqueue", "true"], ["enqueue", "make", "report"], ["enqueue", "--kind", "k"],
            ["enqueue", "--json", '{"command": "true"}'], ["enqueue", "--jsonl", "-"], ["enqueue", '{"argv": ["true"]}'])
EVERY = ENQUEUES + (["work"], ["status"], ["list"], ["show", "x"], ["cancel", "x"], ["retry", "x"], ["sweep"], ["compact"],
                    ["purge", "--dead", "--older-than", "30d"], ["stats"], ["config", "list"], ["config", "get", "timeout"],
                    ["config", "set", "timeout", "5"], ["dlq", "list"], ["bench", "--section", "enqueue"])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SPOOLQ_DIR"}
    env.update(extra)
    return env


def test_enqueue_refuses_a_path_that_is_not_a_spool_and_creates_nothing(tmp_path):
    missing, empty = tmp_path / "typo", tmp_path / "empty"
    empty.mkdir()
    for path in (missing, empty):
        expected = f"spoolq: {path} is not a spool (create one with: spoolq -s {shlex.quote(str(path))} init)\n"
        for args in ENQUEUES:
            proc = SpoolFixture(path).run(*args, input='{"command": "true"}\n', check=False)
            assert (proc.returncode, proc.stderr, proc.stdout) == (1, expected, ""), args
            by_env = subprocess.run(SPOOLQ + args, env=_env(SPOOLQ_DIR=str(path)), input='{"command": "true"}\n',
                                    capture_output=True, text=True, timeout=60)
            assert (by_env.returncode, by_env.stderr) == (1, expected), args
    assert not missing.exists() and os.listdir(empty) == []
    # from a directory without ./spool, as a producer with no SPOOLQ_DIR would run it
    proc = subprocess.run(SPOOLQ + ["enqueue", "true"], env=_env(), cwd=str(empty), capture_output=True, text=True)
    assert proc.returncode == 1 and "is not a spool" in proc.stderr and os.listdir(empty) == []
    s = SpoolFixture(missing)
    s.run("init")
    assert len(s.ids("new")) == 0 and s.enqueue("true") in s.ids("new")


def test_a_path_inside_a_spool_is_refused_naming_the_spool(spool, tmp_path):
    (spool.path / "done" / "sub").mkdir()
    (spool.path / "archive").mkdir()
    before = sorted(str(p) for p in spool.path.rglob("*"))
    root = str(spool.path)
    cases = {spool.path / "new": f"the new/ folder of the spool {root}",
             spool.path / "done" / "sub": f"inside the spool {root}",
             spool.path / "failed" / "typo": f"inside the spool {root}",
             spool.path / "archive": f"inside the spool {root}"}
    for path, where in cases.items():
        expected = f"spoolq: {path} is {where}, not a spool; did you mean -s {root}?\n"
        for args in EVERY + (["init"],):
            proc = SpoolFixture(path).run(*args, input="", check=False)
            assert (proc.returncode, proc.stderr, proc.stdout) == (1, expected, ""), (path, args)
        show = subprocess.run(SPOOLQ + ["show", "x"], env=_env(SPOOLQ_DIR=str(path)), capture_output=True, text=True)
        assert (show.returncode, show.stderr) == (1, expected)  # the quick path of `show` too
    assert sorted(str(p) for p in spool.path.rglob("*")) == before  # nothing made anywhere
    assert spool.enqueue("true") in spool.ids("new")  # the spool itself is fine


def test_the_drop_script_and_the_shell_recipe_keep_refusing_a_missing_spool(tmp_path):
    missing = tmp_path / "typo"
    drop = subprocess.run([str(ROOT / "contrib" / "spoolq-drop"), "-s", str(missing), "true"], capture_output=True,
                          text=True, timeout=60)
    assert drop.returncode == 1 and f"{missing} is not a spool" in drop.stderr
    section = (ROOT / "README.md").read_text().split("## Drop a job from any shell", 1)[1]
    recipe = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    shell = subprocess.run(["sh", "-c", recipe], env={"SPOOLQ_DIR": str(missing), "PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True, timeout=60)
    assert shell.returncode != 0
    assert not missing.exists()


def test_the_readme_first_command_creates_the_spool_before_it_enqueues():
    text = (ROOT / "README.md").read_text()
    command = text.split("<!-- install-command -->", 1)[1].split("```sh\n", 1)[1].split("\n", 1)[0]
    words = [w.strip() for w in command.split("&&")]
    inits = [i for i, w in enumerate(words) if w.endswith("spoolq init")]
    enqueues = [i for i, w in enumerate(words) if "spoolq enqueue" in w]
    assert inits and enqueues and inits[0] < enqueues[0], command
