"""The directory spool's side of job control: the control folder (requests
into live workers, the paused mark) and the events that waiters watch.

``control/`` is the owner's folder (``0700``, made on first use; members of
a shared spool never write it: their requests come through ``drop/`` and
the owner's side writes them here). A request is one file,
``control/<token>.req``: JSON written under a dot-name and renamed in, so
a reader sees all of it or nothing, and it outlives the process that sent
it. ``control/paused`` exists while the spool is paused. Every worker
watches the folder with inotify; a request is removed by whoever carries
it out, or once it can no longer be (its worker gone, its job finished).

Events are hints, as a watching worker's are: after each the reader looks
again at what it waits for, so a lost or merged event costs nothing but a
look. Waiting is a ``select()`` on an inotify descriptor: no CPU, no lock.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import threading
import time
from typing import Any, Callable

from ..linux import Inotify
from .protocol import SpoolDir, id_of, owner_folder

CONTROL = "control"
REQUEST_SUFFIX = ".req"
PAUSED = "paused"
REQUEST_MAX = 4096
#: Which folder events each kind of watch wants (the labels the reader gets).
FINISHED = (("done", Inotify.ARRIVALS), ("dead", Inotify.ARRIVALS), ("failed", Inotify.ARRIVALS))
STATES = (("new", Inotify.ARRIVALS | Inotify.MOVED_FROM | Inotify.DELETE),
          ("cur", Inotify.ARRIVALS | Inotify.MOVED_FROM | Inotify.DELETE),
          ("failed", Inotify.ARRIVALS | Inotify.MOVED_FROM | Inotify.DELETE),
          ("dead", Inotify.ARRIVALS | Inotify.MOVED_FROM | Inotify.DELETE),
          ("done", Inotify.ARRIVALS | Inotify.MOVED_FROM | Inotify.DELETE))
WORKERS = (("workers", Inotify.ARRIVALS | Inotify.DELETE | Inotify.CLOSE_WRITE | Inotify.CLOSE_NOWRITE),)
#: A live view's registrations: made, rewritten, removed (not a reader's
#: close, which the view's own reading would cause).
REGISTRATIONS = ("workers", Inotify.ARRIVALS | Inotify.DELETE | Inotify.CLOSE_WRITE)
CONTROL_EVENTS = Inotify.ARRIVALS | Inotify.DELETE | Inotify.MOVED_FROM
OUTPUT_EVENTS = Inotify.CREATE | Inotify.MODIFY | Inotify.DELETE


def _locked(method: Callable) -> Callable:
    """One thread at a time holds the folder's descriptor (see release)."""

    @functools.wraps(method)
    def wrapper(self: "ControlDir", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class ControlDir:
    """The control folder of one open spool."""

    def __init__(self, spool: SpoolDir, answer: Callable[[], Any] | None = None,
                 ask: Callable[[dict[str, Any], Any, str], Any] | None = None):
        """``answer``: carry out members' requests in drop/ (a worker's
        side); ``ask``: a member's way to the owner's side (DirBackend._ask)."""
        self.spool = spool
        self.member = spool.member
        self._ask = ask
        self._fd: int | None = None
        self._lock = threading.RLock()
        # The owner's worker in a shared spool: carries out members' requests
        # in drop/ (see Pickup.answer_requests), watched with control/.
        self._answer = answer if spool.shared else None

    def answer(self) -> None:
        if self._answer is not None:
            self._answer()

    def ask(self, request: dict[str, Any], what: str) -> Any:
        """A member's request, carried out by the owner's side (through drop/)."""
        return self._ask(request, None, what)

    def require_owner(self, action: str) -> None:
        self.spool.require_owner(action)

    def path(self, *parts: str) -> str:
        return os.path.join(self.spool.root, CONTROL, *parts)

    def fd(self, create: bool = True) -> int | None:
        """The folder, opened without following links (made if missing and
        ``create``); None when it is missing and may not be made."""
        if self._fd is None:
            self._fd = owner_folder(self.spool, CONTROL, 0o700, create, 0o077, "private folder")
        return self._fd

    @_locked
    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @_locked
    def interrupt(self) -> None:
        """Wake the watchers of the folder (a listener told to stop): a
        dot-file made and removed at once, never read as a request."""
        fd = self.fd()
        name = f".wake.{os.urandom(8).hex()}"
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd))
        os.unlink(name, dir_fd=fd)

    def release(self) -> None:
        """Let go of the folder's descriptor until it is next needed (a
        worker's listener, between looks: a worker may run under a low
        open-file limit)."""
        self.close()

    # -- requests -------------------------------------------------------------

    @_locked
    def send(self, request: dict[str, Any]) -> str:
        """Write a request durably; returns its token."""
        fd = self.fd()
        token = os.urandom(8).hex()
        data = json.dumps(dict(request, at=time.time()), separators=(",", ":")).encode()
        tmp = f".{token}.tmp"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            os.write(out, data)
            os.fsync(out)
        finally:
            os.close(out)
        os.rename(tmp, token + REQUEST_SUFFIX, src_dir_fd=fd, dst_dir_fd=fd)
        os.fsync(fd)
        return token

    @_locked
    def requests(self) -> list[tuple[str, dict[str, Any]]]:
        """Every request waiting, as (token, request), oldest first. A file
        that is not one the owner's side or root wrote is removed unread."""
        fd = self.fd(create=False)
        if fd is None:
            return []
        found = []
        for name in os.listdir(fd):
            if not name.endswith(REQUEST_SUFFIX) or name.startswith("."):
                continue
            token = name[:-len(REQUEST_SUFFIX)]
            request = self._read(fd, name)
            if request is None:
                self.done(token)
                continue
            found.append((token, request))
        found.sort(key=lambda item: item[1].get("at", 0))
        return found

    def _read(self, fd: int, name: str) -> dict[str, Any] | None:
        try:
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            return None
        try:
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in (self.spool.owner, 0) or st.st_nlink != 1 \
                    or st.st_mode & 0o022:
                return None
            data = os.read(f, REQUEST_MAX + 1)
        finally:
            os.close(f)
        try:
            request = json.loads(data)
        except ValueError:
            return None
        return request if isinstance(request, dict) and len(data) <= REQUEST_MAX else None

    @_locked
    def done(self, token: str) -> None:
        """Remove a request (carried out, or no longer to be)."""
        fd = self.fd(create=False)
        if fd is None:
            return
        try:
            os.unlink(token + REQUEST_SUFFIX, dir_fd=fd)
        except FileNotFoundError:
            pass

    @_locked
    def pending(self, token: str) -> bool:
        fd = self.fd(create=False)
        try:
            os.stat(token + REQUEST_SUFFIX, dir_fd=fd, follow_symlinks=False)
            return True
        except (FileNotFoundError, TypeError):
            return False

    # -- pause ----------------------------------------------------------------

    @_locked
    def paused(self) -> dict[str, Any] | None:
        """Who paused the spool and when, or None when it is not paused."""
        fd = self.fd(create=False)
        if fd is None:
            return None
        if not os.path.lexists(self.path(PAUSED)):
            return None
        return self._read(fd, PAUSED) or {"by": "?", "at": 0}

    @_locked
    def set_paused(self, info: dict[str, Any] | None) -> bool:
        """Pause (``info``: who, when) or resume; False when it was so already."""
        fd = self.fd()
        if info is None:
            try:
                os.unlink(PAUSED, dir_fd=fd)
            except FileNotFoundError:
                return False
            os.fsync(fd)
            return True
        if self.paused() is not None:
            return False
        tmp = f".{os.urandom(8).hex()}.tmp"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            os.write(out, json.dumps(info).encode())
            os.fsync(out)
        finally:
            os.close(out)
        os.rename(tmp, PAUSED, src_dir_fd=fd, dst_dir_fd=fd)
        os.fsync(fd)
        return True

    # -- events ---------------------------------------------------------------

    @_locked
    def watch(self, *kinds: str) -> "Watch":
        """An inotify instance on what ``kinds`` name: "control", "finished"
        (done/, dead/, failed/ arrivals), "states" (every state folder's
        comings and goings), "workers" (registrations made, closed, removed),
        "output" (running jobs' output written; nothing when out/ is not
        made yet and this user may not make it), "view" (what a live view
        shows: the states, registrations made, rewritten or removed, and the
        control folder, each as far as this user may watch it)."""
        ino = Inotify()
        try:
            for kind in kinds:
                if kind == "view":
                    self._watch_view(ino)
                    continue
                if kind == "control":
                    self.fd()
                    ino.add(self.path(), CONTROL_EVENTS, CONTROL)
                    if self._answer is not None:
                        ino.add(os.path.join(self.spool.root, "drop"), Inotify.ARRIVALS, "drop")
                    continue
                if kind == "output":
                    try:
                        made = self.spool.outputs._folder(not self.member)
                    except PermissionError:
                        made = None
                    if made is not None:
                        ino.add(self.spool.path("out"), OUTPUT_EVENTS, "out")
                    continue
                folders = {"finished": FINISHED, "states": STATES, "workers": WORKERS}[kind]
                for folder, mask in folders:
                    ino.add(os.path.join(self.spool.root, folder), mask, folder)
        except BaseException:
            ino.close()
            raise
        return Watch(ino)

    def _watch_view(self, ino: Inotify) -> None:
        for folder, mask in STATES:
            ino.add(os.path.join(self.spool.root, folder), mask, folder)
        if self.member:
            return  # registrations, control/ and drop/ are the owner's to watch
        ino.add(os.path.join(self.spool.root, REGISTRATIONS[0]), REGISTRATIONS[1], REGISTRATIONS[0])
        if self.fd(create=False) is not None:  # (a view makes nothing: a pause made later is seen on its tick)
            ino.add(self.path(), CONTROL_EVENTS, CONTROL)
        if self.spool.shared:
            ino.add(os.path.join(self.spool.root, "drop"), Inotify.ARRIVALS | Inotify.MOVED_FROM | Inotify.DELETE, "drop")


class Watch:
    """Events of a ``ControlDir.watch``: ``read(timeout)`` gives the job
    ids the events name (a set, empty when the time ran out), or None when
    events were lost (look at everything again)."""

    def __init__(self, ino: Inotify):
        self.ino = ino

    def fileno(self) -> int:
        return self.ino.fileno()

    def read(self, timeout: float | None) -> set[str] | None:
        events = self.ino.read(timeout)
        if events is None:
            return None
        return {name.rpartition(".")[0] if label == "out" else id_of(name) for label, _, name in events}

    def close(self) -> None:
        self.ino.close()
