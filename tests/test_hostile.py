"""Hostile input: random bytes and near-valid JSON (property-based), files
of untrusted users, and the permissions of private and shared spools."""

from __future__ import annotations

import base64
import json
import os
import pwd
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import SPOOLQ, STATES, SpoolFixture

# -- property-based ----------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
FIELDS = ["command", "argv", "kind", "payload", "id", "max_attempts", "timeout", "run_at", "env", "cwd",
          "attempts", "history", "state"]
GOOD = {"command": "true", "argv": ["true"], "kind": "noop", "max_attempts": 2, "timeout": 5, "run_at": 0,
        "env": {"A": "1"}, "attempts": 0, "history": [], "state": "new", "id": "x"}
near_valid = st.builds(
    lambda base, changes: {**base, **changes},
    st.sampled_from([{"command": "true"}, {"argv": ["true"]}, {"kind": "noop"}, {}]),
    st.dictionaries(st.sampled_from(FIELDS), st.one_of(json_values, st.sampled_from(list(GOOD.values()))), max_size=4),
).map(lambda d: json.dumps(d).encode())
garbage = st.one_of(
    st.binary(max_size=300),
    near_valid,
    near_valid.map(lambda b: b[: len(b) // 2]),  # truncated mid-write
    near_valid.map(lambda b: b.replace(b'"', b"'", 1)),
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass") if False else t.encode()),
)
names = st.one_of(
    st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,20}", fullmatch=True),
    st.text(alphabet=st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=30),
).filter(lambda n: n not in (".", "..") and not n.startswith(".") and len(n.encode()) < 200)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(files=st.dictionaries(names, garbage, min_size=1, max_size=12))
def test_random_files_never_crash_the_worker_and_each_ends_in_one_folder(tmp_path_factory, files):
    s = SpoolFixture(tmp_path_factory.mktemp("prop") / "spool")
    s.run("init")
    s.config("fsync", "false")
    s.config("backoff_initial", 0)
    s.config("max_attempts", 1)
    dropped = {}
    for i, (name, data) in enumerate(files.items()):
        tmp = s.path / "tmp" / f"p{i}"
        tmp.write_bytes(data)
        os.rename(tmp, s.path / "new" / name)
        os.utime(s.path / "new" / name, (1e9, 1e9))  # long written: no file waits for a writer to finish it
        dropped[name] = data
    proc = s.run("work", "--app", "noop_app:HANDLERS", check=False, cwd=str(_app_dir(tmp_path_factory)))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    # Every file is in exactly one folder, under its own name or <id>.json;
    # none is left waiting or running, and nothing else appeared.
    found = {}
    for state in STATES:
        for n in os.listdir(s.path / state):
            if not n.startswith("."):  # spoolq's own (the reasons kept beside dead files)
                found.setdefault(n, []).append(state)
    assert not any(len(v) > 1 for v in found.values())
    accounted = set()
    for name, data in dropped.items():
        candidates = [name, name + ".json"] + ([name[:-5]] if name.endswith(".json") else [])
        homes = [c for c in candidates if c in found]
        dups = [n for n in found if n.startswith(name.removesuffix(".json") + ".dup-")]
        assert homes or dups, f"{name!r} vanished"
        home = (homes or dups)[0]
        accounted.add(home)
        # A valid handler job of a kind the worker has no handler for waits.
        assert found[home][0] in ("done", "dead") or (found[home][0] == "new" and _names_a_kind(data)), (name, found[home])
        if found[home][0] == "dead" and not data.strip().startswith(b"{"):
            assert (s.path / "dead" / home).read_bytes() == data  # invalid files stay byte for byte
    assert set(found) == accounted
    listed = s.run("list", "--json", check=False)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr


def _names_a_kind(data: bytes) -> bool:
    try:
        job = json.loads(data)
    except ValueError:
        return False
    return isinstance(job, dict) and isinstance(job.get("kind"), str)


_APP = None


def _app_dir(factory):
    global _APP
    if _APP is None:
        _APP = factory.mktemp("app")
        (_APP / "noop_app.py").write_text("HANDLERS = {'noop': lambda payload: None}\n")
    return _APP


# -- owners and permissions --------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create files owned by another user")


def _user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pytest.skip(f"no user {name} on this machine")


@needs_root
def test_files_of_untrusted_users_go_to_dead_unless_trusted(fast_spool, tmp_path):
    s = fast_spool
    nobody = _user("nobody")
    for name in ("stranger", "friend"):
        path = s.drop(f"{name}.json", json.dumps({"command": f"echo {name}"}))
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    s.work("--max-jobs", "1")
    assert s.where("stranger") == ["dead"] or s.where("friend") == ["dead"]
    s.config("trusted_users", "nobody")
    s.run("retry", "--all")
    first_dead = s.ids("dead")
    assert first_dead == []
    s.work()
    # (Run as nobody when the worker is root: their output says they ran.)
    assert [s.show(name).get("stdout") for name in ("friend", "stranger")] == ["friend\n", "stranger\n"]
    s.config("trusted_users", "[]")
    path = s.drop("late.json", '{"command": "true"}')
    os.chown(path, nobody.pw_uid, nobody.pw_gid)
    s.work()
    reason = s.show("late")["error"]
    assert s.where("late") == ["dead"] and "untrusted user nobody" in reason and "trusted_users" in reason


def test_private_spool_files_are_0600(spool):
    job_id = spool.enqueue("true")
    assert stat.S_IMODE(os.stat(spool.path / "new" / f"{job_id}.json").st_mode) == 0o600
    spool.run("config", "set", "max_attempts", "2")
    assert stat.S_IMODE(os.stat(spool.path / "config.json").st_mode) == 0o600
    spool.work()
    assert stat.S_IMODE(os.stat(spool.path / "done" / f"{job_id}.json").st_mode) == 0o600


def test_a_state_folder_that_is_a_symlink_is_refused(tmp_path):
    s = SpoolFixture(tmp_path / "spool")
    s.run("init")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rmdir(s.path / "dead")
    os.symlink(elsewhere, s.path / "dead")
    proc = s.run("work", check=False)
    assert proc.returncode == 1 and "symlink" in proc.stderr



@needs_root
def test_init_group_never_changes_a_folder_swapped_in_through_a_symlink(tmp_path):
    """A member of the group can rename the spool's folders: one who swaps
    new/ for a symlink to a root-only folder, again and again while root runs
    `init --group`, must never get that folder's owner or mode changed."""
    if shutil.which("groupadd") is None:
        pytest.skip("groupadd not available")
    group = f"sq23r{os.getpid() % 100000}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    racer = None
    try:
        victim = tmp_path / "victim"
        victim.mkdir()
        os.chmod(victim, 0o700)
        before = os.stat(victim)
        s = SpoolFixture(tmp_path / "spool")
        s.run("init", "--group", group)
        racer = subprocess.Popen([sys.executable, "-c", """
import ctypes, os, sys
new, aside, victim = sys.argv[1:]
os.symlink(victim, aside)
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
a, b = new.encode(), aside.encode()
while True:  # swap the folder and the symlink atomically, back and forth
    if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
        try:  # no RENAME_EXCHANGE here: the same, in four renames
            os.rename(new, aside + ".dir")
            os.rename(aside, new)
            os.rename(new, aside)
            os.rename(aside + ".dir", new)
        except OSError:
            pass
""", str(s.path / "new"), str(s.path / "new.aside"), str(victim)])
        deadline = time.monotonic() + 20
        rounds = 0
        while rounds < 200 and time.monotonic() < deadline:
            proc = s.run("init", "--group", group, check=False)
            assert "Traceback" not in proc.stderr, proc.stderr
            rounds += 1
            after = os.stat(victim)
            assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode), \
                f"victim changed after {rounds} rounds: {stat.filemode(after.st_mode)} gid {after.st_gid}"
    finally:
        if racer is not None:
            racer.kill()
            racer.wait()
        subprocess.run(["groupdel", group], capture_output=True)


@pytest.mark.parametrize("loose", [0o755, 0o777], ids=["0755", "0777"])
def test_init_sets_the_mode_of_a_loose_private_root_folder_and_says_so(tmp_path, loose):
    root = tmp_path / "spool"
    root.mkdir()
    os.chmod(root, loose)
    s = SpoolFixture(root)
    proc = s.run("init")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert proc.stderr.strip() == f"spoolq: set the mode of {root} to 0700 (it was {loose:04o})"
    # Idempotent: a second init has nothing to change and says nothing.
    assert s.run("init").stderr == ""
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


@needs_root
def test_init_group_sets_the_mode_of_an_existing_root_folder_and_says_so(tmp_path):
    root = tmp_path / "spool"
    root.mkdir()
    os.chmod(root, 0o777)
    s = SpoolFixture(root)
    proc = s.run("init", "--group", "0")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o2750
    assert proc.stderr.strip() == f"spoolq: set the mode of {root} to 2750 (it was 0777)"
    # `init` without --group keeps a shared spool shared.
    assert s.run("init").stderr == "" and stat.S_IMODE(os.stat(root).st_mode) == 0o2750

def test_lone_surrogates_and_extreme_numbers_never_stop_the_spool(fast_spool, tmp_path):
    """Regression (review): a lone surrogate made every later work and sweep
    crash; huge run_at/timeout values overflowed clock calls."""
    s = fast_spool
    s.drop("surrogate.json", b'{"command": "echo hi", "note": "\\ud800"}')
    s.drop("far-run-at.json", b'{"command": "true", "run_at": 1e300}')
    s.drop("far-run-at2.json", b'{"command": "true", "run_at": 1e19}')
    s.drop("huge-timeout.json", b'{"command": "true", "timeout": 1e10}')
    s.drop("fine.json", b'{"command": "echo ok"}')
    app = tmp_path / "surrogate_app.py"
    app.write_text("HANDLERS = {'weird': lambda p: 'bad\\udcff name'}\n")
    s.enqueue("--kind", "weird", "--id", "weird-result")
    for cmd in (["work", "-j", "2", "--app", "surrogate_app:HANDLERS"], ["sweep"], ["work"]):
        proc = s.run(*cmd, cwd=str(tmp_path), check=False)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert s.where("surrogate") == ["done"] and s.show("surrogate")["note"] == "\ud800"
    assert s.where("fine") == ["done"]
    assert s.show("weird-result")["result"] == "bad\udcff name"
    for name in ("far-run-at", "far-run-at2", "huge-timeout"):
        assert s.where(name) == ["dead"], name
    assert "run_at" in s.show("far-run-at")["error"] and "timeout" in s.show("huge-timeout")["error"]


def test_records_sqlite_cannot_bind_never_stop_compact_stats_or_purge(fast_spool, tmp_path):
    """Regression (audit): one record with a lone surrogate (a non-UTF-8
    byte in a command line) or an integer beyond 64 bits, or a dead file
    whose name is not UTF-8, made compact, stats and purge --dead fail for
    every job of the spool. Each is stored; the record keeps it exactly."""
    s = fast_spool
    s.drop("surrogate.json", '{"command": "true", "note": "echo \\udcff"}')  # (a command may not hold one)
    s.drop("huge-attempts.json", '{"command": "true", "attempts": 9223372036854775807}')
    huge = "1" + "0" * 400  # an integer beyond a double: math.isfinite overflows on it
    s.drop("huge-created.json", '{"command": "true", "created_at": %s}' % huge)
    s.drop("huge-run-at.json", '{"command": "true", "run_at": %s}' % huge)
    proc = s.run("enqueue", "--json", '{"command": "true", "timeout": %s}' % huge, check=False)
    assert proc.returncode == 2 and "timeout" in proc.stderr, proc.stderr
    s.enqueue("--id", "plain", "true")
    bad_name = os.fsdecode(b"caf\xe9.json")
    s.drop(bad_name, '{"command": "true"}')
    binary = b"\x00\x01\xff\xfe{not json"
    s.drop("binary.json", binary)
    s.work()
    assert sorted(s.ids("done")) == ["huge-attempts", "huge-created", "plain", "surrogate"]
    assert s.where("huge-run-at") == ["dead"] and "run_at" in s.show("huge-run-at")["error"]
    assert json.loads(s.run("compact", "--json").stdout)["folded"] == 4
    assert s.names("done") == []
    assert s.show("surrogate")["note"] == os.fsdecode(b"echo \xff") and s.show("surrogate")["compacted"] is True
    assert s.show("huge-attempts")["attempts"] == 9223372036854775807 + 1
    assert json.loads(s.run("stats", "--json").stdout)["total"]["succeeded"] == 4
    assert s.run("purge", "--dead", "--older-than", "0", "--yes").stdout == "purged 3 dead jobs into index.db, left 0\n"
    assert s.names("dead") == []
    kept = s.show("binary")
    assert base64.b64decode(kept["raw_base64"]) == binary and kept["error"] == "not UTF-8 (byte 2)"
    with sqlite3.connect(s.path / "index.db") as db:  # an id show refuses: in SQL only
        (stored,) = db.execute("SELECT record FROM jobs WHERE id LIKE 'caf%'").fetchone()
    stored = json.loads(stored)
    assert stored["id"] == bad_name[:-5] and stored["raw"] == '{"command": "true"}' and "bad file name" in stored["error"]


def test_a_record_spoolq_writes_never_outgrows_max_job_bytes(fast_spool, tmp_path):
    """Regression (audit): a job enqueued near max_job_bytes went dead
    after its first failure ("larger than max_job_bytes") because its
    stderr tail and history entry pushed the record over; a handler's
    large result made a done/ record spoolq itself could not read. The run's
    additions are trimmed to fit: tails first, then the result, then the
    oldest history entries."""
    s = fast_spool
    limit = 20000
    s.config("max_job_bytes", limit)
    s.config("backoff_initial", 0)
    noisy = s.enqueue("--id", "noisy", "--max-attempts", "3", "--payload", json.dumps("p" * 15000),
                      "head -c 9000 /dev/zero | tr '\\0' e >&2; exit 1")
    (tmp_path / "bigresult.py").write_text("def shout(p):\n    raise RuntimeError('x' * 30000)\n"
                                           "HANDLERS = {'big': lambda p: 'r' * 50000, 'shout': shout}\n")
    big = s.enqueue("--id", "big", "--kind", "big")
    # Review: a job with no room left for its own bookkeeping, a huge exception message, and a
    # history_dropped field of the job's own that is no count, with a history to trim.
    full = {"command": "exit 1", "max_attempts": 2, "payload": ""}
    full["payload"] = "p" * (limit - 10 - len(json.dumps(full, separators=(",", ":"))))
    s.drop("full.json", json.dumps(full, separators=(",", ":")))
    s.enqueue("--id", "shout", "--kind", "shout", "--max-attempts", "1")
    odd = {"command": "exit 1", "max_attempts": 40, "history_dropped": "x", "state": "failed", "attempts": 30,
           "history": [{"attempt": i, "error": "e" * 620} for i in range(1, 31)]}
    s.drop("odd.json", json.dumps(odd, separators=(",", ":")))
    # Review: a producer's file does not get the slack for spoolq's own records by adding a history.
    posing = {"command": "true", "history": [0], "pad": "p" * (limit + 1000)}
    s.drop("posing.json", json.dumps(posing, separators=(",", ":")))
    s.run("work", "--app", "bigresult:HANDLERS", cwd=str(tmp_path))
    assert s.where("posing") == ["dead"] and "larger than max_job_bytes" in s.show("posing")["error"]
    for job_id, error in (("full", "exit status 1"), ("shout", "RuntimeError: " + "x" * 1986 + "... (30014 characters)")):
        job = s.show(job_id)
        assert job["state"] == "dead" and job["error"] == error, job_id
        assert job["attempts"] == len(job["history"]) + job.get("history_dropped", 0), job_id
    odd_job = s.show("odd")
    assert odd_job["state"] == "dead" and odd_job["attempts"] == 40 and odd_job["history_dropped"] >= 1
    assert len((s.path / "dead" / "odd.json").read_bytes().rstrip()) <= limit  # (a rewrite in place may pad it)
    job = s.show(noisy)
    assert job["state"] == "dead" and job["attempts"] == 3 and job["error"] == "exit status 1", job.get("error")
    assert len(job["history"]) + int(job.get("history_dropped") or 0) == 3
    assert job["stderr"] and set(job["stderr"]) == {"e"}  # the tail's end, trimmed
    assert os.path.getsize(s.path / "dead" / "noisy.json") <= limit
    done = s.show(big)
    assert done["state"] == "done" and done["outcome"] == "succeeded" and "result" not in done
    assert done["result_dropped"] == f"a result of 50003 bytes does not fit in max_job_bytes ({limit})"
    assert json.loads(s.run("compact", "--json").stdout)["folded"] == 1


def test_a_big_record_does_not_inflate_later_ones(spool):
    """Regression (review): a recycled spare file kept the padded size of the
    biggest record it ever held."""
    s = spool
    s.config("output_limit", 200000)
    big = s.enqueue("head -c 150000 /dev/zero | tr '\\0' x")
    small = [s.enqueue("true") for _ in range(3)]
    s.work()
    assert os.path.getsize(s.path / "done" / f"{big}.json") > 150000
    for job_id in small:
        assert os.path.getsize(s.path / "done" / f"{job_id}.json") < 8192


def test_an_id_a_dropped_file_has_as_its_whole_name_is_refused_on_enqueue(fast_spool):
    """Regression (audit): enqueue looked only for <id>.json, so a job
    dropped as plain `x` lost its id to a later enqueue."""
    s = fast_spool
    s.drop("x", '{"command": "echo dropped"}')
    proc = s.run("enqueue", "--id", "x", "echo enqueued", check=False)
    assert proc.returncode == 1 and "already in new/" in proc.stderr
    assert s.names("new") == ["x"]
    s.work()
    assert s.show("x")["stdout"] == "dropped\n" and s.names("dead") == []


def test_values_that_are_not_json_are_refused_and_never_written(fast_spool, tmp_path):
    """Regression (audit): NaN, Infinity and too-deep nesting were written to
    job files (invalid JSON for every later reader) or accepted by enqueue and
    then killed by the worker."""
    s = fast_spool
    deep = "[" * 300 + "]" * 300
    cases = [
        ("--payload", "NaN"), ("--payload", "1e999"), ("--payload", "-Infinity"), ("--payload", deep),
        ("--payload", "[" * 5000 + "]" * 5000),
    ]
    for option, value in cases:
        proc = s.run("enqueue", "--kind", "k", option, value, check=False)
        assert proc.returncode == 2, (value[:20], proc.stderr)
        assert proc.stderr.count("\n") == 1 and "internal error" not in proc.stderr, proc.stderr
    for text in ('{"command": "true", "payload": NaN}', '{"command": "true", "payload": ' + deep + "}",
                 '{"command": "true", "x": ' + "[" * 5000 + "]" * 5000 + "}"):
        for args, stdin in ((["--json", "-"], text), (["--jsonl", "-"], text + "\n")):
            proc = s.run("enqueue", *args, input=stdin, check=False)
            assert proc.returncode == 2 and "internal error" not in proc.stderr, proc.stderr
            assert proc.stderr.count("\n") == 1
    # Just inside the limit is fine, and the worker reads it back.
    ok = "[" * 250 + "]" * 250
    s.enqueue("--id", "deep-ok", "--payload", ok, "true")
    assert s.ids("new") == ["deep-ok"]
    # Through the API: InvalidJob, not TypeError or ValueError.
    script = tmp_path / "api.py"
    script.write_text(
        "import sys\n"
        "from spoolq import Spool, InvalidJob\n"
        "q = Spool(sys.argv[1])\n"
        "for payload in (float('nan'), float('inf'), {1, 2}, object()):\n"
        "    try:\n"
        "        q.enqueue(command='true', payload=payload)\n"
        "    except InvalidJob as e:\n"
        "        print('refused', e)\n"
    )
    out = subprocess.run([sys.executable, str(script), str(s.path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.count("refused") == 4, out.stderr
    # A dropped file with them is invalid: dead, bytes unchanged, with the reason.
    raw = b'{"command": "true", "payload": [1, NaN, Infinity]}'
    s.drop("nan.json", raw)
    s.drop("deep.json", '{"command": "true", "payload": ' + deep + "}")
    s.work()
    assert (s.path / "dead" / "nan.json").read_bytes() == raw
    assert "NaN is not a JSON value" in s.show("nan")["error"]
    assert "nested more than 256" in s.show("deep")["error"]
    assert s.where("deep-ok") == ["done"]
    for line in s.run("list", "--json").stdout.splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in list --json"))


def test_bad_input_files_and_apps_are_usage_errors_not_internal_ones(fast_spool, tmp_path):
    """Regression (audit): these said 'internal error' and exited 1."""
    s = fast_spool
    binary = tmp_path / "jobs.jsonl"
    binary.write_bytes(b'{"command": "true"}\n\xff\xfe{"command": "true"}\n')
    proc = s.run("enqueue", "--jsonl", str(binary), check=False)
    assert proc.returncode == 2 and proc.stderr == "spoolq: line 2: not UTF-8 (byte 1)\n"
    proc = s.run("enqueue", "--jsonl", str(tmp_path), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "cannot read" in proc.stderr
    assert s.ids("new") == []  # nothing of a bad batch is enqueued
    (tmp_path / "broken_app.py").write_text("raise RuntimeError('no database')\n")
    for app, words in (("json:dumps", "json:dumps is callable"), ("broken_app:HANDLERS", "RuntimeError: no database")):
        proc = s.run("work", "--app", app, cwd=str(tmp_path), check=False)
        assert proc.returncode == 2 and words in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert "internal error" not in proc.stderr


def test_duration_settings_are_capped_so_a_retry_cannot_overflow(fast_spool):
    """Regression (audit): backoff_max 1e300 was accepted, then the worker
    could not record a failure (an mtime 1e300 s away overflows)."""
    s = fast_spool
    for key in ("backoff_initial", "backoff_max", "timeout", "timeout_grace", "rescan_interval"):
        proc = s.run("config", "set", key, "1e300", check=False)
        assert proc.returncode == 2 and "<= 3.1536e+08" in proc.stderr, proc.stderr
    s.config("backoff_initial", 315360000)
    s.config("backoff_max", 315360000)
    s.config("backoff_factor", 1e300)
    s.enqueue("--id", "fails", "--max-attempts", "3", "exit 1")
    proc = s.work(check=False)
    assert proc.returncode == 0, proc.stderr
    assert s.where("fails") == ["failed"]
    assert (s.path / "failed" / "fails.json").stat().st_mtime > time.time() + 9 * 365 * 86400


def test_an_invalid_file_gets_the_time_it_died(fast_spool):
    """Regression (audit): an invalid dropped file kept its old mtime in
    dead/, so it listed as the oldest and `purge --older-than` took it at once."""
    s = fast_spool
    path = s.drop("old-and-bad.json", "not json")
    os.utime(path, (1_000_000_000, 1_000_000_000))
    s.work()
    assert s.names("dead") == ["old-and-bad.json"]
    assert abs((s.path / "dead" / "old-and-bad.json").stat().st_mtime - time.time()) < 60
    assert (s.path / "dead" / "old-and-bad.json").read_bytes() == b"not json"


def test_a_result_nests_one_level_less_than_a_record_and_stays_readable(fast_spool, tmp_path):
    """Regression (review): a result 256 deep made a done/ record 257 deep,
    which spoolq then refused to read (show, list, compact, recovery)."""
    s = fast_spool
    (tmp_path / "nest_app.py").write_text(
        "def nest(n):\n"
        "    value = []\n"
        "    for _ in range(n - 1):\n"
        "        value = [value]\n"
        "    return value\n"
        "HANDLERS = {'nest': lambda payload: nest(payload['depth'])}\n"
    )
    s.enqueue("--kind", "nest", "--id", "ok", "--payload", '{"depth": 255}')
    s.enqueue("--kind", "nest", "--id", "deep", "--max-attempts", "1", "--payload", '{"depth": 256}')
    s.run("work", "--app", "nest_app:HANDLERS", cwd=str(tmp_path))
    ok = s.show("ok")
    assert ok["state"] == "done" and json.dumps(ok["result"]).count("[") == 255
    deep = s.show("deep")
    assert deep["state"] == "dead" and "nested more than 255 levels deep" in deep["error"]
    assert "result" not in deep
    assert json.loads(s.run("compact", "--json").stdout)["folded"] == 1  # done/ only; dead/ stays
    assert s.names("done") == [] and s.show("ok")["result"] == ok["result"]


def test_an_object_with_a_bad_value_as_the_argument_is_refused_not_run_by_sh(fast_spool):
    """Regression (review): `spoolq enqueue '{... NaN}'` fell through to being
    a shell command (exit 0) once the object shortcut parsed strictly."""
    s = fast_spool
    for text in ('{"command": "echo hi", "payload": {"x": NaN}}', '{"command": "true", "x": 1e999}',
                 '{"command": "true", "p": ' + "[" * 2000 + "]" * 2000 + "}",  # too deep for Python's parser
                 '{"command": "true", "n": ' + "9" * 5000 + "}"):  # an integer longer than Python reads
        proc = s.run("enqueue", text, check=False)
        assert proc.returncode == 2 and "not valid JSON" in proc.stderr, proc.stderr
    assert s.ids("new") == []


def test_errors_and_log_lines_stay_one_line_whatever_they_quote(fast_spool, tmp_path):
    """Regression (audit): an argument holding a newline split the error
    into two lines (the second could pose as another message), and a file
    name's terminal escapes reached the worker log raw. Non-finite seconds
    are refused (--poll nan made the worker spin)."""
    s = fast_spool
    for args in (["enqueue", "--jsonl", "/no/such\nspoolq: fake"], ["work", "--app", "bad\nmod:x"],
                 ["init", "--group", "no\nsuch"], ["work", "--poll", "nan"], ["work", "--poll", "inf"],
                 ["enqueue", "--timeout", "nan", "true"]):
        proc = s.run(*args, check=False, cwd=str(tmp_path))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("spoolq: "), (args, proc.stderr)
    s.drop("ev\x1b[31mil.json", '{"command": "true"}')
    log = s.work().stderr
    assert "\x1b" not in log and "ev\\x1b[31mil.json" in log


def test_enqueue_from_a_closed_stdin_is_a_usage_error(fast_spool):
    s = fast_spool
    for args in ("--jsonl -", "--json -"):
        proc = subprocess.run(["/bin/sh", "-c", f'"$@" -s "$SPOOL" enqueue {args} <&-', "sh", *SPOOLQ],
                              capture_output=True, text=True, timeout=60, env=dict(os.environ, SPOOL=str(s.path)))
        assert proc.returncode == 2 and proc.stderr == "spoolq: standard input is closed\n", proc.stderr
    assert s.ids("new") == []


def test_a_config_file_from_before_the_caps_still_works_and_a_bad_one_can_be_repaired(fast_spool):
    """Regression (review): a stored backoff_max above ten years (fine before
    the cap) stopped every command; a bad value could only be fixed by hand."""
    s = fast_spool
    path = s.path / "config.json"
    stored = json.loads(path.read_text())
    path.write_text(json.dumps(dict(stored, backoff_max=1_000_000_000)))
    assert s.status()["new"] == 0
    assert s.run("config", "get", "backoff_max").stdout.strip() == "315360000"
    path.write_text(json.dumps(dict(stored, max_attempts=0)))
    proc = s.run("status", check=False)
    assert proc.returncode == 2 and "max_attempts must be >= 1" in proc.stderr
    s.run("config", "set", "max_attempts", "3")
    assert s.status()["new"] == 0 and json.loads(path.read_text())["max_attempts"] == 3


@needs_root
def test_a_refusal_names_the_folder_the_user_can_change(tmp_path):
    """A permission error names the real path to act on: the folder that
    refuses a new file (not the temporary name spoolq gave it), config.json
    by its full path, and the parent folder a user may not enter (not "no
    spool")."""
    import tempfile

    nobody = _user("nobody")
    as_nobody = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
    if subprocess.run(as_nobody + SPOOLQ + ["--version"], capture_output=True).returncode != 0:
        pytest.skip("spoolq is not installed where nobody can run it")
    base = tempfile.mkdtemp(prefix="spoolq-denied-")  # not under tmp_path: nobody cannot enter that
    try:
        os.chmod(base, 0o755)

        def run(spool: str, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
            return subprocess.run(as_nobody + SPOOLQ + ["-s", spool, *args], capture_output=True, text=True,
                                  input=input, timeout=60, env=dict(os.environ, HOME="/tmp"))

        own = os.path.join(base, "own")
        os.mkdir(own)
        os.chown(own, nobody.pw_uid, nobody.pw_gid)
        assert run(own, "init").returncode == 0
        for folder, args, where in (("tmp", ["enqueue", "true"], "tmp"), ("new", ["enqueue", "true"], "new"),
                                    ("new", ["enqueue", "--jsonl", "-"], "new"), ("", ["config", "set", "max_attempts", "3"], "")):
            os.chmod(os.path.join(own, folder), 0o555)
            try:
                proc = run(own, *args, input='{"command": "true"}\n')
            finally:
                os.chmod(os.path.join(own, folder), 0o700)
            assert proc.returncode == 1 and proc.stderr == f"spoolq: permission denied: {os.path.join(own, where).rstrip('/')}\n", (args, proc.stderr)
        assert os.listdir(os.path.join(own, "new")) == [] and os.listdir(os.path.join(own, "tmp")) == []
        # Another user's spool whose folders this user may not read.
        theirs = os.path.join(base, "theirs")
        subprocess.run(SPOOLQ + ["-s", theirs, "init"], check=True, capture_output=True)
        os.chmod(theirs, 0o755)
        with open(os.path.join(theirs, "config.json"), "w") as f:
            f.write("{}")
        os.chmod(os.path.join(theirs, "config.json"), 0o600)
        for args, where in ((["status"], "tmp"), (["config", "list"], "config.json")):
            proc = run(theirs, *args)
            assert (proc.returncode, proc.stderr) == (1, f"spoolq: permission denied: {theirs}/{where}\n"), args
        # A spool behind a folder this user may not enter.
        closed = os.path.join(base, "closed")
        behind = os.path.join(closed, "inner", "spool")
        os.makedirs(os.path.dirname(behind))
        subprocess.run(SPOOLQ + ["-s", behind, "init"], check=True, capture_output=True)
        os.chmod(closed, 0o700)
        for args in (["status"], ["list"], ["show", "x"], ["sweep"], ["retry", "x"]):
            proc = run(behind, *args)
            assert proc.returncode == 1, args
            assert proc.stderr == f"spoolq: permission denied: {closed} (so the spool {behind} cannot be reached)\n", (args, proc.stderr)
        for args in (["work"], ["enqueue", "true"], ["config", "list"]):
            proc = run(behind, *args)
            assert proc.returncode == 1, args
            assert proc.stderr.startswith(f"spoolq: permission denied: {closed} (so "), (args, proc.stderr)
            assert behind in proc.stderr and proc.stderr.count("\n") == 1, (args, proc.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_root
def test_a_user_without_access_is_told_permission_denied(tmp_path):
    """Audit: a user who may not enter the spool heard "not a spool; run
    'spoolq init'" (status, cancel, compact...) or "cannot read config.json"
    with exit 2, the code for bad input; and a worker whose config.json
    became unreadable died on SIGHUP."""
    import tempfile

    from conftest import wait_for

    base = tempfile.mkdtemp(prefix="spoolq-access-")
    try:
        os.chmod(base, 0o755)
        nobody = _user("nobody")
        as_nobody = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
        if subprocess.run(as_nobody + SPOOLQ + ["--version"], capture_output=True).returncode != 0:
            pytest.skip("spoolq is not installed where nobody can run it")
        private = os.path.join(base, "private")
        subprocess.run(SPOOLQ + ["-s", private, "init"], check=True, capture_output=True)
        for args in (["status"], ["cancel", "x"], ["compact"], ["enqueue", "true"], ["work"], ["config", "list"]):
            proc = subprocess.run(as_nobody + SPOOLQ + ["-s", private, *args], capture_output=True, text=True)
            assert proc.returncode == 1 and proc.stderr.startswith("spoolq: permission denied: "), (args, proc.stderr)
        own = os.path.join(base, "own")
        os.mkdir(own)
        os.chown(own, nobody.pw_uid, nobody.pw_gid)
        subprocess.run(as_nobody + SPOOLQ + ["-s", own, "init"], check=True, capture_output=True)  # work makes none
        worker = subprocess.Popen(as_nobody + SPOOLQ + ["-s", own, "work", "--watch"], stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: os.path.isdir(os.path.join(own, "workers")) and os.listdir(os.path.join(own, "workers")),
                     what="the worker to start")
            config = os.path.join(own, "config.json")
            with open(config, "w") as f:
                f.write("{}")
            os.chmod(config, 0)
            worker.send_signal(signal.SIGHUP)
            wait_for(lambda: "reload failed" in worker.stderr.readline(), what="the reload to fail")
            assert worker.poll() is None  # still running
        finally:
            worker.terminate()
            assert worker.wait(timeout=30) == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)



@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_config_json_that_is_not_a_regular_file_is_refused_never_waited_on(fast_spool, tmp_path, kind):
    s = fast_spool
    s.enqueue("true")
    path = s.path / "config.json"
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        what = "a FIFO"
    elif kind == "symlink":
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text('{"max_attempts": 7}')  # valid settings: only where they are is wrong
        path.symlink_to(elsewhere)
        what = "a symbolic link"
    else:
        path.mkdir()
        what = "a directory"
    message = f"spoolq: {path} is {what}, not a regular file"
    for args in (("status",), ("status", "--json"), ("work",), ("enqueue", "true"), ("config", "get", "max_attempts"),
                 ("config", "set", "max_attempts", "3")):
        proc = s.run(*args, check=False, timeout=20)
        assert (proc.returncode, proc.stderr.strip()) == (2, message), args
    assert len(s.names("new")) == 1  # the worker ran nothing with settings it could not read
    proc = s.run("status", "--prometheus", check=False, timeout=20)
    assert proc.returncode == 0
    assert f'spoolq_config_ok{{spool="{s.path}"}} 0' in proc.stdout
    assert proc.stderr.strip() == f"{message} (metrics read with the default settings)"


def _one_done_job(s: SpoolFixture) -> None:
    job_id = s.enqueue("true")
    s.work()
    assert s.where(job_id) == ["done"]


@pytest.mark.parametrize("name", ["index.db", "index.db-wal", "index.db-shm"])
def test_an_index_file_that_is_a_symlink_is_refused_and_nothing_is_made_at_its_target(fast_spool, tmp_path, name):
    s = fast_spool
    _one_done_job(s)
    if name != "index.db":
        s.run("compact")  # a real index.db, beside which the -wal or -shm name is planted
        _one_done_job(s)
    target = tmp_path / "elsewhere" / "planted"
    target.parent.mkdir()
    (s.path / name).symlink_to(target)
    message = f"spoolq: {s.path / name} is a symbolic link: not opened"
    done = s.names("done")
    for args in (("compact",), ("status",), ("list",), ("stats",)):
        proc = s.run(*args, check=False)
        assert proc.returncode == 1 and proc.stderr.startswith(message), (args, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1
    assert not target.exists() and os.listdir(target.parent) == []
    assert s.names("done") == done  # nothing folded into an index that was not opened


@pytest.mark.parametrize("planted, what", [
    ("CREATE TRIGGER t AFTER INSERT ON jobs BEGIN INSERT OR REPLACE INTO counters VALUES ('pwned', 1); END",
     "a trigger 't'"),
    ("CREATE VIEW v AS SELECT 1", "a view 'v'"),
    ("CREATE TABLE loot (x)", "a table 'loot'"),
    ("CREATE INDEX extra ON jobs (error)", "an index 'extra'"),
])
def test_an_index_with_objects_spoolq_does_not_make_is_refused(fast_spool, planted, what):
    s = fast_spool
    _one_done_job(s)
    s.run("compact")
    db = sqlite3.connect(s.path / "index.db")
    db.execute(planted)
    db.commit()
    db.close()
    _one_done_job(s)
    message = f"spoolq: {s.path / 'index.db'} holds {what} that spoolq does not make: not used"
    for args in (("compact",), ("status",), ("list",), ("stats",), ("show", "nope")):
        proc = s.run(*args, check=False)
        assert proc.returncode == 1 and proc.stderr.startswith(message), (args, proc.stderr)
    # A worker's automatic compaction refuses it too, and keeps working.
    s.config("compact_after", 1)
    _one_done_job(s)
    s.enqueue("true")
    rows = sqlite3.connect(s.path / "index.db").execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
    proc = s.work()
    assert "compaction failed" in proc.stderr and what in proc.stderr
    db = sqlite3.connect(s.path / "index.db")
    assert db.execute("SELECT * FROM counters WHERE name = 'pwned'").fetchall() == []
    assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == rows
    db.close()


def test_a_trigger_planted_while_the_index_is_open_never_fires(fast_spool):
    s = fast_spool
    _one_done_job(s)
    from spoolq import Spool

    spool = Spool(str(s.path))
    spool.compact()  # the connection stays open in this process
    db = sqlite3.connect(s.path / "index.db")
    db.execute("CREATE TRIGGER t AFTER INSERT ON jobs BEGIN INSERT OR REPLACE INTO counters VALUES ('pwned', 1); END")
    db.commit()
    _one_done_job(s)
    with pytest.raises(Exception, match="holds a trigger 't' that spoolq does not make"):
        spool.compact()
    assert db.execute("SELECT * FROM counters WHERE name = 'pwned'").fetchall() == []
    db.close()


def test_a_private_spools_index_files_are_0600_under_umask_022(tmp_path):
    s = SpoolFixture(tmp_path / "spool")
    old = os.umask(0o022)
    try:
        s.run("init")
        s.config("fsync", "false")
        _one_done_job(s)
        s.run("compact")
        reader = sqlite3.connect(s.path / "index.db")  # keeps -wal and -shm while compaction writes
        reader.execute("SELECT COUNT(*) FROM jobs").fetchone()
        _one_done_job(s)
        s.run("compact")
        modes = {n: stat.S_IMODE(os.stat(s.path / n).st_mode) for n in ("index.db", "index.db-wal", "index.db-shm")}
        reader.close()
    finally:
        os.umask(old)
    assert modes == dict.fromkeys(modes, 0o600)
