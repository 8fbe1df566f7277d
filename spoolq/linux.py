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
