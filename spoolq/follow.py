"""The facade's view of a job's output (mixed into ``Spool``): ``output``,
what a running job has written so far from an offset on, and ``logs``, a
job's output (its live output while it runs, its stored tails once its
run ended), followed until the job finishes when asked.

Offsets count the bytes of one run's stream from its start, on both
backends; bytes let go (beyond log_limit, or before a stored tail) are
skipped and told as such (``Piece.skipped``). A finished run's rest comes
from its record: the stored tail and ``stdout_from`` / ``stderr_from``
(bytes written before it) say where it continues what was read live.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .errors import JobNotFound

STREAMS = ("stdout", "stderr")
#: A follower looks again at least this often, events or not (a member
#: of a shared spool may have no events of out/ to watch).
LOOK_EVERY = 1.0


@dataclass
class Piece:
    """Bytes of a job's ``stream``; ``skipped``: bytes before them that
    are not kept; ``stored``: from the record's tail (the run ended)."""

    stream: str
    data: bytes
    skipped: int = 0
    stored: bool = False


class Logs:
    """Mixed into Spool: needs its ``backend``, ``get`` and ``_channel``."""

    backend: Any

    def output(self, job_id: str, stream: str = "stdout", offset: int = 0) -> tuple[bytes, int] | None:
        """What the running job ``job_id`` has written to ``stream`` from
        ``offset`` on, as (bytes, the offset after them), or None when
        the job is not running. The bytes begin at ``next - len(bytes)``:
        later than ``offset`` when older output was let go (log_limit). A
        job that has just started may have nothing to show yet."""
        if stream not in STREAMS:
            raise ValueError(f"no stream {stream!r} (stdout or stderr)")
        self.backend.open()
        got = self.backend.output(job_id, stream, offset)
        if got is not None:
            return got
        job = self.get(job_id)
        return (b"", offset) if job is not None and job.get("state") == "cur" else None

    def logs(self, job_id: str, streams: Iterable[str] = ("stdout",), follow: bool = False,
             on_output: Callable[[Piece], Any] = lambda piece: None,
             on_waiting: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
        """Give ``on_output`` the job's output: a running job's so far, a
        finished (or failed) run's stored tails. With ``follow``, go on as
        it is written (a waiting job: once it starts; a failed run: the
        next run's too) until the job has finished. ``on_waiting(job)``
        is told once when the job has not started yet. Returns the job's
        record as last seen. Raises JobNotFound for an unknown id."""
        streams = tuple(streams)
        for stream in streams:
            if stream not in STREAMS:
                raise ValueError(f"no stream {stream!r} (stdout or stderr)")
        self.backend.open()
        job = self.get(job_id)
        if job is None:
            raise JobNotFound(f"no job {job_id} in this spool")
        if not follow:
            return self._once(job_id, job, streams, on_output, on_waiting)
        watch = self._channel().watch("output", "finished", "states")
        try:
            return _Follower(self, job_id, streams, on_output, on_waiting).run(watch)
        finally:
            watch.close()

    def _once(self, job_id: str, job: dict[str, Any], streams: tuple[str, ...],
              on_output: Callable[[Piece], Any], on_waiting: Callable[[dict[str, Any]], Any] | None) -> dict[str, Any]:
        state = job.get("state")
        if state == "cur":
            got = {stream: self.backend.output(job_id, stream, 0) for stream in streams}
            if any(g is not None for g in got.values()):
                for stream, g in got.items():
                    if g is not None and g[0]:
                        on_output(Piece(stream, g[0], g[1] - len(g[0])))
                return job
            job = self.get(job_id) or job  # (its run may have ended just now)
            state = job.get("state")
        if state in ("done", "dead") or (state == "failed" and job.get("attempts")):
            stored_rest(job, dict.fromkeys(streams, 0), on_output)
            if job.get("readable") is False and on_waiting is not None:
                on_waiting(job)  # (told that its tails are not the caller's to read)
        elif state != "cur" and on_waiting is not None:
            on_waiting(job)
        return job


class _Follower:
    """One ``logs --follow``: looks at the job after each event (or
    LOOK_EVERY seconds), reads what is new, ends once it has finished."""

    def __init__(self, spool: Any, job_id: str, streams: tuple[str, ...], on_output: Callable[[Piece], Any],
                 on_waiting: Callable[[dict[str, Any]], Any] | None):
        self.spool = spool
        self.job_id = job_id
        self.streams = streams
        self.on_output = on_output
        self.on_waiting = on_waiting
        self.offsets = dict.fromkeys(streams, 0)
        self.reading = False  # a run's live output is being read

    def run(self, watch: Any) -> dict[str, Any]:
        looked = False
        while True:
            job = self.spool.get(self.job_id)
            if job is None:  # its history dropped (compact --keep) meanwhile
                return {"id": self.job_id, "state": "done", "outcome": "finished", "readable": False}
            state = job.get("state")
            if state == "cur":
                self._live()
            elif self.reading or (state in ("done", "dead") and not looked):
                # The run read live has ended (or had before the first
                # look): what it pushed last, then the rest from the record.
                if self.reading:
                    self._live()
                stored_rest(job, self.offsets, self.on_output)
                self.offsets = dict.fromkeys(self.streams, 0)
                self.reading = False
            if state in ("done", "dead"):
                return job
            if state != "cur" and not looked and self.on_waiting is not None:
                self.on_waiting(job)
            looked = True
            began = time.monotonic()
            while time.monotonic() - began < LOOK_EVERY:
                named = watch.read(LOOK_EVERY - (time.monotonic() - began))
                if named is None or self.job_id in named:
                    break

    def _live(self) -> None:
        self.reading = True
        for stream in self.streams:
            while True:
                got = self.spool.backend.output(self.job_id, stream, self.offsets[stream], True)
                if got is None:
                    break
                data, after = got
                if after < self.offsets[stream]:  # shorter than what was read: a later run's
                    self.offsets[stream] = 0
                    continue
                if not data:
                    break
                self.on_output(Piece(stream, data, max(0, after - len(data) - self.offsets[stream])))
                self.offsets[stream] = after


def stored_rest(job: dict[str, Any], offsets: dict[str, int], on_output: Callable[[Piece], Any]) -> None:
    """Give ``on_output`` what the record's stored tails hold past
    ``offsets`` (bytes of each stream already read)."""
    for stream, offset in offsets.items():
        text = job.get(stream)
        if not isinstance(text, str) or not text:
            continue
        data = text.encode("utf-8", "replace")
        before = job.get(f"{stream}_from")
        before = before if type(before) is int and before > 0 else 0
        if offset >= before + len(data):
            continue
        if offset >= before:
            on_output(Piece(stream, data[offset - before:], 0, True))
        else:
            on_output(Piece(stream, data, before - offset, True))
