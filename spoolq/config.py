"""Spool settings: ``config.json`` at the spool root, with defaults.

A job's own field (``max_attempts``, ``timeout``) beats the spool setting.
Settings in seconds take the duration syntax of the options (``5m``,
``1h30m``) in ``config set`` and in a hand-written config.json alike; ``config
set`` stores them as seconds.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from typing import Any

from .errors import ConfigError, SpoolError  # noqa: F401 - importable from here too
from .owners import check_owner_file
from .record import MAX_TIMEOUT, InvalidJob, parse_duration, validate_lock_name
from .words import did_you_mean

DEFAULTS: dict[str, Any] = {
    "max_attempts": 5,
    "backoff_initial": 60,
    "backoff_factor": 2,
    "backoff_max": 3600,
    "timeout": 0,
    "idle_timeout": 0,
    "timeout_grace": 5,
    "fsync": True,
    "output_limit": 8192,
    "log_limit": 65536,
    "max_job_bytes": 1048576,
    "trusted_users": [],
    "allow_commands": True,
    "allowed_kinds": [],
    "root_handlers": False,
    "compact_after": 10000,
    "rescan_interval": 30,
    "app": "",
    "relay_to": "",
    "lock_limits": {},
}

HELP = {
    "max_attempts": "runs before a failing job goes to dead/ (integer >= 1)",
    "backoff_initial": "seconds to wait after the first failed run",
    "backoff_factor": "each further failure multiplies the wait by this (>= 1)",
    "backoff_max": "the longest wait between runs, in seconds",
    "timeout": "seconds before a run is killed; 0 means no limit",
    "idle_timeout": "seconds a run may write no output before it is killed; 0 means no limit",
    "timeout_grace": "seconds between SIGTERM and SIGKILL when a run times out",
    "fsync": "make enqueues and outcomes durable against power loss",
    "output_limit": "bytes of stdout and of stderr kept in the record (the tail)",
    "log_limit": "bytes of stdout and of stderr of a running job kept for `logs` (the latest; 0 = none)",
    "max_job_bytes": "largest job file that is read; larger ones go to dead/",
    "trusted_users": "users besides the worker's own, the spool's owner and root whose job files run",
    "allow_commands": "run command and argv jobs (false: they go to dead/, enqueue refuses them)",
    "allowed_kinds": "the handler kinds that run (empty = every kind); others go to dead/",
    "root_handlers": "a root worker runs handler jobs that others enqueued (as root)",
    "compact_after": "fold done/ into index.db when it holds more files (0 = never)",
    "rescan_interval": "seconds between full rescans in watch mode",
    "lock_limits": "jobs holding a lock name that may run at once, by name, beyond the default 1 (gpu=2,db=4)",
    "app": "the handlers every worker loads when --app is not given (MODULE:ATTR, or MODULE for MODULE:HANDLERS)",
    "relay_to": "the PostgreSQL spool 'spoolq relay' moves this spool's jobs into (set by relay; status counts what waits)",
}

_APP_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*)?\Z")


# Durations are capped at ten years, as a job's timeout is: a due time or a
# timer much further out overflows the nanosecond clocks it is kept in.
MAX_SECONDS = MAX_TIMEOUT


def _number(key: str, value: Any, minimum: float, integer: bool = False, above: bool = False,
            maximum: float | None = None, clamp: bool = False) -> int | float:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{key} must be a number, not {value!r}") from None
    return _checked_number(key, value, minimum, integer, above, maximum, clamp)


def _seconds(key: str, value: Any, above: bool = False, clamp: bool = False) -> int | float:
    """A duration setting: a number of seconds, or the duration syntax of
    the command line's options (``5m``, ``1h30m``), stored as seconds."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            given = value
            try:
                value = parse_duration(value)
            except ValueError:
                raise ConfigError(f"{key} must be a duration (like 90, 5m, 1h30m, 7d), not {value!r}") from None
            if value.is_integer():
                value = int(value)  # stored as 300, as `config set timeout 300` stores it
            try:
                return _checked_number(key, value, 0, above=above, maximum=MAX_SECONDS, clamp=clamp)
            except ConfigError as e:
                raise ConfigError(f"{e} (given as {given!r})") from None
    return _checked_number(key, value, 0, above=above, maximum=MAX_SECONDS, clamp=clamp)


def _checked_number(key: str, value: Any, minimum: float, integer: bool = False, above: bool = False,
                    maximum: float | None = None, clamp: bool = False) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a number, not {value!r}")
    if integer:
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{key} must be a whole number, not {value!r}")
            value = int(value)
    if value < minimum or (above and value == minimum):
        op = ">" if above else ">="
        raise ConfigError(f"{key} must be {op} {minimum:g}, not {value!r}")
    if maximum is not None and value > maximum:
        if clamp:
            return maximum
        raise ConfigError(f"{key} must be <= {maximum:g}, not {value!r}")
    return value


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "on", "yes", "1"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "off", "no", "0"):
        return False
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{key} must be true or false, not {value!r}")


def _list(key: str, value: Any, what: str) -> Any:
    """A list given as text (a JSON list, or words separated by commas) as a
    list; anything else as it is."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError:
            raise ConfigError(f"{key} must be a list of {what}") from None
    return [word.strip() for word in text.split(",") if word.strip()]


def _users(key: str, value: Any, stored: bool = False) -> list[str]:
    value = _list(key, value, "user names")
    if not isinstance(value, list) or not all(isinstance(u, (str, int)) and not isinstance(u, bool) for u in value):
        raise ConfigError(f"{key} must be a list of user names or uids")
    users = [str(u) for u in value]
    if not stored:
        # A misspelt name would trust nobody, silently. A numeric uid is taken
        # as it is: it need not have a name here (a container, NFS).
        import pwd

        for user in users:
            if user.isdigit():
                continue
            try:
                pwd.getpwnam(user)
            except KeyError:
                raise ConfigError(f"{key}: no user {user!r} on this system (give a user name or a numeric uid)") from None
    return users


def _kinds(key: str, value: Any) -> list[str]:
    value = _list(key, value, "kinds")
    if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
        raise ConfigError(f"{key} must be a list of kinds (names of handlers)")
    return list(value)


def _app(key: str, value: Any) -> str:
    """A handler module as ``--app`` takes it: MODULE:ATTR, or MODULE alone
    (its HANDLERS); empty for none. Checked for its form only: importing
    it is the worker's, as the user the worker runs as."""
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be MODULE:ATTR (like myapp.jobs:HANDLERS), not {value!r}")
    value = value.strip()
    if value and not _APP_RE.match(value):
        raise ConfigError(f"{key} must be MODULE:ATTR (like myapp.jobs:HANDLERS), not {value!r}")
    return value


def _lock_limits(key: str, value: Any) -> dict[str, int]:
    """Lock names and how many jobs holding each may run at once: a JSON
    object, or ``NAME=N`` pairs separated by commas."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError:
                value = None
        else:
            pairs = [word.strip().partition("=") for word in text.split(",") if word.strip()]
            value = {name.strip(): n.strip() for name, eq, n in pairs} if all(eq for _, eq, _ in pairs) else None
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be NAME=N pairs separated by commas (gpu=2,db=4) or a JSON object")
    limits = {}
    for name, n in value.items():
        try:
            validate_lock_name(name)
        except InvalidJob as e:
            raise ConfigError(f"{key}: {e}") from None
        limits[name] = _number(f"{key}[{name!r}]", n, 1, integer=True)
    return limits


def lock_limit(settings: dict[str, Any], name: str) -> int:
    """How many jobs holding lock ``name`` may run at once."""
    return (settings.get("lock_limits") or {}).get(name, 1)


def unknown(key: str) -> str:
    """The error for a setting spoolq does not know, with the one most
    likely meant, or else all of them."""
    hint = did_you_mean(key, DEFAULTS)
    if hint:
        return f"unknown setting {key!r}{hint}"
    return f"unknown setting {key!r} (known: {', '.join(sorted(DEFAULTS))})"


def setting_name(key: str) -> str:
    """A setting's name as a command gives it: dashes count as underscores
    (``max-attempts``); config.json itself spells them as they are."""
    if key not in DEFAULTS and key.replace("-", "_") in DEFAULTS:
        return key.replace("-", "_")
    return key


def check(key: str, value: Any, stored: bool = False) -> Any:
    """Validate one setting and return it in its stored type. ``stored``:
    read from config.json, where a duration beyond the cap (written before
    there was one) is taken as the cap rather than refused."""
    if key not in DEFAULTS:
        raise ConfigError(unknown(key))
    if key == "max_attempts":
        return _number(key, value, 1, integer=True)
    if key in ("output_limit", "log_limit", "compact_after"):
        return _number(key, value, 0, integer=True)
    if key == "max_job_bytes":
        return _number(key, value, 1, integer=True)
    if key == "backoff_factor":
        return _number(key, value, 1)
    if key == "rescan_interval":
        return _seconds(key, value, above=True, clamp=stored)
    if key in ("backoff_initial", "backoff_max", "timeout", "idle_timeout", "timeout_grace"):
        return _seconds(key, value, clamp=stored)
    if key in ("fsync", "allow_commands", "root_handlers"):
        return _bool(key, value)
    if key == "allowed_kinds":
        return _kinds(key, value)
    if key == "trusted_users":
        return _users(key, value, stored)
    if key == "app":
        return _app(key, value)
    if key == "relay_to":
        return _relay_to(key, value)
    if key == "lock_limits":
        return _lock_limits(key, value)
    raise AssertionError(key)


def _relay_to(key: str, value: Any) -> str:
    """A postgresql:// URL without a password (config.json is readable by
    the spool's users), or "" for none."""
    from urllib.parse import urlsplit

    if not isinstance(value, str) or (value and not value.startswith(("postgresql://", "postgres://"))):
        raise ConfigError(f"{key} must be a postgresql:// URL (or empty), not {value!r}")
    if value and (urlsplit(value).password or "password=" in value):
        raise ConfigError(f"{key} must not carry a password: use ~/.pgpass or PGPASSWORD")
    return value


def refusal(settings: dict[str, Any], job: dict) -> str | None:
    """Why the spool's settings refuse a job of this kind (allow_commands,
    allowed_kinds), or None: the reason a worker gives it in dead/, and
    enqueue's for refusing it."""
    kind = job.get("kind")
    if kind is None:
        if not settings.get("allow_commands", True):
            what = "argv" if job.get("argv") is not None else "command"
            return f"{what} jobs are not allowed in this spool (allow_commands is false)"
        return None
    kinds = settings.get("allowed_kinds") or []
    if kinds and kind not in kinds:
        return f"kind {kind!r} is not in this spool's allowed_kinds ({', '.join(kinds)})"
    return None


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_file(path: str) -> bytes:
    """The first MiB of config.json, read only if it is a regular file: a
    FIFO would block every reader, and a symbolic link (never followed)
    would let whoever may write the spool root point the settings anywhere."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a symbolic link, not a regular file") from None
        if e.errno == errno.ENXIO:  # a socket: it cannot be opened
            raise ConfigError(f"{path} is a socket, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        mode = st.st_mode
        if not stat.S_ISREG(mode):
            what = next((name for test, name in _KINDS if test(mode)), "of another kind")
            raise ConfigError(f"{path} is {what}, not a regular file")
        try:
            # Settings decide whose files run: only the spool's owner (or root) may have written them.
            check_owner_file(path, st, os.stat(os.path.dirname(path) or ".").st_uid)
        except SpoolError as e:
            raise ConfigError(str(e)) from None
        chunks, left = [], 1 << 20
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


REPAIR = "spoolq config set KEY VALUE writes a valid one, keeping the settings it can read"


def load(root: str) -> dict[str, Any]:
    """The spool's settings: config.json over the defaults. A broken file is
    an error (a worker must not run with settings nobody chose)."""
    settings = dict(DEFAULTS)
    path = os.path.join(root, "config.json")
    try:
        raw = read_file(path)
    except FileNotFoundError:
        return settings
    except PermissionError:
        raise  # no access to the spool (or the file): not a bad setting, and said as such
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    try:
        stored = json.loads(raw or b"{}")
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON: {e} ({REPAIR})") from None
    if not isinstance(stored, dict):
        raise ConfigError(f"{path} must hold a JSON object ({REPAIR})")
    for key, value in stored.items():
        try:
            settings[key] = check(key, value, stored=True)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}; spoolq config unset {key} removes it") from None
    return settings


class Settings(dict):
    """The one holder of a spool's settings, shared by everything that
    reads them (the worker, the transitions, automatic compaction, the
    spool directory's fsync flag): ``reload()`` replaces the values in
    place, so a SIGHUP reaches every reader at once. ``generation`` counts
    the loads, for readers that keep something worked out from a value
    (the trusted users' uids). ``on_load`` callbacks are told of each load."""

    def __init__(self, root: str):
        super().__init__()
        self.root = root
        self.loaded = False
        self.generation = 0
        self._on_load: list[Any] = []

    def on_load(self, callback: Any) -> None:
        """Call ``callback(settings)`` after each load from now on."""
        self._on_load.append(callback)

    def reload(self) -> None:
        """Read config.json again; on an error (raised) the values stay as they were."""
        self.use(load(self.root))

    def use(self, values: dict[str, Any]) -> None:
        """Take ``values`` as the settings."""
        self.clear()
        self.update(values)
        self.loaded = True
        self.generation += 1
        for callback in self._on_load:
            callback(self)


def read_stored(root: str) -> tuple[dict[str, Any], bytes, dict[str | None, str]]:
    """Only the settings written in config.json (no defaults), for a change
    of them: (every setting that could be read, the file's bytes, what
    could not be: key (None: the whole file) -> why). A file that does not parse, unknown
    keys and bad values are dropped, so that ``config set`` and ``config
    unset`` can always write a valid file; a file that is not a regular
    file of the spool's owner is still refused (ConfigError)."""
    path = os.path.join(root, "config.json")
    try:
        raw = read_file(path)
    except FileNotFoundError:
        return {}, b"", {}
    try:
        stored = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as e:
        return {}, raw, {None: f"it is not valid JSON ({e})"}
    if not isinstance(stored, dict):
        return {}, raw, {None: "it is not a JSON object"}
    kept, dropped = {}, {}
    for key, value in stored.items():
        try:
            check(key, value, stored=True)
        except ConfigError as e:
            dropped[key] = f"{key} = {json.dumps(value)[:60]} ({e})"
            continue
        kept[key] = value
    return kept, raw, dropped


def dumps(stored: dict[str, Any]) -> bytes:
    return (json.dumps(stored, indent=2, sort_keys=True) + "\n").encode()


def backoff(settings: dict[str, Any], failures: int, jitter: float) -> float:
    """Seconds to wait after the ``failures``-th failed run:
    ``min(backoff_max, initial * factor**(failures-1))`` times ``1 + jitter``
    (jitter in [-0.1, 0.1], applied after the cap; zero stays zero)."""
    initial = float(settings["backoff_initial"])
    factor = float(settings["backoff_factor"])
    cap = float(settings["backoff_max"])
    try:
        delay = initial * factor ** max(0, failures - 1)
    except OverflowError:
        delay = math.inf
    delay = min(cap, delay)
    return max(0.0, delay * (1.0 + jitter))
