"""Who may have written a file: the checks of the shared spool's trust
model (docs/design.md, "Security") that more than one module applies."""

from __future__ import annotations

import os
import stat

from .errors import SpoolError


def user_name(uid: int) -> str:
    """A uid as its user's name, else as the number."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def writable_by_others(st: os.stat_result) -> str | None:
    """Who besides the owner (and root) may write the file or folder ``st``
    is of: "every user", "its group", or None. A group that holds no user
    but the owner (a user private group, as Debian and Ubuntu give every
    user, whose umask then is 002) lets no one else in."""
    if st.st_mode & 0o002:
        return "every user"
    if st.st_mode & 0o020 and not _private_group(st):
        return "its group"
    return None


def _private_group(st: os.stat_result) -> bool:
    import grp
    import pwd

    try:
        owner = pwd.getpwuid(st.st_uid)
        group = grp.getgrgid(st.st_gid)
    except KeyError:
        return False
    return owner.pw_gid == st.st_gid and all(member == owner.pw_name for member in group.gr_mem)


def swappable(path: str, trusted: set[int]) -> tuple[str, os.stat_result] | None:
    """The first place on the way to ``path`` that a user outside
    ``trusted`` could swap for something of their own, with its lstat: a
    folder above it (as written and as resolved) that such a user owns or
    that others may write without the sticky bit, or a symlink on the way
    that such a user owns. None when there is none. ``path`` itself counts
    only as a symlink: as a folder or file its caller judges it."""
    seen = set()
    for full in (os.path.abspath(path), os.path.realpath(path)):
        ways = [full]
        above = os.path.dirname(full)
        while True:
            ways.append(above)
            if above == os.path.dirname(above):
                break
            above = os.path.dirname(above)
        for way in ways:
            if way in seen:
                continue
            seen.add(way)
            try:
                st = os.lstat(way)
            except OSError:
                continue
            link = stat.S_ISLNK(st.st_mode)
            if way == full and not link:
                continue
            if st.st_uid not in trusted:
                return way, st
            if not link and writable_by_others(st) and not st.st_mode & stat.S_ISVTX:
                return way, st
    return None


def check_owner_file(path: str, st: os.stat_result, spool_owner: int) -> None:
    """Refuse (SpoolError) config.json or index.db (or its -wal, -shm)
    unless it belongs to the spool's owner or root and nobody else may
    write it: settings decide whose files run, and history is the owner's."""
    if st.st_uid not in (spool_owner, 0):
        raise SpoolError(f"{path} belongs to {user_name(st.st_uid)}, not to the spool's owner "
                         f"{user_name(spool_owner)}: not used (remove it, or give it to the owner)")
    who = writable_by_others(st)
    if who:
        raise SpoolError(f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}): not used; "
                         f"run 'chmod go-w {path}' as its owner")
