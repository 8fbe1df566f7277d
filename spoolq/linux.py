"""The Linux calls that Python's os module lacks, made through ctypes:
renameat2, statx's birth time, syncfs, fallocate's hole punching,
prctl(PR_SET_PDEATHSIG), and raising an exception into another thread.

One C library handle serves them all, loaded on the first call (ctypes is
not imported by a program that only enqueues). Each call says what it does
where the kernel or C library lacks it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_ctypes: Any = None
_libc: Any = None  # None: not loaded yet; False: none to be had
_funcs: dict[str, Any] = {}


def _load() -> None:
    global _ctypes, _libc
    if _libc is None:
        try:
            import ctypes  # imported here: start-up speed (only a worker or a fresh spool needs it)

            _ctypes = ctypes
            _libc = ctypes.CDLL(None, use_errno=True)
        except (ImportError, OSError):
            _libc = False


def _func(name: str, argtypes: list | None = None, restype: Any = None) -> Any:
    """libc's ``name`` with its types set, or False where there is none."""
    func = _funcs.get(name)
    if func is not None:
        return func
    _load()
    func = False
    if _libc:
        try:
            func = getattr(_libc, name)
            if argtypes is not None:
                func.argtypes = [getattr(_ctypes, t) for t in argtypes]
            if restype is not None:
                func.restype = getattr(_ctypes, restype)
        except AttributeError:
            func = False
    _funcs[name] = func
    return func


def renameat2() -> tuple[Any, Any] | None:
    """``(renameat2, get_errno)``, or None where the C library has no
    renameat2: the caller calls it with (src_dir, src, dst_dir, dst, flags)
    on every rename, so it gets the function itself."""
    func = _func("renameat2", ["c_int", "c_char_p", "c_int", "c_char_p", "c_uint"], "c_int")
    return (func, _ctypes.get_errno) if func else None


def birth_ns(dir_fd: int, name: str) -> int:
    """When the file was created (statx's btime), in ns; 0 where the kernel,
    C library or filesystem do not say. An empty ``name`` means the file
    ``dir_fd`` itself is open on."""
    func = _func("statx", ["c_int", "c_char_p", "c_int", "c_uint", "c_char_p"], "c_int")
    if not func:
        return 0
    buf = _ctypes.create_string_buffer(256)  # struct statx
    # AT_SYMLINK_NOFOLLOW (| AT_EMPTY_PATH), STATX_BTIME; stx_mask at 0, stx_btime (s64 sec, u32 nsec) at 80
    if func(dir_fd, os.fsencode(name), 0x100 | (0x1000 if not name else 0), 0x800, buf) != 0:
        return 0
    raw = buf.raw
    if not int.from_bytes(raw[0:4], sys.byteorder) & 0x800:
        return 0
    return int.from_bytes(raw[80:88], sys.byteorder, signed=True) * 1_000_000_000 + int.from_bytes(raw[88:92], sys.byteorder)


def syncfs(fd: int) -> None:
    """Flush the whole filesystem holding ``fd`` (one sync for many files);
    sync(2) of every filesystem where there is no syncfs."""
    func = _func("syncfs", ["c_int"], "c_int")
    if not func:
        os.sync()
        return
    if func(fd) != 0:
        err = _ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def punch_hole(fd: int, length: int) -> None:
    """Free the first ``length`` bytes of a file, keeping its size (reads of
    the hole give zeros); nothing where fallocate is not to be had."""
    func = _func("fallocate", ["c_int", "c_int", "c_long", "c_long"])
    if func:
        func(fd, 0x01 | 0x02, 0, length)  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


def load_prctl() -> None:
    """Resolve prctl(2) now: a parent that forks often does it once, not in
    every child, where resolving it costs a fraction of a millisecond."""
    _func("prctl")


def set_death_signal(sig: int) -> None:
    """Have this process sent ``sig`` when its parent dies
    (prctl(PR_SET_PDEATHSIG)); nothing where prctl is not to be had."""
    func = _func("prctl")
    if func:
        PR_SET_PDEATHSIG = 1
        func(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def raise_in_thread(thread_id: int, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in the Python thread ``thread_id`` the next time
    it runs Python code (PyThreadState_SetAsyncExc)."""
    _load()
    if _ctypes is None:
        return
    _ctypes.pythonapi.PyThreadState_SetAsyncExc(_ctypes.c_ulong(thread_id), _ctypes.py_object(exc_type))


class Inotify:
    """An inotify instance (inotify_init1 and inotify_add_watch through
    ctypes; the events are read from its descriptor with os.read). Waiting
    on it is a select() on one descriptor: no thread, no polling."""

    CREATE, DELETE, MOVED_TO, MOVED_FROM = 0x100, 0x200, 0x80, 0x40
    MODIFY, ATTRIB, CLOSE_WRITE, CLOSE_NOWRITE = 0x2, 0x4, 0x8, 0x10
    DELETE_SELF, MOVE_SELF, Q_OVERFLOW = 0x400, 0x800, 0x4000
    ARRIVALS = CREATE | MOVED_TO

    def __init__(self) -> None:
        init = _func("inotify_init1", ["c_int"], "c_int")
        if not init:
            raise OSError(38, "inotify is not available")
        fd = init(os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            err = _ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd = fd
        self.watches: dict[int, str] = {}  # watch descriptor -> the label given to add

    def add(self, path: str, mask: int, label: str) -> None:
        """Watch ``path`` (a folder or a file) for the events in ``mask``."""
        add = _func("inotify_add_watch", ["c_int", "c_char_p", "c_uint"], "c_int")
        wd = add(self.fd, os.fsencode(path), mask)
        if wd < 0:
            err = _ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        self.watches[wd] = label

    def fileno(self) -> int:
        return self.fd

    def read(self, timeout: float | None) -> list[tuple[str, int, str]] | None:
        """The events that came, as (label, mask, name), after waiting up to
        ``timeout`` seconds (None: for ever) for the first; [] on timeout;
        None when the queue overflowed (events were lost: look again)."""
        import select

        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        events: list[tuple[str, int, str]] = []
        overflow = False
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            pos = 0
            while pos + 16 <= len(data):
                wd, mask, _cookie, size = (int.from_bytes(data[pos + i:pos + i + 4], sys.byteorder) for i in (0, 4, 8, 12))
                name = data[pos + 16:pos + 16 + size].split(b"\0", 1)[0]
                pos += 16 + size
                if mask & self.Q_OVERFLOW:
                    overflow = True
                    continue
                events.append((self.watches.get(wd, ""), mask, os.fsdecode(name)))
        return None if overflow else events

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
