"""`config set app MODULE`: the handlers every worker of the spool loads
when `--app` is not given, so a plain `spoolq work` (cron, systemd) runs
handler jobs too; a root worker loads it only from a config.json root owns."""

from __future__ import annotations

import os
import textwrap


def _module(folder, name: str = "mailer") -> str:
    (folder / f"{name}.py").write_text(textwrap.dedent("""
        import os, pathlib
        pathlib.Path(os.path.dirname(os.path.abspath(__file__)), "imported").touch()

        def send_email(payload):
            return {"sent": payload["to"]}

        HANDLERS = {"send_email": send_email}
    """))
    return str(folder)


def test_a_plain_worker_loads_the_app_setting(fast_spool, tmp_path):
    s = fast_spool
    here = _module(tmp_path)
    for value, stored in (("mailer:HANDLERS", "mailer:HANDLERS"), ("mailer", "mailer")):
        assert s.run("config", "set", "app", value).stdout == f'app = "{stored}"\n'
        job = s.enqueue("--kind", "send_email", "--payload", '{"to": "a@example.com"}')
        s.work("-q", cwd=here)
        assert s.show(job)["state"] == "done" and s.show(job)["result"] == {"sent": "a@example.com"}
    assert s.run("config", "get", "app").stdout == '"mailer"\n'
    # --app still wins over the setting
    (tmp_path / "other.py").write_text("HANDLERS = {'send_email': lambda p: 'other'}\n")
    job = s.enqueue("--kind", "send_email", "--payload", "{}")
    s.work("-q", "--app", "other:HANDLERS", cwd=here)
    assert s.show(job)["result"] == "other"


def test_a_bad_app_setting_is_refused_or_named(fast_spool, tmp_path):
    s = fast_spool
    for bad in ("not a module", "mailer:", "a..b", ":X"):
        proc = s.run("config", "set", "app", bad, check=False)
        assert proc.returncode == 2 and "app must be MODULE:ATTR (like myapp.jobs:HANDLERS)" in proc.stderr, bad
    s.run("config", "set", "app", "nosuchmodule:HANDLERS")
    proc = s.work(cwd=str(tmp_path), check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("spoolq: the app setting: cannot import nosuchmodule") and proc.stderr.count("\n") == 1


def test_a_root_worker_does_not_import_an_app_set_in_a_config_json_root_does_not_own(users):
    spool = users.folder("app", owner=users.owner) / "spool"
    code = users.folder("code")
    _module(code)
    for args in (["init"], ["config", "set", "app", "mailer"]):
        assert users.spoolq(users.owner, "-s", str(spool), *args).returncode == 0
    assert os.stat(spool / "config.json").st_uid == users.owner.uid
    run = users.spoolq(None, "-s", str(spool), "work", cwd=str(code))
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert not (code / "imported").exists()
