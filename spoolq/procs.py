"""Knowing a process again after its parent died, and killing it without
ever hitting an unrelated process that reused its pid.

A process is identified by (boot id, pid, start time in clock ticks since
boot), all read from /proc. A dead worker's processes are those that carry
the ``SPOOLQ_WORKER`` variable every job process inherits (which also
catches a process that left its group with ``setsid``), run as the user
whose registration names them, and started after the worker did (after
the run's spawn, for a run it recorded). Each is signalled through a pidfd
opened *before* its start time is checked again, so the signal can only
reach the process that was checked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Iterator

_boot_id: str | None = None

# What a worker handles: stop (TERM, INT) and reload (HUP) sent to it, and
# stop and stop now (USR1, USR2) relayed by the parent of a worker pool.
DIRECT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
RELAYED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
HANDLED_SIGNALS = DIRECT_SIGNALS + RELAYED_SIGNALS


@contextlib.contextmanager
def signals_to_main_thread() -> Iterator[None]:
    """Threads started inside this block HANDLED_SIGNALS, so the kernel
    delivers those to the main thread. A signal sent to the process goes
    to any one of its threads that does not block it, and Python runs the
    handler in the main thread only once that thread runs Python again:
    one that landed on a helper thread left a watching worker asleep in
    its 30-second rescan wait before it stopped. (Only for helper threads:
    a thread that starts jobs would pass the mask on to them.)"""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def boot_id() -> str:
    """This boot's random id (empty where /proc does not have it)."""
    global _boot_id
    if _boot_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _boot_id = f.read().strip()
        except OSError:
            _boot_id = ""
    return _boot_id


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2 :].split()
    return [x.decode() for x in rest]


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if gone."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return int(fields[19])  # field 22 of /proc/pid/stat


def _describe(pid: int) -> tuple[str, int, int] | None:
    """(state, pgid, start time) of a live process."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return fields[0], int(fields[2]), int(fields[19])


def _has_env(pid: int, *needles: bytes) -> bool:
    """Whether the process's environment holds every ``NAME=value`` given."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return set(needles) <= set(env.split(b"\0"))


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat uses for start times."""
    return int(time.clock_gettime_ns(time.CLOCK_BOOTTIME) * _TICK // 1_000_000_000)


def _environ(pid: int) -> set[bytes] | None:
    """The process's environment as ``NAME=value`` entries; None when it
    cannot be read (another user's process, or gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return set(f.read().split(b"\0"))
    except OSError:
        return None


def _real_uid(pid: int) -> int | None:
    """The process's real user id, None if gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def find_run_processes(worker_id: str, since: int, owner: int, run: tuple[str, int | None, tuple[int, int] | None] | None
                       ) -> tuple[list[tuple[int, int]], int]:
    """The live processes a dead worker left: ``(ours, others)``, ours as
    (pid, start time) to kill, others how many more there are that it left
    but whose environment cannot be read (another user's), to leave alone.

    A process is ours only if all of these hold, so that nothing a
    registration names can point the kill at an unrelated process:

    - its real uid is ``owner`` (the registration's owner), or the owner is
      root: a root worker runs jobs as the users who enqueued them, so
      under it only the two checks below tell its processes;
    - its environment carries ``SPOOLQ_WORKER=<worker_id>`` (and, for a
      ``run``, that run's ``SPOOLQ_JOB_ID``), which every job process inherits;
    - it started at or after ``since``, the worker's own start, and, for a
      ``run`` (job id, process group, spawn window: the boot ticks read just
      before and after its spawn), at or after the window's start; the
      group's leader, at most at its end.

    ``others`` are processes of ``owner`` in the run's recorded group, whose
    leader is the process spawned in the window, that this user may not
    read: they tell that the run still goes on without being signalled."""
    me = os.getpid()
    needles = {f"SPOOLQ_WORKER={worker_id}".encode()}
    low, pgid, window = since, None, None
    if run is not None:
        needles.add(f"SPOOLQ_JOB_ID={run[0]}".encode())
        pgid, window = run[1], run[2]
        if window is not None and since <= window[0] <= window[1]:
            low = window[0]
        else:
            window = None  # not a spawn of this worker: the group is not known to be the run's
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return [], 0
    table = {}
    for pid in pids:
        if pid != me:
            desc = _describe(pid)
            if desc is not None and desc[2] >= low:
                table[pid] = desc

    def owned(pid: int) -> bool:
        return owner == 0 or _real_uid(pid) == owner

    # The group counts only while its leader (alive or a zombie: either way
    # it pins the id) is the process spawned in the recorded window.
    group = None
    if pgid is not None and pgid > 1 and window is not None:
        leader = table.get(pgid)
        if leader is not None and leader[1] == pgid and leader[2] <= window[1] and owned(pgid):
            group = pgid
    ours, others = [], 0
    for pid, (state, proc_pgid, started) in table.items():
        if state in ("Z", "X"):
            continue
        if pid == pgid and window is not None and started > window[1]:
            continue  # a later process under the leader's pid
        env = _environ(pid)
        if env is None:
            if group is not None and proc_pgid == group and owned(pid):
                others += 1
            continue
        if needles <= env and owned(pid):
            ours.append((pid, started))
    return ours, others


def kill_verified(pid: int, started: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started
    at ``started``. Returns whether a signal was sent; raises PermissionError
    for a process that is there but not ours to signal (another user's)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        pidfd = None
    try:
        if start_time(pid) != started:
            return False
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:  # no pidfd here: the window between check and kill is microseconds
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)


def kill_run(worker_id: str, worker_boot: str, since: int, owner: int,
             run: tuple[str, int | None, tuple[int, int] | None] | None, signal_them: bool = True) -> tuple[int, int]:
    """Kill every process left from a dead worker's run (``run``: job id,
    process group, spawn window), or from any of its runs (None); see
    find_run_processes for which processes count. Returns (killed,
    refused): how many were killed, and how many live on because they are
    not ours to kill (another user's, in a shared spool). With
    ``signal_them`` false nothing is signalled: every process found is
    refused.

    Nothing is killed when the worker ran in an earlier boot (its processes
    died with that boot) or when its boot is unknown."""
    if not worker_boot or worker_boot != boot_id():
        return 0, 0
    killed = 0
    refused: set[int] = set()
    others = 0
    for _ in range(50):  # a process may fork while we kill; repeat until none is left
        found, others = find_run_processes(worker_id, since, owner, run)
        found = [(pid, started) for pid, started in found if pid not in refused]
        if not signal_them:
            refused.update(pid for pid, _ in found)
            break
        if not found:
            break
        for pid, started in found:
            try:
                if kill_verified(pid, started):
                    killed += 1
            except PermissionError:
                refused.add(pid)
        time.sleep(0.01)  # give the kernel a moment to reap what we killed
    return killed, len(refused) + others


def kill_marked(markers: list[str]) -> int:
    """SIGKILL every process whose environment holds all of ``markers``
    (``NAME=value``): what a killed run left behind outside its process
    group (``setsid``). Returns how many were killed."""
    needles = [m.encode() for m in markers]
    me = os.getpid()
    killed = 0
    empty = 0
    for _ in range(20):  # a process may fork while we kill; repeat until none is left
        try:
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
        except OSError:
            return killed
        found = []
        for pid in pids:
            desc = _describe(pid) if _has_env(pid, *needles) else None
            if desc is not None and desc[0] not in ("Z", "X"):
                found.append((pid, desc[2]))
        if not found:
            # Twice in a row: a process in the middle of an exec shows an
            # empty environment for that instant.
            empty += 1
            if empty == 2:
                break
            time.sleep(0.01)
            continue
        empty = 0
        for pid, started in found:
            try:
                killed += kill_verified(pid, started)
            except PermissionError:
                pass  # not ours to kill
        time.sleep(0.01)
    return killed


_file_limit: int | None = None


def open_file_limit() -> int:
    """This process's soft limit on open descriptors (RLIMIT_NOFILE), read
    once; very large when unlimited or unknown. Whatever spoolq keeps open
    in numbers (spare files, a fold's batch) is sized from it: the usual
    soft limit is 1024, and can be far lower."""
    global _file_limit
    if _file_limit is None:
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            _file_limit = soft if soft != resource.RLIM_INFINITY and soft > 0 else 1 << 30
        except (ImportError, OSError, ValueError):
            _file_limit = 1 << 30
    return _file_limit


def usable_cpus() -> int:
    """How many CPUs this process may use: those it may run on, fewer when
    its cgroup's CPU quota (or a parent's) allows less (a container started
    with --cpus, a systemd unit with CPUQuota=)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    return cpus


def cgroup_cpu_quota(cgroup_file: str = "/proc/self/cgroup", mountinfo_file: str = "/proc/self/mountinfo") -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup and its
    parents, None if there is none or it cannot be read; never raises.
    cgroup v2 (cpu.max) and v1 (cpu.cfs_quota_us over cpu.cfs_period_us).
    The cgroup's folder is found through the mount table, whose root may
    be the cgroup itself (inside a container)."""
    try:
        with open(cgroup_file, encoding="utf-8", errors="surrogateescape") as f:
            memberships = [line.split(":", 2) for line in f.read().splitlines()]
        with open(mountinfo_file, encoding="utf-8", errors="surrogateescape") as f:
            mounts = [line.split() for line in f.read().splitlines()]
        best: float | None = None
        for fields in memberships:
            if len(fields) != 3:
                continue
            hierarchy, controllers, path = fields
            v2 = hierarchy == "0" and controllers == ""
            if not v2 and "cpu" not in controllers.split(","):
                continue
            for mount in mounts:
                if "-" not in mount:
                    continue
                tail = mount[mount.index("-") + 1:]
                if len(mount) < 5 or len(tail) < 3:
                    continue
                if v2 != (tail[0] == "cgroup2") or (not v2 and "cpu" not in tail[2].split(",")):
                    continue
                quota = _quota_up_from(mount[4], mount[3], path, v2)
                if quota is not None and (best is None or quota < best):
                    best = quota
        return best
    except Exception:  # odd /proc or /sys contents must never stop a worker
        return None


def _quota_up_from(mountpoint: str, root: str, path: str, v2: bool) -> float | None:
    """The smallest quota from ``path``'s folder up to the mount point."""
    root = root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None  # this mount does not show our cgroup
    folder = os.path.normpath(mountpoint + path[len(root):])
    best: float | None = None
    while True:
        quota = None
        try:
            if v2:
                with open(os.path.join(folder, "cpu.max")) as f:
                    limit, period = f.read().split()[:2]
                if limit != "max" and int(period) > 0:
                    quota = int(limit) / int(period)
            else:
                with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                    limit = int(f.read())
                with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                    period = int(f.read())
                if limit > 0 and period > 0:
                    quota = limit / period
        except (OSError, ValueError):
            pass
        if quota is not None and (best is None or quota < best):
            best = quota
        if folder == os.path.normpath(mountpoint) or folder in ("/", ""):
            return best
        folder = os.path.dirname(folder)
