"""Job ids and the file names they become: what a valid id is, new ids,
a job's file name and back, the name a duplicate is moved to, and the
names of the records staged beside a job and of the reasons kept in dead/.

Pure functions of names (no file is touched), so any module may use them.
"""

from __future__ import annotations

import os
import re
import threading
import time
import zlib

_ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}\Z")

#: A record written ahead of its swap into cur/ (``Held.stage``):
#: ``.staged.<job file name>.<crc32 of its content, 8 hex digits>``.
STAGED_PREFIX = ".staged."

#: Why a file went to dead/, kept from that moment on whatever is later
#: written into it: ``dead/.reason.<its name>``, holding the identity of the
#: file it is for (``<inode> <device> <birth time in ns>``), a newline, and
#: the reason.
REASON_PREFIX = ".reason."


def id_problem(job_id: object) -> str | None:
    """Why ``job_id`` is not a valid id, or None if it is."""
    if not isinstance(job_id, str):
        return "id must be a string"
    # The gravest reason first: '../x' is refused for its path, not its dot.
    if "/" in job_id:
        return f"id {job_id!r} contains '/'"
    if ".." in job_id:
        return f"id {job_id!r} contains '..'"
    if not _ID_RE.match(job_id):
        if job_id.startswith("."):
            return f"id {job_id!r} starts with a dot"
        return f"id {job_id!r} is not 1-128 characters of A-Z a-z 0-9 . _ -"
    return None


def listed_names(job_id: object) -> tuple[str, ...]:
    """The names a file that listings show as ``job_id`` may have, when that
    is no valid id (no '/', no NUL, no dot-file, no longer than a name can
    be): such a file is looked up by that name, only in the state folders."""
    if not isinstance(job_id, str) or not job_id or "/" in job_id or "\x00" in job_id or job_id.startswith("."):
        return ()
    return tuple(n for n in (file_name(job_id), job_id) if len(os.fsencode(n)) <= 255)


def id_of(name: str) -> str:
    """The job id that a file name stands for: the name without ``.json``."""
    return name[:-5] if name.endswith(".json") and len(name) > 5 else name


def file_name(job_id: str) -> str:
    return job_id + ".json"


def duplicate_name(name: str) -> str:
    """A fresh name for a second file claiming an id that is taken: the id
    with a random ``.dup-XXXXXXXX`` suffix (still a valid id)."""
    base = id_of(name)[:110]
    ext = ".json" if name.endswith(".json") else ""
    return f"{base}.dup-{os.urandom(4).hex()}{ext}"


_last_us = 0
_id_lock = threading.Lock()


def new_id() -> str:
    """A fresh id: microseconds since the epoch in hex, then 64 random bits.

    Ids sort in creation order (strictly within a process, to the microsecond
    across processes) and are unique across processes and hosts by the random
    part, with no coordination.
    """
    global _last_us
    with _id_lock:
        us = time.time_ns() // 1000
        if us <= _last_us:
            us = _last_us + 1
        _last_us = us
    return f"{us:014x}.{os.urandom(8).hex()}"


def staged_job_name(name: str) -> str | None:
    """The job file a staged record's name belongs to (None if malformed)."""
    base, dot, crc = name[len(STAGED_PREFIX):].rpartition(".")
    if not name.startswith(STAGED_PREFIX) or not dot or len(crc) != 8 or not base:
        return None
    return base


def staged_intact(name: str, data: bytes) -> bool:
    """Whether ``data`` is whole: its CRC is the one its staged name carries
    (a power cut can leave the name on disk without the data)."""
    return name.endswith(f".{zlib.crc32(data):08x}")
