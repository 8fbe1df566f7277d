"""`spoolq top`, the live view, run as a user runs it: in a real
pseudo-terminal (drawn in place, updated as the spool changes, quit with
q or Ctrl-C, the terminal given back), and as plain blocks when stdout is
no terminal."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import termios
import threading
import time

from conftest import SPOOLQ, wait_for

pytest_plugins = ["pgserver"]

ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Pty:
    """``spoolq top`` on a pseudo-terminal of its own (its controlling
    terminal, 40 rows of 160 columns); what it draws is read as it comes."""

    def __init__(self, location: str, *args: str):
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        self.slave = slave
        env = {k: v for k, v in os.environ.items() if k != "SPOOLQ_DIR"}
        env["TERM"] = "xterm"

        # setsid(1) makes the terminal its controlling one (Ctrl-C reaches
        # it as SIGINT); not a preexec_fn, which may hang in a threaded test.
        self.proc = subprocess.Popen(["setsid", "-w", "-c"] + SPOOLQ + ["-s", location, "top", *args], stdin=slave,
                                     stdout=slave, stderr=slave, env=env, close_fds=True)
        self.raw = b""
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.raw += data

    def text(self) -> str:
        with self._lock:
            return self.raw.decode("utf-8", "replace")

    def frames(self) -> list[str]:
        """Each drawing, from its cursor-home on, escapes taken out."""
        return [ESCAPES.sub("", part) for part in self.text().split("\x1b[H")[1:]]

    def screen(self) -> str:
        frames = self.frames()
        return frames[-1] if frames else ""

    def shows(self, *patterns: str, timeout: float = 30.0) -> str:
        """Wait until the latest drawing holds every pattern (regular expressions)."""
        try:
            return wait_for(lambda: all(re.search(p, self.screen()) for p in patterns) and self.screen(),
                            timeout=timeout, what=f"top to show {patterns}")
        except AssertionError as e:
            raise AssertionError(f"{e}; last drawn:\n{self.screen()}") from None

    def press(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for fd in (self.slave, self.master):
            try:
                os.close(fd)
            except OSError:
                pass


def test_top_in_a_terminal_shows_counts_running_jobs_workers_pause_and_failures_in_place(sq, tmp_path):
    s = sq
    s.config("backoff_initial", "1h")
    bad = s.enqueue("--max-attempts", "1", "echo no; exit 3")
    s.work()
    worker = s.popen("work", "--watch", "-j", "2", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    running = s.enqueue(f"echo \"$((6*7))-printed\"; touch {tmp_path}/began; sleep 300")
    wait_for(lambda: (tmp_path / "began").exists(), what="the job to start")
    wid = wait_for(lambda: s.show(running).get("worker"), what="the job's worker")
    top = Pty(s.location, "--interval", "0.2")
    try:
        shown = top.shows(r"new 0\s+running 1\s+failed 0\s+dead 1\s+done 0", re.escape(running), re.escape(bad),
                          re.escape(wid) + r"\s+pid \d+\s+running 1")
        assert re.search(r"\b\d+s\s+" + re.escape(running) + r"\s+" + re.escape(wid), shown), shown  # age, worker
        top.shows(r"42-printed")  # its last output line (the command itself reads $((6*7)))
        assert re.search(r"dead\s+\S+\s+" + re.escape(bad) + r".*exit status 3", shown), shown
        assert "PAUSED" not in shown
        assert s.run("pause").stdout == "paused\n"
        top.shows(r"PAUSED by \S+", re.escape(wid) + r"\s+pid \d+\s+running 1, paused", timeout=10)
        drawn = len(top.frames())
        job = s.enqueue("true")  # paused: it waits
        enqueued = time.monotonic()
        top.shows(r"new 1\s+running 1", timeout=30)
        assert time.monotonic() - enqueued < 4.0, "the view did not follow the enqueue as it happened"
        assert len(top.frames()) > drawn  # drawn again over the last drawing, not below it
        assert "\x1b[?1049h" in top.text()  # on the alternate screen
        top.press(b"q")
        assert top.proc.wait(15) == 0
        assert top.text().rstrip("\r\n").endswith("\x1b[?25h\x1b[?1049l")  # the screen and cursor given back
        assert termios.tcgetattr(top.slave)[3] & termios.ECHO  # and the terminal's echo
        s.run("resume")
        assert s.run("wait", "--timeout", "60", job, check=False).returncode == 0
    finally:
        top.close()
        s.run("stop", "--now")
        worker.wait(60)


def test_top_quits_on_ctrl_c_and_gives_the_terminal_back(sq):
    top = Pty(sq.location)
    try:
        top.shows(r"jobs\s+new 0")
        top.press(b"\x03")
        assert top.proc.wait(15) == 0
        assert termios.tcgetattr(top.slave)[3] & termios.ICANON
        assert "Traceback" not in top.text()
    finally:
        top.close()


def test_top_without_a_terminal_prints_plain_blocks(sq):
    s = sq
    s.enqueue("--in", "1h", "true")
    run = s.run("top", "-n", "2", timeout=60)
    assert "\x1b" not in run.stdout
    blocks = run.stdout.split("\n\n")
    assert len(blocks) == 2, run.stdout
    for block in blocks:
        assert block.startswith("spoolq top  ") and re.search(r"^jobs\s+new 1\s+running 0", block, re.M), block
        assert re.search(r"^workers\s+0$", block, re.M) and re.search(r"^failures\s+none$", block, re.M), block


def test_top_n_in_a_terminal_leaves_its_last_look_on_the_screen(sq):
    top = Pty(sq.location, "-n", "1")
    try:
        assert top.proc.wait(30) == 0
        wait_for(lambda: "\x1b[?1049l" in top.text(), what="the screen given back")
        after = top.text().split("\x1b[?1049l", 1)[1]
        assert re.search(r"^jobs\s+new 0", after, re.M), after
    finally:
        top.close()
