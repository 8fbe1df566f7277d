"""The PostgreSQL spool's contract, one backend at a time, against a real
server (tests/pgserver.py): its schema and versions, enqueue and ids, the
records a run leaves (the directory spool's history, attempts, outcomes,
backoff and dead state), cancel and retry, settings, retention, stats and
counters, and what it shows of its URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from spoolq import record
from spoolq.errors import ConfigError, DuplicateId, JobNotFound, NotASpool, NotPossible, SpoolError
from spoolq.record import Outcome

pytest_plugins = ["pgserver"]

if os.environ.get("SPOOLQ_CI"):
    import psycopg  # under CI a missing psycopg fails the run
else:
    psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[test]')")

from spoolq.pgspool import PgBackend  # noqa: E402


def job(job_id: str, **fields) -> tuple[str, bytes, None]:
    if not {"command", "argv", "kind"} & set(fields):
        fields["command"] = "true"
    return job_id, record.serialise(record.new_job(fields, job_id, time.time())), None


@pytest.fixture
def spool(pg_spool_url):
    backend = PgBackend(pg_spool_url)
    yield backend
    backend.close()


@pytest.fixture
def worker(spool):
    reg = spool.register()
    yield reg
    reg.close()


def run_once(spool, reg, outcome: Outcome | None = None, **kw):
    claim = spool.claim_next()
    assert claim is not None
    done = spool.finish(claim, outcome or Outcome(start=time.time(), end=time.time(), exit_code=0, **kw), reg.worker_id)
    spool.commit()
    return claim, done


def failing(**kw) -> Outcome:
    return Outcome(start=time.time(), end=time.time(), exit_code=1, error="exit code 1", **kw)


def db_now(url: str) -> float:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT extract(epoch FROM now())::float8").fetchone()[0]


# -- schema ------------------------------------------------------------------------


def test_a_database_without_the_schema_is_no_spool_and_init_makes_it_once(pg_url):
    backend = PgBackend(pg_url)
    with pytest.raises(NotASpool) as e:
        backend.get("x")
    assert "init" in str(e.value)
    assert backend.init() == []
    assert backend.init() == []  # idempotent
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT array_agg(version) FROM spoolq.schema_version").fetchone()[0] == [1, 2]
    assert backend.counts()["new"] == 0
    backend.close()


def test_inits_at_once_make_the_schema_once(pg_url):
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from spoolq.pgspool import PgBackend; "
            "PgBackend(sys.argv[1]).init()")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-c", code, pg_url, root], stderr=subprocess.PIPE) for _ in range(4)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM spoolq.schema_version").fetchone()[0] == 2


def test_a_schema_newer_than_spoolq_is_refused_in_one_line(pg_spool_url):
    with psycopg.connect(pg_spool_url, autocommit=True) as conn:
        conn.execute("INSERT INTO spoolq.schema_version (version) VALUES (99)")
    backend = PgBackend(pg_spool_url)
    for attempt in (backend.counts, backend.init):
        with pytest.raises(SpoolError) as e:
            attempt()
        assert "version 99" in str(e.value) and "upgrade spoolq" in str(e.value) and "\n" not in str(e.value)
    backend.close()


def test_init_refuses_a_group_and_says_roles_decide(spool):
    with pytest.raises(ConfigError, match="roles and grants"):
        spool.init(group="staff")


# -- the URL ---------------------------------------------------------------------


def test_the_location_never_shows_a_password(pg_spool_url):
    secret = "s3cr3t-pw"
    url = pg_spool_url.replace("postgresql://", f"postgresql://postgres:{secret}@") + f"&password={secret}"
    backend = PgBackend(url)
    assert secret not in backend.location and secret not in repr(backend)
    assert backend.location.startswith("postgresql://postgres@")
    assert backend.counts()["new"] == 0  # trust auth: the password is not even needed
    backend.close()
    broken = PgBackend(url.replace("host=", "host=/nonexistent"))
    with pytest.raises(SpoolError) as e:
        broken.counts()
    assert secret not in str(e.value) and "cannot connect" in str(e.value) and "\n" not in str(e.value)


def test_without_psycopg_a_postgresql_spool_is_one_line_naming_the_extra(pg_spool_url):
    code = ("import sys; sys.modules['psycopg'] = None; sys.path.insert(0, sys.argv[2]); "
            "from spoolq.pgspool import PgBackend\n"
            "try:\n    PgBackend(sys.argv[1]).counts()\nexcept Exception as e:\n    print(type(e).__name__, e)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, pg_spool_url, root], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "SpoolError a PostgreSQL spool needs psycopg: pip install 'spoolq[postgres]'"


# -- enqueue ---------------------------------------------------------------------


def test_a_batch_is_enqueued_whole_or_not_at_all(spool):
    assert spool.enqueue([job("a"), job("b")]) == ["a", "b"]
    with pytest.raises(DuplicateId, match="id b is already in the spool"):
        spool.enqueue([job("c"), job("b", command="other")])
    assert not spool.has_id("c")
    assert [j["id"] for j in spool.list()] == ["a", "b"]


def test_the_same_job_again_is_already_there_for_the_relay_but_another_is_a_duplicate(spool):
    first = job("r1", command="make report", payload={"n": 1})
    spool.enqueue([first])
    assert spool.enqueue([first, job("r2")], existing_ok=True) == ["r1", "r2"]
    with pytest.raises(DuplicateId):
        spool.enqueue([job("r1", command="something else")], existing_ok=True)
    assert spool.counts()["new"] == 2


def test_an_id_stays_taken_while_its_history_is_kept(spool, worker):
    spool.enqueue([job("once")])
    run_once(spool, worker)
    with pytest.raises(DuplicateId, match=r"\(done\)"):
        spool.enqueue([job("once")])
    spool.compact(0)
    assert spool.enqueue([job("once")]) == ["once"]


def test_due_times_are_kept_and_claims_take_due_jobs_in_order(spool, worker):
    later = time.time() + 3600
    spool.enqueue([job("z-first"), ("later", record.serialise(record.new_job({"command": "true"}, "later", time.time())),
                                    later)])
    spool.enqueue([job("a-second")])
    waiting = {j["id"]: j for j in spool.list(state="new")}
    assert record.parse_time(waiting["later"]["due_at"]) == pytest.approx(later, abs=0.01)
    order = []
    while (claim := spool.claim_next()) is not None:
        order.append(claim.job_id)
        spool.finish(claim, Outcome(start=time.time(), end=time.time()), worker.worker_id)
    spool.commit()
    assert order == ["z-first", "a-second"]
    assert 3500 < spool.next_due() <= 3600


# -- what a run leaves in the record ---------------------------------------------


def test_a_successful_run_is_recorded_as_the_directory_spool_records_it(spool, worker):
    spool.enqueue([job("ok", command="echo hi")])
    claim, done = run_once(spool, worker, Outcome(start=time.time(), end=time.time(), exit_code=0, stdout="hi\n"))
    assert (done.state, done.lost, done.pending) == ("done", False, False)
    rec = spool.get("ok")
    assert rec["state"] == "done" and rec["outcome"] == "succeeded" and rec["attempts"] == 1
    assert rec["stdout"] == "hi\n" and rec["exit_code"] == 0 and "finished_at" in rec
    (entry,) = rec["history"]
    assert entry["attempt"] == 1 and entry["worker"] == worker.worker_id and entry["exit_code"] == 0
    assert set(entry) == {"attempt", "worker", "due", "start", "end", "exit_code"}


def test_failures_back_off_by_the_database_clock_and_die_after_max_attempts(spool, worker):
    spool.config_set("backoff_initial", "100")
    spool.config_set("max_attempts", "2")
    spool.enqueue([job("flaky")])
    before = db_now(spool.url)
    _, done = run_once(spool, worker, failing())
    assert done.state == "failed"
    assert 90 <= done.due - before <= 111  # 100 s, jitter +-10 %
    rec = spool.get("flaky")
    assert rec["state"] == "failed" and rec["attempts"] == 1 and rec["error"] == "exit code 1" and "failed_at" in rec
    assert spool.claim_next() is None  # not due yet
    with psycopg.connect(spool.url, autocommit=True) as conn:
        conn.execute("UPDATE spoolq.jobs SET at = now() WHERE id = 'flaky'")
    _, done = run_once(spool, worker, failing())
    assert done.state == "dead" and done.due is None
    rec = spool.get("flaky")
    assert rec["state"] == "dead" and rec["attempts"] == 2 and [h["attempt"] for h in rec["history"]] == [1, 2]


def test_a_permanent_failure_goes_dead_at_once(spool, worker):
    spool.enqueue([job("perm")])
    _, done = run_once(spool, worker, failing(permanent=True))
    assert done.state == "dead"


def test_a_record_that_can_never_run_goes_dead_with_the_reason(spool, worker):
    spool.config_set("allow_commands", "false")
    spool.enqueue([job("refused")])
    with psycopg.connect(spool.url, autocommit=True) as conn:  # rows a producer wrote by hand
        conn.execute("INSERT INTO spoolq.jobs (id, record) VALUES ('garbage', 'not json'), "
                     "('nokind', '{\"payload\": 1}'), ('zgood', '{\"kind\": \"k\"}')")
    claim = spool.claim_next()
    assert claim.job_id == "zgood"
    assert claim.job["state"] == "new" and claim.job["attempts"] == 0  # first sight, as for a dropped file
    dead = {j["id"]: j for j in spool.list(state="dead")}
    assert set(dead) == {"refused", "garbage", "nokind"}
    assert "allow_commands is false" in dead["refused"]["error"]
    assert dead["garbage"]["valid"] is False and "not valid JSON" in dead["garbage"]["error"]
    assert "exactly one of command, argv or kind" in dead["nokind"]["error"]


def test_a_hand_inserted_run_at_is_honoured(spool):
    ahead = time.time() + 600
    with psycopg.connect(spool.url, autocommit=True) as conn:
        conn.execute("INSERT INTO spoolq.jobs (id, record) VALUES ('later', %s)",
                     (json.dumps({"kind": "k", "run_at": record.rfc3339(ahead)}),))
    spool.register()
    assert spool.claim_next() is None
    assert record.parse_time(spool.get("later")["due_at"]) == pytest.approx(ahead, abs=0.01)


def test_unclaim_puts_a_job_back_as_it_was(spool, worker):
    spool.enqueue([job("back")])
    claim = spool.claim_next()
    assert spool.get("back")["state"] == "cur" and spool.get("back")["worker"] == worker.worker_id
    assert spool.unclaim(claim) == "new"
    rec = spool.get("back")
    assert rec["state"] == "new" and rec["attempts"] == 0 and "history" not in rec


# -- cancel, retry ---------------------------------------------------------------


def test_cancel_takes_only_waiting_jobs(spool, worker):
    spool.enqueue([job("c1"), job("c2")])
    spool.cancel("c1")
    rec = spool.get("c1")
    assert rec["state"] == "done" and rec["outcome"] == "cancelled"
    claim = spool.claim_next()
    with pytest.raises(NotPossible, match="running"):
        spool.cancel(claim.job_id)
    with pytest.raises(NotPossible, match="finished"):
        spool.cancel("c1")
    with pytest.raises(JobNotFound):
        spool.cancel("nope")


def test_retry_gives_a_dead_job_a_fresh_round_and_keeps_its_history(spool, worker):
    spool.enqueue([job("d1"), job("d2"), job("d3")])
    for _ in range(3):
        run_once(spool, worker, failing(permanent=True))
    spool.enqueue([job("w")])
    with pytest.raises(NotPossible, match="not dead"):
        spool.retry("w")
    spool.retry("d1")
    rec = spool.get("d1")
    assert rec["state"] == "new" and rec["attempts"] == 0 and len(rec["history"]) == 1 and "retried_at" in rec
    assert "error" not in rec and "exit_code" not in rec
    spool.purge_dead(0)
    assert spool.counts()["dead_purged"] == 2 and spool.counts()["dead"] == 0
    assert [(j["id"], j["purged"]) for j in spool.list("dead")] == [("d2", True), ("d3", True)]
    spool.retry("d2")  # purged, and still a dead job: retried from its record
    rec = spool.get("d2")
    assert rec["state"] == "new" and "purged" not in rec and len(rec["history"]) == 1
    assert spool.counts()["dead_purged"] == 1
    spool.enqueue([job("d4")])
    claim = spool.claim_next()
    while claim.job_id != "d4":
        spool.finish(claim, Outcome(start=time.time(), end=time.time()), worker.worker_id)
        claim = spool.claim_next()
    spool.finish(claim, failing(permanent=True), worker.worker_id)
    spool.commit()
    assert spool.retry_all() == ["d4"]


# -- settings --------------------------------------------------------------------


def test_settings_live_in_the_database_and_are_validated(spool, pg_spool_url):
    assert spool.config_set("timeout", "5m") == 300
    with pytest.raises(ConfigError, match="max_attempts must be >= 1"):
        spool.config_set("max_attempts", "0")
    with pytest.raises(ConfigError, match="unknown setting"):
        spool.config_set("nope", "1")
    other = PgBackend(pg_spool_url)  # another process's view
    assert other.config_list()["timeout"] == 300 and other.config_stored() == {"timeout": 300}
    other.settings.reload()
    assert other.settings["timeout"] == 300
    assert spool.config_unset("timeout") is True
    other.settings.reload()
    assert other.settings["timeout"] == 0
    other.close()


def test_a_bad_stored_setting_is_an_error_naming_it(spool):
    with psycopg.connect(spool.url, autocommit=True) as conn:
        conn.execute("INSERT INTO spoolq.settings VALUES ('max_attempts', '\"lots\"')")
    with pytest.raises(ConfigError, match="max_attempts"):
        spool.settings.reload()


# -- retention, stats, counters ------------------------------------------------------


def test_stats_are_the_directory_spools_shape(spool, worker):
    spool.enqueue([job("s1", command="make a"), job("s2", command="make b"), job("s3", kind="mail"),
                   job("s4", kind="mail")])
    for outcome in (Outcome(start=time.time(), end=time.time() + 2), failing(permanent=True),
                    Outcome(start=time.time(), end=time.time() + 1)):
        run_once(spool, worker, outcome)
    spool.cancel("s4")
    stats = spool.stats()
    total = stats["total"]
    assert (total["jobs"], total["succeeded"], total["dead"], total["cancelled"], total["runs"], total["failed_runs"]) \
        == (4, 2, 1, 1, 3, 1)
    assert total["run_max"] == pytest.approx(2, abs=0.01)
    groups = {g["group"]: g for g in stats["groups"]}
    assert set(groups) == {"make", "mail"} and groups["make"]["jobs"] == 2 and groups["mail"]["cancelled"] == 1
    assert set(total) == {"jobs", "succeeded", "failed_runs", "dead", "cancelled", "runs", "wait_p50", "wait_p95",
                          "wait_max", "run_p50", "run_p95", "run_max", "throughput_per_s"}
    assert spool.stats(since=time.time() + 60)["total"]["jobs"] == 0


def test_retention_deletes_old_history_and_no_counter_goes_down(spool, worker):
    spool.enqueue([job(f"j{i}") for i in range(6)])
    for i in range(4):
        run_once(spool, worker, failing(permanent=True) if i == 3 else None)
    spool.cancel("j4")
    spool.purge_dead(0)
    before = spool.metrics()
    assert before["finished"] == {"succeeded": 3, "cancelled": 1} and before["runs"] == {"succeeded": 3, "failed": 1}
    assert spool.compact(3600)["dropped"] == 0
    result = spool.compact(0)
    assert result["dropped"] == 5  # 3 done, 1 cancelled, 1 purged dead; the new job stays
    assert spool.counts()["done"] == 0 and spool.counts()["new"] == 1 and spool.get("j0") is None
    after = spool.metrics()
    assert after["finished"] == before["finished"] and after["runs"] == before["runs"]
    assert after["run_seconds"] == before["run_seconds"]
    assert spool.stats()["total"]["jobs"] == 0


def test_metrics_count_runs_wherever_their_jobs_are(spool, worker):
    spool.enqueue([job("m1"), job("m2")])
    run_once(spool, worker, failing())
    m = spool.metrics()
    assert m["states"]["failed"] == 1 and m["states"]["new"] == 1
    assert m["runs"] == {"succeeded": 0, "failed": 1} and m["run_seconds"]["run_seconds_count"] == 1
    assert len(m["workers"]) == 1 and m["oldest_due_age"] >= 0


# -- ids by their start, handler kinds ------------------------------------------------


def test_ids_that_begin_with_a_prefix_are_found_in_the_states_asked(spool, worker):
    spool.enqueue([job("alpha-1"), job("alpha-2"), job("beta-1")])
    run_once(spool, worker, failing(permanent=True))  # alpha-1: dead
    assert spool.ids_with_prefix("alpha") == ["alpha-1", "alpha-2"]
    assert spool.ids_with_prefix("alpha", ("dead",)) == ["alpha-1"]
    assert spool.ids_with_prefix("alpha", ("new", "failed")) == ["alpha-2"]
    assert spool.ids_with_prefix("b") == ["beta-1"]
    assert spool.ids_with_prefix("gamma") == []
    assert spool.ids_with_prefix("alpha", limit=1) == ["alpha-1"]


def test_a_worker_claims_only_the_handler_kinds_it_runs_and_the_rest_wait(pg_spool_url):
    spool = PgBackend(pg_spool_url)
    try:
        spool.enqueue([job("mail", kind="send_email"), job("cmd", command="true"), job("ping", kind="ping")])
        reg = spool.register(kinds=["ping"])
        try:
            claimed = []
            while (claim := spool.claim_next()) is not None:
                claimed.append(claim.job_id)
                spool.finish(claim, Outcome(start=time.time(), end=time.time()), reg.worker_id)
            spool.commit()
            assert claimed == ["cmd", "ping"]
            assert spool.next_due() is None  # nothing this worker can run waits: it sleeps
            waiting = spool.get("mail")
            assert waiting["state"] == "new" and waiting["attempts"] == 0
            # A live worker that runs ping only: the mail job waits for one with a handler.
            assert waiting["waits_for_handler"] is True
            assert spool.counts()["unhandled"] == {"send_email": 1}
            assert spool.live_workers()[0]["kinds"] == ["ping"]
        finally:
            reg.close()
        # Once that worker has gone, what it said still holds.
        assert spool.counts()["unhandled"] == {"send_email": 1}
        every = spool.register()  # a worker of every kind (kinds None)
        try:
            assert spool.counts()["unhandled"] == {}
            assert spool.claim_next().job_id == "mail"
        finally:
            every.close()
    finally:
        spool.close()


def test_throughput_is_over_a_window_of_at_least_a_minute(spool, worker):
    spool.enqueue([job("a"), job("b")])
    run_once(spool, worker)
    run_once(spool, worker)
    total = spool.stats()["total"]
    assert total["jobs"] == 2 and total["throughput_per_s"] <= 2 / 60 + 0.001


def test_the_backend_has_every_verb_of_the_storage_port(pg_spool_url):
    from spoolq.backend import Backend
    from spoolq.pgspool import PgPort

    verbs = {name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")}
    spool = PgPort(pg_spool_url)  # (PgBackend with the port's whole set of verbs)
    try:
        assert verbs and not {v for v in verbs if not callable(getattr(spool, v, None))}
        assert spool.exists() and spool.count_workers() == 0
        spool.enqueue([job("later")])
        look = spool.next_look()
        assert look.due is not None and abs(look.due - time.time()) < 60 and not look.busy
    finally:
        spool.close()
