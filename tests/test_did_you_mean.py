"""Unknown setting names, options and commands get a "did you mean";
setting names take dashes for underscores."""

from __future__ import annotations

import json


def test_settings_options_and_commands_say_what_was_meant(spool):
    s = spool
    cases = {
        ("config", "set", "max-retries", "3"): "spoolq: unknown setting 'max-retries' (did you mean max_attempts?)\n",
        ("config", "get", "max_retry"): "spoolq: unknown setting 'max_retry' (did you mean max_attempts?)\n",
        ("config", "set", "time_out", "5m"): "spoolq: unknown setting 'time_out' (did you mean timeout?)\n",
        ("config", "unset", "retries"): "spoolq: unknown setting 'retries' (did you mean max_attempts?)\n",
        ("enqueue", "--retries", "3", "true"): "spoolq: No such option '--retries'. Did you mean '--max-attempts'? "
                                              "(see 'spoolq enqueue --help')\n",
        ("enqueue", "--max-retries", "3", "true"): "spoolq: No such option '--max-retries'. Did you mean "
                                                  "'--max-attempts'? (see 'spoolq enqueue --help')\n",
        ("enqeue", "true"): "spoolq: No such command 'enqeue'. Did you mean 'enqueue'? (see 'spoolq --help')\n",
        ("config", "unst", "x"): "spoolq: No such command 'unst'. Did you mean 'unset'? (see 'spoolq config --help')\n",
    }
    for args, expected in cases.items():
        proc = s.run(*args, check=False)
        assert (proc.returncode, proc.stderr) == (2, expected), args
    assert not (s.path / "config.json").exists() and s.ids("new") == []


def test_dashes_stand_for_underscores_in_setting_names(spool):
    s = spool
    assert s.run("config", "set", "max-attempts", "3").stdout == "max_attempts = 3\n"
    assert s.run("config", "set", "backoff-initial", "2m").stdout == "backoff_initial = 120\n"
    assert json.loads((s.path / "config.json").read_text()) == {"max_attempts": 3, "backoff_initial": 120}
    assert s.run("config", "get", "max-attempts").stdout == "3\n"
    assert s.run("config", "unset", "max-attempts").stdout == "unset max_attempts\nmax_attempts = 5 (the default)\n"


def test_a_mistyped_key_in_config_json_is_named_with_the_fix(spool):
    s = spool
    (s.path / "config.json").write_text('{"max_retries": 3}')
    proc = s.run("status", check=False)
    assert proc.returncode == 2
    assert proc.stderr == (f"spoolq: {s.path / 'config.json'}: unknown setting 'max_retries' (did you mean max_attempts?); "
                           "spoolq config unset max_retries removes it\n")
