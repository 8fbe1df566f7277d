"""Near misses: the name a user most likely meant when they gave one that
spoolq does not know (a setting, an option, a command, a job field), for
the "did you mean" of an error. Pure, and imports nothing from spoolq."""

from __future__ import annotations

import difflib
from typing import Iterable

# Names other job queues and habits give to what spoolq calls otherwise;
# too far apart for spelling to find them.
ALIASES = {
    "retries": "max_attempts", "max_retries": "max_attempts", "max_retry": "max_attempts", "retry": "max_attempts",
    "retry_limit": "max_attempts", "attempts": "max_attempts",
    "max_tries": "max_attempts", "tries": "max_attempts", "cmd": "command", "args": "argv", "arguments": "argv",
    "workdir": "cwd", "dir": "cwd", "directory": "cwd", "environment": "env", "delay": "run_at", "eta": "run_at",
}


def _plain(name: str) -> str:
    return name.strip().lstrip("-").lower().replace("-", "_")


def near(name: str, choices: Iterable[str]) -> str | None:
    """The one of ``choices`` that ``name`` most likely meant, or None:
    the same but for case and dashes, a known alias, or a close spelling."""
    by_plain = {_plain(c): c for c in choices}
    plain = _plain(name)
    if plain in by_plain:
        return by_plain[plain]
    alias = ALIASES.get(plain)
    if alias in by_plain:
        return by_plain[alias]
    close = difflib.get_close_matches(plain, list(by_plain), n=1, cutoff=0.6)
    return by_plain[close[0]] if close else None


def did_you_mean(name: str, choices: Iterable[str], quote: bool = False) -> str:
    """`` (did you mean X?)``, or an empty string when nothing is near."""
    match = near(name, choices)
    if match is None:
        return ""
    return f" (did you mean {match!r}?)" if quote else f" (did you mean {match}?)"
