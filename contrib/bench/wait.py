"""A waiter's CPU while it waits and its wake-up latency (the job's finish made known to
the `spoolq wait` process exited), with a watching worker, on a directory spool (its file
arriving in done/) or on a PostgreSQL spool (the finish's notification):
    .venv/bin/python contrib/bench/wait.py [SCRATCH_DIR]
    .venv/bin/python contrib/bench/wait.py --pg postgresql://...   (an empty database)
"""
import os, subprocess, sys, tempfile, threading, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from spoolq.linux import Inotify
V = os.path.join(os.path.dirname(sys.executable), "spoolq")
pg = sys.argv[2] if sys.argv[1:2] == ["--pg"] else None
d = tempfile.mkdtemp(dir=None if pg or len(sys.argv) < 2 else sys.argv[1]); flag = d + "/go"
S = pg or d + "/s"
q = lambda *a: subprocess.run([V, "-s", S, *a], capture_output=True, text=True).stdout.strip()
q("init"); q("config", "set", "fsync", "false")
worker = subprocess.Popen([V, "-s", S, "work", "--watch", "-q"])


def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split(); return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class Finishes:
    """When a job's finish becomes known: its file in done/, or spoolq's notification."""
    def __init__(self):
        if pg:
            import psycopg
            self.conn = psycopg.connect(pg, autocommit=True); self.conn.execute("LISTEN spoolq_finished")
        else:
            self.ino = Inotify(); self.ino.add(S + "/done", Inotify.ARRIVALS, "done")

    def wait(self, job):
        while True:
            if pg:
                for n in self.conn.notifies(timeout=30):
                    if job in n.payload: return time.monotonic()
            elif any(n.startswith(job) for _, _, n in self.ino.read(30) or []):
                return time.monotonic()

    def close(self):
        (self.conn if pg else self.ino).close()


lat, cpus = [], []
for r in range(7):
    try: os.unlink(flag)
    except FileNotFoundError: pass
    job = q("enqueue", f"while ! test -e {flag}; do sleep 0.01; done")
    w = subprocess.Popen([V, "-s", S, "wait", job], stdout=subprocess.DEVNULL)
    time.sleep(1.0); c0 = cpu(w.pid); time.sleep(3.0); cpus.append(cpu(w.pid) - c0)
    finishes = Finishes()
    ended = []
    threading.Thread(target=lambda: (w.wait(), ended.append(time.monotonic()))).start()
    open(flag, "w").close()
    arrived = finishes.wait(job)
    while not ended: time.sleep(0.001)
    lat.append(ended[0] - arrived); finishes.close()
worker.terminate(); worker.wait()
print(f"{'PostgreSQL' if pg else 'directory'} spool")
print(f"waiter CPU over 3 s of waiting: median {statistics.median(cpus):.3f}s (max {max(cpus):.3f}s)")
print(f"finish -> waiter exited: median {statistics.median(lat)*1000:.1f} ms, min {min(lat)*1000:.1f}, max {max(lat)*1000:.1f} ms")
