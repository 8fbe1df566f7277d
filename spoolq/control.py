"""Job control: requests into live workers (stop, stop now, pause, resume,
kill or cancel a running job), a worker's side that carries them out, and
waiting for jobs to finish.

This module speaks of requests, runs and events only; a spool's
``Channel`` (the directory's is dircontrol.ControlDir) carries them:
``send``, ``requests``, ``done``, ``paused``, ``set_paused`` and
``watch(kinds)``, whose result is waited on with ``read(timeout)``.

Who may send what is the trust model's: the owner's side and root write
requests; a member's kill or cancel of its own job reaches the channel
through the owner's side (a request in drop/, carried out by pickup).
A run is signalled only by the worker that started it (``Worker.kill_job``),
never by the sender.
"""

from __future__ import annotations

import logging
import select
import signal
import threading
import time
from typing import Any, Callable, Protocol

#: A request no worker carried out within this long is removed by the
#: next worker that looks (its worker died, its run ended first).
STALE_REQUEST = 600.0
#: How long a sender waits for some worker to take its request.
ANSWER_WAIT = 10.0


class Channel(Protocol):
    def send(self, request: dict[str, Any]) -> str: ...
    def requests(self) -> list[tuple[str, dict[str, Any]]]: ...
    def done(self, token: str) -> None: ...
    def pending(self, token: str) -> bool: ...
    def paused(self) -> dict[str, Any] | None: ...
    def set_paused(self, info: dict[str, Any] | None) -> bool: ...
    def watch(self, *kinds: str) -> Any: ...
    def answer(self) -> None: ...
    def release(self) -> None: ...
    def interrupt(self) -> None: ...


class Controlled(Protocol):
    """What a request does to a worker (Worker implements it)."""

    wid: str

    def stop(self, force: bool = False) -> None: ...
    def set_paused(self, paused: bool) -> None:
        """Once this returns paused, no claim is under way and none begins."""
    def kill_job(self, job_id: str, attempt: int | None, sig: int | None, by: str) -> bool: ...


def signal_number(name: str) -> int:
    """A signal given as HUP, SIGHUP or 1; ValueError for anything else."""
    text = str(name).strip().upper()
    if text.isdigit():
        number = int(text)
        signal.Signals(number)
        return number
    if not text.startswith("SIG"):
        text = "SIG" + text
    try:
        return int(signal.Signals[text])
    except KeyError:
        raise ValueError(f"no signal {name!r}") from None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class Listener:
    """A worker's ear: a thread that sleeps on the channel's events and
    carries out what is asked of this worker or of a run it has."""

    def __init__(self, channel: Channel, worker: Controlled, log: Callable[[str, int, Any], None],
                 blocking: Callable[[], Any]):
        """``blocking()``: a context in which a thread is started with the
        worker's signals blocked (they must reach its main thread)."""
        self._blocking = blocking
        self.channel = channel
        self.worker = worker
        self.log = log
        self._watch: Any = None
        # Stopped by an event on the channel itself (see interrupt): no
        # descriptor of its own, as a worker may run under a low open-file limit.
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Kill requests for runs this worker may start yet (sent as it claimed
        # the job): applied by ``started``, kept in memory, no look per job.
        self._early: dict[tuple[str, int | None], tuple[str, dict[str, Any]]] = {}

    def start(self) -> None:
        """Watch first, then look: nothing sent in between is missed."""
        try:
            self._watch = self.channel.watch("control")
        except OSError as e:
            self.log(f"control requests unavailable ({e}): stop, pause and kill reach this worker only "
                     "by signals", 0, logging.WARNING)
            return
        try:
            self.look()
        except Exception as e:  # as in the loop: a bad request never keeps a worker from starting
            self.log(f"control request failed: {type(e).__name__}: {e}", 0, logging.WARNING)
        self.channel.release()
        self._thread = threading.Thread(target=self._loop, name="spoolq-control", daemon=True)
        with self._blocking():
            self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        if self._thread is not None:
            try:
                self.channel.interrupt()
            except Exception as e:  # (then the thread ends with the process)
                self.log(f"cannot stop the control listener: {type(e).__name__}: {e}", 1, None)
            self._thread.join(5)
            if self._thread.is_alive():
                return  # still in select() on the watch: left to end with the process
            self._thread = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def _loop(self) -> None:
        watch = self._watch
        while not self._stopping:
            select.select([watch.fileno()], [], [])
            if self._stopping:
                return
            try:
                watch.read(0)
            except Exception as e:  # the watch broke (a database restarted): watch anew, then look
                watch = self._watch_again(e)
                if watch is None:
                    return
            try:
                self.look()
            except Exception as e:  # a bad request must not end the worker's ear
                self.log(f"control request failed: {type(e).__name__}: {e}", 0, logging.WARNING)
            self.channel.release()

    def _watch_again(self, error: Exception) -> Any:
        """A new watch in place of one that broke (None: stopping)."""
        text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        self.log(f"control requests unheard ({type(error).__name__}: {text}); watching again", 0, logging.WARNING)
        delay = 0.1
        while not self._stopping:
            try:
                watch = self.channel.watch("control")
            except Exception:
                time.sleep(delay)
                delay = min(5.0, delay * 2)
                continue
            old, self._watch = self._watch, watch
            try:
                old.close()
            except Exception:
                pass
            return watch
        return None

    def look(self) -> None:
        """Carry out every request for this worker or its runs."""
        channel, worker = self.channel, self.worker
        channel.answer()  # members' requests (a shared spool), which may be kills of runs of ours
        info = channel.paused()
        worker.set_paused(info is not None)
        now = time.time()
        for token, request in channel.requests():
            kind = request.get("request")
            if kind == "stop" and request.get("worker") == worker.wid:
                by = request.get("by", "?")
                self.log(f"stopping{' now' if request.get('now') else ''}: asked by {by}", 0, None)
                worker.stop(force=bool(request.get("now")))
                channel.done(token)  # after the stop: its sender learns it claims no more
            elif kind == "pause" and request.get("worker") == worker.wid:
                worker.set_paused(channel.paused() is not None)
                channel.done(token)  # after set_paused: its sender learns no claim begins any more
            elif kind == "kill":
                if self._kill(token, request):
                    continue
                with self._lock:
                    self._early[(request.get("id"), request.get("attempt"))] = (token, request)
                    if len(self._early) > 1000:
                        self._early.pop(next(iter(self._early)))
            if now - float(request.get("at") or 0) > STALE_REQUEST:
                channel.done(token)

    def _kill(self, token: str, request: dict[str, Any]) -> bool:
        sig = request.get("signal")
        by = str(request.get("by", "?"))
        if not self.worker.kill_job(str(request.get("id")), request.get("attempt"),
                                    None if sig is None else int(sig), by):
            return False
        self.channel.done(token)
        what = "cancelled" if sig is None else f"sent {signal_name(int(sig))}"
        self.log(f"job={request.get('id')} {what}: asked by {by}", 1, None)
        return True

    def started(self, job_id: str, attempt: int) -> None:
        """A run begins: a kill sent for it before it was known here applies now."""
        if not self._early:
            return
        with self._lock:
            early = self._early.pop((job_id, attempt), None)
        if early is not None:
            self._kill(*early)
