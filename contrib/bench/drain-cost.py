"""What a drain costs per job, wall and CPU: `spoolq work` draining N `true`
jobs, then N no-op in-process handler jobs, fsync off; one round a call, so
two versions can be run in turn (see README.md here):
    python contrib/bench/drain-cost.py SCRATCH_DIR [N]
prints microseconds per job, wall and CPU (the worker's and its jobs')."""
import os, resource, subprocess, sys, tempfile, time
import spoolq

n = int(sys.argv[2]) if len(sys.argv) > 2 else 1000


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


os.makedirs(sys.argv[1], exist_ok=True)
d = tempfile.mkdtemp(dir=sys.argv[1])
with open(d + "/noopapp.py", "w") as f:
    f.write("HANDLERS = {'noop': lambda payload: None}\n")
env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), d) if p))
wall, cpu = [], []
for name, job, extra in (("a", {"argv": ["true"]}, []), ("b", {"kind": "noop"}, ["--app", "noopapp:HANDLERS"])):
    s = spoolq.Spool(f"{d}/{name}")
    s.enqueue_many([job] * n)
    s.config_set("fsync", False)
    c, t = children_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "spoolq", "-s", f"{d}/{name}", "work", "-q", *extra], check=True, env=env)
    wall.append((time.perf_counter() - t) / n * 1e6)
    cpu.append((children_cpu() - c) / n * 1e6)
    assert s.status()["done"] == n
print(f"true_wall_us={wall[0]:.1f} handler_wall_us={wall[1]:.1f} true_cpu_us={cpu[0]:.1f} handler_cpu_us={cpu[1]:.1f}")
