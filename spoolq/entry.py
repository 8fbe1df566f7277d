"""The ``spoolq`` executable.

Importing click costs ~40 ms on a small machine, more than everything
``spoolq show`` does. Scripts poll a job with ``spoolq show ID`` in loops, so
the plain forms of that one command, ``spoolq [-s DIR] show ID [--json]``,
are answered without click by the same function the click command calls
(``output.show``). Every other command line, help and errors included, goes
to the click CLI unchanged.
"""

from __future__ import annotations

import os
import sys


def plain_show(args: list[str]) -> tuple[str, str, bool] | None:
    """(spool directory, id, as_json) when ``args`` is a plain ``show``
    command line; None for anything click should parse."""
    spool_dir = os.environ.get("SPOOLQ_DIR", "spool")
    if spool_dir == "":
        return None  # leave click's reading of an empty variable to click
    rest = list(args)
    if rest and rest[0] in ("-s", "--spool") and len(rest) >= 2:
        spool_dir, rest = rest[1], rest[2:]
    elif rest and rest[0].startswith("--spool="):
        spool_dir, rest = rest[0][len("--spool="):], rest[1:]
    elif rest and rest[0].startswith("-s") and len(rest[0]) > 2 and rest[0][2] != "-":
        spool_dir, rest = rest[0][2:], rest[1:]
    if not spool_dir or not rest or rest[0] != "show":
        return None  # an empty spool directory is click's to refuse
    options = [a for a in rest[1:] if a.startswith("-")]
    ids = [a for a in rest[1:] if not a.startswith("-")]
    if len(ids) != 1 or options not in ([], ["--json"]):
        return None
    return spool_dir, ids[0], bool(options)


def main() -> None:
    """Run the ``spoolq`` command line."""
    quick = plain_show(sys.argv[1:])
    if quick is None:
        try:
            from .cli import main as click_main  # imported here: start-up speed (click, for every command but a plain show)
        except KeyboardInterrupt:  # Ctrl-C while Python imports: nothing was done yet
            sys.stderr.write("spoolq: interrupted\n")
            sys.exit(130)
        click_main()
        return
    spool_dir, job_id, as_json = quick
    from . import output  # imported here: start-up speed (plain_show needs neither)
    from .spool import Spool

    try:
        output.show(Spool(spool_dir), job_id, as_json)
    except (Exception, KeyboardInterrupt) as e:
        output.fail_for(e)
