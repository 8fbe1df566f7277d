"""What a drain runs and in which order: FIFO, due time before name,
every due job over several passes, concurrency with -j, and the limits
--max-jobs and --max-time."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from conftest import needs_tuning, tuned_worker, wait_for


def test_fifo_order(fast_spool, tmp_path):
    s = fast_spool
    log = tmp_path / "order.log"
    ids = s.run("enqueue", "--jsonl", "-",
                input="".join(json.dumps({"command": f"echo $SPOOLQ_JOB_ID >> {log}"}) + "\n" for _ in range(30))).stdout.split()
    ids += [s.enqueue(f"echo $SPOOLQ_JOB_ID >> {log}") for _ in range(5)]
    s.work()
    assert log.read_text().split() == ids


def test_due_order_beats_name_order(fast_spool, tmp_path):
    s = fast_spool
    log = tmp_path / "order.log"
    a = s.enqueue("--id", "a", f"echo a >> {log}")
    b = s.enqueue("--id", "b", f"echo b >> {log}")
    now = time.time()
    os.utime(s.path / "new" / "a.json", (now - 10, now - 10))
    os.utime(s.path / "new" / "b.json", (now - 20, now - 20))
    s.work()
    assert log.read_text().split() == [b, a]


def test_a_bounded_scan_hands_out_every_due_file_in_order_over_several_passes(fast_spool):
    """With more due files than a pass keeps, each pass returns the earliest
    ones by (due time, name) and says more are waiting; taking them away and
    scanning again yields the rest, in order, then the files not yet due."""
    import random

    from spoolq.dirspool.protocol import SpoolDir

    s = fast_spool
    rng = random.Random(7)
    now = time.time_ns()
    expected = []
    for i in range(120):
        state = "failed" if i % 3 == 0 else "new"
        name = f"job{rng.randrange(10**6):06d}-{i}.json"
        # Few distinct due times, so ties are broken by name.
        due = now - rng.randrange(1, 6) * 10**9
        path = s.path / state / name
        path.write_text('{"command": "true"}')
        os.utime(path, ns=(due, due))
        expected.append((due, name, state))
    later = s.path / "new" / "later.json"
    later.write_text('{"command": "true"}')
    os.utime(later, ns=(now + 60 * 10**9, now + 60 * 10**9))
    expected.sort()

    sp = SpoolDir(str(s.path), fsync=False)
    sp.open()
    handed_out = []
    for _ in range(30):
        scan = sp.scan(now, limit=7)
        assert len(scan.due) <= 7
        assert scan.next_due_ns == now + 60 * 10**9
        for entry in scan.due:
            handed_out.append((entry.due_ns, entry.name, entry.state))
            os.unlink(s.path / entry.state / entry.name)
        if not scan.truncated:
            break
    sp.close()
    assert handed_out == expected
    assert later.exists()


def test_a_bounded_scan_breaks_ties_at_the_cut_by_folder(fast_spool):
    """Same due time, same name in new/ and failed/: failed/ sorts first,
    also when the pair sits exactly where a pass is cut off."""
    import pytest

    from spoolq.dirspool.protocol import SpoolDir

    s = fast_spool
    due = time.time_ns() - 10**9
    files = [s.path / "new" / f"a{i}.json" for i in range(5)] + [s.path / "failed" / "a3.json"]
    for path in files:
        path.write_text('{"command": "true"}')
        os.utime(path, ns=(due, due))
    sp = SpoolDir(str(s.path), fsync=False)
    sp.open()
    try:
        scan = sp.scan(time.time_ns(), limit=4)
        assert [(e.state, e.name) for e in scan.due] == [
            ("new", "a0.json"), ("new", "a1.json"), ("new", "a2.json"), ("failed", "a3.json")]
        assert scan.truncated
        assert not sp.scan(time.time_ns(), limit=6).truncated  # all six fit: nothing left out
        with pytest.raises(ValueError):
            sp.scan(time.time_ns(), limit=0)
    finally:
        sp.close()


def test_jobs_run_concurrently_with_j(fast_spool, tmp_path):
    s = fast_spool
    # Each job waits until all three have started: only -j 3 can finish them.
    d = tmp_path / "barrier"
    d.mkdir()
    cmd = f"touch {d}/$SPOOLQ_JOB_ID; n=0; while [ $(ls {d} | wc -l) -lt 3 ] && [ $n -lt 200 ]; do sleep 0.05; n=$((n+1)); done; [ $n -lt 200 ]"
    ids = [s.enqueue("--max-attempts", "1", cmd) for _ in range(3)]
    s.work("-j", "3", timeout=60)
    assert all(s.where(i) == ["done"] for i in ids)


def test_max_jobs_and_max_time(fast_spool):
    s = fast_spool
    for _ in range(5):
        s.enqueue("true")
    s.work("--max-jobs", "2")
    assert len(s.ids("done")) == 2 and len(s.ids("new")) == 3
    for _ in range(5):
        s.enqueue("sleep 0.3")
    started = time.monotonic()
    s.work("--max-time", "1")
    took = time.monotonic() - started
    # It stops claiming after 1 s and lets the running job finish.
    assert 1 <= len(s.ids("done")) - 2 < 8 and took < 10
    assert s.ids("cur") == []


def test_j_runs_worker_processes_that_share_max_jobs(fast_spool):
    """`work -j 3` is three worker processes; `--max-jobs 4` is their budget
    together, not each one's."""
    s = fast_spool
    ids = [s.enqueue("--argv", "--", "sleep", "0.2") for _ in range(10)]
    proc = s.work("-j", "3", "--max-jobs", "4")
    assert len(s.ids("done")) == 4 and len(s.ids("new")) == 6 and s.ids("cur") == []
    takers = {s.record("done", i)["history"][0]["worker"] for i in ids if s.where(i) == ["done"]}
    assert 2 <= len(takers) <= 3, takers  # not one worker doing it all
    assert proc.returncode == 0


def test_work_exits_when_nothing_is_due(fast_spool):
    s = fast_spool
    s.enqueue("--in", "1h", "true")
    started = time.monotonic()
    proc = s.work()
    assert proc.returncode == 0 and time.monotonic() - started < 10
    assert len(s.ids("new")) == 1


def test_max_jobs_zero_with_j_still_recovers(fast_spool, tmp_path):
    s = fast_spool
    started = tmp_path / "started"
    job_id = s.enqueue(f"touch {started}; exec sleep 300")
    worker = s.popen("work", stderr=subprocess.DEVNULL)
    wait_for(started.exists, what="the job to start")
    worker.kill()
    worker.wait()
    s.work("-j", "3", "--max-jobs", "0")
    assert s.where(job_id) == ["failed"] and s.ids("new") == []


def _due_files_in_new_and_failed(s, log) -> list[str]:
    """120 due jobs in new/ and failed/ with few distinct due times (ties
    broken by name, then failed/ first) and one not yet due; the ids in the
    order a drain must run them."""
    import random

    rng = random.Random(7)
    now = time.time_ns()
    expected = []
    for i in range(120):
        state = "failed" if i % 3 == 0 else "new"
        job_id = f"job{rng.randrange(10**6):06d}-{i}"
        due = now - rng.randrange(1, 6) * 10**9
        path = s.path / state / f"{job_id}.json"
        path.write_text(json.dumps({"command": f"echo $SPOOLQ_JOB_ID >> {log}"}))
        os.utime(path, ns=(due, due))
        expected.append((due, f"{job_id}.json", state, job_id))
    later = s.path / "new" / "later.json"
    later.write_text(json.dumps({"command": f"echo later >> {log}"}))
    os.utime(later, ns=(now + 3600 * 10**9, now + 3600 * 10**9))
    return [job_id for *_, job_id in sorted(expected)]


@needs_tuning
def test_a_drain_runs_every_due_job_in_order_when_more_wait_than_a_pass_keeps(fast_spool, tmp_path):
    """With more due jobs than one pass of the drain keeps (a pass of 7,
    through the Tuning seam), the drain still runs every due job once, in
    (due time, name) order, across new/ and failed/, and leaves the one not
    yet due."""
    s = fast_spool
    log = tmp_path / "order.log"
    expected = _due_files_in_new_and_failed(s, log)
    assert tuned_worker(s, {"scan_limit": 7}).wait(timeout=120) == 0
    assert log.read_text().split() == expected
    assert s.ids("new") == ["later"]
