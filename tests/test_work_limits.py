"""A worker's own resources: descriptors under a low open-file limit and
over a long run, memory under a job that floods its output, CPU use while
it waits for jobs, and reading a backlog that left the page cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from conftest import needs_tuning, tuned_worker, wait_for


def test_worker_processes_of_work_j_do_not_keep_the_commands_descriptors(fast_spool):
    """Audit: each worker process of `work -j N` kept the command's own
    descriptors of the spool's folders beside its own, eight fewer for its
    jobs and records: under a low limit and a busy disk, jobs failed with
    "Too many open files"."""
    s = fast_spool
    command = s.popen("work", "--watch", "-j", "2", stderr=subprocess.DEVNULL)
    try:
        workers = wait_for(lambda: len(s.status()["workers"]) == 2 and s.status()["workers"], what="both workers")
        for pid in (w["pid"] for w in workers):
            targets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            assert targets.count(str(s.path / "new")) == 1, targets
    finally:
        command.send_signal(signal.SIGTERM)
        command.wait(timeout=60)


@pytest.mark.parametrize("processes", ["1", "2", "4"])
def test_a_durable_worker_runs_within_a_low_open_file_limit(spool, processes):
    """fsync on keeps spare files open to rewrite records into, and the old
    inodes until they are synced: up to 320 descriptors, so under a soft
    limit of 64 a worker ran out after ~50 jobs ("cannot record the
    outcome: Too many open files") and stopped. Their number now follows
    the limit. (Audit: with -j N each worker process also kept the
    command's own descriptors of the spool, and jobs failed to start.)"""
    spool.run("enqueue", "--jsonl", "-", input='{"argv": ["echo", "hi"]}\n' * 600)
    proc = spool.run("work", "-j", processes, open_files=48, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    st = spool.status()
    assert st["done"] == 600 and st["failed"] == 0 and st["cur"] == 0, st


def test_a_long_running_worker_keeps_no_descriptors_of_finished_jobs(fast_spool):
    """-j 1 makes the next job's output files ahead and closes the last
    one's after the next has started: the count stays flat however many
    jobs run, and every job captures only its own output."""
    s = fast_spool
    watcher = s.popen("work", "--watch", stderr=subprocess.DEVNULL)
    echo = ["--argv", "--", "sh", "-c", "echo $SPOOLQ_JOB_ID; echo err-$SPOOLQ_JOB_ID >&2"]
    ids = []

    def open_fds() -> int:
        return len(os.listdir(f"/proc/{watcher.pid}/fd"))

    def run_batch(n: int) -> None:
        batch = [s.enqueue(*echo) for _ in range(n)]
        ids.extend(batch)
        wait_for(lambda: all(s.where(j) == ["done"] for j in batch), what="the batch to run")

    try:
        run_batch(5)
        after_five = open_fds()
        run_batch(40)
        # Polled: the worker closes the last job's files a moment after it moves it to done/.
        wait_for(lambda: open_fds() <= after_five, timeout=10, what=f"the worker to hold no more than {after_five} fds")
    finally:
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=60) == 0
    for job_id in ids:
        job = s.show(job_id)
        assert job["stdout"] == job_id + "\n" and job["stderr"] == f"err-{job_id}\n", job


def test_jobs_that_cannot_start_leave_no_descriptors_behind(fast_spool):
    """A job whose program is missing never starts; its output files are
    closed at once, so a long run of such jobs cannot use up the worker's
    descriptors (here only 64) and turn later jobs into internal errors."""
    s = fast_spool
    s.config("max_attempts", 1)
    lines = "".join(json.dumps({"argv": ["/nonexistent-program"]}) + "\n" for _ in range(150))
    s.run("enqueue", "--jsonl", "-", input=lines)
    ok = s.enqueue("--argv", "--", "true")
    proc = s.run("work", open_files=64, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "internal error" not in proc.stderr
    assert len(s.ids("dead")) == 150 and s.where(ok) == ["done"]
    assert proc.stderr.count("cannot start: No such file or directory") == 150


def test_a_job_that_floods_its_output_costs_the_worker_only_a_little_memory(fast_spool):
    """Audit: a worker looked at a job's captured output every 0.25 s, so a
    job printing `yes` (a gigabyte a second here) held 100-450 MB of memory
    between two looks. It now looks sooner while a job writes fast. The
    resident size of the output file is read from the test, through
    /proc/PID/fd, as the job runs."""
    s = fast_spool
    s.enqueue("--timeout", "2", "--max-attempts", "1", "yes")
    worker = s.popen("work", stderr=subprocess.DEVNULL)
    peak = written = 0
    while worker.poll() is None:
        try:
            for fd in os.listdir(f"/proc/{worker.pid}/fd"):
                if "spoolq-stdout" in os.readlink(f"/proc/{worker.pid}/fd/{fd}"):
                    st = os.stat(f"/proc/{worker.pid}/fd/{fd}")
                    peak, written = max(peak, st.st_blocks * 512), max(written, st.st_size)
        except OSError:
            pass  # an output file closed meanwhile
        time.sleep(0.001)
    assert worker.returncode == 0
    if written < 1300 << 20:  # below ~650 MB/s, even looks every 250 ms would hold under the bound
        pytest.skip(f"the job wrote only {written >> 20} MB: too slowly to tell")
    assert peak < 160 << 20, f"{peak >> 20} MB resident of {written >> 20} MB written"
    assert s.show(s.ids("dead")[0])["stdout"].endswith("y\n")


def _has_pidfd() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (AttributeError, OSError):
        return False  # the runner then polls anyway (its fallback), which this test could not tell apart


def _cpu_cgroup(quota: float) -> str | None:
    """A new cgroup limited to ``quota`` CPUs; its folder, None when one
    cannot be made here (not root, or no writable cpu controller)."""
    name = f"spoolq-test-{os.getpid()}"
    try:
        with open("/sys/fs/cgroup/cgroup.subtree_control") as f:
            v2 = "cpu" in f.read().split()
    except OSError:
        v2 = False
    path = f"/sys/fs/cgroup/{name}" if v2 else f"/sys/fs/cgroup/cpu/{name}"
    try:
        os.mkdir(path)
    except OSError:
        return None
    try:
        if v2:
            with open(f"{path}/cpu.max", "w") as f:
                f.write(f"{int(quota * 100000)} 100000")
        else:
            with open(f"{path}/cpu.cfs_quota_us", "w") as f:
                f.write(str(int(quota * 100000)))
        return path
    except OSError:
        os.rmdir(path)
        return None


def _remove_cgroup(path: str) -> None:
    """Kill whatever still runs in the cgroup (a run that timed out), then remove it."""
    for _ in range(100):
        with open(f"{path}/cgroup.procs") as f:
            pids = [int(p) for p in f.read().split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)  # (no event says a killed process has left its cgroup)
    os.rmdir(path)


def _worker_cpu_seconds(spool, argv: list[str], n: int, cpus: list[int], cgroup: str | None = None,
                        jobs: int = 1, **tuning) -> float:
    """Enqueue ``n`` jobs running ``argv`` and drain them with a worker on
    the CPUs ``cpus`` (in ``cgroup``), tuned with ``tuning``; the CPU time
    the worker and the jobs it reaped used. Jobs that sleep use next to
    none: what is left is the worker's, and it shows whether the worker
    burnt a CPU while it waited for them."""
    spool.run("enqueue", "--jsonl", "-", input="".join(json.dumps({"argv": argv}) + "\n" for _ in range(n)))
    enter = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"] if cgroup else []
    proc = tuned_worker(spool, tuning, jobs=jobs, prefix=enter + ["taskset", "-c", ",".join(map(str, cpus))])
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0
    assert spool.names("new") == [] and spool.names("cur") == []
    return usage.ru_utime + usage.ru_stime


needs_two_cpus = pytest.mark.skipif(shutil.which("taskset") is None or not _has_pidfd() or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs taskset, pidfd and two CPUs")


@needs_tuning
@needs_two_cpus
def test_a_lone_worker_spends_a_cpu_waiting_for_short_jobs_only_when_it_has_one_to_spare(fast_spool, tmp_path):
    """A lone worker may wait for a short job's exit on a spare CPU (a VM's
    idle CPU is slow to wake) but never on the CPU its job needs: not with
    one CPU, nor with the load average at the CPU count, nor for -j 2, nor
    once a job was seen to run long. The witness is the CPU time the worker
    uses while its jobs sleep (polling window and load average steered
    through the Tuning seam); a job's exit status is its own either way."""
    s = fast_spool
    two = sorted(os.sched_getaffinity(0))[:2]
    sleeping = ["sleep", "0.5"]
    baseline = _worker_cpu_seconds(s, sleeping, 3, two, spin_window=1e-6, load_average=0.0)
    spent = _worker_cpu_seconds(s, sleeping, 3, two, spin_window=30.0, load_average=0.0)
    assert spent > baseline + 0.6, (baseline, spent)  # two CPUs, one worker: it waited on the spare one
    for label, cpus, jobs, load in (("one CPU", two[:1], 1, 0.0), ("busy machine", two, 1, 2.5), ("-j 2", two, 2, 0.0)):
        spent = _worker_cpu_seconds(s, sleeping, 3, cpus, jobs=jobs, spin_window=30.0, load_average=load)
        assert spent < baseline + 0.4, (label, baseline, spent)
    # A window of 0.3 s and jobs of 1 s: the first is waited for on the CPU
    # (up to 0.3 s of it), the next ones, after one was seen to run long, not.
    spent = _worker_cpu_seconds(s, ["sleep", "1"], 4, two, spin_window=0.3, load_average=0.0)
    assert baseline + 0.1 < spent < baseline + 1.0, (baseline, spent)
    s.run("enqueue", "--cwd", str(tmp_path), "--argv", "--", "sh", "-c", "exit 3")  # started another way, waited for alike
    _worker_cpu_seconds(s, ["true"], 2, two, spin_window=30.0, load_average=0.0)
    assert len(s.ids("failed")) == 1 and s.show(s.ids("failed")[0])["exit_code"] == 3


@needs_tuning
@needs_two_cpus
def test_a_worker_under_a_one_cpu_quota_does_not_take_its_jobs_cpu(fast_spool):
    """Two CPUs to run on, but a cgroup quota of one (a container started
    with --cpus 1): the job needs the CPU the worker would poll on, so
    waiting for it costs the worker no CPU time."""
    cgroup = _cpu_cgroup(1.0) if os.geteuid() == 0 else None
    if cgroup is None:
        pytest.skip("cannot make a cgroup with a CPU quota here (needs root and a writable cpu controller)")
    s = fast_spool
    two = sorted(os.sched_getaffinity(0))[:2]
    sleeping = ["sleep", "0.5"]
    try:
        baseline = _worker_cpu_seconds(s, sleeping, 3, two, spin_window=1e-6, load_average=0.0)
        outside = _worker_cpu_seconds(s, sleeping, 3, two, spin_window=30.0, load_average=0.0)
        assert outside > baseline + 0.6, (baseline, outside)  # outside the cgroup: it waited on a spare CPU
        inside = _worker_cpu_seconds(s, sleeping, 3, two, cgroup=cgroup, spin_window=30.0, load_average=0.0)
        assert inside < baseline + 0.4, (baseline, inside)  # inside: not
    finally:
        _remove_cgroup(cgroup)


def test_the_cpu_quota_is_read_from_the_cgroup_and_its_parents(tmp_path):
    """cgroup v1 and v2 as /proc shows them, on a host and in a container
    (whose mount root is its own cgroup), with quotas on the cgroup or a
    parent; odd contents give no quota rather than an error."""
    from spoolq.procs import cgroup_cpu_quota

    def layout(cgroup: str, mountinfo: str, files: dict[str, str]) -> tuple[str, str]:
        for rel, text in files.items():
            path = tmp_path / "fs" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (tmp_path / "cgroup").write_text(cgroup)
        (tmp_path / "mountinfo").write_text(mountinfo.replace("FS", str(tmp_path / "fs")))
        return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")

    # v2 on a host: the quota sits on a parent slice.
    args = layout("0::/app.slice/spoolq.service\n",
                  "30 23 0:26 / FS/v2 rw - cgroup2 cgroup2 rw\n",
                  {"v2/app.slice/cpu.max": "150000 100000\n", "v2/app.slice/spoolq.service/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(*args) == 1.5
    # v1 in a container: /proc shows /docker/abc, mounted as the root of cpu,cpuacct.
    args = layout("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n",
                  "40 31 0:29 /docker/abc FS/v1c rw - cgroup cgroup rw,cpu,cpuacct\n",
                  {"v1c/cpu.cfs_quota_us": "50000\n", "v1c/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(*args) == 0.5
    # No quota anywhere (v1 -1, v2 max), and a root cgroup.
    args = layout("0::/\n3:cpu:/\n",
                  "30 23 0:26 / FS/v2r rw - cgroup2 cgroup2 rw\n32 31 0:29 / FS/v1r rw - cgroup cgroup rw,cpu\n",
                  {"v2r/cpu.max": "max 100000\n", "v1r/cpu.cfs_quota_us": "-1\n", "v1r/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(*args) is None
    # Odd contents: a period of 0, garbage lines, bytes that are not UTF-8.
    args = layout("0::/x\ngarbage\n", "30 23 0:26 / FS/odd rw - cgroup2 cgroup2 rw\nnonsense\n",
                  {"odd/x/cpu.max": "100000 0\n"})
    assert cgroup_cpu_quota(*args) is None
    (tmp_path / "cgroup").write_bytes(b"0::/\xff\xfe\n")
    assert cgroup_cpu_quota(*args) is None
    assert cgroup_cpu_quota(str(tmp_path / "missing"), args[1]) is None


def _evict(paths) -> None:
    """Drop files' pages from the page cache (written back first), as the
    kernel does to files nobody touched for a while."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_a_backlog_that_left_the_page_cache_drains_each_job_once(fast_spool, tmp_path):
    """A backlog that waited long enough for the kernel to drop its files
    from memory (a worker then reads ahead what it will claim) drains as a
    warm one does: every job runs once, nothing is left in new/ or cur/."""
    s = fast_spool
    n = 400
    s.run("enqueue", "--jsonl", "-", input='{"argv": ["true"]}\n' * n)
    s.work("--max-jobs", "100")
    waiting = [s.path / "new" / name for name in s.names("new")]
    assert len(waiting) == n - 100
    _evict(waiting)
    s.work()
    assert len(s.ids("done")) == n and not s.names("new") and not s.names("cur")
    assert all(s.record("done", i)["attempts"] == 1 for i in s.ids("done"))
