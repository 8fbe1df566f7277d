"""History a typo cannot erase: `compact --keep` and `purge --older-than`
take durations with a unit, and whatever reaches jobs that finished less
than a day ago asks for --yes; a purged dead job is still a dead job to
`show`, `list --state dead` and `retry`."""

from __future__ import annotations

import json
import os
import sqlite3
import time


def _rows(s) -> list[tuple[str, str]]:
    db = sqlite3.connect(s.path / "index.db")
    try:
        return sorted(db.execute("SELECT id, state FROM jobs").fetchall())
    finally:
        db.close()


def _age(s, state: str, job_id: str, seconds: float) -> None:
    """Make a finished job's file (and its record's finish time) this old."""
    path = s.path / state / f"{job_id}.json"
    job = json.loads(path.read_text())
    when = time.time() - seconds
    job["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(when))
    path.write_text(json.dumps(job))
    os.utime(path, (when, when))


def _runs_total(s) -> tuple[int, int]:
    values = {}
    for line in s.run("status", "--prometheus").stdout.splitlines():
        if line.startswith("spoolq_runs_total{"):
            values[line.split('result="')[1].split('"')[0]] = int(line.split()[-1])
    return values["succeeded"], values["failed"]


def test_a_duration_that_drops_history_needs_a_unit(fast_spool):
    s = fast_spool
    done = s.enqueue("--id", "old-done", "true")
    s.enqueue("--id", "old-dead", "--max-attempts", "1", "false")
    s.work("-q")
    _age(s, "done", done, 40 * 86400)
    _age(s, "dead", "old-dead", 40 * 86400)
    s.run("compact", "--keep", "3650d")
    for args in (["compact", "--keep", "30"], ["compact", "--keep", "30", "--yes"], ["purge", "--dead", "--older-than", "7"],
                 ["purge", "--dead", "--older-than", "2.5", "--yes"]):
        proc = s.run(*args, check=False)
        number = args[args.index("--keep" if "--keep" in args else "--older-than") + 1]
        assert proc.returncode == 2, (args, proc.stderr)
        assert f"'{number}' has no unit: say {number}d (days), {number}h (hours) or {number}m (minutes)" in proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stdout == ""
    assert _rows(s) == [("old-done", "done")] and s.ids("dead") == ["old-dead"]  # nothing dropped, nothing purged
    s.run("compact", "--keep", "30d")
    s.run("purge", "--dead", "--older-than", "30d")
    assert _rows(s) == [("old-dead", "dead")]


def test_reaching_jobs_that_finished_less_than_a_day_ago_asks_for_yes(fast_spool):
    s = fast_spool
    for job_id, hours in (("two-hours", 2), ("half-a-day", 12), ("two-days", 48)):
        s.enqueue("--id", job_id, "true")
        s.enqueue("--id", f"dead-{job_id}", "--max-attempts", "1", "false")
    s.work("-q")
    for job_id, hours in (("two-hours", 2), ("half-a-day", 12), ("two-days", 48)):
        _age(s, "done", job_id, hours * 3600)
        _age(s, "dead", f"dead-{job_id}", hours * 3600)
    s.run("compact")
    for keep in ("12h", "1h", "23h59m"):
        proc = s.run("compact", "--keep", keep, check=False)
        assert (proc.returncode, proc.stderr) == (2, f"spoolq: --keep {keep} would drop the history of jobs that "
                                                     "finished less than a day ago; add --yes to do that\n")
    for older in ("1h", "0s", "0"):
        proc = s.run("purge", "--dead", "--older-than", older, check=False)
        assert (proc.returncode, proc.stderr) == (2, f"spoolq: --older-than {older} would purge jobs that died less "
                                                     "than a day ago; add --yes to do that\n")
    assert len(_rows(s)) == 3 and len(s.ids("dead")) == 3  # nothing dropped, nothing purged
    s.run("compact", "--keep", "1d")  # a day or more: no question asked
    s.run("purge", "--dead", "--older-than", "1d")
    assert _rows(s) == [("dead-two-days", "dead"), ("half-a-day", "done"), ("two-hours", "done")]
    s.run("compact", "--keep", "6h", "--yes")
    s.run("purge", "--dead", "--older-than", "6h", "--yes")
    assert _rows(s) == [("dead-half-a-day", "dead"), ("two-hours", "done")]  # --keep drops purged rows too
    assert s.ids("dead") == ["dead-two-hours"]


def test_show_list_and_retry_agree_on_a_purged_dead_job(fast_spool):
    s = fast_spool
    s.enqueue("--id", "gone-wrong", "--max-attempts", "1", f"test -e '{s.path.parent / 'flag'}' || exit 3")
    s.enqueue("--id", "still-here", "--max-attempts", "1", "false")
    s.drop("not-a-job.json", "{oops")
    s.work("-q")
    _age(s, "dead", "gone-wrong", 3 * 86400)
    os.utime(s.path / "dead" / "not-a-job.json", (time.time() - 3 * 86400,) * 2)
    assert "purged 2 dead jobs" in s.run("purge", "--dead", "--older-than", "2d").stdout
    assert s.show("gone-wrong")["state"] == "dead"
    listed = [json.loads(line) for line in s.run("list", "--state", "dead", "--json").stdout.splitlines()]
    assert [(j["id"], j["state"]) for j in listed] == [("gone-wrong", "dead"), ("not-a-job", "dead"), ("still-here", "dead")]
    text = s.run("list", "--state", "dead").stdout.splitlines()
    assert "gone-wrong" in text[0] and text[0].endswith("[purged into index.db]") and "purged" not in text[2]
    assert "still-here" in s.run("dlq", "list").stdout and "gone-wrong" in s.run("dlq", "list").stdout
    everything = [json.loads(line)["id"] for line in s.run("list", "--json").stdout.splitlines()]
    assert sorted(everything) == ["gone-wrong", "not-a-job", "still-here"]

    # retry of the purged job: back in new/ from its record, with a fresh round and its history
    (s.path.parent / "flag").write_text("")
    runs = [_runs_total(s)]
    proc = s.run("retry", "gone-wrong")
    runs.append(_runs_total(s))
    assert (proc.stdout, proc.stderr) == ("gone-wrong\n", "")
    assert s.ids("new") == ["gone-wrong"]
    job = s.show("gone-wrong")
    assert (job["state"], job["attempts"], len(job["history"])) == ("new", 0, 1) and "error" not in job
    assert "retried_at" in job and "compacted" not in job
    assert [json.loads(line)["id"] for line in s.run("list", "--state", "dead", "--json").stdout.splitlines()] == [
        "not-a-job", "still-here"]
    assert s.status()["dead_purged"] == 1
    again = s.run("retry", "gone-wrong", check=False)
    assert (again.returncode, again.stderr) == (1, "spoolq: job gone-wrong is in new/, not dead/\n")
    s.work("-q")
    job = s.show("gone-wrong")
    assert (job["state"], job["outcome"], len(job["history"])) == ("done", "succeeded", 2)
    runs.append(_runs_total(s))
    s.run("compact")
    runs.append(_runs_total(s))
    assert runs == [(0, 2), (0, 2), (1, 2), (1, 2)]  # (succeeded, failed): counted once, never lowered
    assert s.show("gone-wrong")["state"] == "done" and ("gone-wrong", "done") in _rows(s)
    stats = json.loads(s.run("stats", "--json").stdout)["total"]
    assert (stats["jobs"], stats["succeeded"], stats["dead"], stats["runs"]) == (3, 1, 2, 3)

    # what cannot be retried says why
    bad = s.run("retry", "not-a-job", check=False)
    assert bad.returncode == 1 and bad.stderr.startswith(
        "spoolq: cannot retry not-a-job: it was purged from dead/ as no valid job (not valid JSON")
    done = s.run("retry", "gone-wrong", check=False)
    assert (done.returncode, done.stderr) == (
        1, "spoolq: job gone-wrong has finished (done, compacted); only a dead job is retried\n")
    missing = s.run("retry", "never-was", check=False)
    assert (missing.returncode, missing.stderr) == (1, "spoolq: no job never-was in dead/\n")
