"""What decides when a job of a spool directory may run, besides its due
time: the held/ and waiting/ folders and the small files of order/.

- ``order/prio/P~ID``: an empty file saying job ID has priority P (not 0).
  A scan lists this folder (empty unless priorities are in use) and
  orders by it without reading any job file; a marker whose job is gone
  is removed by a later scan. Made before the job is published.
- ``waiting/``: jobs whose dependencies have not all succeeded, parked
  where no pass looks. ``order/deps/DEP/ID``: job ID waits for DEP. The
  move of DEP to done/ releases each such ID whose other dependencies are
  done too (one rename, waiting/ -> new/); its move to dead/ (or a cancel)
  sends them to dead/ with the reason, and theirs after them. The edges
  are a cache: recovery releases or kills whatever waits wrongly.
- ``held/``: jobs held by the operator, never claimed until released.
- ``order/keys/HASH``: the id of the job that last took unique key KEY
  (HASH is its SHA-256). Taken under the file's flock: the key is free
  when the job it names is in none of new/, cur/, failed/, held/, waiting/.
- ``order/locks/NAME.SLOT``: flocked by the worker running a job that
  holds lock NAME, for the whole run (slots 0 .. limit-1), and naming
  that job. The job's processes inherit the flocked descriptor: should the
  worker die, the lock stays held until the last of them has ended (or
  recovery has killed them), and the kernel frees it then, with no expiry
  to guess. A run that ends lets it go for all (flock's LOCK_UN), so a
  process the job left behind does not keep it.

Every move here is one rename of a locked file, as everywhere else.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
import time
from typing import Any, Callable

from .. import config, record
from ..errors import InvalidJob, UnmetDependency
from .protocol import SpoolDir, file_name, id_of

UNFINISHED = ("new", "cur", "failed", "held", "waiting")
STALE_MARK = 300.0  # seconds before a priority marker without its job is removed (an enqueue may be making it)
_OPEN = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
_SLOT = _OPEN | os.O_CREAT  # a lock slot, flocked through a read-only open file


class Order:
    """The order/ folder of one open spool (its subfolders made on first need)."""

    def __init__(self, spool: SpoolDir):
        self.spool = spool
        self._fds: dict[str, int] = {}
        self._made: set[str] = set()  # subfolders made (or found) already
        self._lock = threading.Lock()

    def sub(self, name: str, create: bool = False) -> int | None:
        """The descriptor of ``order/name`` (None when it does not exist)."""
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        if not self.spool.has("order"):
            return None
        with self._lock:
            if name in self._fds:
                return self._fds[name]
            parent = self.spool.fd("order")
            try:
                fd = os.open(name, _OPEN | os.O_DIRECTORY, dir_fd=parent)
            except FileNotFoundError:
                if not create:
                    return None
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                except FileExistsError:
                    pass
                fd = os.open(name, _OPEN | os.O_DIRECTORY, dir_fd=parent)
            self._fds[name] = fd
            return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    # Priorities and dependency edges are reached by path from order/,
    # without descriptors kept open (a worker's descriptors are counted:
    # see commit.py): order/ is its owner's alone, so no one else can put
    # a link in the way. Keys and lock slots keep theirs (sub), when used.

    def _root(self, make: str | None = None) -> int | None:
        """order/'s descriptor (None: no order/), with its subfolder ``make`` made once."""
        if not self.spool.has("order"):
            return None
        root = self.spool.fd("order")
        if make is not None and make not in self._made:
            try:
                os.mkdir(make, 0o700, dir_fd=root)
            except FileExistsError:
                pass
            self._made.add(make)
        return root

    def _make(self, name: str) -> None:
        """Make order/name by path (no descriptor kept), if order/ is there."""
        try:
            os.mkdir(os.path.join(self.spool.root, "order", name), 0o700)
        except (FileExistsError, FileNotFoundError, PermissionError):
            pass

    def mark_priority(self, job_id: str, priority: int) -> None:
        if priority:
            root = self._root("prio")
            os.close(os.open(f"prio/{priority}~{job_id}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                             0o600, dir_fd=root))
            if self.spool.fsync:  # before the job is published: a job on disk has its place
                fd = os.open("prio", _OPEN | os.O_DIRECTORY, dir_fd=root)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def priorities(self) -> dict[str, int]:
        """File name -> priority of every job marked with one."""
        found = {}
        try:
            with os.scandir(os.path.join(self.spool.root, "order", "prio")) as it:
                for entry in it:
                    p, sep, job_id = entry.name.partition("~")
                    try:
                        found[file_name(job_id)] = int(p)
                    except ValueError:
                        continue
        except FileNotFoundError:
            self._make("prio")  # made once: the next pass lists an empty folder
        return found

    def drop_stale_priorities(self, marks: dict[str, int], seen: set[str]) -> None:
        """Remove the markers of jobs no longer waiting or running (a scan
        saw them in neither new/ nor failed/, and they are nowhere else)."""
        root = self._root()
        if root is None:
            return
        now = time.time()
        for name, p in marks.items():
            if name in seen or self.spool.find((name,), UNFINISHED) is not None:
                continue
            mark = f"prio/{p}~{id_of(name)}"
            try:
                if now - os.stat(mark, dir_fd=root, follow_symlinks=False).st_mtime > STALE_MARK:
                    os.unlink(mark, dir_fd=root)
            except FileNotFoundError:
                pass

    # -- unique keys ---------------------------------------------------------

    def with_key(self, key: str, job_id: str, publish: Callable[[], None]) -> str | None:
        """Publish the job holding unique key ``key`` unless an unfinished
        job holds it: then that job's id, and nothing is published. The key
        file's flock makes concurrent enqueues of one key take turns."""
        fd = self.sub("keys", create=True)
        name = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        kfd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        try:
            fcntl.flock(kfd, fcntl.LOCK_EX)
            holder = os.pread(kfd, 200, 0).decode("ascii", "replace").strip()
            if holder and holder != job_id and self.unfinished(holder):
                return holder
            data = job_id.encode("ascii")
            os.ftruncate(kfd, 0)
            os.pwrite(kfd, data, 0)
            publish()
            return None
        finally:
            os.close(kfd)

    def unfinished(self, job_id: str) -> bool:
        """Whether job ``job_id`` waits, is held or runs. Looked for twice:
        a job moving between two folders as they are looked in is found
        by the second look."""
        names = (file_name(job_id),)
        return any(self.spool.find(names, UNFINISHED) is not None for _ in range(2))

    # -- dependencies ------------------------------------------------------------

    def add_edges(self, job_id: str, deps: list[str]) -> None:
        root = self._root("deps")
        for dep in deps:
            try:
                os.mkdir(f"deps/{dep}", 0o700, dir_fd=root)
            except FileExistsError:
                pass
            os.close(os.open(f"deps/{dep}/{job_id}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                             0o600, dir_fd=root))

    def any_dependents(self) -> bool:
        """Whether some job may have dependents (False: none has). A finish
        asks this of every job: while no job has dependents, order/deps/
        has no subfolder, and its link count says so (where the filesystem
        counts them). An edge made after this look is the enqueuer's to
        settle: it looks at the dependency again once its job is published."""
        root = self._root()  # (order/'s descriptor, kept: one short look a finish)
        if root is None:
            return False
        try:
            return os.stat("deps", dir_fd=root, follow_symlinks=False).st_nlink != 2
        except FileNotFoundError:
            self._make("deps")  # made once: the next look costs one stat
            return False

    def dependents(self, dep: str) -> list[str]:
        """The jobs that wait for ``dep``."""
        if not self.any_dependents():
            return []
        try:
            return sorted(os.listdir(os.path.join(self.spool.root, "order", "deps", dep)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def drop_edges(self, dep: str, dependents: list[str]) -> None:
        root = self._root()
        if root is None:
            return
        for name in dependents:
            try:
                os.unlink(f"deps/{dep}/{name}", dir_fd=root)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(f"deps/{dep}", dir_fd=root)
        except OSError:
            pass  # another dependent came meanwhile


class Locks:
    """The lock slots a worker holds for its runs, and the waits for taken
    ones: a thread per taken slot sleeps in flock(2) until it is free, then
    lets it go and wakes the worker (no polling, no expiry)."""

    def __init__(self, order: Order, settings: Any):
        self.order = order
        self.settings = settings
        self.wake: Callable[[], None] = lambda: None
        self._waiting: set[tuple[str, int]] = set()  # (name, slot) a thread waits for
        self._lock = threading.Lock()

    def acquire(self, names: list[str], job_id: str) -> tuple[list[int] | None, str | None]:
        """Slots of every name (sorted) for a run of job ``job_id``:
        (descriptors, None), or (None, the first name whose slots are all
        taken), none kept then. The descriptors are read-only (a job's
        processes get them) and each slot names the job, for show and list."""
        fd = self.order.sub("locks", create=True)
        held: list[int] = []
        for name in names:
            got = None
            for slot in range(config.lock_limit(self.settings, name)):
                sfd = os.open(f"{name}.{slot}", _SLOT, 0o600, dir_fd=fd)
                try:
                    fcntl.flock(sfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    got = sfd
                    break
                except OSError as e:
                    os.close(sfd)
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
            if got is None:
                release(held)
                return None, name
            held.append(got)
            _name_holder(fd, f"{name}.{slot}", job_id)
        return held, None

    def wait_for(self, name: str) -> None:
        """Wake the worker once a slot of ``name`` is let go."""
        for slot in range(config.lock_limit(self.settings, name)):
            with self._lock:
                if (name, slot) in self._waiting:
                    continue
                self._waiting.add((name, slot))
            threading.Thread(target=self._wait_slot, args=(name, slot), daemon=True,
                             name=f"spoolq-lock-{name}").start()

    def _wait_slot(self, name: str, slot: int) -> None:
        try:
            fd = self.order.sub("locks", create=True)
            sfd = os.open(f"{name}.{slot}", _SLOT, 0o600, dir_fd=fd)
            try:
                fcntl.flock(sfd, fcntl.LOCK_EX)
            finally:
                os.close(sfd)  # (lets the slot go at once)
        except OSError:
            pass
        with self._lock:
            self._waiting.discard((name, slot))
        self.wake()


def release(fds: list[int] | None) -> None:
    """Let lock slots go: unlocked first, for every holder of their open
    file (a process the run left behind has it too), then closed."""
    for fd in fds or ():
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _name_holder(locks_fd: int, slot: str, job_id: str) -> None:
    """Write the id of the job that holds a slot into it (its own open
    file: the flocked one is read-only)."""
    try:
        wfd = os.open(slot, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=locks_fd)
    except OSError:
        return
    try:
        os.ftruncate(wfd, 0)
        os.pwrite(wfd, job_id.encode("ascii"), 0)
    except OSError:
        pass
    finally:
        os.close(wfd)


def holders(order: Order, name: str) -> list[str]:
    """The jobs running with lock ``name`` (what their slots say)."""
    fd = order.sub("locks")
    if fd is None:
        return []
    found = []
    prefix = name + "."
    for slot in sorted(os.listdir(fd)):
        if not slot.startswith(prefix):
            continue
        try:
            sfd = os.open(slot, _OPEN, dir_fd=fd)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(sfd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                continue  # free
            except OSError:
                pass
            text = os.pread(sfd, 200, 0).decode("ascii", "replace").strip()
            if text:
                found.append(text)
        finally:
            os.close(sfd)
    return found


def check_dependencies(state_of: Callable[[str], str | None], job_id: str, deps: list[str]) -> bool:
    """Whether every dependency of a job to enqueue has succeeded (False:
    some are unfinished). InvalidJob for an unknown one, or one that ended
    dead or cancelled."""
    waiting = False
    for dep in deps:
        state = state_of(dep)
        if state is None:
            raise UnmetDependency(f"after: no job {dep} in this spool")
        if state in ("dead", "cancelled"):
            raise UnmetDependency(f"after: job {dep} ended {state}; retry it, or enqueue without it")
        waiting = waiting or state != "done"
    return not waiting


def outcome_state(spool: SpoolDir, history: Callable[[str], dict | None], job_id: str) -> str | None:
    """What became of job ``job_id``: done (succeeded), cancelled, dead,
    unfinished, or None when the spool has no such job (its history included)."""
    where = spool.find((file_name(job_id),))
    if where is None:
        job = history(job_id)
        if job is None:
            return None
        if job.get("state") == "dead":
            return "dead"
        return "cancelled" if job.get("outcome") == "cancelled" else "done"
    state = where[0]
    if state == "done":
        try:
            data, _ = spool.read("done", where[1], 1 << 24)
            job = record.loads(data.decode("utf-8", "surrogateescape"))
        except (OSError, ValueError, InvalidJob):
            return "done"
        return "cancelled" if isinstance(job, dict) and job.get("outcome") == "cancelled" else "done"
    if state == "dead":
        return "dead"
    return "unfinished"


