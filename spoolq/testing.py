"""Helpers for testing code that enqueues spoolq jobs.

Like RQ's ``is_async=False`` or huey's immediate mode, but through the real
spool: your code enqueues as usual, and the test runs every due job at once,
in the test's own process, then looks at the results::

    from spoolq.testing import temporary_spool, run_jobs

    def test_signup_sends_a_welcome_mail():
        with temporary_spool() as q:
            app.signup("a@example.com", queue=q)
            done = run_jobs(q, handlers={"send_email": fake_send})
            assert [job["kind"] for job in done] == ["send_email"]
            assert done[0]["result"] == {"sent": 1}

``run_jobs`` raises ``JobFailed`` when a job fails (so a broken handler fails
the test with its own traceback text), unless ``raise_errors=False``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any, Callable, Iterator, Mapping

from .errors import JobFailed  # noqa: F401 - importable from here too
from .spool import Spool


@contextlib.contextmanager
def temporary_spool() -> Iterator[Spool]:
    """A fresh spool in a temporary directory (fsync off: tests need no
    durability), removed afterwards."""
    path = tempfile.mkdtemp(prefix="spoolq-test-")
    try:
        spool = Spool(os.path.join(path, "spool"))
        spool.init()
        spool.config_set("fsync", False)
        yield Spool(spool.path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_jobs(
    spool: Spool,
    handlers: Mapping[str, Callable[[Any], Any]] | None = None,
    include_scheduled: bool = False,
    raise_errors: bool = True,
) -> list[dict[str, Any]]:
    """Run every due job now, in this process, one after the other; return
    the records of the jobs that ran, in the order they ran.

    Failed jobs are retried only when due (a test does not wait for backoff);
    with ``include_scheduled`` delayed jobs are made due and run too.
    With ``raise_errors`` a job that failed raises JobFailed."""
    if include_scheduled:
        spool.backend.due_now()
    runs_before = _runs(spool)
    spool.work(handlers=handlers, signals=False)
    finished = [job for job in spool.list() if len(job.get("history") or []) > runs_before.get(job["id"], 0)]
    finished.sort(key=lambda j: j["history"][-1].get("start", ""))
    if raise_errors:
        for job in finished:
            if job["state"] != "done":
                raise JobFailed(job)
    return finished


def _runs(spool: Spool) -> dict[str, int]:
    return {j["id"]: len(j.get("history") or []) for j in spool.list()}
