"""The job record: parse, validate, serialise and shape job files (what a
run adds to a record, and trimming it to fit max_job_bytes), the time and
duration formats of the command line, and ``Outcome``, what one run
produced. Pure: no file is read or written here.

A job file is a UTF-8 JSON object. Producers write a few fields (``command``
or ``argv`` or ``kind``, ``payload``, ``id``, ``max_attempts``, ``timeout``,
``run_at``, ``env``, ``cwd``, and what decides when it runs: ``priority``,
``after``, ``unique``, ``lock``, ``held``); spoolq adds its own (``state``, ``attempts``,
``history`` ...). Unknown fields are kept as they are. A field set to null
counts as absent.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from .errors import Incomplete, InvalidJob  # noqa: F401 - importable from here too
from .ids import id_problem
from .words import did_you_mean

MAX_EPOCH = 7258118400  # 2200-01-01T00:00:00Z: far later, mtimes in nanoseconds overflow 64 bits
MAX_TIMEOUT = 10 * 365 * 86400  # ten years: beyond it select() and timers overflow

TARGETS = ("command", "argv", "kind")
# The fields a producer writes (see SPOOLQ_FIELDS for spoolq's own).
PRODUCER_FIELDS = TARGETS + ("payload", "id", "max_attempts", "timeout", "idle_timeout", "run_at", "env", "cwd",
                             "priority", "after", "unique", "lock", "held")

MAX_PRIORITY = 9999  # priorities run from -MAX_PRIORITY to MAX_PRIORITY (a short prefix of a file name)
MAX_AFTER = 1000  # dependencies one job may name
MAX_LOCKS = 16  # lock names one job may hold
MAX_UNIQUE = 200  # characters of a unique key
# A lock name is a file name in every backend: an id's characters, at most 64.
_LOCK_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}\Z")


# --------------------------------------------------------------------------
# times and durations


_second_prefix: dict[int, str] = {}


def rfc3339(ts: float | None = None) -> str:
    """An RFC 3339 UTC time with microseconds, e.g. 2026-11-22T07:21:00.123456Z."""
    if ts is None:
        ts = time.time()
    sec, frac = divmod(round(ts * 1e6), 1_000_000)
    prefix = _second_prefix.get(sec)
    if prefix is None:  # formatting the date is the slow part: once per second seen
        if len(_second_prefix) > 256:
            _second_prefix.clear()
        prefix = _second_prefix[sec] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
    return f"{prefix}.{frac:06d}Z"


_RFC3339_RE = re.compile(
    r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d(:\d\d(\.\d+)?)?([Zz]|[+-]\d\d:?\d\d)\Z"
)


_day_epoch: dict[str, int] = {}


def _own_format(text: str) -> float | None:
    """Epoch seconds of a time in spoolq's own format (2026-11-22T07:21:00.123456Z),
    without the general parser: compaction reads several per job."""
    if len(text) != 27 or text[10] != "T" or text[19] != "." or text[26] != "Z":
        return None
    day = _day_epoch.get(text[:10])
    try:
        if day is None:
            import calendar
            from datetime import date

            y, m, d = int(text[0:4]), int(text[5:7]), int(text[8:10])
            date(y, m, d)  # raises for 2026-02-30
            if len(_day_epoch) > 4096:
                _day_epoch.clear()
            day = _day_epoch[text[:10]] = calendar.timegm((y, m, d, 0, 0, 0))
        hour, minute, second = int(text[11:13]), int(text[14:16]), int(text[17:19])
        if hour > 23 or minute > 59 or second > 59:
            return None
        return day + hour * 3600 + minute * 60 + second + int(text[20:26]) / 1e6
    except ValueError:
        return None


def parse_time(value: Any) -> float:
    """An RFC 3339 time (with an offset) or epoch seconds, as epoch seconds."""
    if isinstance(value, str):
        fast = _own_format(value)
        if fast is not None and 0 <= fast <= MAX_EPOCH:
            return fast
    if isinstance(value, bool):
        raise ValueError("a time must be RFC 3339 or epoch seconds, not a boolean")
    if isinstance(value, (int, float)):
        if not 0 <= value <= MAX_EPOCH:  # also nan and inf; an int of any size (isfinite would overflow)
            hint = ""
            if MAX_EPOCH < value <= MAX_EPOCH * 1000:
                seconds = int(value // 1000)
                hint = (f"; it looks like milliseconds: epoch times are in seconds ({seconds} is "
                        f"{rfc3339(seconds)[:19]}Z)")
            raise ValueError(f"{repr(value)[:40]} is not a valid epoch time (0 to {MAX_EPOCH}){hint}")
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            return parse_time(int(text) if text.isdigit() and len(text) < 40 else number)  # named as given: 1769850000000, not 1.76985e+12
        if not _RFC3339_RE.match(text):
            raise ValueError(f"{value!r} is not an RFC 3339 time with an offset (like 2026-01-31T09:00:00Z) or epoch seconds")
        text = text[:-1] + "+00:00" if text[-1] in "Zz" else text
        from datetime import datetime  # only here: it costs a cold `spoolq enqueue` ~5 ms

        try:
            ts = datetime.fromisoformat(text).timestamp()
        except (ValueError, OverflowError):
            raise ValueError(f"{value!r} is not a valid time") from None
        if not 0 <= ts <= MAX_EPOCH:  # named as written, not as the epoch seconds it became
            raise ValueError(f"{value[:40]!r} is outside 1970-01-01T00:00:00Z to 2200-01-01T00:00:00Z")
        return ts
    raise ValueError(f"a time must be RFC 3339 or epoch seconds, not {type(value).__name__}")



def time_or_none(value: Any) -> float | None:
    """``parse_time`` of a field a record may lack or hold anything in: None
    for what is no time."""
    if value is None:
        return None
    try:
        return parse_time(value)
    except ValueError:
        return None


BARE_NUMBER = re.compile(r"\d+(?:\.\d+)?")  # a duration without a unit (seconds)
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)")
_UNITS = {"": 1, "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
          "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
          "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
          "d": 86400, "day": 86400, "days": 86400, "w": 604800, "week": 604800, "weeks": 604800}


def parse_duration(text: Any) -> float:
    """``90``, ``90s``, ``5m``, ``2h``, ``7d`` as seconds; also ``1w``,
    ``1.5h``, the long names systemd and people write (``10min``,
    ``2 hours``) and sums (``1h30m``)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0 or not math.isfinite(text):
            raise ValueError(f"{text!r} is not a valid duration")
        return float(text)
    rest = str(text).strip().lower()
    total, parts = 0.0, 0
    while rest:
        m = _DURATION_PART.match(rest)
        # A bare number only alone: "1h30" is more likely a slip than 1h + 30s.
        if not m or m.group(2) not in _UNITS or (not m.group(2) and (parts or m.end() < len(rest))):
            raise ValueError(f"{text!r} is not a duration (use e.g. 90, 90s, 5m, 10min, 2h, 1h30m, 7d)")
        total += float(m.group(1)) * _UNITS[m.group(2)]
        parts += 1
        rest = rest[m.end():].lstrip()
    if not parts:
        raise ValueError(f"{text!r} is not a duration (use e.g. 90, 90s, 5m, 10min, 2h, 1h30m, 7d)")
    return total


def duration_text(seconds: float) -> str:
    """Seconds as a duration people write: ``90s``, ``10m``, ``1h30m``."""
    left = int(round(seconds))
    if left < 60 or seconds != left:
        return f"{seconds:g}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return "".join(parts)


# --------------------------------------------------------------------------
# validation


def _is_number(v: Any) -> bool:
    # An int is always finite (and isfinite would overflow on one beyond a double).
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (isinstance(v, int) or math.isfinite(v))


def _text(text: str, what: str) -> None:
    """What a job runs is text: no NUL (no C string holds it), and valid
    UTF-8, as JSON is. A byte that is not UTF-8, which a shell's argument
    may hold, becomes a lone surrogate in a Python string (\\udcff) and can
    be written in JSON as such an escape; refused in every such field, by
    ``spoolq enqueue`` and the worker alike (and by contrib/spoolq-drop)."""
    if "\x00" in text:
        raise InvalidJob(f"{what} contains a NUL character")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            c = ord(text[e.start])
            what_char = f"the byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"a lone surrogate U+{c:04X}"
            raise InvalidJob(f"{what} is not valid UTF-8 ({what_char} at character {e.start})") from None


def validate(job: dict, name_id: str | None = None) -> None:
    """Raise InvalidJob with the reason if ``job`` can never run, naming
    each field it has that spoolq does not know, with the one most likely
    meant (``cmd`` for ``command``): that is most often why. (``name_id``:
    the id of the file name, already checked by the caller.) Unknown fields
    in a job that can run are kept, and not a problem."""
    try:
        _validate(job, name_id)
    except InvalidJob as e:
        unknown = [f"unknown field {key[:40]!r}{did_you_mean(key, PRODUCER_FIELDS, quote=True)}"
                   for key in job if key not in PRODUCER_FIELDS and key not in SPOOLQ_FIELDS]
        if not unknown:
            raise
        more = f"; and {len(unknown) - 5} more unknown fields" if len(unknown) > 5 else ""
        raise InvalidJob(f"{e}; {'; '.join(unknown[:5])}{more}") from None


def _validate(job: dict, name_id: str | None) -> None:
    present = (job.get("command") is not None) + (job.get("argv") is not None) + (job.get("kind") is not None)
    if present != 1:
        targets = [f for f in TARGETS if job.get(f) is not None]
        if not targets:
            raise InvalidJob("a job needs exactly one of command, argv or kind; it has none")
        raise InvalidJob(f"a job needs exactly one of command, argv or kind; it has {', '.join(targets)}")
    command = job.get("command")
    if command is not None:
        if not isinstance(command, str) or not command.strip():
            raise InvalidJob("command must be a non-empty string")
        _text(command, "command")
    argv = job.get("argv")
    if argv is not None:
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidJob("argv must be a non-empty list of strings")
        if not argv[0]:
            raise InvalidJob("argv[0] must not be empty")
        for a in argv:
            _text(a, "argv")
    kind = job.get("kind")
    if kind is not None and (not isinstance(kind, str) or not kind):
        raise InvalidJob("kind must be a non-empty string")
    job_id = job.get("id")
    if job_id is not None and job_id != name_id:
        problem = id_problem(job_id)
        if problem:
            raise InvalidJob(problem)
    max_attempts = job.get("max_attempts")
    if max_attempts is not None and (
        not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1
    ):
        raise InvalidJob(f"max_attempts must be an integer >= 1, not {repr(max_attempts)[:40]}")
    for key in ("timeout", "idle_timeout"):
        timeout = job.get(key)
        if timeout is not None and (not _is_number(timeout) or timeout < 0 or timeout > MAX_TIMEOUT):
            raise InvalidJob(f"{key} must be a number of seconds from 0 to {MAX_TIMEOUT:g}, not {repr(timeout)[:40]}")
    if job.get("run_at") is not None:
        try:
            parse_time(job["run_at"])
        except ValueError as e:
            raise InvalidJob(f"run_at: {e}") from None
    env = job.get("env")
    if env is not None:
        _validate_env(env)
    cwd = job.get("cwd")
    if cwd is not None:
        if not isinstance(cwd, str) or not cwd:
            raise InvalidJob("cwd must be a non-empty string")
        _text(cwd, "cwd")
    attempts = job.get("attempts")
    if attempts is not None and (not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 0):
        raise InvalidJob(f"attempts must be an integer >= 0, not {attempts!r}")
    history = job.get("history")
    if history is not None and not isinstance(history, list):
        raise InvalidJob("history must be a list")
    _validate_ordering(job, name_id if name_id is not None else job.get("id"))


ORDERING_FIELDS = frozenset(("priority", "after", "unique", "lock", "held"))
_ORDERING_MARKS = tuple(f'"{name}"' for name in sorted(ORDERING_FIELDS))
_ORDERING_BYTES = tuple(mark.encode() for mark in _ORDERING_MARKS)


def may_order(text: str | bytes) -> bool:
    """Whether a record's text may hold an ordering field (False: it holds
    none, known without parsing it: a field is its quoted name)."""
    marks = _ORDERING_BYTES if isinstance(text, bytes) else _ORDERING_MARKS
    return any(mark in text for mark in marks)


def _validate_ordering(job: dict, own_id: Any) -> None:
    """The fields that decide when a job may run: priority, after, unique, lock, held."""
    if ORDERING_FIELDS.isdisjoint(job):  # (most jobs: one check, at every claim)
        return
    priority = job.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)
                                 or not -MAX_PRIORITY <= priority <= MAX_PRIORITY):
        raise InvalidJob(f"priority must be an integer from {-MAX_PRIORITY} to {MAX_PRIORITY}, not {repr(priority)[:40]}")
    after = job.get("after")
    if after is not None:
        ids = after if isinstance(after, list) else [after]
        if not ids or len(ids) > MAX_AFTER:
            raise InvalidJob(f"after must be a job id or a list of 1 to {MAX_AFTER} job ids")
        for dep in ids:
            problem = id_problem(dep)
            if problem:
                raise InvalidJob(f"after: {problem}")
            if dep == own_id:
                raise InvalidJob(f"after: job {dep} cannot wait for itself")
    unique = job.get("unique")
    if unique is not None:
        if not isinstance(unique, str) or not unique or len(unique) > MAX_UNIQUE:
            raise InvalidJob(f"unique must be a non-empty string of at most {MAX_UNIQUE} characters")
        _text(unique, "unique")
    lock = job.get("lock")
    if lock is not None:
        names = lock if isinstance(lock, list) else [lock]
        if not names or len(names) > MAX_LOCKS:
            raise InvalidJob(f"lock must be a lock name or a list of 1 to {MAX_LOCKS} names")
        for name in names:
            validate_lock_name(name)
    held = job.get("held")
    if held is not None and not isinstance(held, bool):
        raise InvalidJob(f"held must be true or false, not {repr(held)[:40]}")


def validate_lock_name(name: Any) -> None:
    if not isinstance(name, str) or not _LOCK_RE.match(name):
        raise InvalidJob(f"lock name {repr(name)[:70]} is not 1-64 characters of A-Z a-z 0-9 . _ - "
                         "(not starting with a dot)")


def priority_of(job: dict) -> int:
    """A valid record's priority (0 when it has none)."""
    return job.get("priority") or 0


def after_of(job: dict) -> list[str]:
    """The ids a valid record waits for, each once, in its order."""
    after = job.get("after")
    if after is None:
        return []
    return list(dict.fromkeys(after if isinstance(after, list) else [after]))


def locks_of(job: dict) -> list[str]:
    """The lock names a valid record holds while it runs, each once, sorted
    (every worker takes them in one order)."""
    lock = job.get("lock")
    if lock is None:
        return []
    return sorted(set(lock if isinstance(lock, list) else [lock]))


def _validate_env(env: Any) -> None:
    if not isinstance(env, dict):
        raise InvalidJob("env must be an object of strings")
    for k, v in env.items():
        if not isinstance(k, str):
            raise InvalidJob(f"env name {k!r} must be a string, not {type(k).__name__}")
        if not isinstance(v, str):
            raise InvalidJob(f"env[{k!r}] must be a string, not {type(v).__name__}")
        if not k or "=" in k:
            raise InvalidJob(f"env name {k!r} is empty or contains '='")
        _text(k, "env")
        _text(v, "env")


# Fields spoolq writes into a record as it runs the job (the rest are the
# producer's; an id may be either, and is short).
SPOOLQ_FIELDS = frozenset(("id", "history", "history_dropped", "attempts", "state", "outcome", "exit_code", "error",
                           "stdout", "stderr", "result", "result_dropped", "created_at", "finished_at",
                           "failed_at", "retried_at", "run_as"))

# A record spoolq has written (one with a history) may be this much larger
# than max_job_bytes, as long as the producer's own fields fit in it. A
# finish trims what runs add to fit the limit (see fitted), but
# a job enqueued within a few hundred bytes of it has no room for even one
# history entry; without the slack it would go dead for its own bookkeeping.
RECORD_SLACK = 64 * 1024


def max_file_bytes(limit: int) -> int:
    """The largest job file that may still be valid under max_job_bytes
    ``limit``: spoolq's own records have RECORD_SLACK more."""
    return limit + RECORD_SLACK


def read_size(limit: int) -> int:
    """How much of a job file to read for ``parse_sized``: one byte past
    the largest valid file, so a larger one is seen to be larger."""
    return max_file_bytes(limit) + 1


def as_done(job: dict) -> dict:
    """A record found in done/. Every finish and cancel writes an outcome;
    a record without one is a waiting job's that a cancel killed between its
    move and its rewrite left there: read as the cancelled job it is."""
    if "outcome" in job:
        return job
    return dict(job, state="done", outcome="cancelled")


def parse_sized(data: bytes, job_id: str, limit: int) -> dict:
    """``parse``, for a file read up to ``limit`` (max_job_bytes) plus
    RECORD_SLACK and one byte: larger than ``limit`` is invalid, unless the
    record is spoolq's own (it has a history), within the slack, and its
    producer's fields alone fit in ``limit``."""
    if len(data) <= limit:
        return parse(data, job_id)
    try:
        job = parse(data, job_id) if len(data) <= max_file_bytes(limit) else None
    except InvalidJob:
        job = None
    if job is None or not job.get("history") or \
            len(dumps({k: v for k, v in job.items() if k not in SPOOLQ_FIELDS})) > limit:
        raise InvalidJob(f"{len(data)} bytes, larger than max_job_bytes ({limit})")
    return job



def _json_problem(e: json.JSONDecodeError) -> str:
    """The parser's complaint and where, without the character offset:
    'Expecting value at line 1 column 5', 'Unterminated string starting at
    line 1 column 7' (whose message already ends in 'at')."""
    where = f"line {e.lineno} column {e.colno}"
    return f"{e.msg} {where}" if e.msg.endswith(" at") else f"{e.msg} at {where}"

def parse(data: bytes, job_id: str) -> dict:
    """Parse a job file's bytes; the file name's ``job_id`` wins over the
    ``id`` field (which must still be valid when present)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        cut = e.end == len(data) and e.reason == "unexpected end of data"
        raise (Incomplete if cut else InvalidJob)(f"not UTF-8 (byte {e.start})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        raise Incomplete("empty file")
    try:
        job = loads(text)
    except json.JSONDecodeError as e:
        # Only an object can become a job: anything else is wrong from its first byte.
        cut = text.lstrip().startswith("{")
        raise (Incomplete if cut else InvalidJob)(f"not valid JSON: {_json_problem(e)}") from None
    except ValueError as e:  # NaN, numbers too large to convert, nesting
        raise InvalidJob(f"not valid JSON: {e}") from None
    if not isinstance(job, dict):
        raise InvalidJob(f"not a JSON object but {_json_type(job)}")
    validate(job, job_id)
    job["id"] = job_id
    return job


def _json_type(v: Any) -> str:
    if isinstance(v, list):
        return "an array"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, bool):
        return "a boolean"
    if v is None:
        return "null"
    return "a number"


# Deeper nesting is refused when a job is enqueued and when a file is read:
# far below where Python's JSON parser gives up (~1,000 levels, less in a
# deep call stack), so a job enqueue accepts can always be read back by a
# worker.
MAX_DEPTH = 256


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a JSON number")
    return value


# Python's json reads and writes NaN and Infinity, which are not JSON (and
# would make every later reader of the file choke): refused both ways.
_decoder = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)


def loads(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """Strict JSON: no NaN or Infinity, at most ``max_depth`` levels deep.
    Raises ValueError (json.JSONDecodeError for a syntax error)."""
    try:
        value = _decoder.decode(text)
    except RecursionError:
        raise ValueError(too_deep_message(max_depth)) from None
    if _too_deep(value, text.count("[") + text.count("{"), max_depth):
        raise ValueError(too_deep_message(max_depth))
    return value


def too_deep_message(max_depth: int) -> str:
    """The reason given for JSON nested deeper than allowed."""
    return f"nested more than {max_depth} levels deep"


def _too_deep(value: Any, brackets: int, max_depth: int = MAX_DEPTH) -> bool:
    """Whether lists and objects in ``value`` nest more than ``max_depth``
    levels. ``brackets``, the count of ``[`` and ``{`` in its JSON text,
    bounds the depth: only a text with more of them than that is walked."""
    if brackets <= max_depth:
        return False
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return False


_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_ascii_encoder = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False)


def dumps(job: dict) -> bytes:
    """Serialise a record: one line of compact UTF-8 JSON. A string that is
    not valid Unicode (a lone surrogate, which JSON's \\u escapes allow) is
    written escaped, so every record can be written and read back. Raises
    ValueError or TypeError for what is not JSON (NaN, a set)."""
    text = _encoder.encode(job)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (_ascii_encoder.encode(job) + "\n").encode("ascii")


def serialise(job: dict) -> bytes:
    """``dumps`` for a job a producer handed us: InvalidJob (with the reason)
    for anything that is not JSON or nests deeper than MAX_DEPTH."""
    try:
        data = dumps(job)
    except RecursionError:
        raise InvalidJob(too_deep_message(MAX_DEPTH)) from None
    except (TypeError, ValueError) as e:
        raise InvalidJob(f"not JSON: {e}") from None
    if _too_deep(job, data.count(b"[") + data.count(b"{")):
        raise InvalidJob(too_deep_message(MAX_DEPTH))
    return data


def new_job(fields: dict, job_id: str, now: float) -> dict:
    """A fresh record for enqueue: the producer's fields (nulls dropped) plus
    spoolq's own. Raises InvalidJob."""
    job = {k: v for k, v in fields.items() if v is not None}
    for k in ("state", "attempts", "history"):
        job.pop(k, None)
    validate(job)
    job["id"] = job_id
    job["state"] = "new"
    job["attempts"] = 0
    job["created_at"] = rfc3339(now)
    return job


# --------------------------------------------------------------------------
# shaping: what a run, a cancel and a retry change in a record


ERROR_LIMIT = 2000  # characters of a run's error message kept in the record

# What one run leaves in a record besides its history entry: cleared before
# the next run's are written, and by a cancel or a retry.
RUN_FIELDS = frozenset(("exit_code", "error", "stdout", "stderr", "stdout_from", "stderr_from", "result",
                        "result_dropped", "outcome"))
#: A tail's field and the field saying how many bytes of its stream came before it.
TAIL_FROM = (("stdout", "stdout_from"), ("stderr", "stderr_from"))


def capped_error(error: str | None) -> str | None:
    """A run's error message as the record keeps it: an exception's message
    has no bound of its own."""
    if error is not None and len(error) > ERROR_LIMIT:
        return error[:ERROR_LIMIT] + f"... ({len(error)} characters)"
    return error


def clear_run_fields(job: dict) -> None:
    for key in RUN_FIELDS.intersection(job):
        del job[key]


def add_run(job: dict, entry: dict, results: dict) -> None:
    """Record a finished run: ``entry`` (its attempt, worker, times and
    result) appended to the history, the attempts counted, and the last
    run's fields replaced by ``results``."""
    history = job.get("history")
    if not isinstance(history, list):
        history = []
    history.append(entry)
    job["history"] = history
    job["attempts"] = entry["attempt"]
    clear_run_fields(job)
    job.update(results)


#: The error of a run whose worker died under it (its recovery records it).
INTERRUPTED = "interrupted: the worker running it died"


def next_state(job: dict, out: Outcome, attempt: int, max_attempts: int) -> str:
    """Where a job goes after run ``attempt`` with outcome ``out``: done,
    failed or dead (``max_attempts``: the spool's, for a job that sets none;
    a run cancelled while it ran: done, never retried)."""
    if out.ok or out.cancelled:
        return "done"
    if out.permanent:
        return "dead"
    return "dead" if attempt >= (job.get("max_attempts") or max_attempts) else "failed"


def add_finish(job: dict, out: Outcome, attempt: int, due: float, worker_id: str, max_attempts: int) -> str:
    """Record run ``attempt`` of ``job`` (due at ``due``, epoch seconds),
    which ``worker_id`` ran with outcome ``out``: its history entry, the
    attempts, the last run's fields, the state, the outcome of a success and
    when it finished (or failed). Returns the state (see ``next_state``);
    when a failed job is due again is its spool's business."""
    end = rfc3339(out.end or time.time())
    error = capped_error(out.error)
    entry: dict[str, Any] = {"attempt": attempt, "worker": worker_id, "due": rfc3339(due),
                             "start": rfc3339(out.start), "end": end}
    results: dict[str, Any] = {}
    if out.exit_code is not None:
        entry["exit_code"] = results["exit_code"] = out.exit_code
    if error is not None:
        entry["error"] = results["error"] = error
    if out.stdout:
        results["stdout"] = out.stdout
        if out.stdout_from:
            results["stdout_from"] = out.stdout_from
    if out.stderr:
        results["stderr"] = out.stderr
        if out.stderr_from:
            results["stderr_from"] = out.stderr_from
    if out.has_result:
        results["result"] = out.result
    add_run(job, entry, results)
    dest = next_state(job, out, attempt, max_attempts)
    if dest == "done":
        job["outcome"] = "cancelled" if out.cancelled else "succeeded"
    job["state"] = dest
    job["finished_at" if dest != "failed" else "failed_at"] = end
    return dest


def cancel(job: dict) -> None:
    """Mark a waiting job's record as cancelled: done, outcome cancelled."""
    clear_run_fields(job)
    job["state"] = "done"
    job["outcome"] = "cancelled"
    job["finished_at"] = rfc3339()


def fresh_round(job: dict) -> None:
    """Mark a dead job's record as waiting again, with its attempts
    counted from zero (its history is kept)."""
    job["state"] = "new"
    job["attempts"] = 0
    job["retried_at"] = rfc3339()


def retry(job: dict) -> None:
    """Mark a dead job's record as retried: its last run's fields cleared,
    a fresh round of attempts, its history kept."""
    clear_run_fields(job)
    fresh_round(job)


def fitted(job: dict, limit: int) -> bytes:
    """The record, trimmed of what runs added until it fits in max_job_bytes:
    a record spoolq writes must never be one it refuses to read (a job
    enqueued near the limit would go dead for its own stderr tail). Cut in
    turn: the output tails (their starts), the result (noted as dropped),
    the oldest history entries (counted). The job's own fields are never
    cut: for a job that leaves no room, see RECORD_SLACK."""
    data = dumps(job)
    for key, from_key in TAIL_FROM:
        while len(data) > limit and isinstance(job.get(key), str):
            text = job[key]
            keep = len(text) - (len(data) - limit) - 256
            if keep > 0:
                job[key] = text[-keep:]
            else:
                del job[key]
            if type(job.get(from_key, 0)) is int:  # the cut start counts as written before the tail
                job[from_key] = job.get(from_key, 0) + len(text.encode("utf-8", "replace")) - \
                    len(job.get(key, "").encode("utf-8", "replace"))
            data = dumps(job)
    if len(data) > limit and "result" in job:
        size = len(dumps(job["result"]))
        del job["result"]
        job["result_dropped"] = f"a result of {size} bytes does not fit in max_job_bytes ({limit})"
        data = dumps(job)
    history = job.get("history")
    while len(data) > limit and isinstance(history, list) and len(history) > 1:
        cut, freed = 0, 0
        while freed < len(data) - limit and cut < len(history) - 1:
            freed += len(dumps(history[cut]))
            cut += 1
        del history[:cut]
        job["history_dropped"] = dropped_runs(job) + cut
        data = dumps(job)
    return data


def dropped_runs(job: dict) -> int:
    """How many history entries trimming has dropped from ``job`` (0 unless
    the field is a count: a job file may hold anything there)."""
    value = job.get("history_dropped")
    return value if type(value) is int and value > 0 else 0


def continues(job: dict, outcome: dict) -> bool:
    """Whether ``outcome``'s history is ``job``'s plus one run: the job's
    entries, less any oldest ones trimming dropped (and counted), then one."""
    history, previous = outcome.get("history"), job.get("history") or []
    if not isinstance(history, list) or not history or not isinstance(previous, list):
        return False
    kept = history[:-1]
    dropped = len(previous) - len(kept)
    return dropped >= 0 and previous[dropped:] == kept and dropped_runs(outcome) == dropped_runs(job) + dropped


def target_label(job: dict) -> str:
    """What ``stats`` groups a job by: its kind, else its program name."""
    if job.get("kind") is not None:
        return str(job["kind"])
    if job.get("argv"):
        return str(job["argv"][0]).rsplit("/", 1)[-1]
    command = str(job.get("command") or "").strip()
    return command.split(None, 1)[0].rsplit("/", 1)[-1] if command else ""


#: The upper bounds (seconds) of the run-duration histogram every spool
#: keeps (``status --prometheus``, the history's counters): from quick
#: handler calls to day-long batch jobs.
RUN_SECONDS_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 14400, 86400)

NO_RESULT = object()  # an Outcome's result (or exit request) when there is none


@dataclass(slots=True)
class Outcome:
    """What one run produced."""

    start: float
    end: float = 0.0
    exit_code: int | None = None
    error: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    stdout_from: int = 0  # bytes of stdout written before its kept tail
    stderr_from: int = 0
    result: Any = NO_RESULT
    permanent: bool = False
    timed_out: bool = False
    interrupted: bool = False
    not_started: bool = False  # stopped before it began: no run to count (the job goes back as it was)
    cancelled: str | None = None  # who cancelled the run while it ran (it ends for good, not retried)
    exit_request: Any = NO_RESULT  # the code of a sys.exit() in a handler (see call_handler)

    @property
    def ok(self) -> bool:
        return self.error is None and (self.exit_code in (None, 0)) and not self.interrupted

    @property
    def has_result(self) -> bool:
        return self.result is not NO_RESULT
