"""The relay: ``spoolq relay --to postgresql://...`` moves a local spool's
jobs into a PostgreSQL spool, where workers run each exactly once. The
local spool is an outbox while the database is down; a relay killed at
any moment loses nothing and sends nothing twice; a job that cannot be
sent goes to the local dead/ with the reason; ``status`` of the local
spool counts what waits to be relayed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytest_plugins = ["pgserver"]

if os.environ.get("SPOOLQ_CI"):
    import psycopg  # noqa: F401 - under CI a missing psycopg fails the run
else:
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=ROOT)
    e.pop("SPOOLQ_DIR", None)
    return e


def spoolq(spool: str, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "spoolq", "-s", spool, *args], capture_output=True, text=True,
                          timeout=timeout, env=env())
    assert not check or proc.returncode == 0, (args, proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def relay_proc(local: str, url: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spoolq", "-s", local, "relay", "--to", url, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())


def fill(local: str, n: int, marks: str) -> list[str]:
    """n command jobs, each appending its index to ``marks`` when it runs."""
    lines = "".join(json.dumps({"command": f"echo {i} >> {marks}"}) + "\n" for i in range(n))
    proc = subprocess.run([sys.executable, "-m", "spoolq", "-s", local, "enqueue", "--jsonl", "-"], input=lines,
                          capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def status(spool: str) -> dict:
    return json.loads(spoolq(spool, "status", "--json").stdout)


def ran(marks) -> list[int]:
    return sorted(int(x) for x in marks.read_text().split()) if marks.exists() else []


def wait_for(predicate, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def local(tmp_path):
    path = str(tmp_path / "outbox")
    spoolq(path, "init")
    return path


def test_a_backlog_is_relayed_and_run_exactly_once(local, pg_spool_url, tmp_path):
    marks = tmp_path / "marks"
    ids = fill(local, 300, str(marks))
    # The producer's other ways in are unchanged: a job file moved into new/.
    job = {"id": "by-hand", "command": f"echo 300 >> {marks}"}
    (tmp_path / "outbox" / "tmp" / "by-hand.json").write_text(json.dumps(job))
    os.rename(tmp_path / "outbox" / "tmp" / "by-hand.json", tmp_path / "outbox" / "new" / "by-hand.json")
    assert "relay" not in status(local)  # not relayed yet
    spoolq(local, "relay", "--to", pg_spool_url)
    after = status(local)
    assert (after["new"], after["failed"], after["cur"], after["dead"], after["done"]) == (0, 0, 0, 0, 301), after
    assert after["relay"]["waiting"] == 0 and after["relay"]["since"] is None
    shown = json.loads(spoolq(local, "show", "--json", ids[0]).stdout)
    assert shown["state"] == "done" and shown["result"]["relayed_to"] == pg_spool_url
    assert status(pg_spool_url)["new"] == 301
    spoolq(pg_spool_url, "work", "-j", "2")
    assert ran(marks) == list(range(301))
    assert status(pg_spool_url)["done"] == 301
    # Relaying again sends nothing: the local spool is empty.
    spoolq(local, "relay", "--to", pg_spool_url)
    assert status(pg_spool_url)["done"] == 301 and status(pg_spool_url)["new"] == 0


def test_status_says_how_many_wait_to_be_relayed_and_since_when(local, pg_server, pg_spool_url, tmp_path):
    spoolq(local, "relay", "--to", pg_spool_url)  # nothing to send: the spool now knows it is relayed
    fill(local, 3, str(tmp_path / "marks"))
    counts = status(local)
    assert counts["relay"]["to"] == pg_spool_url and counts["relay"]["waiting"] == 3
    assert counts["relay"]["since"] and counts["relay"]["since"] <= time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 1))
    text = spoolq(local, "status").stdout
    assert "3  (wait to be relayed to postgresql://" in text and "the oldest since" in text, text
    assert "password" not in text


def test_a_job_that_cannot_be_sent_goes_to_the_local_dead_with_the_reason(local, pg_spool_url, tmp_path):
    # The same id with different content is already there.
    spoolq(pg_spool_url, "enqueue", "--id", "taken", "echo theirs")
    spoolq(local, "enqueue", "--id", "taken", "echo ours")
    # The same id with the same content counts as sent (a relay's resend).
    spoolq(pg_spool_url, "enqueue", "--id", "same", "echo same")
    spoolq(local, "enqueue", "--id", "same", "echo same")
    # A kind the destination refuses.
    spoolq(pg_spool_url, "config", "set", "allowed_kinds", '["ok"]')
    spoolq(local, "enqueue", "--kind", "nope", "--id", "refused")
    spoolq(local, "enqueue", "--kind", "ok", "--id", "fine")
    proc = spoolq(local, "relay", "--to", pg_spool_url)
    dead = {jid: json.loads(spoolq(local, "show", "--json", jid).stdout) for jid in ("taken", "refused")}
    assert dead["taken"]["state"] == "dead" and "different content" in dead["taken"]["error"], dead["taken"]
    assert dead["refused"]["state"] == "dead" and "allowed_kinds" in dead["refused"]["error"], dead["refused"]
    assert "taken" in proc.stderr and "refused" in proc.stderr
    assert json.loads(spoolq(local, "show", "--json", "same").stdout)["state"] == "done"
    there = json.loads(spoolq(pg_spool_url, "show", "--json", "taken").stdout)
    assert there["command"] == "echo theirs"
    assert json.loads(spoolq(pg_spool_url, "show", "--json", "fine").stdout)["state"] == "new"


def test_while_the_database_is_down_jobs_wait_locally_and_go_once_it_is_back(local, pg_server, pg_spool_url, tmp_path):
    marks = tmp_path / "marks"
    relay = relay_proc(local, pg_spool_url, "--watch")
    try:
        fill(local, 20, str(marks))
        wait_for(lambda: status(pg_spool_url)["new"] == 20, what="the first jobs relayed")
        pg_server.pause()
        try:
            fill(local, 30, str(marks))  # the producer is not held up
            time.sleep(3)  # the relay tries, fails and backs off
            counts = status(local)
            assert counts["new"] + counts["failed"] + counts["cur"] == 30, counts
            assert counts["dead"] == 0 and relay.poll() is None
            # No attempt was used on them.
            assert all(j["attempts"] == 0 for j in map(json.loads, spoolq(local, "list", "--json").stdout.splitlines())
                       if j["state"] in ("new", "failed"))
            # A draining relay says in one line that the jobs wait, and exits 1.
            drain = spoolq(local, "relay", "--to", pg_spool_url, check=False)
            assert drain.returncode == 1 and "wait here" in drain.stderr, drain.stderr
        finally:
            pg_server.resume()
        wait_for(lambda: status(pg_spool_url)["new"] == 50, timeout=180, what="the backlog relayed after the restart")
    finally:
        relay.send_signal(signal.SIGTERM)
        out, err = relay.communicate(timeout=120)
    assert relay.returncode == 0, err
    assert "unavailable" in err and "reachable again" in err, err
    assert status(local)["done"] == 50
    spoolq(pg_spool_url, "work")
    assert ran(marks) == sorted(list(range(20)) + list(range(30)))


def test_a_relay_killed_at_random_moments_loses_nothing_and_sends_nothing_twice(local, pg_spool_url, tmp_path):
    marks = tmp_path / "marks"
    spoolq(local, "config", "set", "max_attempts", "1000")  # each kill counts an interrupted run, as for any worker
    rng = random.Random(os.getpid())
    kills = interrupted = total = 0
    window = 1.0
    # Until kills have landed mid-way (a loaded machine may need more than one backlog).
    while not (kills >= 3 and interrupted) and total < 6000:
        fill(local, 600, str(marks))
        total += 600
        for _ in range(40):
            before = status(local)["done"]
            if before == total:
                break
            relay = relay_proc(local, pg_spool_url)
            time.sleep(rng.uniform(0.0, window))  # over the start-up and the sending
            if relay.poll() is None:
                relay.send_signal(signal.SIGKILL)
                kills += 1
            relay.communicate(timeout=120)
            # Aim at where jobs move: a longer window while kills land before anything moved.
            after = status(local)["done"]
            window = window * 1.3 if after == before else window * 0.6 if after == total else max(0.1, window * 0.8)
        spoolq(local, "relay", "--to", pg_spool_url)  # whatever the kills left
        jobs = [json.loads(line) for line in spoolq(local, "list", "--json").stdout.splitlines()]
        assert sorted(j["state"] for j in jobs) == ["done"] * total
        interrupted = sum(j["attempts"] > 1 for j in jobs)
    assert kills >= 3 and interrupted, f"{kills} kills, none mid-way: the test proved nothing"
    assert status(pg_spool_url)["new"] == total
    spoolq(pg_spool_url, "work", "-j", "2")
    assert ran(marks) == sorted(list(range(600)) * (total // 600))
