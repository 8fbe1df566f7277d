"""Group commit, in process: an outcome is told only once the sync that
covers it is done; many finishes share one sync; a sync that fails leaves
its jobs in cur/ for recovery and stops the worker claiming."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from spoolq import Spool
from spoolq.commit import GroupCommit
from spoolq.record import Outcome
from spoolq.store import DirStore


@dataclass
class FakeClaim:
    job_id: str
    attempt: int = 1

    @property
    def job(self) -> dict:
        return {"id": self.job_id}


class FakeStore:
    """Keeps what happened, in order, in ``events``."""

    def __init__(self, durable: bool = True, fail_sync: bool = False, fail_deferred: bool = False):
        self.durable = durable
        self.fail_sync = fail_sync
        self.fail_deferred = fail_deferred
        self.events: list[tuple] = []
        self.deferred = False

    def sync_staged(self, staged):
        if self.fail_sync:
            raise OSError(5, "Input/output error")
        self.events.append(("sync_staged", tuple(c.job_id for c in staged)))

    def complete(self, claimed, dest, due):
        self.events.append(("complete", claimed.job_id, dest))
        self.deferred = True

    def has_deferred(self):
        return self.deferred

    def unsynced_since(self):
        return 0.0

    def sync_deferred(self):
        if self.fail_deferred:
            raise OSError(28, "No space left on device")
        self.events.append(("sync_deferred",))
        self.deferred = False

    def drop_staged(self, claimed):
        self.events.append(("drop_staged", claimed.job_id))

    def release(self, claimed):
        self.events.append(("release", claimed.job_id))


def make(store, stage_max: int = 64):
    told: list[tuple] = []
    failures: list[tuple] = []
    moved: list[str] = []

    def on_durable(job, out, attempt, dest, due):
        told.append(("told", job["id"], dest))
        store.events.append(("told", job["id"]))

    commit = GroupCommit(store, stage_max, 0.05, lambda claimed, completed: moved.append(claimed.job_id), on_durable,
                         lambda job_id, why, where: failures.append((job_id, why, where)))
    return commit, told, failures, moved


def finished(job_id: str, dest: str = "done"):
    return (FakeClaim(job_id), Outcome(start=1.0, end=1.001), 1, dest, None)


def test_an_outcome_is_told_only_after_the_sync_that_covers_it():
    store = FakeStore()
    commit, told, failures, _ = make(store)
    commit.staged(finished("a"))
    commit.staged(finished("b", "failed"))
    assert told == []  # staged, not yet durable
    commit.commit()
    assert failures == []
    assert [e[1] for e in told] == ["a", "b"]
    names = [e[0] for e in store.events]
    # the records' sync, then the moves, then the folders' sync, and only then the outcomes
    assert names == ["sync_staged", "complete", "complete", "sync_deferred", "told", "told"]


def test_many_finishes_share_one_sync():
    store = FakeStore()
    commit, told, _, moved = make(store)
    for i in range(20):
        commit.staged(finished(f"j{i}"))
    commit.commit()
    assert [e for e in store.events if e[0] == "sync_staged"] == [("sync_staged", tuple(f"j{i}" for i in range(20)))]
    assert [e for e in store.events if e[0] == "sync_deferred"] == [("sync_deferred",)]
    assert len(told) == 20 and moved == [f"j{i}" for i in range(20)]


def test_outcomes_are_told_in_the_order_the_jobs_finished():
    store = FakeStore()
    commit, told, _, _ = make(store)
    commit.moved(finished("first"))  # moved at once (no spare to stage into)
    commit.staged(finished("second"))
    commit.staged(finished("third"))
    commit.commit()
    assert [e[1] for e in told] == ["first", "second", "third"]


def test_a_failed_sync_leaves_the_jobs_in_cur_and_tells_no_outcome():
    store = FakeStore(fail_sync=True)
    commit, told, failures, moved = make(store)
    commit.staged(finished("a"))
    commit.staged(finished("b"))
    commit.commit()
    assert told == [] and moved == []
    assert [(job_id, where) for job_id, _why, where in failures] == [("a", "cur"), ("b", "cur")]
    assert all("cannot sync finished jobs" in why for _job, why, _where in failures)
    # each staged record is dropped and the job let go, for recovery to take
    assert ("drop_staged", "a") in store.events and ("release", "b") in store.events


def test_a_failed_folder_sync_tells_no_outcome_and_stops_claiming():
    store = FakeStore(fail_deferred=True)
    commit, told, failures, _ = make(store)
    commit.staged(finished("a"))
    commit.commit()
    assert told == []
    assert len(failures) == 1 and failures[0][0] is None and "cannot sync finished jobs" in failures[0][1]


def test_with_fsync_off_an_outcome_is_told_as_the_job_moves():
    store = FakeStore(durable=False)
    commit, told, _, _ = make(store)
    commit.moved(finished("a"))
    assert told == [("told", "a", "done")]
    assert store.events == [("told", "a")]


def test_the_committer_thread_commits_what_waited_the_interval():
    store = FakeStore()
    commit, told, _, _ = make(store)
    stop = threading.Event()
    thread = threading.Thread(target=commit.run, args=(stop, 0.05, lambda e: None), daemon=True)
    thread.start()
    try:
        commit.staged(finished("a"))
        commit.want_sync()  # (asks only once the interval passed; the thread commits either way)
        for _ in range(200):
            if told:
                break
            stop.wait(0.01)
    finally:
        commit.stop(stop)
        thread.join(5)
    assert told == [("told", "a", "done")]


def test_on_a_real_spool_a_told_outcome_is_in_done(tmp_path):
    """With a spool directory as the store: each outcome told is of a job
    already in done/, and none is told before its commit."""
    spool = Spool(str(tmp_path / "q"))
    spool.init()
    spool.config_set("fsync", True)
    ids = spool.enqueue_many([{"kind": "noop"}] * 5)
    store = DirStore(spool.context())
    store.open()
    told: list[str] = []

    def on_durable(job, out, attempt, dest, due):
        assert (tmp_path / "q" / "done" / f"{job['id']}.json").exists()
        told.append(job["id"])

    commit = GroupCommit(store, 64, 0.05, lambda claimed, completed: None, on_durable,
                         lambda job_id, why, where: (_ for _ in ()).throw(AssertionError(why)))
    for entry in store.scan(time.time_ns(), 100).due:
        claimed = store.take(store.prepare(entry, time.time_ns(), None, None, None), time.time_ns(), None)
        now = time.time()
        out = Outcome(start=now, end=now)
        dest, due, staged = store.finish(claimed, out, "test-worker")
        item = (claimed, out, claimed.attempt - 1, dest, due)
        commit.staged(item) if staged else commit.moved(item)
    assert told == []
    commit.commit()
    assert sorted(told) == sorted(ids)
    assert len(list((tmp_path / "q" / "done").iterdir())) == 5


def test_the_directory_store_has_every_operation_of_the_store_interface():
    """The worker depends on store.Store only; DirStore is the spool directory's implementation of it."""
    from spoolq.store import Store

    wanted = {name for name in vars(Store) if not name.startswith("_")} | set(Store.__annotations__)
    missing = {name for name in wanted if not hasattr(DirStore, name) and name not in ("settings", "root")}
    assert missing == set()
