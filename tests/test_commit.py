"""Group commit, in process: an outcome is told only once the sync that
covers it is done; many finishes share one sync; a sync that fails leaves
its jobs in cur/ for recovery and stops the worker claiming."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from spoolq import Spool
from spoolq.backend import Finished
from spoolq.dirspool.backend import DirBackend
from spoolq.dirspool.commit import GroupCommit
from spoolq.record import Outcome


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

    def is_staged(self, claimed):
        return True


class Hooks:
    def __init__(self, told, failures, moved, store):
        self.told, self.failures, self.moved, self.store = told, failures, moved, store

    def left(self, claim, completed):
        self.moved.append(claim.job_id)

    def forget(self, job_id):
        pass

    def durable(self, finished, out):
        self.told.append(("told", finished.claim.job_id, finished.state))
        self.store.events.append(("told", finished.claim.job_id))

    def failed(self, job_id, why, where):
        self.failures.append((job_id, why, where))


def make(store, stage_max: int = 64):
    told: list[tuple] = []
    failures: list[tuple] = []
    moved: list[str] = []

    commit = GroupCommit(store, stage_max, 0.05, Hooks(told, failures, moved, store))
    return commit, told, failures, moved


def finished(job_id: str, dest: str = "done"):
    return (Finished(dest, claim=FakeClaim(job_id)), Outcome(start=1.0, end=1.001))


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
    backend = DirBackend(spool.context())
    backend.open()
    registration = backend.register(["noop"])  # (the kinds it runs: a claim passes over the others)
    told: list[str] = []

    class Told(Hooks):
        def durable(self, finished, out):
            job_id = finished.claim.job_id
            assert (tmp_path / "q" / "done" / f"{job_id}.json").exists()
            told.append(job_id)

    commit = GroupCommit(backend, 64, 0.05, Told([], [], [], None))
    while (claim := backend.claim_next()) is not None:
        now = time.time()
        out = Outcome(start=now, end=now)
        commit.add(backend.finish(claim, out, "test-worker"), out)
    assert told == []
    commit.commit()
    assert sorted(told) == sorted(ids)
    assert len(list((tmp_path / "q" / "done").iterdir())) == 5
    registration.close()
    backend.close()


def test_the_directory_backend_has_every_verb_of_the_port():
    """The worker, the facade and the read side depend on backend.Backend
    only; DirBackend is the spool directory's implementation of it."""
    from spoolq.backend import Backend

    wanted = {name for name in vars(Backend) if not name.startswith("_")} | set(Backend.__annotations__)
    facade = {"exists", "init", "config_set", "config_unset", "config_list", "enqueue", "has_id", "get", "list", "counts",
              "live_workers", "stats", "metrics", "cancel", "retry", "retry_all", "compact", "purge_dead", "sweep"}
    missing = {name for name in wanted - facade if not hasattr(DirBackend, name) and name not in ("settings", "location", "log")}
    assert missing == set()
