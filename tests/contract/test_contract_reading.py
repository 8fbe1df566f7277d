"""What a user reads, on both backends: list, show, status and stats in
text and in JSON, and ids given by their start. Where the backends
legitimately differ (a directory spool's records are files: ``show``
names the file), each test says so and checks each one's documented
form."""

from __future__ import annotations

import json

pytest_plugins = ["pgserver"]

STATUS_KEYS = ["new", "cur", "failed", "dead", "done", "done_files", "compacted", "dead_purged"]


def test_list_is_oldest_first_with_one_line_per_job_and_json_lines(sq):
    ids = [sq.enqueue("--id", f"job-{i}", "--in", f"{10 + i}m", "true") for i in range(3)]
    sq.enqueue("--id", "dies", "--max-attempts", "1", "exit 3")
    sq.work()
    listed = sq.listing()
    assert [j["id"] for j in listed if j["state"] == "new"] == ids
    assert {j["id"]: j["state"] for j in listed}["dies"] == "dead"
    assert [j["id"] for j in sq.listing("--state", "dead")] == ["dies"]
    assert [j["id"] for j in sq.listing("--state", "new", "--limit", "2")] == ids[:2]
    text = sq.run("list").stdout.splitlines()
    assert len([line for line in text if "job-" in line or "dies" in line]) == 4
    dead_line = next(line for line in text if "dies" in line)
    assert "dead" in dead_line and "exit status 3" in dead_line
    assert [j["id"] for j in sq.listing("--state", "dead", "--since", "1h")] == ["dies"]
    assert sq.run("dlq", "list").stdout.count("dies") == 1


def test_show_gives_the_whole_record_in_text_and_json(sq, tmp_path):
    job_id = sq.enqueue("--id", "hello", "echo hello; echo oops >&2")
    sq.work()
    job = sq.show(job_id)
    assert (job["state"], job["attempts"], job["exit_code"], job["outcome"]) == ("done", 1, 0, "succeeded")
    assert job["stdout"] == "hello\n" and job["stderr"] == "oops\n"
    [run] = job["history"]
    assert run["attempt"] == 1 and run["exit_code"] == 0 and {"worker", "due", "start", "end"} <= set(run)
    text = sq.run("show", job_id).stdout
    assert "state: done" in text and "outcome: succeeded" in text and "  | hello" in text
    # Where the record is: a directory spool names its file; a PostgreSQL
    # spool's records are rows (docs/postgres.md), with no file to name.
    if sq.kind == "dir":
        assert job["file"].endswith("/done/hello.json")
    else:
        assert "file" not in job
    missing = sq.fail("show", "no-such-job")
    assert missing.returncode == 1 and "no-such-job" in missing.stderr
    assert sq.fail("show", "../bad").returncode == 2


def test_status_counts_the_jobs_per_state_in_text_and_json(sq):
    sq.enqueue("--in", "1h", "true")
    sq.enqueue("true")
    sq.enqueue("--max-attempts", "1", "false")
    sq.work()
    status = sq.status()
    assert list(status)[:len(STATUS_KEYS)] == STATUS_KEYS
    assert {k: status[k] for k in ("new", "cur", "failed", "dead", "done")} == \
        {"new": 1, "cur": 0, "failed": 0, "dead": 1, "done": 1}
    assert status["abandoned"] == 0 and status["workers"] == []
    text = sq.run("status").stdout
    for state, n in (("new", 1), ("dead", 1), ("done", 1)):
        assert any(line.split()[:2] == [state, str(n)] for line in text.splitlines()), text


def test_stats_counts_runs_per_kind_or_program(sq):
    q = sq.api()
    for _ in range(2):
        q.enqueue(command="true")
    q.enqueue(command="exit 3", max_attempts=1)
    q.enqueue(kind="ping")
    q.work(handlers={"ping": lambda payload: "pong"})
    stats = json.loads(sq.run("stats", "--json").stdout)
    assert stats == q.stats()
    by = {row["group"]: row for row in stats["groups"]}
    assert stats["total"]["jobs"] == 4 and stats["total"]["succeeded"] == 3 and stats["total"]["dead"] == 1
    assert by["ping"]["succeeded"] == 1
    assert by["true"]["succeeded"] == 2 and by["exit"]["dead"] == 1
    assert sq.run("stats").returncode == 0


def test_an_id_may_be_given_by_its_start_unless_several_begin_so(sq):
    a = sq.enqueue("--id", "alpha-1", "--in", "1h", "true")
    sq.enqueue("--id", "alpha-2", "--in", "1h", "true")
    sq.enqueue("--id", "beta-1", "--max-attempts", "1", "false")
    sq.work()
    assert sq.show("bet")["id"] == "beta-1"
    ambiguous = sq.fail("show", "alpha")
    assert ambiguous.returncode == 1 and "alpha-1" in ambiguous.stderr and "alpha-2" in ambiguous.stderr
    sq.run("cancel", "alpha-1"[:7])
    assert sq.show(a)["outcome"] == "cancelled"
    assert sq.run("retry", "bet").stdout.split() == ["beta-1"]
    assert sq.show("beta-1")["state"] == "new"
