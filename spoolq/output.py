"""Everything spoolq prints: lines, JSON, one-line errors, a job's record,
and the worker's log lines (``Log``, ``LinePrinter``).

Kept apart from ``cli`` and free of click so that the quick path in
``entry`` (``spoolq show``, which scripts call in loops) prints exactly what
the click command prints without paying for importing click.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from typing import Any, NoReturn

from .errors import ConfigError, DuplicateId, InvalidJob, NoSuchGroup, NotPossible, SpoolError, UnmetDependency
from .ids import id_problem
from .record import rfc3339

LOGGER = "spoolq"  # the logger whose records the worker's log lines are
# The logging levels, as numbers: logging itself is imported only where lines are logged.
DEBUG, INFO, WARNING, ERROR = 10, 20, 30, 40


def echo(text: str = "", err: bool = False, nl: bool = True) -> None:
    """Print a line, flushed. A string UTF-8 cannot encode (a lone
    surrogate from a job file) is printed with that character escaped."""
    stream = sys.stderr if err else sys.stdout
    if stream is None:  # started with that descriptor closed (`>&-`)
        if err:
            return
        raise OSError(errno.EBADF, "standard output is closed")
    stream.write(text.encode("utf-8", "backslashreplace").decode("utf-8") + ("\n" if nl else ""))
    stream.flush()


def note(text: str) -> None:
    """``spoolq: text`` on stderr, a line that is no error."""
    echo(f"spoolq: {one_line(text)}", err=True)


def write_bytes(data: bytes, to_stderr: bool = False) -> None:
    """A job's output as it wrote it, flushed: the bytes themselves into a
    pipe or a file; on a terminal, lines escaped as ``show`` prints them
    (the output may hold escape sequences a terminal would act on)."""
    stream = sys.stderr if to_stderr else sys.stdout
    if stream is None:
        if to_stderr:
            return
        raise OSError(errno.EBADF, "standard output is closed")
    stream.flush()
    if stream.isatty():
        text = data.decode("utf-8", "replace")
        stream.write("\n".join(output_line(line) for line in text.split("\n")))
        stream.flush()
        return
    buffer = getattr(stream, "buffer", None)
    if buffer is None:
        stream.write(data.decode("utf-8", "replace"))
    else:
        buffer.write(data)
    stream.flush()


def dumps(obj: Any, **kw: Any) -> str:
    """JSON for output: UTF-8 where possible, escaped where not. Characters
    JSON leaves raw that a terminal may act on (C1 controls such as U+009B,
    bidi overrides, line separators) are written as ``\\uXXXX``."""
    text = json.dumps(obj, ensure_ascii=False, **kw)
    if not text.replace("\n", "").isprintable():  # a raw newline is indent's, between values
        text = "".join(c if c.isprintable() or c == "\n" else _json_escape(c) for c in text)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, **kw)


def _json_escape(c: str) -> str:
    """``c`` as JSON's ``\\uXXXX`` escape (a surrogate pair above U+FFFF)."""
    n = ord(c)
    if n <= 0xFFFF:
        return f"\\u{n:04x}"
    n -= 0x10000
    return f"\\u{0xD800 + (n >> 10):04x}\\u{0xDC00 + (n & 0x3FF):04x}"


def one_line(text: str) -> str:
    """``text`` with control characters (and undecodable bytes) escaped: a
    file dropped as ``a<newline>b``, or an argument holding a newline or a
    terminal escape, must not split or colour a line read line by line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in text)


def output_line(text: str) -> str:
    """A line of a job's output as ``show`` prints it: escaped as by
    ``one_line``, except tabs, which align columns and move nothing else."""
    if text.isprintable():
        return text
    return "\t".join(one_line(part) for part in text.split("\t"))


def fail(message: str, code: int = 1) -> NoReturn:
    """``spoolq: message`` on stderr (one line, whatever it quotes), then
    exit with ``code``."""
    try:
        echo(f"spoolq: {one_line(message)}", err=True)
    except OSError:
        pass  # stderr is gone too: the exit code is all that is left
    sys.exit(code)


def fail_for(error: BaseException) -> NoReturn:
    """Exit with a one-line message for an exception from the core, or
    re-raise it when it is not one the command knows how to describe.

    1: the request could not be done; 2: invalid input or settings;
    130: interrupted; 141: the reader of stdout went away."""
    if isinstance(error, UnmetDependency):
        fail(str(error), 1)
    if isinstance(error, (InvalidJob, ConfigError, NoSuchGroup)):
        fail(str(error), 2)
    if isinstance(error, (DuplicateId, SpoolError)):
        fail(str(error), 1)
    if isinstance(error, BrokenPipeError):
        # The reader went away (``spoolq list | head``): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(141)
    if isinstance(error, PermissionError):
        blocked = blocked_by(error.filename) if isinstance(error.filename, str) else None
        if blocked:
            fail(f"permission denied: {blocked} (so {error.filename} cannot be reached)", 1)
        fail(f"permission denied: {error.filename or error}", 1)
    if isinstance(error, OSError):
        where = f": {error.filename}" if error.filename else ""
        fail(f"{error.strerror or error}{where}", 1)
    if isinstance(error, KeyboardInterrupt):
        fail("interrupted", 130)
    if not isinstance(error, Exception) or os.environ.get("SPOOLQ_DEBUG"):
        raise error
    import sqlite3

    if isinstance(error, sqlite3.Error):
        fail(f"index.db: {error}", 1)
    # A bug or an unexpected state: still one line.
    fail(f"internal error: {type(error).__name__}: {error} (SPOOLQ_DEBUG=1 shows the traceback)", 1)


def blocked_by(path: str) -> str | None:
    """The folder above ``path`` that this user may not enter, if one is:
    the one whose permissions to change, not ``path`` itself."""
    parent = os.path.dirname(os.path.abspath(path))
    folders = [parent]
    while os.path.dirname(folders[-1]) != folders[-1]:
        folders.append(os.path.dirname(folders[-1]))
    for folder in reversed(folders):
        if os.path.isdir(folder) and not os.access(folder, os.X_OK):
            return folder
    return None


def require_spool(spool) -> None:
    """Exit 1 with the backend's one line when there is no spool there."""
    problem = spool.backend.missing()
    if problem is not None:
        fail(problem, 1)


def refuse_bad_ids(job_ids) -> None:
    """Exit 2 (invalid input) for an id no job can have, before any is acted on."""
    for job_id in job_ids:
        problem = id_problem(job_id)
        if problem:
            fail(problem, 2)  # quoted: a hostile id cannot break the line


ABANDONED = "abandoned: the worker running it died; 'spoolq sweep' (or the next worker) recovers it"


def show(spool, job_id: str, as_json: bool) -> None:
    """``spoolq show``: one job's record, wherever it is, or exit 1."""
    require_spool(spool)
    job = spool.get(job_id)  # also a file `list` shows under a name that is no valid id
    if job is None:
        try:
            whole = spool.resolve(job_id)  # the start of an id
        except NotPossible as e:
            fail(str(e), 1)
        job = spool.get(whole) if whole != job_id else None
    if job is None:
        refuse_bad_ids((job_id,))
        fail(f"no job {job_id} in this spool", 1)
    if as_json:
        echo(dumps(job, indent=2))
        return
    for key, value in job.items():
        if key in ("stdout", "stderr") and isinstance(value, str):
            echo(f"{key}:")
            text = value.rstrip("\n")
            for line in text.split("\n") if text else ():  # the output's own lines; a \r among them shown escaped
                echo(f"  | {output_line(line)}")
        elif key == "history" and isinstance(value, list):
            echo("history:")
            for h in value:
                echo(one_line("  - " + " ".join(f"{k}={v}" for k, v in h.items()) if isinstance(h, dict) else f"  - {h}"))
        else:
            echo(one_line(f"{key}: {value if isinstance(value, str) else dumps(value)}"))
    if job.get("abandoned"):
        echo(f"note: {ABANDONED}")
    if job.get("moved_back_from"):
        echo(f"note: {moved_back(job)}: error, exit_code, stdout and stderr are of its last run, before the move "
             "(history has every run)")
    if job.get("waits_for_handler"):
        echo(one_line(f"note: {waits_for_handler(job)}; no worker of this spool has one (spoolq work --app "
                      "MODULE:ATTR, or spoolq config set app MODULE)"))


def moved_back(job: dict) -> str:
    """What a job in new/ whose record says it was elsewhere is: moved back by hand."""
    return f"moved back to new/ from {job.get('moved_back_from')}/ by hand; it waits for a fresh run"


def waits_for_handler(job: dict) -> str:
    """What a waiting handler job that no worker can run waits for."""
    return f"waits for a worker with a handler for kind {job.get('kind')}"


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level, as sd-daemon(3) prefixes a
    line with it: 3 err, 4 warning, 6 info, 7 debug."""
    if levelno >= ERROR:
        return 3
    if levelno >= WARNING:
        return 4
    return 6 if levelno >= INFO else 7


def under_journal(stream: Any) -> bool:
    """Whether ``stream`` is connected to systemd's journal: $JOURNAL_STREAM
    gives the device and inode of the journal's stream, and a process run
    by a service inherits the variable even when its stderr goes elsewhere
    (``2>>file``), so the descriptor is checked against it."""
    value = os.environ.get("JOURNAL_STREAM")
    if not value:
        return False
    try:
        dev, ino = (int(part) for part in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class LinePrinter:
    """Prints log lines as ``spoolq work`` does: ``TIME text`` (TIME in
    RFC 3339, UTC, milliseconds); under systemd's journal, which stamps
    lines itself, ``<PRIORITY>text`` instead, so that ``journalctl -p err``
    finds dead jobs and errors. The stream is fixed when the printer is
    made: while in-process handlers run, sys.stderr is theirs (see
    runner.call_handler)."""

    def __init__(self, stream: Any = None):
        self.stream = sys.stderr if stream is None else stream  # None: started with stderr closed
        self.journal = self.stream is not None and under_journal(self.stream)
        # Re-entrant: a signal handler (which runs on the main thread, maybe
        # in the middle of a line) logs too, and must not wait for itself.
        self._lock = threading.RLock()

    def write(self, text: str, levelno: int, created: float | None = None) -> None:
        """Print ``text`` (one line) logged at ``levelno`` (a logging level)
        at ``created`` (now if None)."""
        if self.stream is None:
            return
        if self.journal:
            line = f"<{syslog_priority(levelno)}>{text}\n"
        else:
            line = f"{rfc3339(created)[:23]}Z {text}\n"
        with self._lock:
            try:
                self.stream.write(line)
                self.stream.flush()
            except (OSError, ValueError):
                pass


def log_to_stderr() -> None:
    """Print the ``spoolq`` logger's records on stderr with a LinePrinter,
    and only there (an --app module that configures logging gets none of
    them twice)."""
    import logging  # imported here: start-up speed (as in Log)

    printer = LinePrinter()

    class LineHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            printer.write(one_line(record.getMessage()), record.levelno, record.created)

    logger = logging.getLogger(LOGGER)
    logger.addHandler(LineHandler())
    logger.setLevel(logging.DEBUG)  # how much is logged is the worker's Log level (-q, -v)
    logger.propagate = False


class Log:
    """A worker's log: one grep-friendly line per job outcome or event.

    The lines are records of the ``spoolq`` logger (or of ``logger``), each
    with a level: ERROR for a job gone dead and for errors, WARNING for a
    failed run and what else wants a look, INFO for the rest, DEBUG for the
    verbose lines. ``spoolq work`` prints them (output.log_to_stderr); a
    program that configures logging gets them like any library's. Given a
    ``stream``, the lines are printed on it instead, as ``spoolq work``
    prints them. ``level`` is how much is logged at all: 0 problems only
    (``spoolq work -q``), 1 outcomes, 2 verbose."""

    def __init__(self, stream: Any = None, level: int = 1, logger: Any = None):
        import logging  # imported here: start-up speed (``spoolq show`` prints through this module, and logs nothing)

        self.level = level
        self.logger = logger if logger is not None else logging.getLogger(LOGGER)
        self._printer = LinePrinter(stream) if stream is not None else None

    def line(self, text: str, level: int = 1, severity: int | None = None) -> None:
        """Log ``text`` if ``level`` is within this log's; ``severity`` (a
        logging level) defaults to ERROR, INFO and DEBUG for levels 0, 1, 2."""
        if level > self.level:
            return
        if severity is None:
            severity = _SEVERITY[level]
        text = one_line(text)  # a file name or an error quoted in it may hold any character
        if self._printer is not None:
            self._printer.write(text, severity)
        elif self.logger.isEnabledFor(severity):
            self.logger.log(severity, text, stacklevel=2)


    def wants(self, level: int = 1, severity: int | None = None) -> bool:
        """Whether a line of ``level`` would be logged (so a caller can skip building it)."""
        if level > self.level:
            return False
        return self._printer is not None or self.logger.isEnabledFor(_SEVERITY[level] if severity is None else severity)


_SEVERITY = {0: ERROR, 1: INFO, 2: DEBUG}


def wants(log: Any, level: int = 1, severity: int | None = None) -> bool:
    """Whether ``log`` (a Log, or an object with only a ``line`` method,
    which takes every line) would log a line of ``level``."""
    check = getattr(log, "wants", None)
    return True if check is None else check(level, severity)


def as_log(log: Any) -> Any:
    """A worker's Log for what Spool.work was given: a Log (or an object
    with its ``line`` method) as it is, a logging.Logger (or adapter) to
    take every line, or None for the ``spoolq`` logger (whose records
    logging shows as configured)."""
    if isinstance(log, Log) or callable(getattr(log, "line", None)):  # a Log, or an object with its line method
        return log
    if log is None:
        return Log(level=2)
    import logging  # imported here: start-up speed (as in Log)

    if isinstance(log, (logging.Logger, logging.LoggerAdapter)):
        return Log(level=2, logger=log)
    raise TypeError(f"log must be a logging.Logger, not {type(log).__name__}")


def quoted(text: str) -> str:
    """A value for a ``key="value"`` field of a log line: one line, no double quote, at most 200 characters."""
    text = text.replace("\n", " ").replace('"', "'")
    return f'"{text[:200]}"'


def field(value: Any) -> str:
    """A value for a ``key=value`` field of a log line: as it is when it is
    one word, quoted (as by ``quoted``) when it holds a space, a quote, an
    ``=`` or a control character, so a file named ``x outcome=succeeded``
    cannot add a field of its own to the line."""
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' "\'='):
        return text
    return quoted(text)


def log_what_waits(spool: Any, log: Log) -> None:
    """Log, as ``spoolq work`` ends, how many jobs wait failed and when the
    first of them is due again, and how many are dead: a worker run from
    cron exits 0 whatever its jobs did, so this line is what its mail says.
    Nothing when there are neither."""
    try:
        left = spool.backend.leftovers()
    except Exception:  # (a folder made unreadable meanwhile) a note must not fail a clean exit
        return
    failed, next_due, dead = left["failed"], left["next_retry"], left["dead"]
    parts = []
    if failed:
        when = "due now" if next_due is None or next_due <= time.time() else time.strftime("at %Y-%m-%dT%H:%M:%SZ", time.gmtime(next_due))
        parts.append(f"{failed} job{'s wait' if failed != 1 else ' waits'} in failed/ (next retry {when})")
    if dead:
        parts.append(f"{dead}{'' if failed else ' job' if dead == 1 else ' jobs'} dead (spoolq list --state dead)")
    if parts:
        # Not under -q (cron's mail, every minute): a dead job was told once,
        # at ERROR, when it died, and a failed one is retried by design.
        log.line("stopped: " + ", ".join(parts), 1, WARNING)

# -- the live view (spoolq top) -------------------------------------------------

def _age(seconds: float | None) -> str:
    """3s, 4m05s, 2h03m, 3d04h."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _clock(epoch: float | None) -> str:
    return "-" if epoch is None else time.strftime("%H:%M:%SZ", time.gmtime(epoch))


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}/s" if value < 100 else f"{value:.0f}/s"


def top_lines(view: dict, width: int = 10_000, height: int | None = None) -> list[str]:
    """One look of ``spoolq top`` (top.View.look) as lines of at most
    ``width`` characters, at most ``height`` of them (the running jobs and
    failures shortened first)."""
    c, now = view["counts"], view["at"]
    paused = view.get("paused")
    head = [f"spoolq top  {view['location']}  {rfc3339(now)[:19]}Z"
            + (f"  PAUSED by {paused.get('by')} ('spoolq resume')" if paused else "")]
    states = f"new {c['new']}  running {c['cur']}  failed {c['failed']}  dead {c['dead']}  done {c['done']}"
    if c.get("dropped") is not None:
        states += f"  dropped {c['dropped']}"
    if c.get("abandoned"):
        states += f"  ({c['abandoned']} abandoned)"
    head.append(f"jobs      {states}")
    rates = view["rates"]
    over = f"  (over the last {int(rates['over'])}s)" if rates.get("over") else ""
    head.append(f"rates     enqueued {_rate(rates['enqueued'])}  finished {_rate(rates['finished'])}{over}")
    due = view.get("next_retry")
    head.append("retry     " + ("none waiting" if due is None else
                                "next due now" if due <= now else f"next in {_age(due - now)} (at {_clock(due)})"))
    workers = _top_workers(view, paused is not None)
    running = [f"running   {len(view['running'])}" + ("+" if c["cur"] > len(view["running"]) else "")]
    for r in view["running"]:
        what = r["what"]
        if r.get("line") and len(what) > 32:  # room for the last line on a narrow screen
            what = what[:29] + "..."
        line = f"  {_age(r['age']):>7}  {r['id']}  {r.get('worker') or ('abandoned' if r.get('abandoned') else '-')}  {what}"
        running.append(line + (f"  | {r['line']}" if r.get("line") else ""))
    failures = [f"failures  {len(view['failures'])} latest" if view["failures"] else "failures  none"]
    for f in view["failures"]:
        said = f"{f['state']:<6}  {_clock(f['at'])}  {f['id']}  try {f.get('attempts') or '-'}"
        if f.get("due"):
            said += f"  retry {_clock(f['due'])}"
        failures.append(f"  {said}  {f.get('error') or ''}".rstrip())
    lines = _fit(head + workers, running, failures, height)
    return [one_line(line)[:width] for line in lines]


def _top_workers(view: dict, paused: bool) -> list[str]:
    if not view.get("workers_seen", True):
        return ["workers   - (seen by the spool's owner only)"]
    lines = [f"workers   {len(view['workers'])}"]
    for w in view["workers"]:
        jobs = len(w.get("jobs") or {})
        state = f"running {jobs}" if jobs else "paused" if paused else "idle"
        if jobs and paused:
            state += ", paused"
        lines.append(f"  {w.get('worker')}  pid {w.get('pid')}  {state}  since {str(w.get('started_at') or '-')[:19]}")
    return lines


def _fit(fixed: list[str], running: list[str], failures: list[str], height: int | None) -> list[str]:
    """The lines that fit ``height``: the fixed ones and the two section
    heads, then as many running jobs and failures as there is room for (a
    line says how many running jobs more)."""
    if height is None or len(fixed) + len(running) + len(failures) <= height:
        return fixed + running + failures
    room = max(0, height - len(fixed) - 2)
    failed = failures[1:][:room // 3]
    left, ran = room - len(failed), running[1:]
    if len(ran) > left:
        ran = ran[:left - 1] + [f"  ... {len(ran) - left + 1} more"] if left else []
    return (fixed + running[:1] + ran + failures[:1] + failed)[:height]


class Terminal:
    """``spoolq top`` on a terminal: the alternate screen, no cursor, keys
    read one at a time without echo; all of it given back on the way out
    (also on SIGTERM or a hang-up, which end the view as Ctrl-C does)."""

    def __init__(self, out: Any, keys: Any):
        self.out = out
        self.keys = keys  # a terminal's stdin, or None
        self._saved: Any = None
        self._handlers: dict[int, Any] = {}

    def __enter__(self) -> "Terminal":
        import signal
        import termios

        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._handlers[signum] = signal.signal(signum, _interrupt)
        if self.keys is not None:
            fd = self.keys.fileno()
            self._saved = termios.tcgetattr(fd)
            mode = termios.tcgetattr(fd)
            mode[3] &= ~(termios.ICANON | termios.ECHO)  # keys one at a time, unseen; Ctrl-C still interrupts
            mode[6][termios.VMIN], mode[6][termios.VTIME] = 1, 0
            termios.tcsetattr(fd, termios.TCSANOW, mode)
        self.out.write("\x1b[?1049h\x1b[?25l")
        self.out.flush()
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal
        import termios

        try:
            self.out.write("\x1b[?25h\x1b[?1049l")
            self.out.flush()
        except (OSError, ValueError):
            pass
        if self._saved is not None:
            termios.tcsetattr(self.keys.fileno(), termios.TCSANOW, self._saved)
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)

    def draw(self, lines: list[str]) -> None:
        """Over the last look, in place: each line cleared to its end, the rest of the screen below."""
        self.out.write("\x1b[H" + "".join(line + "\x1b[K\n" for line in lines[:-1]) + (lines[-1] if lines else "")
                       + "\x1b[K\x1b[J")
        self.out.flush()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_top(view: Any, iterations: int | None = None) -> None:
    """``spoolq top``: a look of ``view`` (top.View) drawn in place on a
    terminal, each time the view says one is due, until ``q`` (or Ctrl-C);
    plain blocks one after another when stdout is no terminal. Ends after
    ``iterations`` looks when given."""
    out = sys.stdout
    if out is None or not out.isatty():
        _top_blocks(view, iterations)
        return
    keys = sys.stdin if sys.stdin is not None and sys.stdin.isatty() else None
    with view, Terminal(out, keys) as screen:
        shown = 0
        while True:
            try:
                columns, rows = os.get_terminal_size(out.fileno())
            except OSError:
                columns, rows = 80, 24
            lines = top_lines(view.look(), columns, rows)
            screen.draw(lines)
            shown += 1
            if iterations is not None and shown >= iterations:
                break
            while (fd := view.wait([keys.fileno()] if keys is not None else [])) is not None:
                pressed = os.read(fd, 64)
                if not pressed or pressed[:1] in (b"q", b"Q"):
                    return
                if pressed[:1] in (b" ", b"\x0c"):  # space or Ctrl-L: look now
                    break
    for line in lines:  # -n ran out: its last look stays on the screen given back
        echo(line)


def _top_blocks(view: Any, iterations: int | None) -> None:
    with view:
        shown = 0
        while True:
            if shown:
                echo("")
            for line in top_lines(view.look()):
                echo(line)
            shown += 1
            if iterations is not None and shown >= iterations:
                return
            view.wait()
