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

from conftest import SPOOLQ, wait_for, strace_filters


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


def _polled_pids(spool, *work_args: str, cpus: list[int], window: str = "30", load: str = "0",
                 cgroup: str | None = None) -> tuple[set[int], set[int]]:
    """Run ``spoolq work`` on the CPUs ``cpus`` (in ``cgroup``) under
    strace, with the load average taken as ``load``; return the pids of the
    job processes whose exit the worker polled for (waitid with WNOHANG and
    WNOWAIT, see worker.SPIN_WINDOW) and of all the job processes."""
    logs = spool.path.parent / "waitid"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    enter = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"] if cgroup else []
    # -ff: a file per process, so that no call is split in two ("unfinished"
    # and "resumed") by another process's call in between.
    subprocess.run(
        enter + ["taskset", "-c", ",".join(map(str, cpus)),
                 "strace", "-ff", "-qq", "--seccomp-bpf", "-e", "trace=waitid,execve", "-o", str(logs / "trace")]
        + SPOOLQ + ["-s", str(spool.path), "work", *work_args],
        capture_output=True, text=True, check=True, timeout=120,
        env={**os.environ, "SPOOLQ_TEST_SPIN_WINDOW": window, "SPOOLQ_TEST_LOADAVG": load},
    )
    polled, jobs = set(), set()
    for log in logs.iterdir():
        pid = int(log.name.rsplit(".", 1)[1])
        for call in log.read_text().splitlines():
            if re.match(r"waitid\(P_PID, \d+, .*WNOHANG", call):
                assert "WNOWAIT" in call, call  # polling must not reap: the runner reaps once it knows
                polled.add(int(call.split(",")[1]))
            elif re.match(r'execve\("[^"]*/(true|sleep|sh)"', call):
                jobs.add(pid)
    return polled, jobs


@pytest.mark.skipif(not strace_filters() or shutil.which("taskset") is None or not _has_pidfd()
                    or len(os.sched_getaffinity(0)) < 2, reason="needs strace (seccomp-bpf), taskset, pidfd and two CPUs")
def test_a_lone_worker_polls_for_short_jobs_only_with_a_cpu_to_spare(fast_spool, tmp_path):
    """-j 1 polls for a short job's exit rather than sleep (a VM's idle CPU
    is slow to wake) only when it and its job can each have a CPU, the load
    average is below the CPU count, and jobs are short: not with one CPU,
    nor for two worker processes on two CPUs, nor under load, and after a
    long job not for the next (a cgroup quota: the next test)."""
    s = fast_spool
    two = sorted(os.sched_getaffinity(0))[:2]

    def enqueue(argv: list[str], n: int, **fields) -> None:
        s.run("enqueue", "--jsonl", "-", input="".join(json.dumps({"argv": argv, **fields}) + "\n" for _ in range(n)))

    enqueue(["true"], 5)
    enqueue(["sh", "-c", "exit 3"], 1, cwd=str(tmp_path))  # a job with a cwd is started by Popen: polled too
    polled, jobs = _polled_pids(s, cpus=two)
    assert len(jobs) == 6 and polled == jobs  # two CPUs, one worker: every short job
    assert len(s.ids("done")) == 5 and len(s.ids("failed")) == 1  # and each exit status is the job's own
    assert s.show(s.ids("failed")[0])["exit_code"] == 3

    enqueue(["true"], 6)
    polled, jobs = _polled_pids(s, cpus=two[:1])
    assert len(jobs) == 6 and not polled  # one CPU: the job needs it

    enqueue(["true"], 6)
    polled, jobs = _polled_pids(s, "-j", "2", cpus=two)
    assert len(jobs) == 6 and not polled  # two workers and their jobs on two CPUs

    enqueue(["true"], 6)
    polled, jobs = _polled_pids(s, cpus=two, load="2.5")
    assert len(jobs) == 6 and not polled  # a machine busier than its CPUs

    enqueue(["sleep", "0.3"], 3)
    polled, jobs = _polled_pids(s, cpus=two, window="0.1")
    assert len(jobs) == 3 and len(polled) == 1 and polled < jobs  # only the first, before a job was seen to be long
    assert len(s.ids("done")) == 26


@pytest.mark.skipif(not strace_filters() or shutil.which("taskset") is None or not _has_pidfd()
                    or len(os.sched_getaffinity(0)) < 2, reason="needs strace (seccomp-bpf), taskset, pidfd and two CPUs")
def test_a_worker_under_a_one_cpu_quota_does_not_poll(fast_spool):
    """Two CPUs to run on, but a cgroup quota of one (a container started
    with --cpus 1): the job needs the CPU the worker would poll on."""
    cgroup = _cpu_cgroup(1.0) if os.geteuid() == 0 else None
    if cgroup is None:
        pytest.skip("cannot make a cgroup with a CPU quota here (needs root and a writable cpu controller)")
    s = fast_spool
    try:
        s.run("enqueue", "--jsonl", "-", input=json.dumps({"argv": ["true"]}) + "\n")
        polled, jobs = _polled_pids(s, cpus=sorted(os.sched_getaffinity(0))[:2])
        assert len(jobs) == 1 and polled == jobs  # outside the cgroup: polled
        s.run("enqueue", "--jsonl", "-", input="".join(json.dumps({"argv": ["true"]}) + "\n" for _ in range(6)))
        polled, jobs = _polled_pids(s, cpus=sorted(os.sched_getaffinity(0))[:2], cgroup=cgroup)
        assert len(jobs) == 6 and not polled  # inside: not
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


def _cached(path) -> bool:
    """Whether the first page of ``path`` is in the page cache (a read that
    does not wait for the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    except OSError as e:  # RWF_NOWAIT not supported by this filesystem (overlayfs)
        pytest.skip(f"cannot tell a cached page here: {e}")
    finally:
        os.close(fd)


def _cold_reads_are_slow(folder) -> bool:
    """Whether reading an evicted small file here waits long enough for a
    worker to notice (protocol.SLOW_READ_NS): not on tmpfs, where nothing
    leaves memory, nor on a disk as fast as memory."""
    from spoolq.protocol import SLOW_READ_NS

    folder.mkdir()
    paths = [folder / str(i) for i in range(32)]
    for p in paths:
        p.write_bytes(b"{}" * 50)
    _evict(paths)
    slow = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        began = time.perf_counter_ns()
        os.pread(fd, 200, 0)
        slow += time.perf_counter_ns() - began > SLOW_READ_NS
        os.close(fd)
    return slow >= 24


def _willneeds(spool, *work_args: str) -> int:
    """Run ``spoolq work`` under strace; how many files it read ahead."""
    log = spool.path.parent / "fadvise.log"
    subprocess.run(["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=fadvise64", "-o", str(log)]
                   + SPOOLQ + ["-s", str(spool.path), "work", *work_args],
                   capture_output=True, text=True, check=True, timeout=120)
    return sum("POSIX_FADV_WILLNEED" in line for line in log.read_text().splitlines())


@pytest.mark.skipif(not strace_filters() or not hasattr(os, "RWF_NOWAIT"), reason="needs strace (seccomp-bpf) and preadv2")
def test_a_drain_reads_ahead_once_its_files_have_left_the_page_cache(fast_spool, tmp_path):
    """A backlog that waited long enough for the kernel to drop its files
    from memory would cost each claim a disk read of its own: a worker
    that sees its claims' reads wait asks the kernel to read the files
    ahead (posix_fadvise WILLNEED), and one whose files are in memory
    does not. Either way each job runs once."""
    if not _cold_reads_are_slow(tmp_path / "probe"):
        pytest.skip("reading an evicted file here is not slower than reading memory")
    s = fast_spool
    n = 400
    s.run("enqueue", "--jsonl", "-", input='{"argv": ["true"]}\n' * n)
    assert _willneeds(s, "--max-jobs", "100") == 0  # read from memory: nothing to read ahead
    waiting = [s.path / "new" / name for name in s.names("new")]
    assert len(waiting) == n - 100
    for _ in range(5):  # (a page still being written back, or just read, is not dropped at once)
        _evict(waiting)
        if not any(_cached(p) for p in waiting[-20:]):
            break
    else:
        pytest.skip("the kernel kept these files in memory")
    ahead = _willneeds(s)
    # The first claims find out (one or two PROBE_CLAIMS of 64, three on a
    # very busy host), the rest were read ahead, none twice.
    assert (n - 100) // 3 <= ahead <= n - 100
    assert len(s.ids("done")) == n and not s.names("new") and not s.names("cur")
    assert all(s.record("done", i)["attempts"] == 1 for i in s.ids("done"))
