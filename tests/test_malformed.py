"""Files that can never run go to dead/ byte-for-byte unchanged, with the
reason printed by ``show --json`` and ``list --json``; the worker never
crashes and never runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import wait_for

BAD_FILES = {
    "not-json": (b"this is not json", "not valid JSON"),
    "empty": (b"", "empty file"),
    "binary": (bytes(range(256)) * 4, "not UTF-8"),
    "not-object": (b'["command", "true"]', "not a JSON object"),
    "string": (b'"true"', "not a JSON object"),
    "no-target": (b'{"payload": 1}', "exactly one of command, argv or kind"),
    "two-targets": (b'{"command": "true", "kind": "x"}', "it has command, kind"),
    "null-target": (b'{"command": null}', "it has none"),
    "command-type": (b'{"command": ["true"]}', "command must be a non-empty string"),
    "argv-type": (b'{"argv": "true"}', "argv must be a non-empty list"),
    "argv-items": (b'{"argv": ["true", 1]}', "argv must be a non-empty list"),
    "max-attempts-0": (b'{"command": "true", "max_attempts": 0}', "max_attempts must be an integer >= 1"),
    "max-attempts-float": (b'{"command": "true", "max_attempts": 2.5}', "max_attempts"),
    "max-attempts-bool": (b'{"command": "true", "max_attempts": true}', "max_attempts"),
    "timeout-neg": (b'{"command": "true", "timeout": -1}', "timeout must be"),
    "timeout-str": (b'{"command": "true", "timeout": "5"}', "timeout must be"),
    "env-int": (b'{"command": "true", "env": {"A": 1}}', "env['A'] must be a string"),
    "env-list": (b'{"command": "true", "env": ["A=1"]}', "env must be an object"),
    "run-at-words": (b'{"command": "true", "run_at": "yesterday"}', "run_at"),
    "run-at-naive": (b'{"command": "true", "run_at": "2026-01-01T00:00:00"}', "run_at"),
    # Named as written: it said "253402300799.0 is not a valid epoch time".
    "run-at-far": (b'{"command": "true", "run_at": "9999-12-31T23:59:59Z"}',
                   "run_at: '9999-12-31T23:59:59Z' is outside 1970-01-01T00:00:00Z to 2200-01-01T00:00:00Z"),
    "id-dotdot": (b'{"command": "true", "id": "../x"}', "'../x' contains '/'"),
    "id-slash": (b'{"command": "true", "id": "a/b"}', "contains '/'"),
    "id-hidden": (b'{"command": "true", "id": ".hidden"}', "starts with a dot"),
    "id-dotdot-start": (b'{"command": "true", "id": "..x"}', "contains '..'"),  # audit: it said "starts with a dot"
    "cwd-type": (b'{"command": "true", "cwd": 7}', "cwd must be"),
    "nul-in-command": (b'{"command": "tr\\u0000ue"}', "NUL"),
    "nan": (b'{"command": "true", "timeout": NaN}', "NaN is not a JSON value"),
    "infinite": (b'{"command": "true", "payload": [1e999]}', "1e999 is too large for a JSON number"),
    "deep": (b"[" * 100000 + b"]" * 100000, "nested more than 256 levels deep"),
    "deep-but-parsable": (b'{"command": "true", "payload": ' + b"[" * 300 + b"]" * 300 + b"}",
                          "nested more than 256 levels deep"),
    "attempts-type": (b'{"command": "true", "attempts": "many"}', "attempts"),
}


def _settled(path):
    """A file whose writer is long done with it (see WRITER_GRACE)."""
    old = time.time() - 60
    os.utime(path, (old, old))
    return path


def test_every_malformed_class_goes_to_dead_unchanged_with_a_reason(fast_spool, tmp_path):
    s = fast_spool
    marker = tmp_path / "ran"
    for name, (data, _) in BAD_FILES.items():
        _settled(s.drop(f"{name}.json", data.replace(b"true", f"touch {marker}".encode()) if b"NaN" in data else data))
    s.enqueue("--id", "good", "true")
    proc = s.work()
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
    assert s.where("good") == ["done"]
    assert sorted(s.ids("dead")) == sorted(BAD_FILES)
    listed = {j["id"]: j for j in map(json.loads, s.run("list", "--state", "dead", "--json").stdout.splitlines())}
    for name, (data, reason) in BAD_FILES.items():
        on_disk = (s.path / "dead" / f"{name}.json").read_bytes()
        if b"NaN" not in data:
            assert on_disk == data, name  # byte for byte
        assert reason in listed[name]["error"], (name, listed[name]["error"])
        shown = s.show(name)
        assert shown["state"] == "dead" and reason in shown["error"], name
    assert s.ids("new") == [] and s.ids("cur") == []


def test_hostile_names_and_id_fields(fast_spool):
    s = fast_spool
    # A name that is not a valid id (spaces, too long) goes to dead/ unchanged.
    s.drop("has space.json", b'{"command": "true"}')
    s.drop("x" * 200 + ".json", b'{"command": "true"}')
    s.work()
    assert sorted(s.names("dead")) == sorted(["has space.json", "x" * 200 + ".json"])
    listed = [json.loads(line) for line in s.run("list", "--json", "--state", "dead").stdout.splitlines()]
    assert all("bad file name" in j["error"] for j in listed)


def test_oversized_files_are_not_read(fast_spool):
    s = fast_spool
    s.config("max_job_bytes", 1000)
    s.drop("big.json", json.dumps({"command": "true", "pad": "x" * 5000}))
    proc = s.run("enqueue", "--payload", json.dumps("y" * 5000), "true", check=False)
    assert proc.returncode == 2 and "max_job_bytes" in proc.stderr
    s.work()
    assert s.where("big") == ["dead"]
    assert "larger than max_job_bytes (1000)" in s.show("big")["error"]


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "dangling"])
def test_special_files_are_never_followed_or_opened(fast_spool, tmp_path, kind):
    s = fast_spool
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"command": f"touch {tmp_path}/followed"}))
    path = s.path / "new" / "odd.json"
    if kind == "symlink":
        os.symlink(target, path)
    elif kind == "dangling":
        os.symlink(tmp_path / "missing", path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkdir(path)
    s.enqueue("true")
    proc = s.work(timeout=30)  # a FIFO opened for reading would hang here
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "followed").exists()
    assert s.names("dead") == ["odd.json"]
    moved = s.path / "dead" / "odd.json"
    if kind in ("symlink", "dangling"):
        assert os.path.islink(moved)  # the link itself moved, not its target
        assert target.exists()
    expected = {"symlink": "a symlink", "dangling": "a symlink", "fifo": "a FIFO", "directory": "a directory"}[kind]
    assert s.show("odd")["error"].startswith(expected)


def test_the_reason_a_file_went_to_dead_is_kept_when_the_file_is_changed(fast_spool):
    s = fast_spool
    _settled(s.drop("edited.json", b'{"command": ["true"]}'))
    _settled(s.drop("replaced.json", b"\x00 not json"))
    s.work()
    assert sorted(s.names("dead")) == ["edited.json", "replaced.json"]
    assert (s.path / "dead" / "edited.json").read_bytes() == b'{"command": ["true"]}'  # bytes unchanged
    was = {"edited": "command must be a non-empty string", "replaced": "not valid JSON"}
    # Changed by hand in dead/: into a valid job, into other garbage.
    (s.path / "dead" / "edited.json").write_text('{"command": "true"}')
    (s.path / "dead" / "replaced.json").write_bytes(b"")
    for job_id, reason in was.items():
        assert reason in s.show(job_id)["error"], job_id
        assert reason in s.run("show", job_id).stdout
    listed = {j["id"]: j for j in map(json.loads, s.run("list", "--state", "dead", "--json").stdout.splitlines())}
    assert sorted(listed) == ["edited", "replaced"]  # what keeps the reasons is no job
    assert all(was[k] in listed[k]["error"] for k in was)
    assert "command must be a non-empty string" in s.run("list", "--state", "dead").stdout
    assert s.status()["dead"] == 2
    # Another file under the name is told by its own reason, not the old one.
    os.unlink(s.path / "dead" / "replaced.json")
    (s.path / "dead" / "replaced.json").write_bytes(b"[1]")
    assert "not a JSON object" in s.show("replaced")["error"]
    # A file retried out of dead/ leaves nothing behind there.
    s.run("retry", "edited")
    assert s.where("edited") == ["new"] and s.show("edited").get("error") is None
    assert not [n for n in os.listdir(s.path / "dead") if "edited" in n]


def test_a_purged_dead_file_keeps_the_reason_it_went_to_dead(fast_spool):
    s = fast_spool
    _settled(s.drop("fixed.json", b'{"argv": "true"}'))
    s.work()
    (s.path / "dead" / "fixed.json").write_text('{"argv": ["true"]}')
    assert s.run("purge", "--dead", "--older-than", "0", "--yes").stdout.startswith("purged 1 ")
    shown = s.show("fixed")
    assert shown["state"] == "dead" and "argv must be a non-empty list" in shown["error"]
    assert os.listdir(s.path / "dead") == []


def test_a_dead_file_fixed_by_hand_runs_after_retry(fast_spool):
    s = fast_spool
    _settled(s.drop("fixme.json", b'{"command": '))
    s.work()
    assert s.where("fixme") == ["dead"]
    (s.path / "dead" / "fixme.json").write_text('{"command": "true"}')
    s.run("retry", "fixme")
    s.work()
    assert s.show("fixme")["state"] == "done"


# --------------------------------------------------------------------------
# a writer still writing straight into new/

LEFT_FOR_WRITER = "not a whole job yet"


def _watching(s, tmp_path):
    """A watching worker, its log in a file; only events and the writer's
    grace can wake it (the periodic rescan is an hour away)."""
    s.config("rescan_interval", 3600)
    log = tmp_path / "worker.log"
    proc = s.popen("work", "--watch", stderr=open(log, "w"))
    wait_for(lambda: s.names("workers"), what="the worker to start")
    return proc, log


def _stop(proc):
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def test_a_file_written_into_new_in_two_halves_runs_as_a_job(fast_spool, tmp_path):
    s = fast_spool
    marker = tmp_path / "ran"
    proc, log = _watching(s, tmp_path)
    with open(s.path / "new" / "slow.json", "w") as f:
        f.write(f'{{"command": "touch {marker}"')
        f.flush()

        def seen_half():
            # A slow writer: it keeps writing (white space) until the worker
            # has looked at the half-written file.
            f.write(" ")
            f.flush()
            return LEFT_FOR_WRITER in log.read_text()

        wait_for(seen_half, interval=0.5, what="the worker to leave the half-written file alone")
        assert s.names("new") == ["slow.json"] and s.names("dead") == []
        f.write("}")
    wait_for(lambda: s.where("slow") == ["done"], what="the finished file to run")
    assert marker.exists()
    _stop(proc)
    assert s.names("dead") == []


def test_a_file_left_unfinished_goes_to_dead_once_its_writer_is_quiet(fast_spool, tmp_path):
    s = fast_spool
    proc, log = _watching(s, tmp_path)
    path = s.path / "new" / "stuck.json"
    path.write_bytes(b'{"command": ')
    written = path.stat().st_mtime
    wait_for(lambda: LEFT_FOR_WRITER in log.read_text(), what="the worker to leave the file alone for now")
    if time.time() - written < 4:  # (not so loaded a machine that the grace is nearly over)
        assert s.names("new") == ["stuck.json"]
    # No event comes, and no rescan for an hour: the worker comes back by itself.
    wait_for(lambda: s.names("dead") == ["stuck.json"], what="the unfinished file to go to dead/")
    assert (s.path / "dead" / "stuck.json").stat().st_mtime - written >= 4.9  # not before the grace
    assert (s.path / "dead" / "stuck.json").read_bytes() == b'{"command": '
    assert "not valid JSON" in s.show("stuck")["error"]
    _stop(proc)


def test_a_drain_waits_out_the_grace_and_files_no_writer_can_finish_go_to_dead_at_once(fast_spool, tmp_path):
    s = fast_spool
    s.config("max_job_bytes", 1000)
    s.drop("words.json", b"this is not json")  # no appending makes this a job
    s.drop("array.json", b'["command", ')  # a job is an object
    s.drop("has space.json", b'{"command": ')  # a name no job can have
    s.drop("big.json", b'{"command": "' + b"x" * 5000)  # too large already
    os.symlink(tmp_path / "nowhere", s.path / "new" / "link.json")
    s.drop("empty.json", b"")  # just created: its writer may be about to write
    proc = s.work()
    assert sorted(s.names("dead")) == sorted(["empty.json", "words.json", "array.json", "has space.json",
                                              "big.json", "link.json"])
    assert s.names("new") == []
    waited = [line for line in proc.stderr.splitlines() if LEFT_FOR_WRITER in line]
    assert len(waited) == 1 and "job=empty " in waited[0], proc.stderr
    assert s.show("empty")["error"] == "empty file"
