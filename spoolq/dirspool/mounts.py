"""Which filesystem a spool lies on, and whether its locks reach other
machines.

A worker's claim and recovery rest on flock(2) (and the history on
SQLite's POSIX locks): a lock another machine cannot see lets two workers
on two machines run one job at once. Some mounts keep locks on the client
that took them: sshfs and most other FUSE filesystems (the kernel keeps the
lock when the filesystem does not take it), NFS mounted with ``nolock`` or
``local_lock=...``, CIFS with ``nobrl``. Those are named here so that a
worker can refuse them; the network filesystems whose locks do reach the
server (NFS with server locks, CIFS, GlusterFS, MooseFS, JuiceFS, CephFS)
are named too, so the worker can say what a network partition does to
them. Everything is read from /proc/self/mountinfo: no system call that
could hang on a dead server.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"

# FUSE filesystems that hand locks to their cluster (a partition can still
# drop them: see docs/design.md, "A spool on a network filesystem").
CLUSTER_FUSE = {"glusterfs", "mfs", "moosefs", "juicefs", "ceph-fuse", "lizardfs", "beegfs"}
NETWORK = {"nfs", "nfs4", "cifs", "smb3", "ceph", "glusterfs", "ocfs2", "gfs2", "lustre", "beegfs"}


@dataclass(frozen=True)
class Mount:
    point: str  # where it is mounted
    fstype: str  # as mount(8) names it: nfs4, fuse.sshfs, ...
    source: str  # what is mounted there (host:/path for network filesystems)
    options: frozenset[str]  # mount and filesystem options together

    def option(self, name: str) -> str | None:
        """The value of ``name=value`` among the options (None when absent)."""
        for opt in self.options:
            if opt.startswith(name + "="):
                return opt.split("=", 1)[1]
        return None


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse(line: str) -> Mount | None:
    """One mountinfo line (proc(5)); None for a line it cannot read."""
    fields = line.split()
    try:
        sep = fields.index("-", 6)
        point, options = _unescape(fields[4]), fields[5].split(",")
        fstype, source = fields[sep + 1], _unescape(fields[sep + 2])
        options += fields[sep + 3].split(",") if len(fields) > sep + 3 else []
    except (ValueError, IndexError):
        return None
    return Mount(point, fstype, source, frozenset(options))


def mount_of(path: str, mountinfo: str | None = None) -> Mount | None:
    """The mount ``path`` lies on: the longest mount point above its real
    path, the last one mounted when several share it (None when
    mountinfo cannot be read)."""
    real = os.path.realpath(path)
    best: Mount | None = None
    try:
        with open(mountinfo or MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        mount = parse(line)
        if mount is None:
            continue
        point = mount.point.rstrip("/") or "/"
        if real == point or real.startswith(point if point == "/" else point + "/"):
            if best is None or len(point) >= len(best.point.rstrip("/") or "/"):
                best = mount
    return best


def local_locks(mount: Mount) -> str | None:
    """Why locks taken on ``mount`` stay on this machine, or None when
    they reach every machine that mounts it (or it is no network mount)."""
    kind, _, sub = mount.fstype.partition(".")
    if kind == "fuse" and sub:
        if sub in CLUSTER_FUSE:
            return None
        return f"{mount.fstype} keeps locks on the machine that took them"
    if kind in ("nfs", "nfs4"):
        if "nolock" in mount.options:
            return "it is mounted with nolock: locks stay on this machine"
        scope = mount.option("local_lock")
        if scope and scope != "none":
            return f"it is mounted with local_lock={scope}: locks stay on this machine"
    if kind in ("cifs", "smb3") and "nobrl" in mount.options:
        return "it is mounted with nobrl: locks stay on this machine"
    return None


def is_network(mount: Mount) -> bool:
    """Whether other machines may mount the same files."""
    kind, _, sub = mount.fstype.partition(".")
    return kind in NETWORK or (kind == "fuse" and (sub in CLUSTER_FUSE or ":" in mount.source))


ADVICE = ("For many machines use a PostgreSQL spool (docs/postgres.md); "
          "if workers run on this machine only, add --allow-local-locks")


def require_shared_locks(root: str, forced: bool) -> str | None:
    """Refuse (ValueError, its text one line) a spool at ``root`` whose
    locks other machines would not see, unless ``forced``. Returns a
    caution for a worker to log once when the spool is on a network
    filesystem (whose locks a partition can drop), else None."""
    mount = mount_of(root)
    if mount is None:
        return None
    why = local_locks(mount)
    if why is not None and not forced:
        raise ValueError(f"{root} is on {mount.fstype} ({mount.source}): {why}, so workers on two "
                         f"machines could run one job twice at once. {ADVICE}")
    if why is None and is_network(mount):
        return (f"{root} is on {mount.fstype}: a network partition can drop a live worker's locks, "
                "and another machine's recovery then runs its job again (docs/design.md, "
                "\"A spool on a network filesystem\")")
    return None
