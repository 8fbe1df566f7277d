"""What an operator does, on both backends: cancel, retry (one, several,
--all), compaction and purging with their durations and --yes, the
history after them (show, list and stats agree), settings, and sweep."""

from __future__ import annotations

import json

pytest_plugins = ["pgserver"]


def _dead(sq, n: int = 1) -> list[str]:
    ids = [sq.enqueue("--max-attempts", "1", f"exit {3 + i}") for i in range(n)]
    sq.work()
    assert all(sq.show(i)["state"] == "dead" for i in ids)
    return ids


def test_cancel_finishes_a_waiting_job_as_cancelled_and_refuses_others(sq):
    waiting = sq.enqueue("--in", "1h", "true")
    ran = sq.enqueue("true")
    sq.work()
    sq.run("cancel", waiting)
    job = sq.show(waiting)
    assert (job["state"], job["outcome"], job.get("attempts", 0)) == ("done", "cancelled", 0)
    again = sq.fail("cancel", waiting)
    assert again.returncode == 1 and waiting in again.stderr
    assert sq.fail("cancel", ran).returncode == 1
    assert sq.fail("cancel", "no-such-job").returncode == 1
    assert sq.api().cancel(waiting) is False
    assert sq.status()["done"] == 2


def test_retry_gives_a_dead_job_a_fresh_round_keeping_its_history(sq, tmp_path):
    [job_id] = _dead(sq)
    assert sq.run("retry", job_id).stdout.split() == [job_id]
    job = sq.show(job_id)
    assert job["state"] == "new" and job.get("attempts", 0) == 0 and "retried_at" in job
    assert len(job["history"]) == 1
    assert sq.fail("retry", job_id).returncode == 1  # no longer dead
    sq.work()
    job = sq.show(job_id)
    assert (job["state"], job["attempts"]) == ("dead", 1) and len(job["history"]) == 2
    assert sq.api().retry(job_id) is True
    assert sq.show(job_id)["state"] == "new"


def test_retry_all_and_dlq_retry_take_every_dead_job(sq):
    ids = _dead(sq, 3)
    out = sq.run("retry", "--all").stdout.split()
    assert sorted(out) == sorted(ids)
    assert sq.status()["dead"] == 0 and sq.status()["new"] == 3
    sq.work()
    assert sorted(sq.run("dlq", "retry", "--all").stdout.split()) == sorted(ids)
    assert sq.listing("--state", "dead") == []


def test_compact_needs_a_unit_and_yes_for_recent_history(sq):
    sq.enqueue("true")
    sq.work()
    bare = sq.fail("compact", "--keep", "30")
    assert bare.returncode == 2 and "30" in bare.stderr
    recent = sq.fail("compact", "--keep", "1h")
    assert recent.returncode == 2 and "--yes" in recent.stderr
    zero = sq.fail("compact", "--keep", "0")
    assert zero.returncode == 2 and "--yes" in zero.stderr
    assert sq.status()["done"] == 1  # nothing dropped
    assert sq.fail("purge", "--dead", "--older-than", "5").returncode == 2
    assert sq.fail("purge", "--dead", "--older-than", "1h").returncode == 2


def test_history_after_compaction_is_seen_alike_by_show_list_and_stats(sq):
    done = [sq.enqueue(f"echo {i}") for i in range(3)]
    cancelled = sq.enqueue("--in", "1h", "true")
    sq.run("cancel", cancelled)
    sq.work()
    before = json.loads(sq.run("stats", "--json").stdout)
    listed = sorted(j["id"] for j in sq.listing("--state", "done"))
    sq.run("compact")
    sq.run("compact", "--keep", "30d")
    assert sorted(j["id"] for j in sq.listing("--state", "done")) == listed == sorted(done + [cancelled])
    assert sq.show(done[0])["stdout"] == "0\n"
    assert sq.show(cancelled)["outcome"] == "cancelled"
    after = json.loads(sq.run("stats", "--json").stdout)
    assert after["total"]["jobs"] == before["total"]["jobs"] == 4
    assert after["total"]["cancelled"] == 1
    assert sq.status()["done"] == 4
    # --keep 0 --yes drops the history of every finished job.
    sq.run("compact", "--keep", "0", "--yes")
    assert sq.listing("--state", "done") == [] and sq.status()["done"] == 0
    assert sq.fail("show", done[0]).returncode == 1


def test_a_purged_dead_job_is_still_dead_and_can_be_retried(sq):
    [job_id] = _dead(sq)
    sq.run("purge", "--dead", "--older-than", "0", "--yes")
    job = sq.show(job_id)
    assert job["state"] == "dead" and job["error"] == "exit status 3"
    assert [j["id"] for j in sq.listing("--state", "dead")] == [job_id]
    assert json.loads(sq.run("stats", "--json").stdout)["total"]["dead"] == 1
    assert sq.run("retry", job_id).stdout.split() == [job_id]
    job = sq.show(job_id)
    assert job["state"] == "new" and len(job["history"]) == 1
    sq.work()
    assert sq.show(job_id)["state"] == "dead"
    assert json.loads(sq.run("stats", "--json").stdout)["total"]["dead"] == 1


def test_settings_are_set_read_listed_and_unset(sq):
    assert sq.run("config", "get", "max_attempts").stdout.strip() == "5"
    sq.run("config", "set", "max_attempts", "3")
    sq.run("config", "set", "timeout", "5m")
    assert sq.run("config", "get", "max_attempts").stdout.strip() == "3"
    assert sq.run("config", "get", "timeout").stdout.strip() == "300"
    listed = sq.run("config", "list").stdout
    assert "max_attempts = 3" in listed.splitlines(), listed
    bad = sq.fail("config", "set", "max_attempts", "0")
    assert bad.returncode == 2 and "max_attempts" in bad.stderr
    typo = sq.fail("config", "set", "max-retries", "3")
    assert typo.returncode == 2 and "max_attempts" in typo.stderr
    sq.run("config", "unset", "max_attempts")
    assert sq.run("config", "get", "max_attempts").stdout.strip() == "5"
    assert sq.api().config_list()["timeout"] == 300
    # The setting applies to the next job that fails.
    sq.run("config", "set", "max_attempts", "1")
    job_id = sq.enqueue("false")
    sq.work()
    assert sq.show(job_id)["state"] == "dead"


def test_sweep_on_a_quiet_spool_changes_nothing(sq):
    waiting = sq.enqueue("--in", "1h", "true")
    assert sq.run("sweep").returncode == 0
    assert sq.show(waiting)["state"] == "new"
    report = sq.api().sweep()
    assert report.recovered == 0 and report.dead == 0
