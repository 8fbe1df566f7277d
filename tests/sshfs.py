"""A real sshfs mount for the tests: an sshd of its own on a free local
port (keys made for it in a temporary folder) serving a folder that sshfs
mounts elsewhere, as a second machine would see it. Needs sshfs, sshd and
/dev/fuse; ``unavailable()`` says what is missing, for a skip (or, under
CI, a failure: .ci/run installs them; see ``require``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SSHD = "/usr/sbin/sshd"


def unavailable() -> str | None:
    """What this machine lacks for an sshfs mount (None: nothing)."""
    for tool, where in (("sshfs", shutil.which("sshfs")), ("sshd", SSHD if os.path.exists(SSHD) else None),
                        ("fusermount", shutil.which("fusermount3") or shutil.which("fusermount"))):
        if where is None:
            return f"{tool} is not installed (Debian: apt-get install sshfs openssh-server)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if os.geteuid() != 0:
        return "the sshd of the test runs as root"
    return None


def require() -> None:
    """Skip the test on a machine without sshfs, with the reason; under CI
    (``SPOOLQ_CI`` set) fail instead: a test must not pass by being skipped."""
    import pytest

    missing = unavailable()
    if missing is None:
        return
    if os.environ.get("SPOOLQ_CI"):
        pytest.fail(f"sshfs tests cannot run under CI: {missing}", pytrace=False)
    pytest.skip(f"no sshfs mount for the tests: {missing}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


@contextmanager
def mounted(tmp: Path) -> Iterator[tuple[Path, Path]]:
    """(served, mount): ``served`` is the folder as this machine has it,
    ``mount`` the same folder through sshfs."""
    keys, served, mount = tmp / "ssh", tmp / "served", tmp / "mnt"
    for folder in (keys, served, mount):
        folder.mkdir()
    _keygen(keys / "host")
    _keygen(keys / "user")
    shutil.copy(keys / "user.pub", keys / "authorized_keys")
    port = _free_port()
    (keys / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {keys}/host\nAuthorizedKeysFile {keys}/authorized_keys\n"
        f"PasswordAuthentication no\nPermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
        f"Subsystem sftp internal-sftp\nPidFile {keys}/sshd.pid\n")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation folder
    sshd = subprocess.Popen([SSHD, "-D", "-f", str(keys / "sshd_config"), "-E", str(keys / "sshd.log")])
    try:
        deadline = time.monotonic() + 30
        while True:
            done = subprocess.run(
                ["sshfs", "-p", str(port), "-o", f"IdentityFile={keys}/user,StrictHostKeyChecking=no,"
                 "UserKnownHostsFile=/dev/null,BatchMode=yes", f"root@127.0.0.1:{served}", str(mount)],
                capture_output=True, text=True, timeout=60)
            if done.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshfs could not mount: {done.stderr.strip()}")
            time.sleep(0.2)  # sshd still starting
        try:
            yield served, mount
        finally:
            unmount = shutil.which("fusermount3") or shutil.which("fusermount")
            if subprocess.run([unmount, "-u", str(mount)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    finally:
        sshd.terminate()
        sshd.wait(timeout=30)
