"""A minimal worker loop over the PostgreSQL spool's backend, for the tests
of its claims, liveness and self-fencing while ``spoolq work`` does not
yet run on it: claim, run, finish, commit, as the worker does, with none of
the worker's pipelining.

A command job runs in its own session with the worker's markers in its
environment (SPOOLQ_WORKER, SPOOLQ_JOB_ID), and its process group is noted
in the registration, as the worker does; a handler job (``kind``) is a no-op.
Each outcome, once committed, is one JSON line on stdout.

    python pgloop.py URL [--watch]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spoolq import procs  # noqa: E402
from spoolq.pgspool import PgBackend  # noqa: E402
from spoolq.pgspool.types import Unavailable  # noqa: E402
from spoolq.record import Outcome  # noqa: E402


def say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def run(backend: PgBackend, reg, claim) -> Outcome:
    job = claim.job
    start = time.time()
    if job.get("kind") is not None:
        return Outcome(start=start, end=time.time())
    argv = ["/bin/sh", "-c", job["command"]] if job.get("command") else job["argv"]
    env = dict(os.environ, SPOOLQ_JOB_ID=claim.job_id, SPOOLQ_WORKER=reg.worker_id,
               SPOOLQ_ATTEMPT=str(claim.attempt), SPOOLQ_SPOOL=backend.location)
    before = procs.boot_ticks()
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    reg.note_run(claim.job_id, claim.attempt, proc.pid, (before, procs.boot_ticks()))
    say(event="started", id=claim.job_id, pid=proc.pid, attempt=claim.attempt, at=time.time())
    code = proc.wait()
    error = None
    if code < 0:
        error = f"killed by signal {-code}"
    elif code:
        error = f"exit code {code}"
    return Outcome(start=start, end=time.time(), exit_code=code, error=error)


def step(backend: PgBackend, reg, waker, watch: bool) -> bool:
    """Run one job, or wait for one (True); or find none (False: drained)."""
    claim = backend.claim_next()
    if claim is None:
        backend.commit()
        if not watch:
            return False
        backend.housekeeping()
        due = backend.next_due()
        waker.wait(1.0 if due is None else min(1.0, max(0.0, due)))
        waker.clear()
        return True
    say(event="claimed", id=claim.job_id, at=time.time())
    out = run(backend, reg, claim)
    done = backend.finish(claim, out, reg.worker_id)
    backend.commit()
    reg.end_run(claim.job_id)
    say(event="finished", id=claim.job_id, state=done.state, lost=done.lost, attempt=claim.attempt)
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--watch", action="store_true")
    args = ap.parse_args()
    backend = PgBackend(args.url)
    backend.log = lambda text: say(event="log", text=text)
    backend.open()
    reg = backend.register()
    say(event="registered", worker=reg.worker_id, row=reg.id)
    waker = backend.waker() if args.watch else None
    if waker:
        waker.start()
        waker.listening.wait(10)
    backend.recover()
    while True:
        try:
            if not step(backend, reg, waker, args.watch):
                break
        except Unavailable as e:  # the database is out of reach, or this worker is registering again
            say(event="log", text=f"unavailable: {e}")
            time.sleep(0.1)
    if waker:
        waker.stop()
    reg.close()
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
