"""idle_timeout: a run that writes no output for that long is stopped as
a timeout stops it, with the reason "no output for ..."; a run that keeps
writing is left alone however long it runs."""

from __future__ import annotations

import time

pytest_plugins = ["pgserver"]


def test_a_silent_run_is_stopped_and_a_talking_one_is_not(sq, tmp_path):
    silent = sq.enqueue("--idle-timeout", "2s", "--max-attempts", "1", f"echo started; sleep 60; touch {tmp_path}/woke")
    talking = sq.enqueue("--idle-timeout", "2s", "for i in 1 2 3 4 5 6 7 8; do echo $i; sleep 0.5; done")
    began = time.monotonic()
    sq.work("-j", "2")
    assert time.monotonic() - began < 45  # not the 60 s the silent one would sleep
    job = sq.show(silent)
    assert job["state"] == "dead" and job["history"][-1]["error"] == "no output for 2s"
    assert job["stdout"] == "started\n"
    assert not (tmp_path / "woke").exists()  # its process group went with it
    assert sq.show(talking)["outcome"] == "succeeded"


def test_the_setting_applies_to_jobs_without_their_own(sq):
    sq.run("config", "set", "idle_timeout", "1")
    job = sq.enqueue("--max-attempts", "1", "sleep 60")
    sq.work()
    assert sq.show(job)["history"][-1]["error"] == "no output for 1s"
    fine = sq.enqueue("--idle-timeout", "0", "sleep 2")  # the job's own 0: no limit
    sq.work()
    assert sq.show(fine)["outcome"] == "succeeded"


def test_a_run_that_touches_its_heartbeat_is_not_idle(sq):
    job = sq.enqueue("--idle-timeout", "2s", 'for i in 1 2 3 4 5 6 7 8 9 10; do touch "$SPOOLQ_HEARTBEAT"; sleep 0.5; done')
    sq.work()
    assert sq.show(job)["outcome"] == "succeeded"
