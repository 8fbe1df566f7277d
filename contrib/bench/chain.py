#!/usr/bin/env python3
"""How long each link of a dependency chain waits for the one before it.

Usage: chain.py SCRATCH_DIR [LINKS] [--fsync]   (default 1000 links, fsync off)

Enqueues LINKS no-op jobs, each ``--after`` the one before (all but the
first wait in waiting/), starts one ``spoolq work --watch`` worker, and
once the last link is done reads every link's run from its record: the
delay of a link is its start minus the end of the one before (that
job's process exit to the next one's start: the finish, the move that
releases the dependent, the wake-up and the claim). Prints the median,
90th percentile and largest delay, in milliseconds. Removes nothing;
delete SCRATCH_DIR afterwards.
"""

import os
import statistics
import subprocess
import sys
import time

from spoolq import Spool
from spoolq.record import parse_time


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    fsync = "--fsync" in sys.argv
    os.makedirs(args[0], exist_ok=True)
    path = os.path.join(args[0], "chain-spool")
    links = int(args[1]) if len(args) > 1 else 1000
    spool = Spool(path)
    spool.init()
    spool.config_set("fsync", fsync)
    ids = [spool.enqueue(argv=["true"])]
    for _ in range(links - 1):
        ids.append(spool.enqueue(argv=["true"], after=ids[-1]))
    worker = subprocess.Popen([sys.executable, "-m", "spoolq", "-s", path, "work", "--watch"],
                              stderr=subprocess.DEVNULL)
    started = time.monotonic()
    try:
        while (spool.get(ids[-1]) or {}).get("state") != "done":
            if time.monotonic() - started > 3600:
                sys.exit("the chain did not finish within an hour")
            time.sleep(0.2)
    finally:
        worker.terminate()
        worker.wait()
    runs = [spool.get(job_id)["history"][-1] for job_id in ids]
    delays = [(parse_time(b["start"]) - parse_time(a["end"])) * 1000 for a, b in zip(runs, runs[1:])]
    delays.sort()
    p90 = delays[int(len(delays) * 0.9)]
    print(f"{links} links, fsync {'on' if fsync else 'off'}: per-link delay median {statistics.median(delays):.1f} ms, "
          f"p90 {p90:.1f} ms, max {delays[-1]:.1f} ms; over 100 ms: {sum(d > 100 for d in delays)}")


if __name__ == "__main__":
    main()
