"""A waiter's CPU while it waits and its wake-up latency (the job's file arriving in done/ to
the `spoolq wait` process exited), on a directory spool with a watching worker:
    .venv/bin/python contrib/bench/wait.py [SCRATCH_DIR]
"""
import os, subprocess, sys, tempfile, threading, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from spoolq.linux import Inotify
V = os.path.join(os.path.dirname(sys.executable), "spoolq")
d = tempfile.mkdtemp(dir=sys.argv[1] if len(sys.argv) > 1 else None); S = d + "/s"; flag = d + "/go"
q = lambda *a: subprocess.run([V, "-s", S, *a], capture_output=True, text=True).stdout.strip()
q("init"); q("config", "set", "fsync", "false")
worker = subprocess.Popen([V, "-s", S, "work", "--watch", "-q"])
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split(); return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
lat, cpus = [], []
for r in range(7):
    try: os.unlink(flag)
    except FileNotFoundError: pass
    job = q("enqueue", f"while ! test -e {flag}; do sleep 0.01; done")
    w = subprocess.Popen([V, "-s", S, "wait", job], stdout=subprocess.DEVNULL)
    time.sleep(1.0); c0 = cpu(w.pid); time.sleep(3.0); cpus.append(cpu(w.pid) - c0)
    ino = Inotify(); ino.add(S + "/done", Inotify.ARRIVALS, "done")
    ended = []
    threading.Thread(target=lambda: (w.wait(), ended.append(time.monotonic()))).start()
    open(flag, "w").close()
    while True:
        ev = ino.read(30)
        if any(n.startswith(job) for _, _, n in ev or []): arrived = time.monotonic(); break
    while not ended: time.sleep(0.001)
    lat.append(ended[0] - arrived); ino.close()
worker.terminate(); worker.wait()
print(f"waiter CPU over 3 s of waiting: median {statistics.median(cpus):.3f}s (max {max(cpus):.3f}s)")
print(f"finish (file in done/) -> waiter exited: median {statistics.median(lat)*1000:.1f} ms, min {min(lat)*1000:.1f}, max {max(lat)*1000:.1f} ms")
