"""Running one job: processes, timeouts, output, handlers.

Command and argv jobs run in a new session (so a new process group) with
their output captured into anonymous memory files, not pipes: a job that
leaves ``sleep 100 &`` behind holds a pipe open and would make the worker
wait, but it cannot hold up a file. The payload arrives on stdin the same
way. The worker waits on a pidfd, so it wakes the instant the job exits and
can still signal the whole group before it reaps the leader (while the
leader is unreaped its pid, and so the group id, cannot be reused).

Handler jobs (``kind``) call a Python function. Without a timeout they run
in the worker itself (cheapest: a function call). With a timeout they run in
a child process that is killed when it runs over, because a thread stuck in
a Python loop cannot be stopped any other way; the worker's fork server
(forkserver.py) forks it, not the worker, whose threads may hold locks.

What a handler prints is its job's output, as a command's is, not the
worker's (which is cron's mail or the journal). A forked handler's
descriptors 1 and 2 are memory files, as a command's are, so everything it
writes is kept. An in-process handler shares the worker's descriptors with
the worker's own log and with other handlers running beside it, so only
what is written through ``sys.stdout`` and ``sys.stderr`` by the thread
running it is kept (print, tracebacks, a logging handler looking up
``sys.stderr`` as it writes): while handlers run those two are routed per
thread (see _Routed). Writes to the descriptors themselves (a subprocess
the handler starts without capturing it, C code) and writes from threads
the handler starts go where they did; give the job a timeout to keep those
too.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from . import linux, procs, record
from .errors import ForkServerGone, Permanent  # noqa: F401 - Permanent: importable from here too
from .record import NO_RESULT, Outcome  # noqa: F401 - Outcome: importable from here too

PERMANENT_EXIT = 100
STOPPED_NOW = "killed: the worker was told to stop now"  # the error of a run a forced stop ended or kept from starting


def cancelled_error(by: str | None) -> str:
    """The error of a run cancelled while it ran."""
    return f"cancelled by {by}"


@dataclass(slots=True)
class Limits:
    timeout: float  # seconds, 0 = none
    grace: float
    output_limit: int
    idle: float = 0.0  # seconds without output before the run is stopped, 0 = never


@dataclass(slots=True)
class RunHandle:
    """A run in progress, so the worker can kill it on a second signal.

    ``inline`` is true exactly while an in-process handler runs: only then may
    the worker raise its stop exception into the running thread, so the
    exception always lands inside ``call_handler``."""

    pid: int | None = None
    interrupted: bool = False
    inline: bool = False
    cancelled: str | None = None  # who asked for the run to be cancelled (see cancel)
    outputs: tuple[int, int] | None = None  # its stdout and stderr files, while it runs (read by the worker's Pump)
    keep: int = 0  # the bytes at the end of each that capturing never lets go (see kept_from)
    # Re-entrant: kill() runs in a signal handler on the main thread, which
    # may have been interrupted while holding this lock.
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _reaped: bool = False

    def kill(self) -> None:
        """Kill the run's whole process group (if it has processes)."""
        with self._lock:
            self.interrupted = True
            if self.pid is not None and not self._reaped:
                _killpg(self.pid, signal.SIGKILL)

    def send(self, sig: int) -> bool:
        """Send ``sig`` to the run's process group; False when it has no
        process (yet, or any more). Only while the leader is unreaped, so
        the group id is still this run's and cannot name anyone else's."""
        with self._lock:
            if self.pid is None or self._reaped:
                return False
            _killpg(self.pid, sig)
            return True

    def cancel(self, by: str, grace: float) -> None:
        """End the run for good: SIGTERM to its process group, SIGKILL
        after ``grace`` seconds if it still runs. A run that has no process
        yet is kept from starting; an in-process handler is the caller's to
        stop (it has no process to signal)."""
        with self._lock:
            if self.cancelled is None:
                self.cancelled = by
            if not self.send(signal.SIGTERM):
                return
        timer = threading.Timer(grace, self.send, (signal.SIGKILL,))
        timer.daemon = True
        with procs.signals_to_main_thread():  # a stop signal must reach the worker's main thread
            timer.start()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _memfd(name: str) -> int:
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        import tempfile

        f = tempfile.TemporaryFile()
        fd = os.dup(f.fileno())
        f.close()
        return fd


def memfd(name: str) -> int:
    """An empty anonymous memory file (close-on-exec), or a deleted
    temporary file where there are none."""
    return _memfd(name)


def make_outputs() -> tuple[int, int]:
    """Two empty memory files for a job's stdout and stderr."""
    stdout_fd = _memfd("spoolq-stdout")
    try:
        return stdout_fd, _memfd("spoolq-stderr")
    except BaseException:
        os.close(stdout_fd)
        raise


def close_all(fds: list[int]) -> None:
    """Close and forget every descriptor in ``fds``."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def inheritable_fds() -> list[int]:
    """This process's descriptors above 2 that a spawned job would inherit
    (no close-on-exec flag): what ``spawn`` must close in the child. Python
    opens everything close-on-exec; these come from whoever started us, or
    from C code such as watchdog's inotify descriptor."""
    found = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        fd = int(name)
        if fd > 2:
            try:
                if os.get_inheritable(fd):
                    found.append(fd)
            except OSError:
                pass  # the descriptor listdir itself used
    return found


class _Spawned:
    """The part of Popen that ``_run`` uses, for a posix_spawn or forked child."""

    __slots__ = ("pid",)

    def __init__(self, pid: int):
        self.pid = pid

    def wait(self) -> int:
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


_devnull_fd: int | None = None
_home: str | None = None
_DEFAULT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name))


def default_cwd() -> str:
    """Where a command or argv job without a ``cwd`` runs (and what a
    relative one is taken from): the home directory of the user the worker
    runs as, from the password database rather than $HOME (which cron,
    systemd and su each set their own way), or / when it has none. Never the
    directory the worker happened to be started in."""
    global _home
    if _home is None:
        import pwd

        try:
            home = pwd.getpwuid(os.geteuid()).pw_dir
        except KeyError:
            home = ""
        _home = home if home and os.path.isdir(home) else "/"
    return _home


# A command job's shell reads the command from the environment, which only
# its own user and root may read, so ps shows no job's command to others.
# The space keeps a command starting with "-" from being read as options of
# eval (bash, as /bin/sh, would).
SHELL_COMMAND = 'eval " $SPOOLQ_COMMAND"'
# A job run as another user changes to its folder only as that user: the
# shell that does it is started after the worker has dropped to the user's
# groups and ids. A folder the user cannot enter ends the run for good
# (PERMANENT_EXIT), with the reason a worker gives for a missing folder
# when it starts a job itself: no later attempt runs as anyone else.
CANNOT_ENTER = "spoolq: cannot start: its working directory "


def _no_folder(cwd: str, why: str) -> str:
    return f"cannot start: its working directory {cwd} {why}"


def as_user(job: dict, user: Any, env: dict[str, str]) -> list[str]:
    """The argv that runs ``job`` as ``user`` (a password entry) by way of a
    shell that first changes to the job's folder, as that user: its
    ``cwd`` (a relative one from the user's home directory), else the home
    directory, or / when the user cannot enter that. Sets SPOOLQ_CWD in
    ``env`` for the shell, which unsets it (and the worker's folder, which
    ``cd`` leaves in OLDPWD) before the job starts."""
    import shlex

    home = user.pw_dir or "/"
    if job.get("cwd"):
        env["SPOOLQ_CWD"] = os.path.join(home, job["cwd"])
        # What the user sees of the folder, tested as the user: root never
        # looks at it for a member.
        name = shlex.quote(user.pw_name)
        why = (f'if [ -d "$SPOOLQ_CWD" ]; then why="cannot be entered as "{name}; '
               'elif [ -e "$SPOOLQ_CWD" ]; then why="is not a directory"; '
               f'else why="does not exist or "{name}" cannot reach it"; fi; ')
        said = shlex.quote(f"{CANNOT_ENTER}%s %s\\n")
        fail = f'{{ {why}printf {said} "$SPOOLQ_CWD" "$why" >&2; exit {PERMANENT_EXIT}; }}'
    else:
        env["SPOOLQ_CWD"] = home
        fail = "cd /"
    cd = f'cd -- "$SPOOLQ_CWD" 2>/dev/null || {fail}; unset SPOOLQ_CWD OLDPWD; '
    if job.get("argv") is not None:
        return ["/bin/sh", "-c", cd + 'exec "$@"', "sh", *job["argv"]]
    return ["/bin/sh", "-c", cd + SHELL_COMMAND]


def _in_place(cwd: str) -> bool:
    """Whether ``cwd`` is the worker's own directory, so posix_spawn (which
    cannot change directory) may start the job."""
    try:
        return cwd == os.getcwd()
    except OSError:
        return False


def _spawn(argv: list[str], env: dict[str, str], cwd: str | None, fds: tuple[int, int, int],
           close: list[int], threaded: bool, user: Any = None, keep: tuple[int, ...] = ()):
    """Start a job's process as the leader of a new session with ``fds`` as
    its stdin, stdout and stderr, closing ``close`` and every close-on-exec
    descriptor. posix_spawn (a vfork and exec, without Popen's Python-side
    set-up) is the cheaper of the two per job, but it keeps the GIL until the
    child has exec'd, so with other threads running jobs (``threaded``)
    Popen, which lets the GIL go, is faster. Popen is also the way for a
    ``cwd`` other than the worker's own, which os.posix_spawn cannot set, and for closing a descriptor
    at or above the soft open-file limit (inherited from a parent with a
    higher one), which the C library refuses to put in a close action.
    ``user`` (a password entry) is whom to run it as: Popen sets its groups
    (as initgroups would), group and user in the child, before the exec.
    ``keep``: descriptors the process inherits (at their numbers), which
    Popen passes."""
    def popen() -> subprocess.Popen:
        ids = {}
        if user is not None:
            ids = {"user": user.pw_uid, "group": user.pw_gid,
                   "extra_groups": os.getgrouplist(user.pw_name, user.pw_gid)}
        return subprocess.Popen(argv, stdin=fds[0], stdout=fds[1], stderr=fds[2], cwd=cwd, env=env,
                                start_new_session=True, close_fds=True, pass_fds=keep, **ids)

    if cwd is not None and _in_place(cwd):
        cwd = None
    if cwd is not None or threaded or user is not None or keep or (close and max(close) >= procs.open_file_limit()):
        return popen()
    actions = [(os.POSIX_SPAWN_DUP2, fds[0], 0), (os.POSIX_SPAWN_DUP2, fds[1], 1), (os.POSIX_SPAWN_DUP2, fds[2], 2)]
    actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in close if fd not in fds]
    # Python ignores SIGPIPE and SIGXFSZ; a job gets them back at their
    # defaults (as Popen's restore_signals does), or `yes | head` misbehaves.
    options = {"file_actions": actions, "setsid": True, "setsigdef": _DEFAULT_SIGNALS}
    program = argv[0]
    try:
        if "/" in program:
            return _Spawned(os.posix_spawn(program, argv, env, **options))
        if env.get("PATH") == os.environ.get("PATH"):
            # The C library searches our PATH, which is the job's too.
            return _Spawned(os.posix_spawnp(program, argv, env, **options))
        # The job sets its own PATH: search it here, as Popen would.
        error: OSError | None = None
        for folder in os.get_exec_path(env):
            try:
                return _Spawned(os.posix_spawn(os.path.join(folder, program), argv, env, **options))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as e:
                error = error or e
        raise error or FileNotFoundError(2, os.strerror(2))
    except OSError as e:
        if e.errno == errno.EBADF:
            # A close action the C library refused (a descriptor above a soft
            # limit lowered since it was read), before or in the child, which
            # then never ran the job: Popen closes descriptors its own way.
            return popen()
        e.filename = program
        raise


def _stdin_devnull() -> int:
    global _devnull_fd
    if _devnull_fd is None:
        _devnull_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return _devnull_fd


def _tail(fd: int, limit: int) -> tuple[str, int]:
    """The last ``limit`` bytes written to ``fd`` as text, and where in
    the stream that text begins: what was written before it, in bytes,
    reckoned from the text as stored (so that the stored text, encoded,
    ends exactly where the stream ended)."""
    size = os.fstat(fd).st_size
    if limit <= 0 or size == 0:
        return "", size
    data = os.pread(fd, limit, max(0, size - limit))
    text = data.decode("utf-8", errors="replace")
    return text, max(0, size - (len(data) if text.isascii() else len(text.encode("utf-8"))))


def _wait_exit(pid: int, pidfd: int | None, timeout: float | None, spin_until: float | None = None) -> bool:
    """Wait until ``pid`` has exited (without reaping it); False on timeout.

    Until ``spin_until`` (a monotonic time) it polls instead of sleeping,
    yielding the CPU between polls: see Worker's SPIN_WINDOW for why."""
    began = time.monotonic()
    if spin_until is not None and began < spin_until:
        end = spin_until if timeout is None else min(spin_until, began + timeout)
        try:
            while time.monotonic() < end:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
                os.sched_yield()
        except ChildProcessError:
            return True
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - began))
    if pidfd is not None:
        ready, _, _ = select.select([pidfd], [], [], timeout)
        return bool(ready)
    # No pidfd: poll waitid with WNOWAIT so the pid stays pinned.
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.0005
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        if info is not None:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


TRIM_EVERY = 0.25  # at most this many seconds between checks of how much output a running job captured
TRIM_FIRST = 0.005  # the first check; the interval doubles while little is written, and shrinks when much is
TRIM_ABOVE = 1 << 20  # captured output beyond this (and 4x output_limit) is let go


def _trim(fd: int, keep: int) -> tuple[int, int]:
    """Free all but the last ``keep`` bytes of a growing output file (punch
    a hole; the size stays, reads of the hole give zeros), so a job that
    writes gigabytes costs the worker only its tail in memory. Returns the
    file's size (all the job wrote) and its mtime (a touch counts as output
    for the idle timeout)."""
    st = os.fstat(fd)
    size = st.st_size
    if size <= max(TRIM_ABOVE, 4 * keep):
        return size, st.st_mtime_ns
    linux.punch_hole(fd, (size - keep) & ~4095)
    return size, st.st_mtime_ns


def kept_from(size: int, keep: int) -> int:
    """The first offset of a captured output of ``size`` bytes sure to be
    kept (see _trim: what it frees lies before ``size - keep``). Found by
    reckoning, not by lseek(SEEK_DATA), which would move the file offset
    the job's process writes at."""
    return 0 if size <= max(TRIM_ABOVE, 4 * keep) else size - keep


def _next_trim(wait: float, grown: int) -> float:
    """The wait before the next look at a job's output, after it wrote
    ``grown`` bytes during the last ``wait``: longer (up to TRIM_EVERY)
    while it writes little, short enough for ~TRIM_ABOVE a look while it
    writes fast (a job printing `yes` can write a gigabyte a second)."""
    if grown <= TRIM_ABOVE // 4:
        return min(TRIM_EVERY, wait * 2)
    return max(TRIM_FIRST, min(TRIM_EVERY, wait * TRIM_ABOVE / grown))


def _supervise(pid: int, limits: Limits, handle: RunHandle, outputs: tuple[int, ...] = (), keep: int = 0,
               on_slow: tuple[float, Callable[[], None]] | None = None, started: float | None = None,
               spin: float = 0.0, exit_fd: int | None = None) -> str | None:
    """Wait for a child, enforcing the timeout (counted from ``started``,
    a monotonic time, else from now) and the idle timeout (no output
    written for ``limits.idle`` seconds) on its process group and keeping
    its captured output bounded. Returns why it was stopped ("timeout",
    "idle"), None when it exited by itself. The child is left
    for the caller to reap. Until ``spin`` seconds after ``started`` the
    wait polls rather than sleeps (see _wait_exit). ``exit_fd``: a
    descriptor that turns readable once the process has exited, for one
    that is not this process's child (then ``spin`` must be 0)."""
    pidfd = exit_fd
    if exit_fd is None:
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pidfd = None
    try:
        if started is None:
            started = time.monotonic()
        deadline = started + limits.timeout if limits.timeout > 0 else None
        spin_until = started + spin if spin > 0 else None
        if on_slow is not None:
            slow_after, slow = on_slow
            if deadline is not None:
                slow_after = min(slow_after, max(0.0, deadline - time.monotonic()))
            if _wait_exit(pid, pidfd, slow_after, spin_until):
                return None
            slow()
        trim_wait, written, touched = TRIM_FIRST, dict.fromkeys(outputs, 0), dict.fromkeys(outputs, 0)
        idle = limits.idle if outputs else 0.0
        active = started  # when output last grew (the outputs' sizes are looked at with each trim)
        why = "timeout"
        while True:
            wait = trim_wait if outputs else None
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                wait = left if wait is None else min(wait, left)
            if _wait_exit(pid, pidfd, wait, spin_until):
                return None
            if deadline is not None and time.monotonic() >= deadline:
                break
            grown, stirred = 0, False
            for fd in outputs:
                size, mtime = _trim(fd, keep)
                grown, written[fd] = max(grown, size - written[fd]), size
                stirred, touched[fd] = stirred or mtime != touched[fd], mtime
            trim_wait = _next_trim(trim_wait, grown)
            if idle > 0:
                now = time.monotonic()
                if grown or stirred:
                    active = now
                elif now - active >= idle:
                    why = "idle"
                    break
        with handle._lock:
            _killpg(pid, signal.SIGTERM)
        if not _wait_exit(pid, pidfd, limits.grace):
            with handle._lock:
                _killpg(pid, signal.SIGKILL)
            _wait_exit(pid, pidfd, None)
        # The leader is dead but unreaped, so the group id is still ours:
        # make sure nothing it started outlives the timeout.
        with handle._lock:
            _killpg(pid, signal.SIGKILL)
        return why
    finally:
        if pidfd is not None and exit_fd is None:
            os.close(pidfd)


@dataclass(slots=True)
class RunPlan:
    """What a run of a job in a process of its own needs besides the job:
    the same for a command and for a handler with a timeout, so both go
    through one skeleton (_run).

    ``on_spawn(pid, window)`` is told the process the moment it exists
    (``window``: boot ticks before and after the spawn, to tell it from a
    later process with its pid); ``on_slow`` = (seconds, callback) is called
    once if it still runs after that long. A command's: ``env``, its
    environment; ``close``, the descriptors it must not inherit if the
    caller knows them already (see inheritable_fds; else they are looked up
    at the spawn); ``threaded``, other threads of this process start jobs
    too. ``outputs``: empty memory files (see make_outputs) for its stdout
    and stderr, made ahead by the caller, else made now; ``spent``: where to
    put its files once read, for the caller to close later (see close_all),
    else they are closed before the run returns. Both keep a system call
    each off the path between one job and the next. ``spin``: how long
    after the spawn to poll for its exit rather than sleep (see _wait_exit)."""

    limits: Limits
    handle: RunHandle
    on_spawn: Callable[[int, tuple[int, int]], None]
    on_slow: tuple[float, Callable[[], None]] | None = None
    env: dict[str, str] | None = None
    close: list[int] | None = None
    threaded: bool = False
    outputs: tuple[int, int] | None = None
    spent: list[int] | None = None
    spin: float = 0.0
    user: Any = None  # a password entry: run the command as this user (a root worker)
    on_exit: Callable[[RunHandle], None] | None = None  # told once its process is reaped, before its files are read and closed
    keep: tuple[int, ...] = ()  # descriptors the command's processes inherit (the claim's ``keep``)


def run_process(job: dict, plan: RunPlan) -> Outcome:
    """Run a command or argv job to its end and report what happened."""
    return _run(plan, _Exec(job, plan.env))


def fork_handler(server: Any, job: dict, plan: RunPlan) -> Outcome:
    """Run a handler job in a child process that ``server`` (a
    forkserver.ForkServer) forks, killed if it runs over its timeout."""
    return _run(plan, _Fork(server, job))


def _run(plan: RunPlan, how: "_Exec | _Fork") -> Outcome:
    """The one skeleton of a run in a process of its own: start it (``how``
    says how: exec a command, or fork a handler), tell on_spawn, supervise
    it (timeout, grace, bounded output, a kill on stop), reap it, and build
    the Outcome from its exit and its output's tails."""
    out = Outcome(start=time.time())
    handle, limits = plan.handle, plan.limits
    outputs = plan.outputs if plan.outputs is not None else make_outputs()
    fds = list(outputs)  # the run's files, closed here or handed to ``spent``
    started_up = False
    try:
        how.prepare(fds)
        if handle.interrupted or handle.cancelled:  # told to stop before it started: do not start it
            out.end = time.time()
            out.error = STOPPED_NOW if handle.interrupted else cancelled_error(handle.cancelled)
            out.interrupted = out.not_started = handle.interrupted
            out.cancelled = handle.cancelled
            return out
        before = procs.boot_ticks()
        proc = how.start(plan, outputs, out)
        started = time.monotonic()  # the timeout counts from here, not from after on_spawn
        if proc is None:  # it could not start: ``out`` says why
            out.end = time.time()
            return out
        handle.pid = proc.pid
        handle.keep = limits.output_limit
        handle.outputs = outputs
        started_up = True  # its files may now wait in ``spent``: the next spawn closes them
        try:
            try:
                plan.on_spawn(proc.pid, (before, procs.boot_ticks()))
            except Exception:
                pass  # the registration is a safety net; the run goes on without it
            if handle.interrupted:  # a kill arrived before the pid was known
                handle.kill()
            elif handle.cancelled:
                handle.send(signal.SIGTERM)
            # (A handler's process is the fork server's child: its exit is told on exit_fd.)
            stopped = _supervise(proc.pid, limits, handle, outputs, limits.output_limit, plan.on_slow,
                                 started, plan.spin, getattr(proc, "exit_fd", None))
            out.timed_out = stopped is not None
        except BaseException:
            # Whatever went wrong here, leave nothing running behind us.
            _killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        with handle._lock:
            if handle.cancelled:  # nothing the run started outlives it
                _killpg(proc.pid, signal.SIGKILL)
            handle._reaped = True  # before reaping: after it the group id may be reused
            code = proc.wait()
        out.end = time.time()
        out.interrupted = handle.interrupted
        out.cancelled = handle.cancelled
        if out.timed_out:
            out.error = (f"no output for {record.duration_text(limits.idle)}" if stopped == "idle"
                         else f"timed out after {limits.timeout:g}s")
        elif out.interrupted:
            out.error = STOPPED_NOW
        elif out.cancelled:
            out.error = cancelled_error(out.cancelled)
        more_stderr = how.finish(out, code)
        out.stdout, out.stdout_from = _tail(outputs[0], limits.output_limit)
        out.stderr, out.stderr_from = _tail(outputs[1], limits.output_limit)
        if more_stderr:
            out.stderr = _tail_text(out.stderr + more_stderr, limits.output_limit)
            out.stderr_from = 0  # (a traceback follows what the process wrote: no longer one stream)
        return out
    finally:
        if started_up and plan.on_exit is not None:
            try:
                plan.on_exit(handle)
            except Exception:
                pass  # its live output is a convenience; the run's outcome is not
        handle.outputs = None
        how.close()
        if plan.spent is not None and started_up:
            plan.spent.extend(fds)
        else:
            close_all(fds)


class _Exec:
    """How a command or argv job runs: exec'd (posix_spawn or Popen) in a
    new session, its payload on stdin from a memory file."""

    __slots__ = ("job", "env", "stdin", "stderr")

    def __init__(self, job: dict, env: dict[str, str] | None):
        self.job = job
        self.env = dict(os.environ) if env is None else env
        self.stdin: int | None = None
        self.stderr: int | None = None  # a run as another user: its stderr, for why it could not start

    def prepare(self, fds: list[int]) -> None:
        if self.job.get("payload") is not None:
            self.stdin = _memfd("spoolq-payload")
            fds.append(self.stdin)
            os.write(self.stdin, json.dumps(self.job["payload"], ensure_ascii=False).encode())
            os.lseek(self.stdin, 0, os.SEEK_SET)

    def start(self, plan: RunPlan, outputs: tuple[int, int], out: Outcome) -> Any:
        """The started process (with .pid and .wait()), or None with why in ``out.error``."""
        job, env, cwd = self.job, self.env, None
        if job.get("command") is not None:
            env["SPOOLQ_COMMAND"] = job["command"]  # (a string: the record's checks say so)
        if plan.user is not None:
            argv = as_user(job, plan.user, env)
            self.stderr = outputs[1]
        else:
            argv = list(job["argv"]) if job.get("argv") is not None else ["/bin/sh", "-c", SHELL_COMMAND]
            home = default_cwd()
            cwd = os.path.join(home, job["cwd"]) if job.get("cwd") else home
        try:
            stdin = self.stdin if self.stdin is not None else _stdin_devnull()
            return _spawn(argv, env, cwd, (stdin, outputs[0], outputs[1]),
                          inheritable_fds() if plan.close is None else plan.close, plan.threaded, plan.user,
                          plan.keep)
        except OSError as e:
            where = f": {e.filename}" if e.filename else ""
            out.error = f"cannot start: {e.strerror or e}{where}"
            if e.filename == cwd and e.errno in (errno.ENOENT, errno.ENOTDIR):
                # A directory that is not there does not come back by retrying.
                out.permanent = True
                out.error = _no_folder(cwd, "does not exist" if e.errno == errno.ENOENT else "is not a directory")
        except ValueError as e:  # e.g. an embedded NUL that slipped through
            out.error = f"cannot start: {e}"
        return None

    def finish(self, out: Outcome, code: int) -> str | None:
        """Judge the exit ``code``; None: no more stderr than the job's own."""
        env = self.env
        if (out.timed_out or out.interrupted or out.cancelled) and env.get("SPOOLQ_WORKER"):
            # Killed with its process group; what left the group (setsid) is
            # found by the variables that mark this run, as recovery would.
            procs.kill_marked([f"{k}={env[k]}" for k in ("SPOOLQ_WORKER", "SPOOLQ_JOB_ID", "SPOOLQ_ATTEMPT") if k in env])
        out.exit_code = code
        if out.error is not None:
            pass
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            out.error = f"killed by {name}"
        elif code == PERMANENT_EXIT:
            out.permanent = True
            out.error = self._cannot_enter() or f"exit status {code}: failed permanently"
        elif code != 0:
            out.error = f"exit status {code}"
        return None

    def _cannot_enter(self) -> str | None:
        """Why a run as another user could not start: it could not enter
        its folder (see as_user). None otherwise."""
        if self.stderr is None:
            return None
        line = os.pread(self.stderr, 8192, 0).decode("utf-8", "replace").partition("\n")[0]
        return line.removeprefix("spoolq: ") if line.startswith(CANNOT_ENTER) else None

    def close(self) -> None:
        pass  # its payload file is among the run's files


class _Fork:
    """How a handler job with a timeout runs: in a child process that the
    worker's fork server (forkserver.py) forks, which writes what the
    handler did (error, traceback, result) as JSON to a memory file the
    worker reads once the child has exited."""

    __slots__ = ("server", "job", "result_fd")

    def __init__(self, server: Any, job: dict):
        self.server = server
        self.job = job
        self.result_fd: int | None = None

    def prepare(self, fds: list[int]) -> None:
        self.result_fd = _memfd("spoolq-result")

    def start(self, plan: RunPlan, outputs: tuple[int, int], out: Outcome) -> Any:
        """The started process (see forkserver.Served), or None with why in ``out.error``."""
        job = self.job
        try:
            return self.server.start(job.get("kind"), job.get("payload"), plan.limits.output_limit, outputs,
                                     self.result_fd)
        except ForkServerGone:
            raise  # the worker's to handle: no later handler job can start either
        except OSError as e:  # the fork failed (too many processes, no memory)
            out.error = f"cannot start: {e.strerror or e}"
        return None

    def finish(self, out: Outcome, code: int) -> str | None:
        """Take the child's report; the handler's traceback, if any, follows its stderr."""
        size = os.fstat(self.result_fd).st_size
        report = None
        if size:
            try:
                report = json.loads(os.pread(self.result_fd, size, 0))
            except ValueError:
                report = None
        if out.error is not None:
            pass
        elif report is None:
            out.error = f"the handler process died ({'signal ' + str(-code) if code < 0 else 'exit status ' + str(code)})"
        else:
            out.error = report.get("error")
            out.permanent = bool(report.get("permanent"))
            if "result" in report:
                out.result = report["result"]
        return (report or {}).get("tb") or ""

    def close(self) -> None:
        if self.result_fd is not None:
            os.close(self.result_fd)


def run_forked_handler(handler: Callable[[Any], Any] | None, kind: str, payload: Any, output_limit: int,
                       outputs: tuple[int, int], result_fd: int, parent: int) -> None:
    """The body of a handler job's own process (forked by the fork server,
    ``parent``): run the handler with its output going to ``outputs``, write
    what it did to ``result_fd``, and leave without cleanup. Never returns."""
    code = 0
    try:
        die_with_parent()  # killed with the server, which dies with the worker
        if os.getppid() != parent:  # the server died before prctl took hold
            os._exit(1)
        # The server ignores these; a timeout's SIGTERM must end the handler.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        # Its output is the job's, as a command's is. Fresh streams: the
        # worker's may hold text it buffered but did not write yet.
        os.dup2(outputs[0], 1)
        os.dup2(outputs[1], 2)
        # Line-buffered: what it printed before a timeout killed it is kept.
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
        child = Outcome(start=time.time())
        try:
            _call_into(child, handler, {"kind": kind, "payload": payload}, Limits(0, 0, output_limit))
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError, AttributeError):
                    pass
        report = {"error": child.error, "tb": child.stderr, "permanent": child.permanent}
        if child.has_result:
            report["result"] = child.result
        os.pwrite(result_fd, json.dumps(report).encode(), 0)
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _describe_exception(e: BaseException, limit: int) -> tuple[str, str]:
    message = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    tb = "".join(traceback.format_exception(e))
    if limit > 0 and len(tb) > limit:
        tb = tb[-limit:]
    return message, tb


def _json_result(value: Any) -> Any:
    """The handler's return value as stored JSON, or raise TypeError/ValueError."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    # Stored inside the record, one level down: the whole must stay readable.
    return record.loads(json.dumps(value, allow_nan=False), max_depth=record.MAX_DEPTH - 1)


class _Captured:
    """What one in-process handler writes to sys.stdout or sys.stderr: the
    last ``limit`` characters (at least ``limit`` bytes) of it, so a handler
    printing without end costs the worker little memory."""

    encoding = "utf-8"
    errors = "backslashreplace"

    def __init__(self, limit: int):
        self.limit = limit
        self._parts: list[str] = []
        self._size = 0

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if self.limit > 0 and text:
            self._parts.append(text)
            self._size += len(text)
            if self._size > 2 * self.limit + 4096:
                kept = "".join(self._parts)[-self.limit:]
                self._parts, self._size = [kept], len(kept)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    @property
    def buffer(self) -> Any:
        """For ``sys.stdout.buffer.write(b"...")``: bytes kept as UTF-8 text."""
        return _CapturedBytes(self)

    def text(self) -> str:
        return "".join(self._parts)


class _CapturedBytes:
    def __init__(self, captured: _Captured):
        self._captured = captured

    def write(self, data: bytes) -> int:
        self._captured.write(bytes(data).decode("utf-8", errors="replace"))
        return len(data)

    def flush(self) -> None:
        pass


class _Routed:
    """sys.stdout or sys.stderr while in-process handlers run: a thread
    running a handler writes into that handler's _Captured, any other
    thread (the worker's, the application's) to the stream that was there
    before."""

    def __init__(self, name: str, original: Any):
        self._name = name
        self._original = original

    def _target(self) -> Any:
        captured = getattr(_capture, self._name, None)
        if captured is None:
            limit = getattr(_capture, "limit", None)
            if limit is None:  # not a thread running a handler
                return self._original
            # Made at the handler's first write: most print nothing.
            captured = _Captured(limit)
            setattr(_capture, self._name, captured)
        return captured

    def write(self, text: str) -> int:
        target = self._target()
        return len(text) if target is None else target.write(text)  # None: started with it closed

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        target = self._target()
        if target is not None:
            target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)


_capture = threading.local()  # .limit, .stdout, .stderr: the running handler's, in its thread (see _Routed._target)
_capture_lock = threading.Lock()
_capturing = 0  # handlers running in this process with their output captured
_routed: tuple[Any, Any] | None = None  # the (_Routed, _Routed) in place while any is
_last_routed: tuple[Any, Any] | None = None  # the pair last in place, used again for the same streams


def _begin_capture(limit: int) -> None:
    """Route this thread's sys.stdout and sys.stderr into captures of their
    own until _end_capture; they are put in place while any handler runs."""
    global _capturing, _routed
    with _capture_lock:
        if _capturing == 0:
            last = _last_routed
            if last is None or last[0]._original is not sys.stdout or last[1]._original is not sys.stderr:
                last = (_Routed("stdout", sys.stdout), _Routed("stderr", sys.stderr))
            _routed = last  # (the last pair again when the streams are the same: one job after another)
            sys.stdout, sys.stderr = _routed
        _capturing += 1
    _capture.stdout = _capture.stderr = None
    _capture.limit = limit


def _end_capture() -> tuple[str, str]:
    """What this thread's handler printed; the streams are put back once
    no handler runs (unless someone else has replaced them since)."""
    global _capturing, _routed, _last_routed
    out, err = _capture.stdout, _capture.stderr
    _capture.stdout = _capture.stderr = _capture.limit = None
    with _capture_lock:
        _capturing -= 1
        if _capturing == 0 and _routed is not None:
            if sys.stdout is _routed[0]:
                sys.stdout = _routed[0]._original
            if sys.stderr is _routed[1]:
                sys.stderr = _routed[1]._original
            _routed, _last_routed = None, _routed
    return (out.text() if out is not None else ""), (err.text() if err is not None else "")


def _tail_text(text: str, limit: int) -> str:
    """The last ``limit`` bytes of ``text`` in UTF-8, as _tail gives a command's."""
    if limit <= 0 or not text:
        return ""
    data = text.encode("utf-8", "backslashreplace")
    return data[-limit:].decode("utf-8", errors="replace") if len(data) > limit else text


# This process's pid, kept current in a child made by os.fork (or
# multiprocessing): call_handler compares it with getpid() after a handler
# returns, and so makes one system call a job, not two. (A child forked
# without Python's hooks keeps its parent's pid here, which is still the
# worker's pid to compare with.)
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def call_handler(handler: Callable[[Any], Any] | None, job: dict, limits: Limits, handle: RunHandle) -> Outcome:
    """Run a handler job in this process (no timeout possible); what it
    prints in this thread becomes the job's stdout and stderr."""
    out = Outcome(start=time.time())
    _begin_capture(limits.output_limit)
    try:
        with handle._lock:
            handle.inline = True
        worker_pid = _pid
        try:
            _call_into(out, handler, job, limits)
        finally:
            if os.getpid() != worker_pid:
                # A child the handler forked has returned from it: going on, it
                # would be a second worker running jobs the first already ran.
                _end_forked_child(out)
            _leave_inline(handle)
    finally:
        printed, printed_err = _end_capture()  # (out of the window a forced stop is raised in)
    out.stdout = _tail_text(printed, limits.output_limit)
    out.stderr = _tail_text(printed_err + (out.stderr or ""), limits.output_limit)  # then the traceback, if any
    out.end = time.time()
    return out


def _end_forked_child(out: Outcome) -> None:
    """End a process a handler forked, where it returned: its exit status
    what it asked with sys.exit() (as Python would give it), else 0 for a
    return and 1 for an exception; what it printed flushed first (to the
    worker's streams: its job's record is the worker's to write)."""
    code = 0 if out.error is None else 1
    if out.exit_request is not NO_RESULT:
        request = out.exit_request
        code = request if isinstance(request, int) else (0 if request is None else 1)
    captured = (getattr(_capture, "stdout", None), getattr(_capture, "stderr", None))
    for stream, text in zip((sys.stdout, sys.stderr), captured):
        stream = getattr(stream, "_original", stream)
        try:
            if text is not None:
                stream.write(text.text())
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code & 0xFF)


def _leave_inline(handle: RunHandle) -> None:
    with handle._lock:
        handle.inline = False


def _call_into(out: Outcome, handler, job: dict, limits: Limits) -> None:
    if handler is None:
        out.error = f"no handler for kind {job.get('kind')!r} in this worker"
        return
    payload = job.get("payload")
    try:
        value = handler({} if payload is None else payload)
    except Permanent as e:
        out.error, out.stderr = _describe_exception(e, limits.output_limit)
        out.permanent = True
        return
    except (Exception, SystemExit) as e:  # sys.exit() in a handler fails the job, not the worker
        out.error, out.stderr = _describe_exception(e, limits.output_limit)
        if isinstance(e, SystemExit):
            out.error = f"the handler called sys.exit({e.code!r})"
            out.exit_request = e.code
        return
    try:
        out.result = _json_result(value)
    except RecursionError:  # from json.dumps, deeper than it goes
        out.error = f"the handler returned a value {record.too_deep_message(record.MAX_DEPTH - 1)}"
    except (TypeError, ValueError) as e:
        out.error = f"the handler returned a value that is not JSON: {type(value).__name__} ({e})"


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a forked child: be sent ``sig`` when the parent dies (Linux). A
    parent that forks often resolves prctl first (linux.load_prctl)."""
    linux.set_death_signal(sig)
