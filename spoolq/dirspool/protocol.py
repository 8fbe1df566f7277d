"""The on-disk protocol: the only module that knows paths, locks, fsync and
renames (the names themselves are ``ids``'s).

A spool is a directory; a job is a file; a job's state is the folder its file
is in. Every change of state is one ``rename(2)`` that never replaces a file,
so a crash at any instant leaves every job in exactly one folder. A file in
``cur/`` is always held by an exclusive ``flock`` of the worker running it;
the kernel drops the lock when that worker dies, which is how recovery tells
an abandoned job from a running one.

Everything here works on directory file descriptors (``*at`` calls), so a
worker never re-resolves the spool path per job and never follows a symlink
inside the spool.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import itertools
import os
import stat
import sys
import threading
import time
import zlib
from typing import Callable, Iterator, NamedTuple

from .. import linux, procs
from ..owners import check_owner_file, swappable, user_name, writable_by_others  # noqa: F401 - importable from here too
from ..errors import Busy, Exists, Gone, InsideSpool, NoSuchGroup, NotASpool, NotRegular, SpoolError  # noqa: F401 - importable from here too
from ..ids import (  # noqa: F401 - importable from here too
    REASON_PREFIX,
    STAGED_PREFIX,
    duplicate_name,
    file_name,
    id_of,
    id_problem,
    listed_names,
    new_id,
    staged_intact,
    staged_job_name,
)

STATES = ("new", "cur", "failed", "dead", "done", "held", "waiting")
WAITING = ("new", "failed")
#: Folders a spool made before they existed lacks: made when it is next
#: opened by its owner; a folder missing is an empty one. held/: jobs held
#: until released; waiting/: jobs waiting for dependencies; order/: what
#: orders jobs without reading them (ordering.py).
LATER_FOLDERS = ("held", "waiting", "order")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FOLDERS = ("tmp",) + STATES + ("workers", "order")

#: A record rewritten in place must fit in one page: the kernel copies a
#: write page by page and checks for SIGKILL between pages, so a write that
#: stays within the first page is all-or-nothing for a killed process.
IN_PLACE_LIMIT = 4096
# A read of a small job file from memory takes a few microseconds; one that
# waits for the disk takes 100 or more. Reads slower than this are counted
# (SpoolDir.slow_reads) so a worker can tell a backlog gone cold.
SLOW_READ_NS = 40_000

TMP_MAX_AGE = 36 * 3600  # Maildir's rule: a tmp/ file this old is abandoned.

# The modes of a shared spool (init --group), as docs/design.md's trust
# model states them. Members reach only the drop: they read the root folder
# and the state folders' listings but create nothing there; they create
# files in drop/, which they cannot list (so cannot open, hence cannot lock)
# and whose sticky bit keeps them off each other's files. Every file the
# owner's side locks is 0600, so no member can open it, hence none can lock
# it. workers/ is the owner's alone (its flock is the cron recipe's lock).
SHARED_ROOT = 0o2750
SHARED_FOLDER = 0o2750
SHARED_DROP = 0o3730
WORKERS_MODE = 0o700
SHARED_FILE = 0o640  # config.json, index.db, and the replies to members' requests
OWNER_FILES = ("config.json", "index.db", "index.db-wal", "index.db-shm")
DROP = "drop"
REQUEST_SUFFIX = ".request"
REPLY_SUFFIX = ".reply"




# --------------------------------------------------------------------------
# lock descriptors and fork

# Every descriptor through which this process holds a flock. A forked child
# (a handler with a timeout, or anything a handler forks) shares those locks
# until it closes its copies; if it outlived the worker, the worker's jobs
# would look alive. So every fork closes them in the child.
# Files that will be locked are opened and recorded under _fd_lock, which
# every fork takes first, so no fork can fall between the two.
_held_fds: set[int] = set()
_fd_lock = threading.Lock()


def _open_held(name: str, flags: int, mode: int = 0o777, dir_fd: int | None = None) -> int:
    with _fd_lock:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
        _held_fds.add(fd)
    return fd


def _close_held(fd: int) -> None:
    _held_fds.discard(fd)
    os.close(fd)


def _before_fork() -> None:
    _fd_lock.acquire()


def _after_fork_in_parent() -> None:
    _fd_lock.release()


def _after_fork_in_child() -> None:
    global _fd_lock, _writer_tag
    _fd_lock = threading.Lock()
    for fd in list(_held_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _held_fds.clear()
    _writer_tag = _new_writer_tag()  # last: the locks are let go whatever happens here


def _new_writer_tag() -> str:
    """This process in the names it writes under: its pid and a random
    token, drawn once per process (and again in a forked child), so that a
    recycled pid never meets the names a crashed process left behind."""
    return f"{os.getpid()}.{os.urandom(6).hex()}"


_writer_tag = _new_writer_tag()
_name_seq = itertools.count(1)  # next() is atomic under the GIL: no lock


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _names(dir_fd: int, name: str, st: os.stat_result) -> bool:
    """Whether ``name`` in the folder still names the file ``st`` is of
    (not gone, not replaced by another file since it was opened)."""
    try:
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)


# --------------------------------------------------------------------------
# renames that never replace


_renameat2 = None
_renameat2_state = 0  # 0 unknown, 1 available, -1 unsupported here
# os.fsencode's own encoding, without its checks (two renames a job)
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def _load_renameat2():
    global _renameat2, _renameat2_state
    _renameat2 = linux.renameat2()
    _renameat2_state = 1 if _renameat2 else -1


def rename_noreplace(src_dir: int, src: str, dst_dir: int, dst: str) -> None:
    """Move ``src`` to ``dst`` unless ``dst`` exists (then raise Exists).

    Uses ``renameat2(RENAME_NOREPLACE)`` where the kernel and filesystem have
    it, else ``link`` + ``unlink`` (which cannot replace either). Raises
    FileNotFoundError when ``src`` is gone: a lost race.
    """
    if _renameat2_state == 0:
        _load_renameat2()
    if _renameat2_state == 1:
        func, get_errno = _renameat2
        if func(src_dir, src.encode(_FS_ENCODING, _FS_ERRORS), dst_dir, dst.encode(_FS_ENCODING, _FS_ERRORS), 1) == 0:
            return
        err = get_errno()
        if err == errno.EEXIST:
            raise Exists(dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), src)
        # This filesystem has no RENAME_NOREPLACE: fall through for good.
        globals()["_renameat2_state"] = -1
    try:
        os.link(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
    except FileExistsError:
        raise Exists(dst) from None
    except PermissionError:
        # Directories cannot be hard-linked; they only ever go to dead/.
        st = os.stat(src, dir_fd=src_dir, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise
        try:
            os.stat(dst, dir_fd=dst_dir, follow_symlinks=False)
            raise Exists(dst)
        except FileNotFoundError:
            os.rename(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
        return
    os.unlink(src, dir_fd=src_dir)


_exchange_ok = True


def exchange(dir_fd: int, a: str, b: str) -> bool:
    """Atomically swap two names in one folder (``RENAME_EXCHANGE``).
    Returns False where the kernel or filesystem cannot."""
    global _exchange_ok
    if _renameat2_state == 0:
        _load_renameat2()
    if _renameat2_state != 1 or not _exchange_ok:
        return False
    func, get_errno = _renameat2
    if func(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), 2) == 0:
        return True
    err = get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        _exchange_ok = False
        return False
    raise OSError(err, os.strerror(err), b)


# --------------------------------------------------------------------------
# the spool directory


class Entry(NamedTuple):
    """A waiting file found by a scan, in claim order."""

    due_ns: int
    name: str
    state: str
    mode: int = 0  # st_mode seen by the scan (0: unknown)


class Scan(NamedTuple):
    due: list[Entry]  # due now, sorted by (due time, name), at most `limit`
    next_due_ns: int | None  # earliest due time of the files not due yet
    truncated: bool  # more due files exist than were returned


class SpoolDir:
    """The folders of one spool, held open as directory descriptors."""

    def __init__(self, root: str, fsync: bool = True):
        self.root = os.path.abspath(root)
        self.fsync = fsync
        self._fds: dict[str, int] = {}
        self._open_lock = threading.Lock()
        self.shared = False  # a group-shared spool (see SHARED_ROOT)
        self.owner = -1  # the uid that owns the root folder, once open
        # This user is not the spool's owner: in a shared spool it drops
        # jobs and requests into drop/ (a member; root too, on a spool it
        # does not own) instead of writing in the owner's folders.
        self.drops_in = False
        self.member = False  # a member of a shared spool's group: neither its owner nor root
        self.drops = DropBox(self)  # drop/: members' jobs and requests, the owner's pickup
        self.slow_reads = 0  # job reads that took longer than SLOW_READ_NS (see Held.read)
        self.syncs = GroupSync(self)  # deferred folder syncs and the spare files
        self.reasons = DeadReasons(self)  # why each file in dead/ is there
        self.outputs = LiveOutputs(self)  # out/: running jobs' output

    # -- layout ------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def exists(self) -> bool:
        return os.path.isdir(self.path("new"))

    def init(self, group: str | None = None) -> list[str]:
        """Create the layout (idempotent). With ``group``, a shared spool;
        an older shared spool is converted (see convert_files). Returns
        what it changed in an existing spool, a line each, for the caller
        to report. Never inside another spool (see refuse_inside_spool)."""
        refuse_inside_spool(self.root)
        changed = make_layout(self.root, group)
        self._close_fds()
        self.open()
        if self.shared:
            changed += convert_files(self)
        return changed

    def open(self, create: bool = False) -> None:
        """Open the state folders; with ``create``, make the layout first."""
        if self._fds:
            return
        with self._open_lock:
            if self._fds:
                return
            if create and not self.exists():
                make_layout(self.root, None)
            fds: dict[str, int] = {}
            try:
                _open_folders(self.root, create, fds)
                devs = {os.fstat(fd).st_dev for fd in fds.values()}
                if len(devs) > 1:
                    raise SpoolError(f"the folders of {self.root} are on different filesystems; rename(2) needs one")
                root_st = os.stat(self.root)
                self.shared = bool(root_st.st_mode & stat.S_ISGID and root_st.st_mode & 0o070)
                self.owner = root_st.st_uid
                self.drops_in = self.shared and os.geteuid() != self.owner
                self.member = self.drops_in and os.geteuid() != 0
                if self.shared:
                    fd = _open_drop(self.root, root_st)
                    if fd is not None:
                        fds[DROP] = fd
                _check_ownership(self.root, root_st, {f: os.fstat(fd) for f, fd in fds.items()})
                _check_way_in(self.root, root_st.st_uid)
            except BaseException:
                for fd in fds.values():
                    os.close(fd)
                raise
            self._fds = fds

    def require_owner(self, action: str) -> None:
        """Refuse (SpoolError) unless this user owns the open spool or is
        root: a member of a shared spool's group only enqueues and reads."""
        if os.geteuid() not in (self.owner, 0):
            who = f"{user_name(self.owner)}, who owns {self.root}," + ("" if self.owner == 0 else " or root")
            raise SpoolError(f"only {who} may {action}")

    def has(self, folder: str) -> bool:
        """Whether the spool has the folder (one of LATER_FOLDERS may be missing)."""
        if not self._fds:
            self.open()
        if folder in self._fds:
            return True
        return folder in LATER_FOLDERS and os.path.isdir(os.path.join(self.root, folder)) \
            and not os.path.islink(os.path.join(self.root, folder))

    def fd(self, folder: str) -> int:
        if not self._fds:
            self.open()
        try:
            return self._fds[folder]
        except KeyError:
            if folder in LATER_FOLDERS:
                return self._open_later(folder)
            raise SpoolError(f"{self.root} has no {folder}/ folder; run 'spoolq init'") from None

    def _open_later(self, folder: str) -> int:
        """One of LATER_FOLDERS, opened when first used (and kept)."""
        with self._open_lock:
            if folder not in self._fds:
                try:
                    self._fds[folder] = os.open(os.path.join(self.root, folder), _DIR_FLAGS)
                except OSError:
                    raise SpoolError(f"{self.root} has no {folder}/ folder; run 'spoolq init' as its owner") \
                        from None
            return self._fds[folder]

    @contextlib.contextmanager
    def _looking_in(self, folder: str) -> Iterator[int | None]:
        """A folder's descriptor for one look: one of LATER_FOLDERS not
        opened yet is opened for the look only (None when it is missing)."""
        if not self._fds:
            self.open()
        fd = self._fds.get(folder)
        if fd is not None or folder not in LATER_FOLDERS:
            yield self.fd(folder)
            return
        try:
            fd = os.open(os.path.join(self.root, folder), _DIR_FLAGS)
        except OSError:
            yield None
            return
        try:
            yield fd
        finally:
            os.close(fd)

    def _close_fds(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def close(self) -> None:
        self.drop_spares()
        self._close_fds()

    # -- group commit and spare files (see GroupSync) ---------------------

    def drop_spares(self) -> None:
        """Remove this process's spare files (a clean exit)."""
        self.syncs.drop_spares()

    def remove_stale_spares(self) -> int:
        """Remove what dead processes left of their spare and staged files."""
        return self.syncs.remove_stale_spares()

    def sync_data(self, fds: list[int]) -> None:
        """Make the staged records written to ``fds`` durable."""
        self.syncs.sync_data(fds)

    def sync_deferred(self) -> None:
        """fsync the folders of deferred moves: destinations, then sources."""
        self.syncs.sync_deferred()

    @property
    def has_deferred(self) -> bool:
        return self.syncs.has_deferred

    @property
    def unsynced_since(self) -> float:
        """Monotonic time of the oldest change whose sync is deferred."""
        return self.syncs.unsynced_since

    # -- why a file is in dead/ (see DeadReasons) ---------------------------

    def note_reason(self, name: str, reason: str, st: os.stat_result | None = None) -> None:
        self.reasons.note(name, reason, st)

    def noted_reason(self, name: str) -> str | None:
        return self.reasons.noted(name)

    def remove_stale_reasons(self) -> int:
        return self.reasons.remove_stale()

    #: Every record, registration, spare and reason: only the file's owner
    #: may open it (in a shared spool a member that could open a file could
    #: lock it, and the owner's side relies on the locks of these files).
    file_mode = 0o600

    @property
    def settings_mode(self) -> int:
        """The mode of config.json: the group of a shared spool reads it."""
        return SHARED_FILE if self.shared else 0o600

    @property
    def for_another(self) -> bool:
        """Root working on a spool another user owns: the records it writes
        there are given to that user, so every record in the owner's
        folders is the owner's (see Held.rewrite)."""
        return self.owner not in (0, -1) and os.geteuid() == 0

    def staged_records(self) -> dict[str, list[str]]:
        """The staged records in cur/ (see ``Held.stage``), by the name of
        the job file each belongs to."""
        found: dict[str, list[str]] = {}
        with os.scandir(self.fd("cur")) as it:
            for e in it:
                if e.name.startswith(STAGED_PREFIX):
                    job = staged_job_name(e.name)
                    if job:
                        found.setdefault(job, []).append(e.name)
        return found

    def sync_dir(self, folder: str) -> None:
        if self.fsync:
            os.fsync(self.fd(folder))

    def tmp_name(self, base: str) -> str:
        """A name in tmp/ that no other writer uses: this process's tag and
        a number it never gave before (no system call: an enqueue makes one)."""
        return f"{base}.{_writer_tag}.{next(_name_seq)}"

    # -- enqueue -----------------------------------------------------------

    def _write_tmp(self, name: str, data: bytes, mtime_ns: int | None, owner: int = -1) -> tuple[str, int]:
        """Write ``data`` to a fresh file in tmp/ (given to the user ``owner``
        unless -1); return its tmp name and open fd."""
        tmp = self.tmp_name(name)
        tmp_dir = self.fd("tmp")
        try:
            fd = _open_held(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, self.file_mode, dir_fd=tmp_dir)
        except OSError as e:
            # Not a bare name: say where (a full disk, a read-only one); a
            # refusal is the folder's, which is what the user can change.
            e.filename = self.path("tmp") if isinstance(e, PermissionError) else self.path("tmp", tmp)
            raise
        try:
            if self.shared:
                os.fchmod(fd, self.file_mode)  # whatever the umask
            if owner != -1:
                os.fchown(fd, owner, -1)
            _write_all(fd, data)
            if mtime_ns is not None:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            return tmp, fd
        except BaseException as e:
            _close_held(fd)
            _unlink_quietly(tmp_dir, tmp)
            if isinstance(e, OSError) and not e.filename:
                e.filename = self.path("tmp", tmp)
            raise

    def publish(self, name: str, data: bytes, mtime_ns: int | None = None, folder: str = "new") -> None:
        """Enqueue: write in tmp/, fsync, move into new/ (or ``folder``)
        without replacing, fsync it. Raises Exists if ``new/name`` is taken.
        Only when this returns is the job enqueued; on any error no file is
        left in new/."""
        tmp_dir = self.fd("tmp")
        tmp, fd = self._write_tmp(name, data, mtime_ns)
        try:
            try:
                if self.fsync:
                    os.fsync(fd)
            finally:
                _close_held(fd)
            rename_noreplace(tmp_dir, tmp, self.fd(folder), name)
        except BaseException as e:
            _unlink_quietly(tmp_dir, tmp)
            self._denied_in(e, folder, "tmp")
            raise
        self.sync_dir(folder)

    def publish_many(self, items: list[tuple[str, bytes, int | None]]) -> list[str]:
        """Enqueue many jobs with one sync for all files (group commit).

        Every file is written in tmp/ first; then one ``syncfs`` makes them all
        durable; then each is moved into new/; then one fsync of new/. Returns
        the names published. On an error, files not yet published are removed
        from tmp/ and the exception carries ``published`` (names already in
        new/)."""
        tmp_dir = self.fd("tmp")
        written: list[tuple[str, str]] = []
        published: list[str] = []
        try:
            written = list(zip(self.write_synced(items), (name for name, _data, _mtime in items)))
            new_dir = self.fd("new")
            for tmp, name in written:
                rename_noreplace(tmp_dir, tmp, new_dir, name)
                published.append(name)
        except BaseException as e:
            self._denied_in(e, "new", "tmp")
            done = set(published)
            for tmp, name in written:
                if name not in done:
                    _unlink_quietly(tmp_dir, tmp)
            if published:
                try:
                    self.sync_dir("new")
                except OSError:
                    pass  # the error raised already says the disk is in trouble
            e.published = published  # type: ignore[attr-defined]
            raise
        if published:
            try:
                self.sync_dir("new")
            except OSError as e:  # all are in new/, not surely on disk: say which
                e.published = published  # type: ignore[attr-defined]
                raise
        return published

    def write_synced(self, items: list[tuple[str, bytes, int | None]]) -> list[str]:
        """Write each (name, bytes, mtime) as a new file of this user's in
        tmp/, all made durable by one ``syncfs`` (fsync on); returns their
        names in tmp/, in order. On an error none is left there."""
        tmp_dir = self.fd("tmp")
        written: list[str] = []
        try:
            for name, data, mtime_ns in items:
                tmp, fd = self._write_tmp(name, data, mtime_ns)
                written.append(tmp)
                _close_held(fd)
            if self.fsync and written:
                linux.syncfs(tmp_dir)
        except BaseException:
            for tmp in written:
                _unlink_quietly(tmp_dir, tmp)
            raise
        return written

    def find(self, names: tuple[str, ...], states: tuple[str, ...] = STATES) -> tuple[str, str] | None:
        """(state, name) of the first of ``names`` found in ``states``, in
        that order (one stat each; nothing is listed)."""
        for state in states:
            with self._looking_in(state) as fd:
                if fd is None:
                    continue
                for name in names:
                    try:
                        os.stat(name, dir_fd=fd, follow_symlinks=False)
                        return state, name
                    except FileNotFoundError:
                        continue
        return None

    # -- reading -----------------------------------------------------------

    def names(self, folder: str) -> Iterator[str]:
        """Names in a folder, dot-files left out, in directory order."""
        with self._looking_in(folder) as fd:
            if fd is None:
                return
            with os.scandir(fd) as it:
                names = [entry.name for entry in it if not entry.name.startswith(".")]
        yield from names

    def count(self, folder: str) -> int:
        n = 0
        with self._looking_in(folder) as fd:
            if fd is None:
                return 0
            with os.scandir(fd) as it:
                for entry in it:
                    if entry.name[0] != ".":
                        n += 1
        return n

    def count_apart(self, folder: str) -> int:
        """``count(folder)`` on a descriptor of its own, held only while it
        counts: for a thread beside the worker (a folder's descriptor shares
        its read position with every duplicate). 0 when it cannot be had now."""
        try:
            fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd(folder))
        except (OSError, SpoolError):
            return 0
        try:
            with os.scandir(fd) as it:
                return sum(1 for entry in it if entry.name[0] != ".")
        finally:
            os.close(fd)

    def entries(self, folder: str) -> Iterator[tuple[str, os.stat_result]]:
        """(name, lstat) of each entry of a folder, dot-files left out."""
        found = []
        with self._looking_in(folder) as fd:
            if fd is None:
                return
            for name in self.names(folder):
                try:
                    found.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False)))
                except FileNotFoundError:
                    continue
        yield from found

    def lstat(self, folder: str, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd(folder), follow_symlinks=False)

    def read(self, folder: str, name: str, limit: int) -> tuple[bytes, os.stat_result]:
        """Read at most ``limit`` bytes of a regular file without following
        links or blocking; raise NotRegular for anything else."""
        dir_fd = self.fd(folder)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(kind_of(st.st_mode))
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode):
                raise NotRegular(kind_of(fst.st_mode))
            return _read_upto(fd, limit, fst.st_size), fst
        finally:
            os.close(fd)

    def scan(self, now_ns: int, limit: int, states: tuple[str, ...] = WAITING) -> Scan:
        """The due files of ``states`` in claim order (see scan_due)."""
        return scan_due(self.fd, now_ns, limit, states)

    def prefetch(self, entries: list[Entry]) -> None:
        """Start reading these waiting files into memory (see prefetch)."""
        prefetch(self.fd, entries)

    # -- holding files -----------------------------------------------------

    def hold(self, folder: str, name: str, wait: bool = False, mode: int = 0) -> "Held":
        """Open and exclusively flock ``folder/name``.

        Raises NotRegular for anything but a regular file (nothing is opened
        that could block or follow a link), Busy when another process holds
        the lock, Gone when the name vanished or now names another file.
        ``mode`` is the st_mode a scan just saw, saving a stat; should the
        name have become something else since, O_NOFOLLOW|O_NONBLOCK keep
        the open harmless and the fstat below refuses it."""
        dir_fd = self.fd(folder)
        if not mode:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(kind_of(mode))
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        writable = True
        try:
            fd = _open_held(name, os.O_RDWR | flags, dir_fd=dir_fd)
        except PermissionError:
            fd = _open_held(name, os.O_RDONLY | flags, dir_fd=dir_fd)
            writable = False
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise NotRegular("special file") from None
            if e.errno == errno.EROFS:
                fd = _open_held(name, os.O_RDONLY | flags, dir_fd=dir_fd)
                writable = False
            else:
                raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Busy(name) from None
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode):
                raise NotRegular(kind_of(fst.st_mode))
            if not _names(dir_fd, name, fst):
                raise Gone(name)
        except BaseException:
            _close_held(fd)
            raise
        return Held(self, folder, name, fd, fst, writable)

    def move_entry(self, folder: str, name: str, to_folder: str, to_name: str | None = None) -> str:
        """Move an entry that cannot be locked (symlink, FIFO, directory) as
        itself, never its target. Finds a free name in the destination rather
        than replace anything. Returns the name it got."""
        target = self._free_name(to_folder, to_name or name)
        while True:
            try:
                rename_noreplace(self.fd(folder), name, self.fd(to_folder), target)
                break
            except Exists:
                target = self._free_name(to_folder, to_name or name, force_suffix=True)
        self.sync_dir(to_folder)
        self.sync_dir(folder)
        return target

    def move_squatter_aside(self, folder: str, name: str) -> bool:
        """In a shared spool, move a member's file that took a job's name in
        ``folder`` to dead/ (under a .dup- name, with the reason), so the
        name keeps meaning the job that had it: a member may create any
        name in a state folder, and would otherwise have ``show`` tell its
        file as another user's job. Files of the spool's owner, root or
        this user stay (an operator's copy is theirs to sort out)."""
        if not self.shared:
            return False
        try:
            st = os.stat(name, dir_fd=self.fd(folder), follow_symlinks=False)
        except FileNotFoundError:
            return True  # gone meanwhile: the name is free again
        if st.st_uid in (self.owner, 0, os.geteuid()):
            return False
        try:
            aside = self.move_entry(folder, name, "dead", duplicate_name(name))
        except PermissionError:
            # A member's directory moves to another folder only for a user
            # who may write the directory itself: the job takes a .dup- name.
            return False
        self.note_reason(aside, f"a file of {user_name(st.st_uid)} in {folder}/ under the name of a job, "
                                "moved aside when that job got there", st)
        return True

    def _free_name(self, folder: str, name: str, force_suffix: bool = False) -> str:
        if not force_suffix:
            try:
                os.stat(name, dir_fd=self.fd(folder), follow_symlinks=False)
            except FileNotFoundError:
                return name
        return duplicate_name(name)

    def remove_tmp(self, older_than_s: float = TMP_MAX_AGE) -> int:
        """Delete tmp/ files not touched for ``older_than_s`` seconds."""
        limit = time.time() - older_than_s
        removed = 0
        tmp_dir = self.fd("tmp")
        for name, st in list(self.entries("tmp")):
            if max(st.st_mtime, st.st_atime) < limit:
                try:
                    if stat.S_ISDIR(st.st_mode):
                        continue
                    os.unlink(name, dir_fd=tmp_dir)
                    removed += 1
                except FileNotFoundError:
                    pass
        if removed:
            self.sync_dir("tmp")
        return removed

    # -- small private files (config, worker registrations) ---------------

    def create_held(self, folder: str, name: str, data: bytes) -> "Held":
        """Create ``folder/name`` already locked: it is written and flocked
        under a dot-name (ignored by everyone) and only then renamed into
        view, so nobody ever sees it unlocked."""
        dir_fd = self.fd(folder)
        tmp = "." + self.tmp_name(name)
        mode = self.file_mode
        fd = _open_held(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        try:
            if self.shared:
                os.fchmod(fd, mode)  # whatever the umask
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_all(fd, data)
            rename_noreplace(dir_fd, tmp, dir_fd, name)
        except BaseException:
            _close_held(fd)
            _unlink_quietly(dir_fd, tmp)
            raise
        return Held(self, folder, name, fd, os.fstat(fd), True)

    def is_locked(self, folder: str, name: str) -> bool | None:
        """Whether someone holds ``folder/name`` (None if it is gone). Takes
        only a shared lock for an instant, so it never looks like an owner."""
        try:
            fd = _open_held(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd(folder))
        except FileNotFoundError:
            return None
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            _close_held(fd)

    def _denied_in(self, error: BaseException, *folders: str) -> None:
        """A permission error from a move or a create, whose file name is a
        bare or temporary one, said of the folder that refuses it (the first
        of ``folders`` this user cannot write, "" for the spool root)."""
        if not isinstance(error, PermissionError):
            return
        paths = [self.path(f) if f else self.root for f in folders]
        error.filename = next((p for p in paths if not os.access(p, os.W_OK | os.X_OK)), paths[0])

    def remove_file(self, folder: str, name: str) -> None:
        """Remove ``folder/name`` if it is there."""
        _unlink_quietly(self.fd(folder), name)

    def replace_file(self, folder: str | None, name: str, data: bytes, mode: int | None = None) -> None:
        """Atomically replace a small file (tmp + fsync + rename), with
        ``mode`` whatever the umask; on an error the tmp file is removed."""
        dir_fd = self.fd(folder) if folder else os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            tmp = "." + self.tmp_name(name)
            mode = mode or self.file_mode
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
            try:
                try:
                    os.fchmod(fd, mode)
                    _write_all(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                _unlink_quietly(dir_fd, tmp)
                raise
            os.fsync(dir_fd)
        except PermissionError as e:
            self._denied_in(e, folder or "")
            raise
        finally:
            if not folder:
                os.close(dir_fd)


# -- scanning the waiting folders

def scan_due(dir_of: Callable[[str], int], now_ns: int, limit: int, states: tuple[str, ...] = WAITING) -> Scan:
    """List the waiting folders once (``dir_of(folder)`` is its descriptor) and return
    the due files in claim order: by (due time = mtime, name). Memory stays bounded by ``limit``
    however many files wait; ``truncated`` says a further scan is needed."""
    if limit < 1:
        raise ValueError("a scan keeps at least one entry")
    due: list[Entry] = []
    next_due: int | None = None
    truncated = False
    cap = limit + max(1, limit // 4)  # memory stays near `limit` entries whatever waits
    # Once `due` has overflowed, only entries that sort before the last
    # one kept can still make the cut: most of a large backlog is turned
    # away by one integer comparison instead of being kept and sorted.
    cut_mtime: int | None = None
    cut_rest = ("", "")  # (name, state) of the last entry kept
    # A scan creates an object or two per waiting file, none of which can
    # form a cycle: with a million waiting, the cyclic collector would
    # only walk the kept entries again and again (a quarter of the time
    # of a pass over a million entries). This pauses it process-wide,
    # handler threads included, for one pass.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for state in states:
            dir_fd = dir_of(state)
            with os.scandir(dir_fd) as it:
                for entry in it:
                    name = entry.name
                    if name[0] == ".":
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    mtime = st.st_mtime_ns
                    if mtime > now_ns:
                        if next_due is None or mtime < next_due:
                            next_due = mtime
                        continue
                    if cut_mtime is not None and (
                        mtime > cut_mtime or (mtime == cut_mtime and (name, state) >= cut_rest)
                    ):
                        continue
                    due.append(Entry(mtime, name, state, st.st_mode))
                    if len(due) >= cap:
                        due.sort()
                        del due[limit:]
                        last = due[-1]
                        cut_mtime, cut_rest = last.due_ns, (last.name, last.state)
                        truncated = True
    finally:
        if collecting:
            gc.enable()
    due.sort()
    if len(due) > limit:
        del due[limit:]
        truncated = True
    return Scan(due, next_due, truncated)

def prefetch(dir_of: Callable[[str], int], entries: list[Entry]) -> None:
    """Ask the kernel to start reading these waiting files into memory
    (``POSIX_FADV_WILLNEED`` returns at once; the reads run on their own),
    so that claiming them later does not wait for the disk one file at
    a time. Only for regular files the scan saw; opened without following
    links or blocking, read by nobody, closed at once, errors ignored."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for entry in entries:
        if not stat.S_ISREG(entry.mode):
            continue
        try:
            fd = os.open(entry.name, flags, dir_fd=dir_of(entry.state))
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


class GroupSync:
    """What group commit defers for one spool (SpoolDir.syncs): the folders
    whose fsync after a move waits for the next commit, and the spare files
    records are rewritten into (an old record's inode becomes a spare only
    once the folders that named it are synced)."""

    def __init__(self, spool: "SpoolDir"):
        self.spool = spool
        self._lock = threading.Lock()
        self._spares: list[tuple[str, int]] = []  # locked dot-files in cur/ to rewrite into
        self._retired: list[tuple[str, int]] = []  # old inodes waiting for a sync before reuse
        # Each is an open descriptor: kept to a sixteenth and a quarter of the
        # open-file limit (64 and 256 under the usual 1024), so that a low
        # limit leaves room for the jobs' own files.
        limit = procs.open_file_limit()
        self._spares_max = max(1, min(64, limit // 16))
        self._retired_max = max(1, min(256, limit // 4))
        # Folders renamed into/out of whose fsync was deferred: destinations
        # are synced before sources, so a power cut can leave a job in two
        # folders (run again) but never in none. (Where renames are
        # journaled, as on ext4 by default, a rename reaches the disk whole
        # anyway. Without a journal the order is all there is, and the
        # kernel's own writeback, or a move made by another thread between
        # the two fsyncs, can still undo it: such a filesystem needs fsck after
        # a power cut, which puts a file found in no folder in lost+found.)
        self._unsynced_dst: set[str] = set()
        self._unsynced_src: set[str] = set()
        self.unsynced_since = 0.0  # monotonic time of the oldest deferred change

    def defer(self, to_folder: str, from_folder: str) -> None:
        """A move from ``from_folder`` to ``to_folder`` whose syncs wait for sync_deferred."""
        with self._lock:
            if not self.has_deferred:
                self.unsynced_since = time.monotonic()
            self._unsynced_dst.add(to_folder)
            self._unsynced_src.add(from_folder)

    def take_spare(self) -> tuple[str, int] | None:
        """A locked file in cur/ under a dot-name (ignored by everyone), to
        write a record into and swap in. Creates one when none is left (in
        tmp/, locked, then renamed into cur/, so it is never seen unlocked);
        None where RENAME_EXCHANGE is not available or creating fails."""
        if not _exchange_ok or _renameat2_state == -1:
            return None
        with self._lock:
            if self._spares:
                return self._spares.pop()
        tmp_dir = self.spool.fd("tmp")
        tmp = self.spool.tmp_name("spare")
        try:
            fd = _open_held(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, self.spool.file_mode, dir_fd=tmp_dir)
        except OSError:
            return None
        name = ".spare." + tmp[len("spare."):]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if self.spool.shared:
                os.fchmod(fd, self.spool.file_mode)
            os.rename(tmp, name, src_dir_fd=tmp_dir, dst_dir_fd=self.spool.fd("cur"))
        except OSError:
            _close_held(fd)
            _unlink_quietly(tmp_dir, tmp)
            return None
        return name, fd

    def give_spare(self, name: str, fd: int) -> None:
        with self._lock:
            if len(self._spares) < self._spares_max:
                self._spares.append((name, fd))
                return
        self._discard_spare(name, fd)

    def _discard_spare(self, name: str, fd: int) -> None:
        _unlink_quietly(self.spool.fd("cur"), name)
        _close_held(fd)

    def retire_inode(self, name: str, fd: int) -> None:
        """An old record's inode, now under a spare name in cur/, to reuse.
        With fsync on it may only be overwritten once the folders that named
        it are synced (else a power cut could leave its old name pointing at
        another job's record): it waits for ``sync_deferred``."""
        if not self.spool.fsync:
            self.give_spare(name, fd)
            return
        with self._lock:
            if len(self._retired) < self._retired_max:
                if not self.has_deferred:
                    self.unsynced_since = time.monotonic()
                self._retired.append((name, fd))
                return
        self._discard_spare(name, fd)

    def drop_spares(self) -> None:
        """Remove this process's spare files (a clean exit)."""
        with self._lock:
            spares, self._spares = self._spares + self._retired, []
            self._retired = []
        for name, fd in spares:
            if self.spool._fds:
                _unlink_quietly(self.spool._fds["cur"], name)
            _close_held(fd)

    def remove_stale_spares(self) -> int:
        """Remove spare files that dead processes left in cur/ (and staged
        records whose job is no longer there for recovery to complete), and
        the half-made registrations (dot-files) a crash can leave in workers/."""
        removed = 0
        with os.scandir(self.spool.fd("cur")) as it:
            listed = [e.name for e in it]
        jobs = {name for name in listed if not name.startswith(".")}
        names = [name for name in listed if name.startswith(".spare.")
                 or (name.startswith(STAGED_PREFIX) and staged_job_name(name) not in jobs)]
        for name in names:
            if self.spool.is_locked("cur", name) is False:
                _unlink_quietly(self.spool.fd("cur"), name)
                removed += 1
        if "workers" in self.spool._fds:
            old = time.time() - 60
            with os.scandir(self.spool.fd("workers")) as it:
                stale = [e.name for e in it if e.name.startswith(".") and _changed_before(e, old)]
            for name in stale:
                if self.spool.is_locked("workers", name) is False:
                    _unlink_quietly(self.spool.fd("workers"), name)
                    removed += 1
        return removed

    def sync_data(self, fds: list[int]) -> None:
        """Make the staged records written to ``fds`` durable: an fdatasync
        for one, else one syncfs of the spool's filesystem for them all (a
        few hundred microseconds, against as much for each fdatasync; it also
        flushes whatever else is dirty on that filesystem)."""
        if not self.spool.fsync or not fds:
            return
        if len(fds) == 1:
            os.fdatasync(fds[0])
        else:
            linux.syncfs(self.spool.fd("cur"))

    def sync_deferred(self) -> None:
        """fsync the folders of deferred moves: destinations, then sources."""
        with self._lock:
            dst, src = self._unsynced_dst, self._unsynced_src
            self._unsynced_dst, self._unsynced_src = set(), set()
        with self._lock:
            retired, self._retired = self._retired, []
        try:
            for folder in sorted(dst):
                os.fsync(self.spool.fd(folder))
            for folder in sorted(src - dst):
                os.fsync(self.spool.fd(folder))
            for folder in sorted(src & dst):
                os.fsync(self.spool.fd(folder))
            if retired:
                # A retired inode was named in new/ or failed/ (until its claim)
                # and in cur/ (until the exchange): once those folders are on
                # disk it is named nowhere else, and may be overwritten.
                for folder in ("new", "failed", "cur"):
                    if folder not in src and folder not in dst:
                        os.fsync(self.spool.fd(folder))
        except BaseException:
            for name, fd in retired:
                self._discard_spare(name, fd)
            raise
        for name, fd in retired:
            self.give_spare(name, fd)

    @property
    def has_deferred(self) -> bool:
        return bool(self._unsynced_dst or self._unsynced_src or self._retired)


class DeadReasons:
    """Why each file in dead/ is there (SpoolDir.reasons), kept in a
    dot-file beside it so the file's own bytes are never touched."""

    def __init__(self, spool: "SpoolDir"):
        self.spool = spool

    def remove_stale(self) -> int:
        """Remove the reasons kept (see note) for dead files that
        were moved away by hand: one listing of dead/. Only those a minute
        old: one written just now may be for a file that is moving in."""
        old = time.time() - 60
        with os.scandir(self.spool.fd("dead")) as it:
            listed = list(it)
        files = {e.name for e in listed if not e.name.startswith(".")}
        stale = [e.name for e in listed if e.name.startswith(REASON_PREFIX)
                 and e.name[len(REASON_PREFIX):] not in files and _changed_before(e, old)]
        for name in stale:
            _unlink_quietly(self.spool.fd("dead"), name)
        return len(stale)

    def note(self, name: str, reason: str, st: os.stat_result | None = None) -> None:
        """Keep why ``dead/name`` (the file ``st`` is of) went to dead/, so
        that it is still told after the file is changed by hand. The file's
        own bytes are never touched: the reason goes in a dot-file beside it,
        naming the file's inode, so that another file given the name later
        does not inherit it. Written after the move and not synced: without
        it (a crash in between, a full disk) the reason is worked out again
        from the file, as it can be until the file is changed."""
        dead_dir, tmp_dir = self.spool.fd("dead"), self.spool.fd("tmp")
        tmp = self.spool.tmp_name("reason")
        try:
            if st is None:
                st = os.stat(name, dir_fd=dead_dir, follow_symlinks=False)
            data = f"{_identity(dead_dir, name, st)}\n{reason}".encode("utf-8", "surrogatepass")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, self.spool.file_mode, dir_fd=tmp_dir)
            try:
                if self.spool.shared:
                    os.fchmod(fd, self.spool.file_mode)
                _write_all(fd, data)
            finally:
                os.close(fd)
            os.rename(tmp, REASON_PREFIX + name, src_dir_fd=tmp_dir, dst_dir_fd=dead_dir)
        except OSError:
            _unlink_quietly(tmp_dir, tmp)

    def noted(self, name: str) -> str | None:
        """The reason kept for ``dead/name`` (see note), if one was
        kept for the file that has the name now."""
        try:
            st = os.stat(name, dir_fd=self.spool.fd("dead"), follow_symlinks=False)
            data, kept = self.spool.read("dead", REASON_PREFIX + name, 1 << 16)
        except (OSError, NotRegular):
            return None
        if kept.st_uid not in (0, self.spool.owner):
            # Only workers and recovery note reasons, and only root and the
            # owner run them; any member may make a dot-file in dead/.
            return None
        head, newline, reason = data.decode("utf-8", "surrogatepass").partition("\n")
        if not newline or head != _identity(self.spool.fd("dead"), name, st):
            return None
        return reason


class DropBox:
    """The drop folder of a shared spool (SpoolDir.drops), Postfix's
    maildrop: members (and root, on a spool it does not own) create files
    in it, each its own, and cannot list it; the owner's side lists it,
    reads each file once without locking it (a member may open its own
    file and lock it, so nothing here relies on a lock of one) and copies
    what it accepts into new/ as records of its own."""

    def __init__(self, spool: "SpoolDir"):
        self.spool = spool

    # -- a member's side ----------------------------------------------------

    def put(self, items: list[tuple[str, bytes, int | None]]) -> list[str]:
        """Drop files: each written under a dot-name (which the owner's side
        ignores), readable by the group whatever the umask, its mtime the due
        time; all made durable with one sync; each renamed to its name
        without replacing (Exists if taken); then one more sync makes the
        renames durable (a member may not open drop/ to fsync it). Returns
        the names dropped; on an error the exception carries ``published``."""
        sp = self.spool
        dir_fd = sp.fd(DROP)
        written: list[tuple[str, str, int]] = []
        published: list[str] = []
        try:
            for name, data, mtime_ns in items:
                tmp = "." + sp.tmp_name(name)
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 SHARED_FILE, dir_fd=dir_fd)
                except PermissionError as e:
                    e.filename = sp.path(DROP)
                    raise
                written.append((tmp, name, fd))
                os.fchmod(fd, SHARED_FILE)
                _write_all(fd, data)
                if mtime_ns is not None:
                    os.utime(fd, ns=(mtime_ns, mtime_ns))
            if sp.fsync and written:
                linux.syncfs(written[0][2])
            for tmp, name, _fd in written:
                rename_noreplace(dir_fd, tmp, dir_fd, name)
                published.append(name)
            if sp.fsync and published:
                linux.syncfs(written[0][2])
        except BaseException as e:
            done = set(published)
            for tmp, name, _fd in written:
                if name not in done:
                    _unlink_quietly(dir_fd, tmp)
            e.published = published  # type: ignore[attr-defined]
            raise
        finally:
            for _tmp, _name, fd in written:
                os.close(fd)
        return published

    def request(self, data: bytes) -> str:
        """Drop a request (``<token>.request``); returns its token, which
        names the reply. The token is random: no member can guess
        another's, and none can list drop/ to find one."""
        token = os.urandom(12).hex()
        self.put([(token + REQUEST_SUFFIX, data, None)])
        return token

    def reply(self, token: str) -> bytes | None:
        """The reply to request ``token``, if the owner's side has written
        one (a file another member made under the name is none)."""
        try:
            fd = os.open(token + REPLY_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.spool.fd(DROP))
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in (self.spool.owner, 0):
                return None
            return _read_upto(fd, 1 << 20, st.st_size)
        finally:
            os.close(fd)

    # -- the owner's side ---------------------------------------------------

    def lock(self) -> bool:
        """Take the pickup lock (the drop folder's flock, which no member
        can open, so none can take): one process of the owner's side picks
        up at a time. False if another holds it."""
        try:
            fcntl.flock(self.spool.fd(DROP), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def unlock(self) -> None:
        fcntl.flock(self.spool.fd(DROP), fcntl.LOCK_UN)

    def names(self) -> list[str]:
        """Every name in drop/, dot-names (files still being written) included."""
        with os.scandir(self.spool.fd(DROP)) as it:
            return [e.name for e in it]

    def open(self, name: str) -> tuple[int, os.stat_result]:
        """Open a dropped file to read it, without following a link or
        blocking, and without locking it: (descriptor, its fstat). Raises
        NotRegular for anything but a regular file."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.spool.fd(DROP))
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise NotRegular("special file") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NotRegular(kind_of(st.st_mode))
        return fd, st

    @staticmethod
    def read(fd: int, limit: int, size: int) -> bytes:
        """At most ``limit`` bytes of a dropped file opened by ``open``."""
        return _read_upto(fd, limit, size)

    @staticmethod
    def identity(fd: int, st: os.stat_result) -> str:
        """What tells a dropped file from any other given its name later:
        inode, device and birth time (kept in the record as ``dropped``)."""
        return f"{st.st_ino} {st.st_dev} {linux.birth_ns(fd, '')}"

    def copy_in(self, records: list[tuple[str, bytes, int]]) -> list[bool]:
        """Put records (name, bytes, due time) into new/ as new files of this
        user: all written in tmp/, made durable with one sync, each renamed
        into new/ without replacing, new/ synced once. Returns for each
        whether it got its name (False: the name was taken meanwhile)."""
        sp = self.spool
        tmp_dir = sp.fd("tmp")
        written = sp.write_synced(records)
        placed: list[bool] = []
        try:
            new_dir = sp.fd("new")
            for (name, _data, _due), tmp in zip(records, written):
                try:
                    rename_noreplace(tmp_dir, tmp, new_dir, name)
                    placed.append(True)
                except Exists:
                    _unlink_quietly(tmp_dir, tmp)
                    placed.append(False)
        except BaseException:
            for tmp in written[len(placed):]:
                _unlink_quietly(tmp_dir, tmp)
            raise
        if any(placed):
            sp.sync_dir("new")
        return placed

    def unlink(self, name: str) -> None:
        """Remove a dropped file (the owner of drop/ may, sticky bit or not)."""
        _unlink_quietly(self.spool.fd(DROP), name)

    def to_dead(self, name: str, to_name: str | None = None) -> str:
        """Move an entry of drop/ to dead/ as it is (one rename, not synced:
        lost to a power cut, it is only looked at again). Returns its name
        in dead/. PermissionError for a member's folder, which only a user
        who may write the folder itself can move to another one."""
        sp = self.spool
        target = sp._free_name("dead", to_name or name)
        while True:
            try:
                rename_noreplace(sp.fd(DROP), name, sp.fd("dead"), target)
                return target
            except Exists:
                target = sp._free_name("dead", to_name or name, force_suffix=True)

    def answer(self, token: str, data: bytes) -> None:
        """Write the reply to request ``token``: a file of this user the
        group may read, renamed into drop/ over whatever has its name."""
        sp = self.spool
        tmp, fd = sp._write_tmp("reply", data, None)
        try:
            os.fchmod(fd, SHARED_FILE)
            os.rename(tmp, token + REPLY_SUFFIX, src_dir_fd=sp.fd("tmp"), dst_dir_fd=sp.fd(DROP))
        except BaseException:
            _unlink_quietly(sp.fd("tmp"), tmp)
            raise
        finally:
            _close_held(fd)

    def answered(self, token: str) -> bool:
        """Whether this user has written the reply to request ``token``."""
        try:
            st = os.stat(token + REPLY_SUFFIX, dir_fd=self.spool.fd(DROP), follow_symlinks=False)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()

    def remove_stale(self, older_than_s: float = TMP_MAX_AGE) -> int:
        """Remove dot-files (drops never finished: their writer died) not
        changed for ``older_than_s`` seconds."""
        limit = time.time() - older_than_s
        removed = 0
        dir_fd = self.spool.fd(DROP)
        for name in self.names():
            if not name.startswith("."):
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode) and max(st.st_mtime, st.st_atime) < limit:
                    os.unlink(name, dir_fd=dir_fd)
                    removed += 1
            except OSError:
                pass
        return removed


OUT = "out"
OUT_STREAMS = ("stdout", "stderr")
PUNCH_SLACK = 0  # a live output file is cut back to log_limit (a page more at most) at each write


class LiveOutputs:
    """``out/``: what running jobs wrote, ``out/ID.stdout`` and
    ``out/ID.stderr``, written by the worker running the job (its pump,
    see liveout.py) and removed when the run ends, or by the recovery that
    finds its job no longer in cur/. The owner's folder, made on first
    use: ``0700`` and files ``0600`` in a private spool; in a shared one
    ``2750`` and ``0640``, so the group reads a running job's output as it
    reads a finished one's in the history. Each file is bounded: bytes more
    than log_limit before its end are let go (a hole: the size stays, so
    a reader's offsets stay valid)."""

    def __init__(self, spool: SpoolDir):
        self.spool = spool
        self._dir: int | None = None
        self._files: dict[tuple[str, str], list[int]] = {}  # (job, stream) -> [fd, freed up to]
        self._held: dict[tuple[str, str], int] = {}  # a follower's open files (see read)
        self._lock = threading.Lock()

    def _folder(self, create: bool) -> int | None:
        """out/, opened without following links (made if missing and
        ``create``); None when missing. Refused unless it is the owner's
        and no one else may write it."""
        if self._dir is None:
            mode = SHARED_FOLDER if self.spool.shared else 0o700
            self._dir = owner_folder(self.spool, OUT, mode, create, 0o022, "folder")
        return self._dir

    # -- the worker's side ------------------------------------------------------

    def put(self, job_id: str, stream: str, start: int, data: bytes, limit: int) -> None:
        """Write bytes ``start``.. of a stream of a running job's output."""
        with self._lock:
            entry = self._files.get((job_id, stream))
            if entry is None:
                folder = self._folder(True)
                fd = os.open(f"{job_id}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=folder)
                if self.spool.shared:
                    os.fchmod(fd, SHARED_FILE)
                entry = self._files[(job_id, stream)] = [fd, 0]
        fd = entry[0]
        if data:
            _write_all_at(fd, data, start)
        cut = (start + len(data) - limit) & ~4095
        if cut > entry[1] + PUNCH_SLACK:
            linux.punch_hole(fd, cut)
            entry[1] = cut

    def remove(self, job_id: str) -> None:
        """The run ended: its files go."""
        with self._lock:
            for stream in OUT_STREAMS:
                entry = self._files.pop((job_id, stream), None)
                if entry is not None:
                    os.close(entry[0])
                    _unlink_quietly(self._dir, f"{job_id}.{stream}")

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._files.values():
                os.close(fd)
            self._files.clear()
            for fd in self._held.values():
                os.close(fd)
            self._held.clear()
            if self._dir is not None:
                os.close(self._dir)
                self._dir = None

    def remove_orphans(self) -> int:
        """Remove the files of jobs no longer in cur/ (their worker died, or
        died between a run's end and the removal). out/ is listed before
        cur/: a file made after its listing is a run's that began since."""
        folder = self._folder(False)
        if folder is None:
            return 0
        names = os.listdir(folder)
        if not names:
            return 0
        running = {id_of(name) for name in self.spool.names("cur")}
        removed = 0
        for name in names:
            job_id, _, stream = name.rpartition(".")
            if stream in OUT_STREAMS and job_id in running:
                continue
            _unlink_quietly(folder, name)
            removed += 1
        return removed

    # -- readers ---------------------------------------------------------------

    def read(self, job_id: str, stream: str, offset: int, hold: bool = False,
             most: int = 1 << 20) -> tuple[bytes, int] | None:
        """What is kept of a stream of a running job from ``offset`` on (a
        part let go is skipped: the bytes begin at ``next - len(bytes)``),
        and the offset after them; None when it has no live output. With
        ``hold`` the file stays open for the next read, so that a follower
        reads the last bytes pushed as the run ended, after its removal
        (then None once they are read)."""
        try:
            folder = self._folder(False)
        except FileNotFoundError:
            return None
        if folder is None:
            return None
        held = self._held.get((job_id, stream))
        fd = self._open_live(folder, f"{job_id}.{stream}")
        if fd is None and held is None:
            return None
        removed = fd is None
        if fd is not None and held is not None and os.path.samestat(os.fstat(fd), os.fstat(held)):
            os.close(fd)
            fd = None
        if fd is None:
            got = _read_from(held, offset, most)
            if removed and not got[0]:  # removed (the run ended) and read to its end
                os.close(self._held.pop((job_id, stream)))
                return None
            return got
        if held is not None:  # a later run's file
            os.close(self._held.pop((job_id, stream)))
        if hold:
            self._held[(job_id, stream)] = fd
            return _read_from(fd, offset, most)
        try:
            return _read_from(fd, offset, most)
        finally:
            os.close(fd)

    def _open_live(self, folder: int, name: str) -> int | None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except (FileNotFoundError, ValueError):
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != self.spool.owner or st.st_nlink != 1:
            os.close(fd)
            return None
        return fd


def _read_from(fd: int, offset: int, most: int) -> tuple[bytes, int]:
    """What a live output file holds from ``offset`` on (skipping a hole)."""
    size = os.fstat(fd).st_size
    start = min(offset, size)
    if start < size:
        try:
            start = os.lseek(fd, start, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            start = size
    data = os.pread(fd, min(most, size - start), start) if start < size else b""
    return data, start + len(data)


def owner_folder(spool: SpoolDir, name: str, mode: int, create: bool, loose: int, what: str) -> int | None:
    """Folder ``name`` of the spool's root, one the owner's side makes on
    first use (with ``mode``), opened without following links; None when
    it is missing and not ``create``. Refused (PermissionError) unless it
    is the owner's and its mode has none of the bits ``loose``."""
    root = os.open(spool.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
        except FileNotFoundError:
            if not create:
                return None
            fd, made = _make_folder(name, mode, root, spool.path(name))
            if made:
                os.fchmod(fd, mode)
    finally:
        os.close(root)
    st = os.fstat(fd)
    if st.st_uid != spool.owner or stat.S_IMODE(st.st_mode) & loose:
        os.close(fd)
        raise PermissionError(f"{spool.path(name)} is not the spool owner's {what}")
    return fd


def convert_files(spool: SpoolDir) -> list[str]:
    """Bring the files of a shared spool made by an older layout to the
    trust model (docs/design.md, "Security"), through descriptors and
    without following links: the owner's files (records, reasons, spares,
    registrations) 0600; root's given to the owner when root runs this;
    members' waiting jobs (new/, failed/, and cur/, whose workers were
    stopped first) moved into drop/ for the owner's side to pick up again;
    members' files in done/ moved to dead/; anything else of a member's
    (in tmp/ or workers/, dot-files) removed. Returns what it did, a line
    each (nothing for a spool that needs nothing)."""
    me, owner = os.geteuid(), spool.owner
    counts = dict.fromkeys(("tightened", "given", "left_root", "to_drop", "to_dead", "removed", "folders"), 0)
    for folder in ("tmp",) + STATES + ("workers",):
        if folder not in spool._fds and not (folder in LATER_FOLDERS and spool.has(folder)):
            continue
        dir_fd = spool.fd(folder)
        with os.scandir(dir_fd) as it:
            names = [e.name for e in it]
        for name in names:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if st.st_uid in (owner, 0):
                if stat.S_ISREG(st.st_mode) and (stat.S_IMODE(st.st_mode) != spool.file_mode or st.st_uid != owner):
                    counts[_make_owners(dir_fd, name, owner, me)] += 1
                continue
            if stat.S_ISDIR(st.st_mode):
                counts["folders"] += 1  # only a user who may write a folder moves it to another: left
                continue
            try:
                if name.startswith(".") or folder in ("tmp", "workers"):
                    os.unlink(name, dir_fd=dir_fd)
                    counts["removed"] += 1
                elif folder in ("new", "failed", "cur") and stat.S_ISREG(st.st_mode):
                    spool.move_entry(folder, name, DROP)
                    counts["to_drop"] += 1
                elif folder != "dead":
                    spool.move_entry(folder, name, "dead")
                    counts["to_dead"] += 1
            except FileNotFoundError:
                continue
    name = user_name(owner)
    said = {
        "tightened": f"made {{}} of {name} readable by {name} alone (0600)",
        "given": f"gave {{}} root wrote to {name} (0600)",
        "left_root": f"left {{}} root wrote as they are: run this as root to give them to {name}",
        "to_drop": "moved {} of members (waiting in new/, failed/ or cur/) into drop/, for a worker to pick up",
        "to_dead": "moved {} of members from done/ to dead/",
        "removed": "removed {} of members from tmp/ and workers/, and members' dot-files",
        "folders": "left {} members made in the spool (remove them as root)",
    }
    return [said[key].format(_count(n, "folder" if key == "folders" else "job" if key == "to_drop" else "file"))
            for key, n in counts.items() if n]


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _make_owners(dir_fd: int, name: str, owner: int, me: int) -> str:
    """Make the file ``name`` (the owner's or root's) the owner's, 0600;
    which of convert_files' counts it adds to."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return "left_root"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "tightened"
        given = st.st_uid != owner
        if given and me != 0:
            return "left_root"
        if given:
            os.fchown(fd, owner, -1)
        os.fchmod(fd, SpoolDir.file_mode)
        return "given" if given else "tightened"
    except PermissionError:
        return "left_root"
    finally:
        os.close(fd)


class Held:
    """A job file held under an exclusive flock by this process.

    The lock follows the inode, so it moves with the file through renames.
    Whoever holds it may rewrite the record and move the file; nobody else
    can claim, cancel, retry or recover it meanwhile."""

    __slots__ = ("spool", "folder", "name", "fd", "st", "size", "writable", "staged")

    def __init__(self, spool: SpoolDir, folder: str, name: str, fd: int, st: os.stat_result, writable: bool):
        self.spool = spool
        self.folder = folder
        self.name = name
        self.fd = fd
        self.st = st  # as found when locked: owner, links, mtime (the due time)
        self.size = st.st_size  # the current size (it changes as we rewrite)
        self.writable = writable
        self.staged: tuple[str, int, bytes] | None = None  # see stage()
        _held_fds.add(fd)

    def read(self, limit: int) -> bytes:
        began = time.perf_counter_ns()
        data = _read_upto(self.fd, limit, self.size)
        if time.perf_counter_ns() - began > SLOW_READ_NS:
            self.spool.slow_reads += 1  # it waited for the disk (or lost its CPU meanwhile)
        return data

    def still_named(self) -> os.stat_result | None:
        """The locked file's stat if ``folder/name`` still names it; None
        if the name is gone or now names another file (say an editor that
        saved by rename while we held the old one). One stat of the name:
        when it is our inode (``st`` always describes the descriptor held),
        that stat is the file's own, current mtime included."""
        try:
            now = os.stat(self.name, dir_fd=self.spool.fd(self.folder), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return now if (now.st_ino, now.st_dev) == (self.st.st_ino, self.st.st_dev) else None

    def rewrite(self, data: bytes, durable: bool = True, mtime_ns: int | None = None, for_owner: bool = False) -> None:
        """Replace the file's content with ``data``, keeping the lock.

        With fsync off, a record that fits in one page is written in place:
        no new file, nothing for ext4 to allocate. It is padded with spaces to
        the old length (JSON allows trailing white space), so one ``pwrite``
        is the whole change and a process killed at any instant leaves the
        old record or the new one. Otherwise (fsync on, large records, files
        we may not write): write a new file in tmp/, fsync it, lock it, and
        rename it over the old name, so a crash or power cut leaves one
        whole record and the file is never unlocked. ``for_owner``: a new
        file root writes in a spool another user owns is that user's (see
        SpoolDir.for_another)."""
        old_size = self.size
        sync = self.spool.fsync and durable
        if (
            mtime_ns is None
            and self.writable
            and not sync
            and self.st.st_nlink == 1
            and max(len(data), old_size) <= IN_PLACE_LIMIT
        ):
            if len(data) < old_size:
                data = data + b" " * (old_size - len(data))
            if os.pwrite(self.fd, data, 0) != len(data):
                raise OSError(errno.EIO, "short write rewriting a job record")
            self.size = len(data)
            return
        sp = self.spool
        if mtime_ns is None and self.folder == "cur" and self._rewrite_by_exchange(data, sync):
            return
        # (With mtime_ns the new record and its mtime arrive in one rename.)
        tmp_dir = sp.fd("tmp")
        tmp, fd = sp._write_tmp(self.name, data, mtime_ns, sp.owner if for_owner and sp.for_another else -1)
        try:
            if sync:
                os.fsync(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self.name, src_dir_fd=tmp_dir, dst_dir_fd=sp.fd(self.folder))
        except BaseException:
            _close_held(fd)
            _unlink_quietly(tmp_dir, tmp)
            raise
        _close_held(self.fd)  # the old inode is gone from the folder; drop its lock
        self.fd = fd
        self.writable = True
        self.st = os.fstat(fd)
        self.size = self.st.st_size

    def _rewrite_by_exchange(self, data: bytes, sync: bool) -> bool:
        """Write the record into a spare file we hold locked, fsync it, and
        swap it with our name in one RENAME_EXCHANGE: the name always holds a
        whole, locked record, and no inode is created or freed (on ext4
        without a journal a create after many deletes is slow). The old
        inode becomes the next spare when it is plainly ours."""
        filled = self._fill_spare(data)
        if filled is None:
            return False
        name, fd, data = filled
        try:
            if sync:
                os.fdatasync(fd)
        except BaseException:
            self.spool.syncs._discard_spare(name, fd)
            raise
        if not self._swap_in(name, fd, data):
            self.spool.syncs.give_spare(name, fd)
            return False
        return True

    def stage(self, data: bytes) -> bool:
        """Write the next record of a job in cur/ into a spare, unsynced, and
        name it ``.staged.<name>.<crc32>``, where recovery finds it should
        this process die: the record is then whole (the CRC says so), so the
        run's outcome is kept rather than run again. ``SpoolDir.sync_data``
        makes any number of staged records durable with one sync, and then
        ``commit_staged`` swaps each in. False where no spare can be had
        (the caller rewrites the usual way)."""
        if self.folder != "cur" or self.staged is not None:
            return False
        filled = self._fill_spare(data)
        if filled is None:
            return False
        name, fd, data = filled
        staged = f"{STAGED_PREFIX}{self.name}.{zlib.crc32(data):08x}"
        cur = self.spool.fd("cur")
        try:
            os.rename(name, staged, src_dir_fd=cur, dst_dir_fd=cur)
        except BaseException:
            self.spool.syncs._discard_spare(name, fd)
            raise
        self.staged = (staged, fd, data)
        return True

    def commit_staged(self) -> None:
        """Swap the staged record in (after ``SpoolDir.sync_data``)."""
        assert self.staged is not None
        name, fd, data = self.staged
        self.staged = None
        if not self._swap_in(name, fd, data, keep=True):  # no exchange after all: the usual way
            self.spool.syncs._discard_spare(name, fd)
            self.rewrite(data)

    def drop_staged(self) -> None:
        """Forget a staged record that will not be committed: its file stays
        for recovery, unlocked once this process closes it."""
        if self.staged is not None:
            _close_held(self.staged[1])
            self.staged = None

    def _fill_spare(self, data: bytes) -> tuple[str, int, bytes] | None:
        """A spare holding ``data`` (padded as written); None if none can be had."""
        sp = self.spool
        spare = sp.syncs.take_spare()
        if spare is None:
            return None
        name, fd = spare
        try:
            # Overwrite without truncating, padded with spaces to the old size
            # (JSON allows trailing white space): the blocks stay allocated, the
            # size stays put, so fdatasync writes the data and nothing else. A
            # spare much larger than the record (after a big one) is cut down.
            size = os.fstat(fd).st_size
            if size > max(IN_PLACE_LIMIT, 2 * len(data)):
                os.ftruncate(fd, len(data))
            elif len(data) < size:
                data = data + b" " * (size - len(data))
            _write_all_at(fd, data)
        except BaseException:
            sp.syncs._discard_spare(name, fd)
            raise
        return name, fd, data

    def _swap_in(self, name: str, fd: int, data: bytes, keep: bool = False) -> bool:
        """Exchange the spare ``name`` (holding ``data``) with our name.
        False where the filesystem cannot (the spare is still the caller's);
        if the exchange fails, the spare is closed, and removed unless
        ``keep`` (a staged record that recovery may still need)."""
        sp = self.spool
        cur = sp.fd("cur")
        try:
            if not exchange(cur, name, self.name):
                return False
        except BaseException:
            if keep:
                _close_held(fd)
            else:
                sp.syncs._discard_spare(name, fd)
            raise
        old_fd, old_writable = self.fd, self.writable
        self.fd = fd
        self.st = os.fstat(fd)
        self.size = len(data)
        self.writable = True
        old = os.fstat(old_fd)
        if old_writable and old.st_uid == os.geteuid() and old.st_nlink == 1 and stat.S_ISREG(old.st_mode):
            try:
                os.fchmod(old_fd, sp.file_mode)
            except OSError:
                pass
            sp.syncs.retire_inode(name, old_fd)
        else:  # someone else's file, read-only, or linked elsewhere: let it go
            _unlink_quietly(cur, name)
            _close_held(old_fd)
        return True

    def unlink(self) -> None:
        """Remove the held file (its lock goes with the last descriptor)."""
        try:
            os.unlink(self.name, dir_fd=self.spool.fd(self.folder))
        except FileNotFoundError:
            pass
        if self.folder == "dead":
            _unlink_quietly(self.spool.fd("dead"), REASON_PREFIX + self.name)
        self.release()

    def set_mtime(self, mtime_ns: int) -> None:
        os.utime(self.fd, ns=(mtime_ns, mtime_ns))

    def move(self, to_folder: str, to_name: str | None = None, keep_name: bool = False, defer_sync: bool = False) -> str:
        """Rename into ``to_folder`` without replacing anything. A taken name
        raises Exists with ``keep_name``, else gets a ``.dup-XXXX`` suffix
        rather than be overwritten. fsyncs the destination, then the source
        folder (with ``defer_sync``, later, in ``SpoolDir.sync_deferred``).
        Returns the new name."""
        sp = self.spool
        target = to_name or self.name
        src_dir = sp.fd(self.folder)
        dst_dir = sp.fd(to_folder)
        asides = 3  # a squatter that keeps coming back gets the job a .dup- name after all
        while True:
            try:
                rename_noreplace(src_dir, self.name, dst_dir, target)
                break
            except Exists:
                if keep_name:
                    raise
                if asides and target == (to_name or self.name) and sp.move_squatter_aside(to_folder, target):
                    asides -= 1
                    continue
                target = sp._free_name(to_folder, to_name or self.name, force_suffix=True)
        if self.folder == "dead":  # its reason stays behind no longer (see note_reason)
            _unlink_quietly(src_dir, REASON_PREFIX + self.name)
        # Where the file is now, before a sync that may fail: a caller told
        # of that failure must not think the job is still where it was.
        from_folder, self.folder, self.name = self.folder, to_folder, target
        if sp.fsync:
            if defer_sync:
                sp.syncs.defer(to_folder, from_folder)
            else:
                os.fsync(dst_dir)
                if src_dir != dst_dir:
                    os.fsync(src_dir)
        return target

    def release(self) -> None:
        if self.fd >= 0:
            _close_held(self.fd)
            self.fd = -1


# --------------------------------------------------------------------------
# helpers


def _changed_before(entry: os.DirEntry, when: float) -> bool:
    """Whether a listed file was last changed before ``when``; a file gone
    since the listing (another worker's registration, renamed into place as
    this one starts) was not."""
    try:
        return entry.stat(follow_symlinks=False).st_mtime < when
    except FileNotFoundError:
        return False


def _identity(dir_fd: int, name: str, st: os.stat_result) -> str:
    """What tells a file from another given its name later, yet stays the
    same while it is written to: its inode, and the time it was created
    (an inode number is often reused at once once its file is removed)."""
    return f"{st.st_ino} {st.st_dev} {linux.birth_ns(dir_fd, name)}"



def _make_folder(name: str, mode: int, dir_fd: int | None, shown: str | None = None) -> tuple[int, bool]:
    """(descriptor, created) of folder ``name`` (relative to ``dir_fd``),
    made if missing and opened without following a symlink."""
    shown = shown or name
    try:
        os.mkdir(name, mode & 0o777, dir_fd=dir_fd)
        created = True
    except FileExistsError:
        created = False
    except PermissionError as e:
        e.filename = shown  # said as "permission denied: PATH"
        raise
    except OSError as e:
        raise SpoolError(f"cannot create {shown}: {e.strerror}") from None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except PermissionError as e:
        e.filename = shown
        raise
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(shown):
            raise SpoolError(f"{shown} is a symlink; spool folders must be real directories") from None
        if e.errno == errno.ENOTDIR:
            raise SpoolError(f"{shown} exists and is not a directory") from None
        raise SpoolError(f"cannot open {shown}: {e.strerror}") from None
    return fd, created

def make_layout(path: str, group: str | None) -> list[str]:
    """Make the folders of the spool at ``path`` and set their owner and
    modes through descriptors opened with O_NOFOLLOW: a member of the group
    who swaps a folder for a symlink between two calls gets a refusal,
    never a chown or chmod of the symlink's target (init often runs as
    root). With ``group``, a shared spool, whose owner must be in the group
    (it reads the jobs members drop through it): checked before anything
    is made. Returns what it changed in an existing spool, a line each."""
    gid = -1
    if group is not None:
        gid = _group_id(group)
    refuse_swappable_way(path)  # before anything is looked up through the path, made or changed
    # A root given as a symlink (./spool -> /data/spool) is the folder it
    # names; from there on nothing is followed.
    root = os.path.realpath(path) if os.path.islink(path) else path
    if not os.path.isdir(root):
        refuse_non_directory(path)  # a dangling symlink: nothing is made at its target
    if group is not None:
        _check_owner_in_group(root, group, gid)
    changed = []
    root_fd, created = _make_folder(root, 0o700 if group is None else SHARED_ROOT, None)
    try:
        st = os.fstat(root_fd)
        old = stat.S_IMODE(st.st_mode)
        shared = group is not None or bool(old & stat.S_ISGID and old & 0o070)
        if shared:
            want = SHARED_ROOT  # a shared spool stays shared, with the modes of the trust model
            if gid == -1:
                gid = st.st_gid  # (init without --group keeps the group it has)
        else:
            want = 0o700 if created or old & 0o077 else old
        if group is not None:
            os.fchown(root_fd, -1, gid)
        if want != old or group is not None:
            os.fchmod(root_fd, want)  # after fchown, which may clear setgid
        if want != old and not created:
            changed.append(f"set the mode of {path} to {want:04o} (it was {old:04o})")
        # Root making the layout in a folder another user owns makes it that user's spool.
        uid = st.st_uid if os.geteuid() == 0 and st.st_uid != 0 else -1
        was_spool = _is_dir(root_fd, "new")  # (an older spool, to convert: say what is made for it)
        for folder in FOLDERS + ((DROP,) if shared else ()):
            fmode = _folder_mode(folder, shared)
            shown = os.path.join(root, folder)
            fd, made = _make_folder(folder, fmode, root_fd, shown)
            try:
                before = stat.S_IMODE(os.fstat(fd).st_mode)
                if group is not None or uid != -1 or (shared and made):
                    os.fchown(fd, uid, gid)
                if shared or made:
                    os.fchmod(fd, fmode)
                if made and was_spool:
                    changed.append(f"made {shown}/ ({fmode:04o})" + (": members drop their jobs and requests there"
                                                                    if folder == DROP else ""))
                elif not made and shared and before != fmode:
                    changed.append(f"set the mode of {shown}/ to {fmode:04o} (it was {before:04o})")
            finally:
                os.close(fd)
        if shared:
            for name in OWNER_FILES:
                _tighten_file(root_fd, name, SHARED_FILE, gid)
    finally:
        os.close(root_fd)
    return changed


def _is_dir(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _make_later_folder(root: str, folder: str) -> None:
    """Make a folder of LATER_FOLDERS in a spool made before it, as its
    owner only, with the mode of its kind; leave it out when it cannot be made."""
    try:
        root_st = os.stat(root)
        if root_st.st_uid != os.geteuid():
            return
        shared = bool(root_st.st_mode & stat.S_ISGID and root_st.st_mode & 0o070)
        mode = _folder_mode(folder, shared)
        try:
            os.mkdir(os.path.join(root, folder), mode)
            os.chmod(os.path.join(root, folder), mode, follow_symlinks=False)
        except FileExistsError:
            pass
    except OSError:
        return


def _folder_mode(folder: str, shared: bool) -> int:
    if folder == "order":
        return 0o700
    if folder == "workers" or not shared:
        return WORKERS_MODE if folder == "workers" else 0o700
    return SHARED_DROP if folder == DROP else SHARED_FOLDER


def _group_id(group: str) -> int:
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        try:
            return grp.getgrgid(int(group)).gr_gid
        except (KeyError, ValueError):
            raise NoSuchGroup(f"--group: no such group: {group!r}") from None


def _check_owner_in_group(root: str, group: str, gid: int) -> None:
    """Refuse (SpoolError) a shared spool whose owner is not in its group:
    the owner's workers read the jobs members drop through the group, and
    would leave every one of them waiting."""
    import grp
    import pwd

    try:
        owner = os.stat(root).st_uid if os.path.isdir(root) else os.geteuid()
    except OSError:
        owner = os.geteuid()
    if owner == 0:
        return  # root reads every file
    try:
        user = pwd.getpwuid(owner)
    except KeyError:
        return  # no name to check membership by; the worker says so if it cannot read
    if user.pw_gid == gid or user.pw_name in grp.getgrgid(gid).gr_mem:
        return
    name = grp.getgrgid(gid).gr_name
    raise SpoolError(f"{user.pw_name}, who owns the spool {root}, is not in group {name}: its workers could not read "
                     f"the jobs members drop; add it (usermod -aG {name} {user.pw_name}), then run this again "
                     f"(and restart its workers)")


def _tighten_file(root_fd: int, name: str, mode: int, gid: int) -> None:
    """Give the owner's file ``name`` in the root folder ``mode`` (and
    group ``gid`` unless -1), through a descriptor; a symlink or another
    user's file is left for opening to refuse."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid in (os.geteuid(), 0):
            if gid != -1:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _fix_for(root: str, root_st: os.stat_result) -> str:
    """The command that sets a spool's modes right, for an error to end with."""
    if root_st.st_mode & stat.S_ISGID and root_st.st_mode & 0o070:
        import grp

        try:
            group = grp.getgrgid(root_st.st_gid).gr_name
        except KeyError:
            group = str(root_st.st_gid)
        return f"run 'spoolq -s {root} init --group {group}' as {user_name(root_st.st_uid)}"
    return f"run 'spoolq -s {root} init' as {user_name(root_st.st_uid)}"


def _check_ownership(root: str, root_st: os.stat_result, folders: dict[str, os.stat_result]) -> None:
    """Refuse a spool that is not the caller's to use, or that others could
    have changed (docs/design.md, "Security"): its root folder belongs to
    this user or root, or it is a shared spool of a group this user is in;
    no folder is writable by others, nor by the group except a state
    folder with the sticky bit; every folder belongs to the spool's owner
    or root."""
    me, owner, mode = os.geteuid(), root_st.st_uid, root_st.st_mode
    shared = bool(mode & stat.S_ISGID and mode & 0o070)
    if owner not in (me, 0) and me != 0:
        member = root_st.st_gid == os.getegid() or root_st.st_gid in os.getgroups()
        if not (shared and member):
            raise SpoolError(f"{root} belongs to {user_name(owner)}: spoolq uses a spool of your own, root's, "
                             "or a shared one of a group you are in")
    who = writable_by_others(root_st)
    if who == "every user":
        raise SpoolError(f"{root} is writable by every user (mode {stat.S_IMODE(mode):o}); {_fix_for(root, root_st)}")
    if who:
        raise SpoolError(f"{root} is writable by its group (mode {stat.S_IMODE(mode):o}), so a member could replace "
                         f"its settings; {_fix_for(root, root_st)}")
    if shared and DROP not in folders:
        raise SpoolError(f"{root} is a shared spool of an older layout, in which members write into the owner's "
                         f"folders; convert it: stop its workers, then {_fix_for(root, root_st)}")
    for folder, st in folders.items():
        path = os.path.join(root, folder)
        if st.st_uid not in (owner, 0):
            raise SpoolError(f"{path} belongs to {user_name(st.st_uid)}, not to the spool's owner "
                             f"{user_name(owner)}; {_fix_for(root, root_st)}")
        mode = stat.S_IMODE(st.st_mode)
        if folder == DROP:
            # The one folder members write: each its own files (sticky), and
            # none may list it, or it could open it, and so lock it.
            if mode & 0o007 or mode & 0o070 != 0o030 or not mode & stat.S_ISVTX:
                raise SpoolError(f"{path} has mode {mode:o}, not {SHARED_DROP:o}: members must be able to create "
                                 f"files there and nothing more; {_fix_for(root, root_st)}")
            continue
        who = writable_by_others(st)
        if who:
            raise SpoolError(f"{path} is writable by {who} (mode {mode:o}), so one user could "
                             f"move or remove another's files; {_fix_for(root, root_st)}")
        if shared and folder == "workers" and mode & 0o077:
            raise SpoolError(f"{path} can be opened by others (mode {mode:o}), so a member could lock it; "
                             f"{_fix_for(root, root_st)}")


def _open_folders(root: str, create: bool, fds: dict[str, int]) -> None:
    """Open the folders of the spool at ``root`` into ``fds`` (by name),
    never through a symlink; workers/ is made if missing with ``create``,
    and left out where this user may not open it (a member of a shared
    spool: it is the owner's alone)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    for folder in FOLDERS:
        path = os.path.join(root, folder)
        try:
            if folder in LATER_FOLDERS:  # opened when first used (SpoolDir.fd): a worker's descriptors are counted
                if not os.path.isdir(path):
                    _make_later_folder(root, folder)
                continue
            fds[folder] = os.open(path, flags)
        except FileNotFoundError:
            if folder == "workers" and create:
                refuse_swappable_way(root)
                os.mkdir(path, WORKERS_MODE)
                fds[folder] = os.open(path, flags)
            elif folder == "workers":
                continue
            elif folder in LATER_FOLDERS:
                _make_later_folder(root, folder)
            elif not os.path.isdir(os.path.join(root, "new")):
                raise NotASpool(root) from None
            else:
                raise SpoolError(f"{root} is not a spool (no {folder}/); run 'spoolq init'") from None
        except NotADirectoryError:
            if os.path.islink(path):
                raise SpoolError(f"{path} is a symlink; spool folders must be real directories") from None
            raise SpoolError(f"{path} is not a directory") from None
        except PermissionError as e:
            if folder == "workers" or folder in LATER_FOLDERS:
                continue
            e.filename = path  # said as "permission denied: PATH", the folder to look at
            raise
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise SpoolError(f"{path} is a symlink; spool folders must be real directories") from None
            raise SpoolError(f"cannot open {path}: {e.strerror}") from None


def _open_drop(root: str, root_st: os.stat_result) -> int | None:
    """A descriptor of a shared spool's drop/ (None if it has none). A
    member may not read drop/ (so it cannot list it, nor open it, nor lock
    it); it gets an O_PATH descriptor, enough to create and rename its own
    files in it by name."""
    path = os.path.join(root, DROP)
    flags = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, os.O_RDONLY | flags)
    except FileNotFoundError:
        return None
    except PermissionError:
        return os.open(path, os.O_PATH | flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SpoolError(f"{path} is a symlink; spool folders must be real directories") from None
        raise SpoolError(f"cannot open {path}: {e.strerror}") from None


def _check_way_in(root: str, spool_owner: int) -> None:
    """Refuse a spool reached through a folder or symlink that someone other
    than this user, the spool's owner or root could change: config.json,
    index.db and the folders are opened by path, so whoever may swap a
    folder on the way could point a worker at a spool of their own, or make
    it write there."""
    _refuse_way(root, {os.geteuid(), 0, spool_owner})


def _refuse_way(path: str, trusted: set[int]) -> None:
    """Refuse (SpoolError) ``path`` if a user outside ``trusted`` could swap
    a folder or symlink on the way to it (see owners.swappable)."""
    found = swappable(path, trusted)
    if found is None:
        return
    way, st = found
    if st.st_uid not in trusted:
        raise SpoolError(f"{path} is reached through {way}, which {user_name(st.st_uid)} owns and could "
                         "swap; use a path through folders of yours, the spool's owner's or root's")
    raise SpoolError(f"{path} is reached through {way}, which others can write (mode "
                     f"{stat.S_IMODE(st.st_mode):o}) and so swap; use a path through folders "
                     "only their owner can change")


def refuse_swappable_way(path: str) -> None:
    """Refuse (SpoolError) to make or change a spool at ``path`` that
    someone else could point elsewhere, before anything is made or changed
    (init often runs as root): ``path`` itself when it is a symlink not of
    this user's or root's, or a folder or symlink on the way to it (see
    owners.swappable) that a user other than this one, root or the owner
    of the folder it names could change."""
    me = os.geteuid()
    try:
        st = os.lstat(path)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode) and st.st_uid not in (me, 0):
        raise SpoolError(f"{path} is a symlink of {user_name(st.st_uid)}, who could point it anywhere; "
                         "use the folder it names, or a symlink of yours or root's")
    trusted = {me, 0}
    try:
        trusted.add(os.stat(path).st_uid)  # an existing root folder: its owner's spool
    except OSError:
        pass
    _refuse_way(path, trusted)


def is_layout(path: str) -> bool:
    """Whether ``path`` holds a spool's folders (all of them: a Maildir,
    with only tmp/ new/ cur/, is not a spool). workers/ and drop/ are not
    asked for: an older spool may lack them. Only stat: a member of a
    shared spool, who may not list every folder, is told it is in a spool."""
    return all(os.path.isdir(os.path.join(path, folder)) for folder in ("new", "tmp", "cur", "failed", "dead", "done"))


def refuse_inside_spool(path: str) -> None:
    """InsideSpool when ``path`` lies inside a spool: in one of its folders,
    or anywhere below its root but a dot-folder there (where ``spoolq
    bench`` keeps its scratch spools). One stat per folder above ``path``
    that is no spool."""
    path = os.path.abspath(path)
    below, parent = os.path.basename(path), os.path.dirname(path)
    while below:
        if not below.startswith(".") and is_layout(parent):
            raise InsideSpool(path, parent, below if below in FOLDERS + (DROP,) else None)
        up = os.path.dirname(parent)
        if up == parent:
            return
        below, parent = f"{os.path.basename(parent)}/{below}", up


def refuse_non_directory(path: str) -> None:
    """SpoolError when ``path`` exists but is not a directory (say a file
    given where the spool should be)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        if os.path.islink(path) and not os.path.exists(path):
            # Nothing is made at a link's target: the user says where the spool goes.
            raise SpoolError(f"{path} is a symlink to {os.readlink(path)}, which does not exist; "
                             "create that folder first (mkdir), then run spoolq again")
        raise SpoolError(f"{path} exists and is not a directory")


def kind_of(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _write_all(fd: int, data: bytes) -> None:
    n = os.write(fd, data)
    if n == len(data):
        return  # the usual case: a job file is small
    if n <= 0:
        raise OSError(errno.EIO, "write returned no progress")
    view = memoryview(data)[n:]
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write returned no progress")
        view = view[n:]


def _write_all_at(fd: int, data: bytes, at: int = 0) -> None:
    pos = os.pwrite(fd, data, at)
    if pos == len(data):
        return  # the usual case: a record is small
    if pos <= 0:
        raise OSError(errno.EIO, "write returned no progress")
    view = memoryview(data)
    while pos < len(data):
        n = os.pwrite(fd, view[pos:], at + pos)
        if n <= 0:
            raise OSError(errno.EIO, "write returned no progress")
        pos += n


def _read_upto(fd: int, limit: int, size_hint: int | None = None) -> bytes:
    """Read at most ``limit`` bytes from the start of ``fd``. With the size
    from fstat as a hint, a whole small file costs one read of its size
    (asking for a megabyte would allocate one)."""
    if size_hint is None:
        size_hint = os.fstat(fd).st_size
    want = min(limit, size_hint + 1)
    data = os.pread(fd, want, 0)
    if len(data) < want or len(data) >= limit:
        return data
    chunks = [data]  # the file grew since fstat: read on to the limit
    pos = len(data)
    while pos < limit:
        chunk = os.pread(fd, min(limit - pos, 1 << 20), pos)
        if not chunk:
            break
        chunks.append(chunk)
        pos += len(chunk)
    return b"".join(chunks)


def _unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
