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


def check_owner_file(path: str, st: os.stat_result, spool_owner: int) -> None:
    """Refuse (SpoolError) config.json or index.db (or its -wal, -shm)
    unless it belongs to the spool's owner or root and nobody else may
    write it: settings decide whose files run, and history is the owner's."""
    if st.st_uid not in (spool_owner, 0):
        raise SpoolError(f"{path} belongs to {user_name(st.st_uid)}, not to the spool's owner "
                         f"{user_name(spool_owner)}: not used (remove it, or give it to the owner)")
    if st.st_mode & 0o022:
        who = "every user" if st.st_mode & 0o002 else "its group"
        raise SpoolError(f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}): not used; "
                         f"run 'chmod go-w {path}' as its owner")
