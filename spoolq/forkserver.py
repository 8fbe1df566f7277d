"""The fork server: the process a worker's handler jobs with a timeout are
forked from.

A handler job with a timeout runs in a process of its own, so that it can be
killed when it runs over (see runner.py). A worker has threads (its
registration's flusher, the group commit, the watcher, ``jobs=N`` slots, a
program's own), and a process forked from one of them gets a copy of every
lock as it was at that instant: a lock another thread held (a module's
import lock, the allocator's, a C library's, the program's own) stays held
for ever in the child, whose handler then hangs on it until its timeout
kills it. So a worker that has handlers forks this server once, as it
starts and before it starts any thread; the server forks each handler
child from its own single thread and holds no lock while it does.

What a child sees is the worker as it was when the server was forked: the
handlers it was given (closures and bound methods too, since nothing is
passed by name) and everything they reach, as they were then. What changes
in the worker later (a module an in-process handler imports, a value it
sets) is not seen; what a child changes is lost with it, as before. A
program that calls ``Spool.work`` while threads of its own already run
forks the server from a threaded process once; start the worker before
other threads, or run ``spoolq work --app``, whose process has none.

The worker talks to the server over a socket pair (SOCK_SEQPACKET, one
message a request). A request carries, as descriptors: the server's end of
a socket pair made for that run, the run's stdout and stderr files, the
file the child writes its report to, and a memory file holding the kind,
payload and output limit. On the run's socket the server answers with the
child's pid, then, once the child has exited, its exit status. It reaps the
child only when the worker closes its end, so that until then the pid and
process group id stay the child's, and the worker may signal them (a
timeout, a stop) as it would a child of its own. The server dies with the
worker, and its children with it.
"""

from __future__ import annotations

import array
import errno
import json
import os
import select
import signal
import socket
from typing import Any, Callable

from . import linux, runner
from .errors import ForkServerGone

_RUN = b"run"
_FDS = 5  # a request's descriptors: run socket, stdout, stderr, report, request
_QUIET = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_POLL_WITHOUT_PIDFD = 0.02  # seconds between looks at running children where pidfd_open is missing


class ForkServer:
    """The worker's side: forks the server now, then starts handler
    processes through it (from any thread) until ``close``."""

    def __init__(self, handlers: dict[str, Callable[[Any], Any]]):
        linux.load_prctl()  # resolved once here, not in every child
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        # The worker's signal handlers must never run in the server: block
        # the signals across the fork; the server ignores them before it
        # unblocks (which drops any that came meanwhile).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _QUIET)
        try:
            pid = os.fork()
            if pid == 0:
                ours.close()
                _serve(theirs, handlers, parent)  # never returns
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        theirs.close()
        self.pid = pid
        self._sock = ours

    def start(self, kind: str, payload: Any, output_limit: int, outputs: tuple[int, int], report_fd: int) -> "Served":
        """Start a child running the handler of ``kind``; raises ForkServerGone
        if the server has ended, OSError if the fork failed."""
        request = runner.memfd("spoolq-request")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            os.write(request, json.dumps({"kind": kind, "payload": payload, "limit": output_limit}).encode())
            fds = array.array("i", [theirs.fileno(), outputs[0], outputs[1], report_fd, request])
            try:
                self._sock.sendmsg([_RUN], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            except OSError as e:
                raise ForkServerGone(e.errno, f"the fork server (pid {self.pid}) has ended") from None
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
            os.close(request)
        try:
            answer = mine.recv(64)
            if not answer:
                raise ForkServerGone(errno.EPIPE, f"the fork server (pid {self.pid}) has ended")
            if answer.startswith(b"E"):  # the fork failed: its errno
                code = int(answer[1:])
                raise OSError(code, os.strerror(code))
            return Served(int(answer), mine)
        except BaseException:
            mine.close()
            raise

    def close(self) -> None:
        """End the server (it has no child left once the worker's runs are
        over) and reap it."""
        self._sock.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


class Served:
    """A handler process the server started, as runner's ``_run`` uses a
    child of its own: ``pid``, ``exit_fd`` (readable once it has exited) and
    ``wait()`` (its exit status, after which its pid may be reused)."""

    __slots__ = ("pid", "_sock")

    def __init__(self, pid: int, sock: socket.socket):
        self.pid = pid
        self._sock = sock

    @property
    def exit_fd(self) -> int:
        return self._sock.fileno()

    def wait(self) -> int:
        try:
            status = self._sock.recv(64)
        finally:
            self._sock.close()  # the server reaps it now
        # Nothing: the server died, and the child with it (its death signal).
        return int(status) if status else -signal.SIGKILL


# -- the server's side ---------------------------------------------------------


class _Child:
    __slots__ = ("pid", "sock", "pidfd", "status", "abandoned")

    def __init__(self, pid: int, sock: socket.socket, pidfd: int | None):
        self.pid = pid
        self.sock = sock
        self.pidfd = pidfd
        self.status: int | None = None  # its exit status, once it has exited (it stays unreaped until told)
        self.abandoned = False


def _serve(sock: socket.socket, handlers: dict[str, Callable[[Any], Any]], worker: int) -> None:
    """The server's body; never returns."""
    code = 0
    try:
        runner.die_with_parent()
        if os.getppid() != worker:  # the worker died before prctl took hold
            os._exit(1)
        for sig in _QUIET:
            signal.signal(sig, signal.SIG_IGN)
        # Children must be reaped here, by waitpid: not ignored, as a
        # program that calls Spool.work may have it.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        _Server(sock, handlers).loop()
    except BaseException:
        code = 1
    finally:
        os._exit(code)


class _Server:
    def __init__(self, sock: socket.socket, handlers: dict[str, Callable[[Any], Any]]):
        self.sock = sock
        self.handlers = handlers
        self.pid = os.getpid()
        self.poll = select.poll()
        self.poll.register(sock, select.POLLIN)
        self.by_fd: dict[int, _Child] = {}  # a run socket's or a pidfd's descriptor -> its child

    def loop(self) -> None:
        while True:
            timeout = None
            if any(c.pidfd is None and c.status is None for c in self.by_fd.values()):
                timeout = _POLL_WITHOUT_PIDFD * 1000
            for fd, _ in self.poll.poll(timeout):
                if fd == self.sock.fileno():
                    if not self._request():
                        return  # the worker closed its end: it is done
                    continue
                child = self.by_fd.get(fd)
                if child is None:
                    continue
                if fd == child.pidfd:
                    self._exited(child)
                else:
                    self._released(child)
            for child in list(self.by_fd.values()):
                if child.pidfd is None and child.status is None:
                    self._exited(child)

    def _request(self) -> bool:
        data, ancillary, _, _ = self.sock.recvmsg(16, socket.CMSG_SPACE(_FDS * 4))
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        if not data:
            return False
        if data != _RUN or len(fds) != _FDS:
            runner.close_all(list(fds))
            return True
        run_sock = socket.socket(fileno=fds[0])
        rest = list(fds[1:])
        try:
            self._fork(run_sock, rest[0], rest[1], rest[2], rest[3])
        finally:
            runner.close_all(rest)
        return True

    def _fork(self, run_sock: socket.socket, stdout: int, stderr: int, report: int, request: int) -> None:
        try:
            pid = os.fork()
        except OSError as e:
            _send(run_sock, b"E%d" % (e.errno or errno.EAGAIN))
            run_sock.close()
            return
        if pid == 0:
            self._child(run_sock, stdout, stderr, report, request)  # never returns
        try:
            os.setpgid(pid, pid)  # also here, so a kill reaches its group however early it comes
        except OSError:
            pass
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pidfd = None
        child = _Child(pid, run_sock, pidfd)
        self.by_fd[run_sock.fileno()] = child
        self.poll.register(run_sock, select.POLLIN)
        if pidfd is not None:
            self.by_fd[pidfd] = child
            self.poll.register(pidfd, select.POLLIN)
        _send(run_sock, b"%d" % pid)

    def _child(self, run_sock: socket.socket, stdout: int, stderr: int, report: int, request: int) -> None:
        """In the child: nothing of the server's but the handlers; then the handler."""
        try:
            os.setpgid(0, 0)
            self.sock.close()
            run_sock.close()
            for other in {id(c): c for c in self.by_fd.values()}.values():  # (each is there under two descriptors)
                other.sock.close()
                if other.pidfd is not None:
                    os.close(other.pidfd)
            size = os.fstat(request).st_size
            asked = json.loads(os.pread(request, size, 0))
            os.close(request)
            handler = self.handlers.get(asked["kind"])
        except BaseException:
            os._exit(1)
        runner.run_forked_handler(handler, asked["kind"], asked["payload"], asked["limit"], (stdout, stderr),
                                  report, self.pid)

    def _exited(self, child: _Child) -> None:
        """Tell the worker the child's exit status, if it has exited; it stays unreaped."""
        if child.status is not None:
            return
        try:
            info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = None
            child.status = -signal.SIGKILL  # (cannot be: only this server reaps it)
        if info is not None:
            child.status = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if child.status is None:
            return
        if child.pidfd is not None:
            self.poll.unregister(child.pidfd)
            del self.by_fd[child.pidfd]
            os.close(child.pidfd)
            child.pidfd = None
        if child.abandoned:
            self._reap(child)
        else:
            _send(child.sock, b"%d" % child.status)

    def _released(self, child: _Child) -> None:
        """The worker closed its end of a run's socket: reap the child, or
        (if the worker let it go while it ran) kill it and reap it once it
        has exited."""
        if child.status is not None:
            self._reap(child)
            return
        child.abandoned = True
        self.poll.unregister(child.sock)
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except OSError:
            pass

    def _reap(self, child: _Child) -> None:
        try:
            os.waitpid(child.pid, 0)
        except ChildProcessError:
            pass
        fd = child.sock.fileno()
        if self.by_fd.pop(fd, None) is not None and not child.abandoned:
            self.poll.unregister(fd)
        child.sock.close()


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.send(data)
    except OSError:
        pass  # the worker let the run go: it learns nothing more

