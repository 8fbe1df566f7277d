"""What wakes a waiting worker of a PostgreSQL spool: ``LISTEN`` on the
channel every enqueue, retry and failure due now ``NOTIFY``s (once per
transaction), on a connection of the waker's own. A lost connection is
opened again with backoff, and each reconnection wakes the worker for a
rescan (it may have missed a notification meanwhile); the worker's timed
rescans (``rescan_interval``) are the backstop.
"""

from __future__ import annotations

import os
import select
import threading
from typing import Any, Callable

from .. import procs
from ..waker import Waker
from .connect import first_line

CHANNEL = "spoolq_jobs"
RETRY_FIRST = 0.1
RETRY_MAX = 5.0


class PgWaker(Waker):
    """Wakes the worker on each notification on CHANNEL."""

    def __init__(self, connect: Callable[[], Any], log: Callable[[str], None] | None = None):
        super().__init__()
        self._connect = connect
        self._log = log or (lambda text: None)
        self._stop_r, self._stop_w = os.pipe()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.listening = threading.Event()  # set while LISTEN is in force

    def start(self) -> None:
        with procs.signals_to_main_thread():
            self._thread = threading.Thread(target=self._run, name="spoolq-listen", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        try:
            os.write(self._stop_w, b".")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=10)
        for fd in (self._stop_r, self._stop_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _run(self) -> None:
        delay = RETRY_FIRST
        while not self._stopping:
            try:
                conn = self._connect()
            except Exception as e:
                self._log(f"cannot listen for new jobs: {e}; trying again in {delay:g} s")
                if self._sleep(delay):
                    return
                delay = min(RETRY_MAX, delay * 2)
                continue
            try:
                conn.execute(f"LISTEN {CHANNEL}")
                delay = RETRY_FIRST
                self.listening.set()
                self.wake()  # whatever came while not listening
                self._listen(conn.pgconn)
            except Exception as e:
                if not self._stopping:
                    self._log(f"listening for new jobs failed: {first_line(e)}; listening again")
            finally:
                self.listening.clear()
                conn.close()

    def _listen(self, pgconn: Any) -> None:
        """Wake on each notification until stopped (or the connection breaks: raised)."""
        sock = pgconn.socket
        while not self._stopping:
            ready, _, _ = select.select([sock, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            pgconn.consume_input()
            if pgconn.status != 0:
                raise ConnectionError("the connection ended")
            woken = False
            while pgconn.notifies() is not None:
                woken = True
            if woken:
                self.wake()

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` unless stopped; True when stopping."""
        ready, _, _ = select.select([self._stop_r], [], [], seconds)
        return bool(ready) or self._stopping
