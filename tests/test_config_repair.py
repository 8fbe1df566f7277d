"""`config set` and `config unset` repair a config.json that does not
parse or holds unknown keys or bad values: a valid file is written with
every setting that could be read, what was dropped is said on stderr, and
the old file is kept as config.json.bad."""

from __future__ import annotations

import json


def test_config_set_repairs_a_file_that_does_not_parse(spool):
    s = spool
    broken = b'{"max_attempts": 3, "fsync": false'  # cut short by an editor
    (s.path / "config.json").write_bytes(broken)
    assert s.run("config", "list", check=False).returncode == 2
    proc = s.run("config", "set", "timeout", "5m")
    assert proc.stdout == "timeout = 300\n"
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("spoolq: config.json: dropped the whole file: it is not valid JSON (")
    assert lines[1] == f"spoolq: config.json: the old file is kept as {s.path / 'config.json.bad'}" and len(lines) == 2
    assert json.loads((s.path / "config.json").read_text()) == {"timeout": 300}
    assert (s.path / "config.json.bad").read_bytes() == broken
    assert json.loads(s.run("config", "get", "timeout").stdout) == 300


def test_config_set_keeps_what_it_can_read_and_drops_the_rest(spool):
    s = spool
    text = '{"max_attempts": 3, "max_retries": 4, "timeout": "zz", "fsync": false, "backoff_initial": "2m"}'
    (s.path / "config.json").write_text(text)
    proc = s.run("config", "set", "output_limit", "100")
    assert proc.stdout == "output_limit = 100\n"
    lines = proc.stderr.splitlines()
    assert len(lines) == 3 and lines[0].startswith("spoolq: config.json: dropped max_retries = 4 (unknown setting")
    assert lines[1] == ("spoolq: config.json: dropped timeout = \"zz\" (timeout must be a duration (like 90, 5m, 1h30m, "
                        "7d), not 'zz')")
    assert json.loads((s.path / "config.json").read_text()) == {
        "max_attempts": 3, "fsync": False, "backoff_initial": "2m", "output_limit": 100}
    assert (s.path / "config.json.bad").read_text() == text
    settings = json.loads(s.run("status", "--json").stdout)  # every command works again
    assert settings["new"] == 0


def test_config_unset_removes_a_setting_known_or_not(spool):
    s = spool
    (s.path / "config.json").write_text('{"max_attempts": 3, "max_retries": 4}')
    assert s.run("status", check=False).returncode == 2
    proc = s.run("config", "unset", "max_retries")
    assert (proc.stdout, proc.stderr) == ("unset max_retries\n", "")  # the key unset is no news
    assert json.loads((s.path / "config.json").read_text()) == {"max_attempts": 3}
    assert not (s.path / "config.json.bad").exists()
    proc = s.run("config", "unset", "max_attempts")
    assert proc.stdout == "unset max_attempts\nmax_attempts = 5 (the default)\n"
    assert json.loads((s.path / "config.json").read_text()) == {}
    again = s.run("config", "unset", "max_attempts")
    assert again.stdout == "max_attempts was not set\nmax_attempts = 5 (the default)\n"
    typo = s.run("config", "unset", "nonsense", check=False)
    assert typo.returncode == 2 and typo.stderr.startswith("spoolq: unknown setting 'nonsense'")
    (s.path / "config.json").write_text("[1, 2]")
    proc = s.run("config", "unset", "timeout")
    assert "dropped the whole file: it is not a JSON object" in proc.stderr
    assert json.loads((s.path / "config.json").read_text()) == {}
    assert (s.path / "config.json.bad").read_text() == "[1, 2]"
