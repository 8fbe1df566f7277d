"""History: compaction into index.db, answers from folders plus index,
stats, Prometheus metrics and purging dead jobs."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import sqlite3
import subprocess
import time

from conftest import wait_for


def _rows(s) -> list[tuple[str, str]]:
    db = sqlite3.connect(s.path / "index.db")
    try:
        return db.execute("SELECT id, state FROM jobs").fetchall()
    finally:
        db.close()


def test_compaction_folds_done_and_everything_still_answers(fast_spool):
    s = fast_spool
    ok = [s.enqueue("echo hi") for _ in range(30)]
    dead = s.enqueue("--max-attempts", "1", "exit 4")
    s.work("-q")
    out = s.run("compact").stdout
    assert "folded 30 jobs" in out
    assert s.names("done") == [] and s.ids("dead") == [dead]  # dead/ is never compacted
    assert sorted(r[0] for r in _rows(s)) == sorted(ok)
    st = s.status()
    assert st["done"] == 30 and st["compacted"] == 30 and st["done_files"] == 0 and st["dead"] == 1
    job = s.show(ok[0])
    assert job["state"] == "done" and job["stdout"] == "hi\n" and job["compacted"] is True
    listed = [json.loads(line) for line in s.run("list", "--state", "done", "--json").stdout.splitlines()]
    assert [j["id"] for j in listed] == ok  # oldest first, from the index
    assert len(s.run("list", "--state", "done", "--limit", "5").stdout.splitlines()) == 5
    # Compacted ids stay taken.
    proc = s.run("enqueue", "--id", ok[0], "true", check=False)
    assert proc.returncode == 1 and "index" in proc.stderr
    # New finished jobs merge with the compacted ones, in finish order.
    more = s.enqueue("true")
    s.work("-q")
    listed = [json.loads(line)["id"] for line in s.run("list", "--state", "done", "--json").stdout.splitlines()]
    assert listed == ok + [more]
    assert s.status()["done"] == 31


def test_compaction_while_two_workers_drain_loses_nothing(fast_spool, tmp_path):
    s = fast_spool
    log = tmp_path / "ran.log"
    ids = s.run("enqueue", "--jsonl", "-", input="".join(
        json.dumps({"command": f"echo $SPOOLQ_JOB_ID >> {log}"}) + "\n" for _ in range(600))).stdout.split()
    workers = [s.popen("work", "-j", "2", "-q") for _ in range(2)]
    compactions = 0
    while any(w.poll() is None for w in workers):
        s.run("compact")
        compactions += 1
    s.run("compact")
    rows = _rows(s)
    assert len(rows) == len({r[0] for r in rows}) == 600  # one row per job
    assert {r[0] for r in rows} == set(ids)
    assert s.names("done") == [] and s.names("cur") == [] and s.names("new") == []
    assert collections.Counter(log.read_text().split()) == collections.Counter({i: 1 for i in ids})
    assert compactions >= 2


def test_a_compaction_killed_at_random_points_leaves_one_row_per_job(fast_spool):
    s = fast_spool
    s.config("fsync", "true")  # the index commits durably before files go
    ids = s.run("enqueue", "--jsonl", "-", input='{"command": "true"}\n' * 3000).stdout.split()
    s.config("fsync", "false")
    s.work("-q", "-j", "2")
    s.config("fsync", "true")
    rng = random.Random(5)
    kills = 0
    for _ in range(8):
        proc = s.popen("compact", stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))
        time.sleep(rng.uniform(0.05, 0.4))  # a random point in the compaction, not a synchronisation
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        if not s.names("done"):
            break
    s.run("compact")
    rows = _rows(s)
    assert sorted(r[0] for r in rows) == sorted(ids)
    assert s.names("done") == []
    db = sqlite3.connect(s.path / "index.db")
    counted = db.execute("SELECT value FROM counters WHERE name = 'rows_done'").fetchone()[0]
    runs = db.execute("SELECT COUNT(*), COUNT(DISTINCT job_id) FROM runs").fetchone()
    db.close()
    assert counted == 3000 and runs == (3000, 3000)
    assert s.status()["done"] == 3000
    assert kills >= 1


def _fake_done(s, job_id: str, finished: float, runs: list[tuple[float, float]], outcome="succeeded", kind="report"):
    """A finished record as a worker writes it, with runs (wait, duration)."""
    history = []
    t = finished - sum(w + d for w, d in runs)
    for i, (wait, duration) in enumerate(runs, 1):
        due = t
        start = due + wait
        end = start + duration
        entry = {"attempt": i, "worker": "w", "due": _t(due), "start": _t(start), "end": _t(end)}
        if i < len(runs) or outcome == "dead":
            entry["error"] = "exit status 1"
            entry["exit_code"] = 1
        else:
            entry["exit_code"] = 0
        history.append(entry)
        t = end
    state = "dead" if outcome == "dead" else "done"
    job = {"kind": kind, "id": job_id, "state": state, "attempts": len(runs), "history": history,
           "created_at": _t(finished - 100), "finished_at": _t(finished)}
    if state == "done":
        job["outcome"] = outcome
    path = s.drop(f"{job_id}.json", json.dumps(job), folder=state)
    os.utime(path, (finished, finished))


def _t(ts: float) -> str:
    from spoolq.record import rfc3339

    return rfc3339(ts)


def test_stats_percentiles_on_known_durations(fast_spool):
    s = fast_spool
    now = time.time()
    # 100 report jobs: run i takes i ms and waited i/10 s (i = 1..100).
    for i in range(1, 101):
        _fake_done(s, f"r{i:03d}", now - 1000 + i, [(i / 10, i / 1000)])
    # 20 mail jobs: a failed run then a good one; two cancelled; one dead.
    for i in range(20):
        _fake_done(s, f"m{i:02d}", now - 500 + i, [(1.0, 0.5), (2.0, 0.25)], kind="mail")
    _fake_done(s, "c1", now - 10, [], outcome="cancelled", kind="mail")
    _fake_done(s, "c2", now - 9, [], outcome="cancelled", kind="mail")
    _fake_done(s, "d1", now - 8, [(0.0, 3.0)], outcome="dead", kind="mail")
    s.run("compact")  # half in the index, half still in done/ ...
    for i in range(101, 121):
        _fake_done(s, f"r{i:03d}", now - 200 + i, [(i / 10, i / 1000)])  # ... plus 20 more report jobs in done/
    result = json.loads(s.run("stats", "--json").stdout)
    groups = {g["group"]: g for g in result["groups"]}
    rep = groups["report"]
    assert rep["jobs"] == 120 and rep["succeeded"] == 120 and rep["failed_runs"] == 0 and rep["runs"] == 120
    # nearest rank over 1..120: p50 = 60th, p95 = 114th
    assert abs(rep["run_p50"] - 0.060) < 1e-4 and abs(rep["run_p95"] - 0.114) < 1e-4 and abs(rep["run_max"] - 0.120) < 1e-4
    assert abs(rep["wait_p50"] - 6.0) < 1e-3 and abs(rep["wait_p95"] - 11.4) < 1e-3 and abs(rep["wait_max"] - 12.0) < 1e-3
    mail = groups["mail"]
    assert mail["jobs"] == 23 and mail["succeeded"] == 20 and mail["cancelled"] == 2 and mail["dead"] == 1
    assert mail["runs"] == 41 and mail["failed_runs"] == 21  # 20 failed first runs + the dead one's run
    assert abs(mail["run_p50"] - 0.5) < 1e-4 and abs(mail["run_max"] - 3.0) < 1e-4
    total = result["total"]
    assert total["jobs"] == 143 and total["runs"] == 161
    for key in ("wait_p50", "wait_p95", "run_p50", "run_p95"):
        assert isinstance(total[key], float)
    recent = json.loads(s.run("stats", "--json", "--since", "400").stdout)
    assert recent["total"]["jobs"] == 20 + 3  # the 20 newest reports, c1, c2, d1; the rest finished earlier
    assert "report" in s.run("stats").stdout


def test_keep_drops_old_rows_only(fast_spool):
    s = fast_spool
    now = time.time()
    for i in range(5):
        _fake_done(s, f"old{i}", now - 40 * 86400, [(0.1, 0.1)])
    for i in range(5):
        _fake_done(s, f"new{i}", now - 3600, [(0.1, 0.1)])
    s.run("compact", "--keep", "30d")
    assert sorted(r[0] for r in _rows(s)) == [f"new{i}" for i in range(5)]
    assert s.status()["done"] == 5
    assert s.run("show", "old1", check=False).returncode == 1
    assert s.show("new1")["state"] == "done"


def test_keep_0_drops_every_finished_job_only_when_confirmed(fast_spool):
    """`compact --keep 0` would drop every row, the jobs it has just folded
    included: the command refuses it without --yes and changes nothing; the
    Python API (keep=0) does as it is told."""
    s = fast_spool
    jobs = [s.enqueue("true") for _ in range(3)]
    s.work("-q")
    for given in ("0", "0s"):
        proc = s.run("compact", "--keep", given, check=False)
        assert proc.returncode == 2
        assert proc.stderr == (f"spoolq: --keep {given} would drop the history of every finished job, including the "
                               "ones this compaction folds; add --yes to do that\n")
    assert sorted(s.ids("done")) == sorted(jobs) and not (s.path / "index.db").exists()
    s.run("compact", "--keep", "1d")
    assert s.status()["done"] == 3 and sorted(r[0] for r in _rows(s)) == sorted(jobs)
    assert json.loads(s.run("compact", "--keep", "0", "--yes", "--json").stdout)["dropped"] == 3
    assert _rows(s) == [] and s.run("show", jobs[0], check=False).returncode == 1
    from spoolq import Spool

    more = s.enqueue("true")
    s.work("-q")
    assert Spool(s.path).compact(keep=0)["dropped"] == 1
    assert _rows(s) == [] and s.ids("done") == [] and s.run("show", more, check=False).returncode == 1


def test_prometheus_output_parses(fast_spool):
    from prometheus_client.parser import text_string_to_metric_families

    s = fast_spool
    for _ in range(3):
        s.enqueue("true")
    s.enqueue("--max-attempts", "2", "false")
    s.enqueue("--in", "1h", "true")
    s.work("-q")
    s.run("compact")
    s.enqueue("true")
    s.work("-q")
    text = s.run("status", "--prometheus").stdout
    families = {f.name: f for f in text_string_to_metric_families(text)}
    jobs = {smp.labels["state"]: smp.value for smp in families["spoolq_jobs"].samples}
    assert jobs == {"new": 1, "cur": 0, "failed": 1, "dead": 0, "done": 1, "held": 0, "waiting": 0}
    assert families["spoolq_jobs_compacted"].samples[0].value == 3
    assert families["spoolq_finished_jobs"].type == "counter"
    finished = {smp.labels["result"]: smp.value for smp in families["spoolq_finished_jobs"].samples}
    assert finished == {"succeeded": 4, "cancelled": 0}
    runs = {smp.labels["result"]: smp.value for smp in families["spoolq_runs"].samples}
    assert runs == {"succeeded": 4, "failed": 1}  # the job waiting in failed/ has failed once
    assert families["spoolq_workers"].samples[0].value == 0
    assert families["spoolq_oldest_due_job_age_seconds"].samples[0].value == 0  # the failed one is not due yet


def _metrics(s) -> dict:
    """The scrape as {sample name: {label values (spool left out): value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    proc = s.run("status", "--prometheus")
    out: dict = collections.defaultdict(dict)
    for family in text_string_to_metric_families(proc.stdout):
        for smp in family.samples:
            assert smp.labels.pop("spool") == str(s.path)
            out[smp.name][tuple(sorted(smp.labels.items()))] = smp.value
    return out


def _counters(metrics: dict) -> dict:
    return {(name, labels): v for name, samples in metrics.items() if name.endswith(("_total", "_bucket", "_sum", "_count"))
            for labels, v in samples.items()}


def test_failed_runs_count_as_they_happen_wherever_the_job_is(fast_spool):
    """An alert on the failure rate needs each failed run counted when it
    happens: in failed/, dead/, back in new/ after a retry, in the index
    after a purge; no counter ever goes down, compaction and purge
    included; the run-duration histogram counts every run."""
    s = fast_spool
    failing = s.enqueue("--max-attempts", "2", "exit 3")
    s.work("-q")
    assert s.where(failing) == ["failed"]
    scrapes = [_metrics(s)]

    def runs(m):
        return {dict(k)["result"]: v for k, v in m["spoolq_runs_total"].items()}

    assert runs(scrapes[-1]) == {"succeeded": 0, "failed": 1}
    assert scrapes[-1]["spoolq_run_duration_seconds_count"][()] == 1

    os.utime(s.path / "failed" / f"{failing}.json")  # due now: it runs again, fails, and dies
    s.work("-q")
    assert s.where(failing) == ["dead"]
    scrapes.append(_metrics(s))
    assert runs(scrapes[-1]) == {"succeeded": 0, "failed": 2}

    ok = [s.enqueue("true") for _ in range(3)]
    s.work("-q")
    scrapes.append(_metrics(s))
    assert runs(scrapes[-1]) == {"succeeded": 3, "failed": 2}
    s.run("retry", failing)  # back to new/ with its history: its two runs still count
    scrapes.append(_metrics(s))
    assert runs(scrapes[-1]) == {"succeeded": 3, "failed": 2}
    s.work("-q")  # a third failed run, in failed/ again
    scrapes.append(_metrics(s))
    assert runs(scrapes[-1]) == {"succeeded": 3, "failed": 3}
    os.utime(s.path / "failed" / f"{failing}.json")
    s.work("-q")
    s.run("compact")
    assert s.ids("done") == [] and s.ids("dead") == [failing]
    scrapes.append(_metrics(s))
    s.run("purge", "--dead", "--older-than", "0s", "--yes")
    assert s.ids("dead") == []
    scrapes.append(_metrics(s))
    assert runs(scrapes[-1]) == {"succeeded": 3, "failed": 4}
    finished = {dict(k)["result"]: v for k, v in scrapes[-1]["spoolq_finished_jobs_total"].items()}
    assert finished == {"succeeded": 3, "cancelled": 0}
    # History dropped by --keep leaves the counters as they were.
    _fake_done(s, "old", time.time() - 40 * 86400, [(0.1, 2.0), (0.1, 0.05)])
    scrapes.append(_metrics(s))
    assert runs(scrapes[-1]) == {"succeeded": 4, "failed": 5}
    s.run("compact", "--keep", "30d")
    assert s.run("show", "old", check=False).returncode == 1  # dropped
    scrapes.append(_metrics(s))
    assert runs(scrapes[-1]) == {"succeeded": 4, "failed": 5}

    last = scrapes[-1]
    buckets = sorted((float(dict(k)["le"]), v) for k, v in last["spoolq_run_duration_seconds_bucket"].items())
    assert buckets[-1] == (float("inf"), 9) and last["spoolq_run_duration_seconds_count"][()] == 9
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    assert dict(buckets)[1.0] == 8 and dict(buckets)[5.0] == 9  # the 2 s run of "old"
    assert 2.0 <= last["spoolq_run_duration_seconds_sum"][()] < 2.0 + 8 * 1.0
    for before, after in zip(scrapes, scrapes[1:]):
        b, a = _counters(before), _counters(after)
        assert set(b) <= set(a)
        assert all(a[k] >= v for k, v in b.items()), [(k, v, a[k]) for k, v in b.items() if a[k] < v]


def test_an_index_made_before_the_run_duration_histogram_gets_it_from_its_runs(fast_spool):
    s = fast_spool
    _fake_done(s, "a", time.time() - 60, [(0.1, 0.3), (0.1, 20.0)])
    _fake_done(s, "b", time.time() - 30, [(0.1, 2.0)])
    s.run("compact")
    db = sqlite3.connect(s.path / "index.db")
    with db:  # as schema 1 left it: no duration counters
        db.execute("DELETE FROM counters WHERE name LIKE 'run_seconds%'")
        db.execute("PRAGMA user_version = 1")
    db.close()
    m = _metrics(s)
    buckets = {dict(k)["le"]: v for k, v in m["spoolq_run_duration_seconds_bucket"].items()}
    assert (buckets["0.5"], buckets["5"], buckets["15"], buckets["60"], buckets["+Inf"]) == (1, 2, 2, 3, 3)
    assert m["spoolq_run_duration_seconds_count"][()] == 3
    assert abs(m["spoolq_run_duration_seconds_sum"][()] - 22.3) < 0.01
    assert {dict(k)["result"]: v for k, v in m["spoolq_runs_total"].items()} == {"succeeded": 2, "failed": 1}


def test_each_job_counts_and_lists_once_while_a_compaction_runs(fast_spool):
    """Compaction commits a batch of rows, then removes their files: in
    between, a job is in done/ and in the index. status, list and the
    metrics, polled from other processes all through a compaction of
    thousands of jobs, show each job exactly once, and the finished-jobs
    counter never moves but up."""
    import threading

    s = fast_spool
    n = 3000
    now = time.time()
    expected: list[str] = []
    polls: list[tuple[str, bool, object]] = []  # (what, started while a job was in both, answer)

    def in_both() -> bool:
        try:
            db = sqlite3.connect(f"file:{s.path / 'index.db'}?mode=ro", uri=True, timeout=30)
            try:
                rows = db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
            finally:
                db.close()
        except sqlite3.Error:
            return False
        return len(os.listdir(s.path / "done")) + rows > len(expected)

    def poller(what: str, args: tuple[str, ...], parse, compaction) -> None:
        while compaction.poll() is None:
            both = in_both()
            polls.append((what, both, parse(s.run(*args).stdout)))

    def listed(out: str) -> list[str]:
        return [json.loads(line)["id"] for line in out.splitlines()]

    def metrics(out: str) -> tuple[float, float, float]:
        from prometheus_client.parser import text_string_to_metric_families

        fam = {f.name: {tuple(sorted(x.labels.items())): x.value for x in f.samples}
               for f in text_string_to_metric_families(out)}
        spool = ("spool", str(s.path))
        return (fam["spoolq_finished_jobs"][(("result", "succeeded"), spool)],
                fam["spoolq_jobs"][(spool, ("state", "done"))] + fam["spoolq_jobs_compacted"][(spool,)],
                fam["spoolq_runs"][(("result", "succeeded"), spool)])

    for round_ in range(8):  # until a poll lands in the window between a commit and its unlinks (narrow on a loaded machine)
        for i in range(n):
            job_id = f"r{round_}j{i:05d}"
            _fake_done(s, job_id, now - 3600 + i / 100, [(0.0, 0.01)])
            expected.append(job_id)
        polls.clear()
        compaction = s.popen("compact", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        threads = [threading.Thread(target=poller, args=a + (compaction,)) for a in (
            ("status", ("status", "--json"), lambda out: (json.loads(out)["done"],)),
            ("list", ("list", "--state", "done", "--json"), listed),
            ("metrics", ("status", "--prometheus"), metrics))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert compaction.wait() == 0, compaction.stderr.read()
        assert s.names("done") == [] and s.status()["compacted"] == len(expected)
        finished_seen = []
        for what, _, answer in polls:
            if what == "status":
                assert answer == (len(expected),)
            elif what == "list":
                assert sorted(answer) == expected, (len(answer), len(set(answer)), len(expected))
            else:
                assert answer == (len(expected),) * 3
                finished_seen.append(answer[0])
        assert finished_seen == sorted(finished_seen)
        if any(both for _, both, _ in polls):
            break
    else:
        raise AssertionError("no poll started while a compacted job's file was still in done/")


def test_counters_only_rise_while_workers_drain_failing_jobs_and_compact(fast_spool):
    """Scraped all through a drain (jobs moving new -> cur -> failed ->
    cur -> dead or done, compactions folding done/), no counter ever
    goes down, and the last scrape counts every run, the dead jobs' too."""
    s = fast_spool
    s.config("backoff_initial", 0)
    s.config("compact_after", 100)
    n = 600
    s.run("enqueue", "--jsonl", "-", input="".join(
        json.dumps({"command": ("exit 1", "exit $((SPOOLQ_ATTEMPT == 1))", "true")[i % 3],  # dies, fails once, runs
                    "max_attempts": 2}) + "\n" for i in range(n)))
    workers = [s.popen("work", "-j", "2", "-q") for _ in range(2)]
    scrapes = []
    while any(w.poll() is None for w in workers):
        scrapes.append(_counters(_metrics(s)))
    scrapes.append(_counters(_metrics(s)))
    for before, after in zip(scrapes, scrapes[1:]):
        assert all(after.get(k, 0) >= v for k, v in before.items()), [(k, v, after.get(k)) for k, v in before.items() if after.get(k, 0) < v]
    last = {k[0] + str(dict(k[1]).get("result", "")): v for k, v in scrapes[-1].items()}
    assert (last["spoolq_runs_totalsucceeded"], last["spoolq_runs_totalfailed"]) == (2 * n // 3, n)
    assert len(scrapes) >= 3


def test_auto_compaction_during_a_drain(fast_spool):
    s = fast_spool
    s.config("compact_after", 50)
    s.run("enqueue", "--jsonl", "-", input='{"command": "true"}\n' * 200)
    err = s.work().stderr
    assert "compacted" in err
    st = s.status()
    # The compaction runs beside the worker and stops with it, after at
    # least one batch: what it did not reach stays in done/.
    assert st["done"] == 200 and st["compacted"] > 50 and st["compacted"] + st["done_files"] == 200
    assert not _compactions_of(s)  # none left running


def _compactions_of(s) -> list[int]:
    """The pids of the compaction processes workers started on spool ``s``
    (their command line names the spool and compact_beside)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(b"compact_beside" in a for a in argv) and str(s.path).encode() in argv:
            found.append(int(pid))
    return found


def _one_row_per_job(s, ids: list[str], one_run_each: bool = True) -> None:
    """Every job once in the index, its counters and runs counted once
    (each job ran once, unless a killed worker's job ran again)."""
    rows = _rows(s)
    assert sorted(r[0] for r in rows) == sorted(ids)
    db = sqlite3.connect(s.path / "index.db")
    counted = db.execute("SELECT value FROM counters WHERE name = 'rows_done'").fetchone()[0]
    succeeded = db.execute("SELECT value FROM counters WHERE name = 'runs_succeeded'").fetchone()[0]
    runs = db.execute("SELECT COUNT(*), COUNT(DISTINCT job_id) FROM runs").fetchone()
    db.close()
    assert counted == succeeded == len(ids) and runs[1] == len(ids)
    assert runs[0] == len(ids) or not one_run_each
    assert s.status()["done"] == len(ids)


def test_a_workers_compaction_killed_at_random_points_loses_nothing_and_counts_nothing_twice(fast_spool):
    """The compaction a worker runs beside itself, killed with -9 at random
    points while the worker drains (and started again by the worker at its
    next check): each job ends in the index once, its runs counted once,
    and status counts every job once all along, its count never falling."""
    s = fast_spool
    s.config("fsync", "true")  # the index commits durably before files go
    s.config("compact_after", 100)
    n = 3000
    ids = s.run("enqueue", "--jsonl", "-", input='{"command": "true"}\n' * n).stdout.split()
    worker = s.popen("work", "-q", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rng = random.Random(7)
    kills = seen = 0
    while worker.poll() is None:
        for pid in _compactions_of(s):
            time.sleep(rng.uniform(0, 0.05))  # a random point in its batch, not a synchronisation
            try:
                os.kill(pid, signal.SIGKILL)  # a child of our own worker, named by its command line
                kills += 1
            except ProcessLookupError:
                pass
        done = s.status()["done"]
        assert seen <= done <= n  # each job counted once, and the count never falls
        seen = done
        time.sleep(0.01)
    assert worker.wait() == 0, worker.stderr.read()
    s.run("compact")
    _one_row_per_job(s, ids)
    assert s.names("done") == []
    assert kills >= 1


def test_a_workers_compaction_ends_with_the_worker_even_when_the_worker_is_killed(fast_spool):
    """A worker killed with -9 while its compaction runs: the compaction
    stops by itself after its batch in hand, and recovery and the next
    compaction account for every job once."""
    s = fast_spool
    s.config("compact_after", 100)
    n = 3000
    ids = s.run("enqueue", "--jsonl", "-", input='{"command": "true"}\n' * n).stdout.split()
    worker = s.popen("work", "-q", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: _compactions_of(s) or worker.poll() is not None, what="the worker's compaction to start")
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    wait_for(lambda: not _compactions_of(s), timeout=120, what="its compaction to end with it")
    s.work("-q")  # recovers the killed worker's jobs and runs the rest
    s.run("compact")
    _one_row_per_job(s, ids, one_run_each=False)


def test_compaction_holds_no_more_files_than_the_descriptor_limit_allows(fast_spool):
    """A fold locks its files a batch at a time; under a soft limit of 1024
    (the usual default, systemd's too) a batch of 2,000 failed with "Too
    many open files" and folded nothing, by hand and in every worker."""
    s = fast_spool
    s.run("enqueue", "--jsonl", "-", input='{"command": "true"}\n' * 1500)
    s.work()
    proc = s.run("compact", open_files=1024, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert s.status()["compacted"] == 1500 and not s.names("done")

    s.config("compact_after", 100)  # a worker's own compaction, under a tighter limit still
    s.run("enqueue", "--jsonl", "-", input='{"command": "true"}\n' * 400)
    proc = s.run("work", open_files=64, check=False, timeout=300)
    assert proc.returncode == 0 and "compaction failed" not in proc.stderr, proc.stderr
    st = s.status()
    assert st["done"] == 1900 and st["compacted"] > 1500 and st["compacted"] + st["done_files"] == 1900


def test_purge_dead_clears_old_dead_jobs_into_the_index(fast_spool):
    s = fast_spool
    old = s.enqueue("--max-attempts", "1", "false")
    s.drop("garbage.json", b"not json at all")
    s.work("-q")
    past = time.time() - 10 * 86400
    for name in s.names("dead"):
        os.utime(s.path / "dead" / name, (past, past))
    recent = s.enqueue("--max-attempts", "1", "false")
    s.work("-q")
    out = s.run("purge", "--dead", "--older-than", "7d").stdout
    assert "purged 2" in out
    assert s.ids("dead") == [recent]
    job = s.show(old)
    assert job["state"] == "dead" and job["compacted"] is True and job["error"] == "exit status 1"
    assert s.show("garbage")["raw"] == "not json at all"
    assert s.status()["dead_purged"] == 2
    assert s.run("purge", "--older-than", "1d", check=False).returncode == 2  # --dead is required


def test_a_job_left_behind_by_a_killed_purge_and_retried_replaces_its_row(fast_spool, tmp_path):
    """Regression (audit): a purge killed between its commit and its unlinks
    leaves a dead file that is also in the index. Retried, the job ran and
    was folded again as a `.dup-` row, while `show` kept answering with the
    old dead row. A later run of the same job (same created_at, history
    continued) replaces its row; a different job with that id still gets
    a `.dup-` row."""
    s = fast_spool
    s.config("backoff_initial", 0)
    flag = tmp_path / "flag"
    job_id = s.enqueue("--id", "again", "--max-attempts", "1", f"test -e {flag}")
    s.work("-q")
    left = s.path / "dead" / "again.json"
    data, mtime = left.read_bytes(), os.stat(left).st_mtime_ns
    s.run("purge", "--dead", "--older-than", "0", "--yes")
    left.write_bytes(data)  # as a purge killed after its commit leaves it: in dead/ and in the index
    os.utime(left, ns=(mtime, mtime))
    assert _rows(s) == [(job_id, "dead")] and s.status()["dead_purged"] == 1
    flag.touch()
    s.run("retry", job_id)
    s.work("-q")
    s.run("compact")
    assert _rows(s) == [(job_id, "done")]
    job = s.show(job_id)
    assert job["outcome"] == "succeeded" and [h.get("error") for h in job["history"]] == ["exit status 1", None]
    status = s.status()
    assert (status["dead"], status["dead_purged"], status["compacted"]) == (0, 0, 1)
    stats = json.loads(s.run("stats", "--json").stdout)["total"]
    assert (stats["jobs"], stats["succeeded"], stats["dead"], stats["runs"], stats["failed_runs"]) == (1, 1, 0, 2, 1)
    s.drop("again.json", '{"command": "echo another job under that id"}', folder="done")
    s.run("compact")
    assert sorted(state for _, state in _rows(s)) == ["done", "done"] and len([i for i, _ in _rows(s) if ".dup-" in i]) == 1
    # Review: the same, but retried and then cancelled, so it never ran again.
    other = s.enqueue("--id", "cancelled-later", "--max-attempts", "1", "false")
    s.work("-q")
    left = s.path / "dead" / f"{other}.json"
    data, mtime = left.read_bytes(), os.stat(left).st_mtime_ns
    s.run("purge", "--dead", "--older-than", "0", "--yes")
    left.write_bytes(data)
    os.utime(left, ns=(mtime, mtime))
    s.run("retry", other)
    s.run("cancel", other)
    s.run("compact")
    assert [row for row in _rows(s) if row[0].startswith(other)] == [(other, "done")]
    assert s.show(other)["outcome"] == "cancelled" and s.status()["dead_purged"] == 0


def test_the_documented_queries_run_on_a_real_index(fast_spool):
    import re

    from conftest import ROOT

    s = fast_spool
    s.enqueue("true")
    s.enqueue("--max-attempts", "2", "--id", "twice", 'test "$SPOOLQ_ATTEMPT" = 2')
    s.config("backoff_initial", 0)
    s.work("-q")
    s.run("compact")
    queries = re.findall(r'sqlite3 (?:-box )?spool/index.db "(.*?)"', (ROOT / "docs" / "reference.md").read_text(), re.S)
    assert len(queries) == 3
    db = sqlite3.connect(s.path / "index.db")
    results = [db.execute(q).fetchall() for q in queries]
    db.close()
    assert {r[0] for r in results[0]} == {"true", "test"}
    assert len(results[1]) == 3
    assert results[2] == [("twice", 2, "exit status 1")]


def test_compaction_removes_what_a_killed_first_compaction_left(fast_spool):
    s = fast_spool
    s.enqueue("true")
    s.work()
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = s.path / f"index.db.new-{gone.pid}-0a1b2c3d"
    live = s.path / f"index.db.new-{os.getpid()}-0a1b2c3d"
    for path in (stale, live, s.path / f"{stale.name}-journal"):
        path.write_bytes(b"")
    out = s.run("compact").stdout
    assert not stale.exists() and not (s.path / f"{stale.name}-journal").exists()
    assert live.exists()  # its creator still runs
    assert "removed 2 tmp/ files" in out
