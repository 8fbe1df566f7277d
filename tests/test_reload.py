"""SIGHUP rereads config.json for everything a worker does with the
settings: claiming and running jobs, and its automatic compaction."""

from __future__ import annotations

import signal

import pytest

from conftest import wait_for
from test_watch import watcher_factory  # noqa: F401 - the fixture

OLD_LIMIT = 1000
NEW_LIMIT = 200_000


@pytest.mark.parametrize("args", [(), ("-j", "2")], ids=["one process", "a pool"])
def test_automatic_compaction_folds_with_the_reloaded_settings(fast_spool, watcher_factory, args):  # noqa: F811
    """A done/ record larger than the max_job_bytes the worker started with
    (plus the slack a record may grow by) but within the value reloaded on
    SIGHUP is a valid record: the automatic compaction folds it into
    index.db, as a fresh worker would, instead of leaving it in done/."""
    s = fast_spool
    s.config("max_job_bytes", OLD_LIMIT)
    s.config("compact_after", 2)
    w = watcher_factory(*args)
    s.config("max_job_bytes", NEW_LIMIT)
    w.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: w.log().count("reloaded config.json") == w.processes, what="every worker to reload")
    big = s.enqueue("true " + "x" * 80_000)  # a record of ~80 KB: beyond 1000 bytes and the 64 KiB slack
    small = [s.enqueue("true") for _ in range(3)]
    wait_for(lambda: not s.names("new") and not s.names("cur"), what="the jobs to finish")
    wait_for(lambda: "compacted" in w.log(), what="an automatic compaction")
    wait_for(lambda: f"{big}.json" not in s.names("done"), timeout=10,
             what=f"the large record to be folded (done/ holds {s.names('done')}; log: {w.log()})")
    log = w.stop()
    assert "compaction failed" not in log
    assert s.show(big)["state"] == "done"
    for job_id in small:
        assert s.show(job_id)["state"] == "done"


def test_one_settings_holder_reaches_every_reader(tmp_path):
    """In process: the Spool's settings, the transition context and the
    spool directory's fsync flag see one reload of config.json at once."""
    from spoolq import Spool

    path = tmp_path / "spool"
    Spool(path).init()
    q = Spool(path)
    settings = q.settings
    ctx = q.backend.context()
    assert q.backend.dir.fsync is True
    Spool(path).config_set("max_job_bytes", 5000)  # another writer: q has not seen it
    Spool(path).config_set("fsync", False)
    assert ctx.settings["max_job_bytes"] == 1048576
    settings.reload()
    assert q.settings is settings and ctx.settings is settings
    assert ctx.settings["max_job_bytes"] == 5000
    assert q.backend.dir.fsync is False
