"""The ``spoolq`` command: parse arguments, call ``Spool``, print.

Exit status: 0 success; 1 the request could not be done (unknown id,
duplicate id, job not cancellable, disk errors); 2 usage or invalid input;
75 a member's cancel or retry that no worker answered in time (it is
carried out later). Errors are one line on stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import click

from . import controlcli, output, record
from .errors import JobNotFound, NotPossible, RequestPending
from .output import dumps, echo, fail, one_line
from .spool import PartlyEnqueued, Spool, load_app
from .words import did_you_mean

STATE_CHOICE = click.Choice(["new", "cur", "failed", "dead", "done", "held", "waiting"])
# A member's cancel or retry that no worker answered in time: it waits in
# drop/ and is carried out later (EX_TEMPFAIL, as mail tools say "queued").
PENDING = 75


class Seconds(click.FloatRange):
    """A number of seconds: a FloatRange that also refuses nan and inf
    (click's lets nan through, since every comparison with it is false)."""

    name = "seconds"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return number


def _duration(ctx, param, value):
    if value is None:
        return None
    ctx.meta.setdefault("spoolq.given", {})[param.name] = value  # for messages: what the user wrote
    try:
        return record.parse_duration(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _history_duration(ctx, param, value):
    """A duration that decides which history goes (``compact --keep``,
    ``purge --older-than``): a unit is required, since ``--keep 30`` read
    as seconds drops what was meant to be kept for a month. Zero needs none."""
    seconds = _duration(ctx, param, value)
    if seconds and record.BARE_NUMBER.fullmatch(value.strip()):
        number = value.strip()
        raise click.BadParameter(f"{value!r} has no unit: say {number}d (days), {number}h (hours) or {number}m "
                                 "(minutes)")
    return seconds


# A compact or purge that reaches jobs finished this recently asks for --yes.
RECENT = 86400
# An --at further in the past than this is noted (`date +%s` a moment ago is not).
PAST_NOTED = 60


def _given(ctx, name: str) -> str:
    """A duration option as the user wrote it (``--in 400d``, not seconds)."""
    return ctx.meta.get("spoolq.given", {}).get(name, "")


def _spool_dir(ctx, param, value):
    if value == "":
        # `-s "$UNSET"` must not turn the current directory into a spool.
        raise click.BadParameter("the spool directory must not be empty")
    return value


def _json_arg(text: str, what: str) -> Any:
    try:
        return record.loads(text)
    except ValueError as e:
        fail(f"{what} is not valid JSON: {e}", 2)


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _near_option(error: click.UsageError) -> str:
    """A "did you mean" for an unknown option that click's own spelling
    check finds nothing for (``--retries`` for ``--max-attempts``)."""
    if not isinstance(error, click.NoSuchOption) or error.possibilities or error.ctx is None:
        return ""
    names = [opt for param in error.ctx.command.params for opt in param.opts if opt.startswith("--")]
    return did_you_mean(error.option_name, names, quote=True).replace(" (did", " Did").replace("?)", "?")


def _spool_after(ctx, param, value):
    """``-s DIR`` given after the command's name: the spool, as before it."""
    if value is not None:
        ctx.find_root().obj = Spool(_spool_dir(ctx, param, value))


class SpoolGroup(click.Group):
    """Turns the core's exceptions into one-line messages and exit codes,
    and gives every command ``-s/--spool`` of its own (``spoolq enqueue -s
    DIR ...`` as well as ``spoolq -s DIR enqueue ...``)."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        cmd.params.append(click.Option(["-s", "--spool", "spool_after"], metavar="DIR", expose_value=False,
                                       callback=_spool_after, help="The spool directory (as before the command)."))
        super().add_command(cmd, name)

    def main(self, *args: Any, **kwargs: Any) -> Any:
        # click's own errors (a bad option, a missing argument) print usage,
        # a hint and the error on four lines; spoolq's errors are one line.
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except _NO_ARGS_IS_HELP as e:  # plain `spoolq`: the help, as click prints it
            echo(e.format_message(), err=True)
            sys.exit(e.exit_code)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "spoolq"
            fail(f"{e.format_message()}{_near_option(e)} (see '{where} --help')", e.exit_code)
        except click.ClickException as e:
            fail(e.format_message(), e.exit_code)
        except click.Abort:
            fail("interrupted", 130)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException):
            raise
        except (Exception, KeyboardInterrupt) as e:
            output.fail_for(e)


@click.group(cls=SpoolGroup, context_settings={"help_option_names": ["-h", "--help"]})
# The default shown by --help is the spool in use: $SPOOLQ_DIR when set.
@click.option("-s", "--spool", "spool_dir", envvar="SPOOLQ_DIR", default=os.environ.get("SPOOLQ_DIR") or "spool",
              show_default=True, callback=_spool_dir,
              help="The spool directory (else $SPOOLQ_DIR, else ./spool).")
@click.version_option(package_name="spoolq")
@click.pass_context
def cli(ctx: click.Context, spool_dir: str) -> None:
    """A background job queue that is nothing but a directory."""
    ctx.obj = Spool(spool_dir)


def _id_completer(*states: str):
    """Shell completion of job ids: those in these states of the spool
    given by -s or $SPOOLQ_DIR, as the backend lists them cheaply (a
    directory's listing; nothing when there is no spool)."""
    def complete(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
        root = ctx.find_root().params.get("spool_dir") or os.environ.get("SPOOLQ_DIR") or "spool"
        try:
            return Spool(root).backend.complete_ids(states, incomplete)
        except Exception:  # (no spool, a database out of reach) nothing to offer
            return []

    return complete


def _spool(ctx: click.Context) -> Spool:
    return ctx.find_root().obj


def _existing(ctx: click.Context) -> Spool:
    spool = _spool(ctx)
    output.require_spool(spool)
    return spool


# --------------------------------------------------------------------------


@cli.command()
@click.option("--group", help="Share the spool with this group: members drop jobs into drop/ and read listings "
                               "and the history (the owner must be in the group).")
@click.pass_context
def init(ctx, group):
    """Create the spool layout (idempotent); convert an older shared spool."""
    spool = _spool(ctx)
    for change in spool.init(group=group):
        echo(f"spoolq: {one_line(change)}", err=True)
    echo(spool.path)


# Everything from the first command word on is the command's own, options
# included (`spoolq enqueue ls -l`), as with nq, tsp and env.
@cli.command(context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[COMMAND | PROG ARG...]")
@click.option("--argv", "use_argv", is_flag=True, help="Run ARGS as PROG ARG..., even a single one (no shell).")
@click.option("--kind", help="A Python handler job of this kind.")
@click.option("--payload", help="JSON handed to the handler, or to the process on stdin.")
@click.option("--json", "job_json", metavar="JSON", help="A whole job object ('-' reads stdin).")
@click.option("--jsonl", "jsonl", metavar="FILE", help="One job object per line ('-' reads stdin).")
@click.option("--id", "job_id", help="The job id (default: a fresh, time-ordered one).")
@click.option("--max-attempts", type=click.IntRange(min=1), help="Runs before the job goes to dead/.")
@click.option("--timeout", callback=_duration, metavar="DURATION", help="Time before a run is killed (90, 5m, 1h30m).")
@click.option("--idle-timeout", callback=_duration, metavar="DURATION",
              help="Stop a run that writes no output for this long (10m).")
@click.option("--in", "delay", callback=_duration, metavar="DURATION", help="Run after this delay (90, 5m, 2h, 7d).")
@click.option("--at", "at", metavar="TIME", help="Run at this time (RFC 3339 or epoch seconds).")
@click.option("--env", "env", multiple=True, metavar="K=V", help="Add to the job's environment (repeatable).")
@click.option("--cwd", metavar="DIR", help="Working directory of the run (default: the current directory).")
@click.option("--wait", "wait_", is_flag=True, help="Then wait for the job to finish (exit status as `spoolq wait`).")
@click.option("--priority", type=click.IntRange(-record.MAX_PRIORITY, record.MAX_PRIORITY),
              help="Higher runs first among due jobs (default 0).")
@click.option("--after", "after", metavar="ID[,ID...]", help="Start only once these jobs have succeeded.")
@click.option("--unique", metavar="KEY", help="Add nothing while an unfinished job has this key (its id is printed).")
@click.option("--lock", "lock", multiple=True, metavar="NAME",
              help="Run while no other job holding NAME runs (repeatable; `lock_limits` raises the limit).")
@click.option("--hold", "hold", is_flag=True, help="Enqueue it held: it runs once released (spoolq release).")
@click.pass_context
def enqueue(ctx, args, use_argv, kind, payload, job_json, jsonl, job_id, max_attempts, timeout, idle_timeout, delay, at,
            env, cwd, wait_, priority, after, unique, lock, hold):
    """Enqueue a job and print its id.

    One argument is a shell command (run by /bin/sh); several are a
    program and its arguments, run directly. Options go before them.

    \b
      spoolq enqueue 'make report > report.log'
      spoolq enqueue convert in.png out.jpg
      spoolq enqueue --argv ./build.sh
      spoolq enqueue --kind send_email --payload '{"to": "a@example.com"}'
      spoolq enqueue --json '{"command": "true", "max_attempts": 3}'
      spoolq enqueue '{"command": "true"}'     (one JSON object: the same as --json)
      spoolq enqueue --jsonl jobs.jsonl
      spoolq enqueue --after 0190a1b2 --priority 5 --lock db ./migrate.sh
    """
    args, use_argv, job_json = _command_form(args, use_argv, kind, job_json, jsonl)
    options = _job_options(ctx, payload, job_id, max_attempts, timeout, delay, at, env, cwd)
    if idle_timeout is not None:
        if idle_timeout > record.MAX_TIMEOUT:
            fail(f"--idle-timeout {_given(ctx, 'idle_timeout')} is too long: it is at most {record.MAX_TIMEOUT} "
                 "seconds (3650d)", 2)
        options["idle_timeout"] = idle_timeout
    options.update(_order_options(priority, after, unique, lock, hold))
    spool = _existing(ctx)  # a mistyped path must not become a spool no worker reads
    if jsonl is not None:
        if job_id is not None:
            fail("--id cannot apply to many jobs; put an id in each line", 2)
        jobs = [_cwd_here(fields) for fields in _read_jsonl(jsonl, options)]
        try:
            ids = spool.enqueue_many(jobs)
        except PartlyEnqueued as e:
            _print_ids(e.ids)  # these will run: a caller must not enqueue them again
            raise
        except KeyboardInterrupt as e:  # Ctrl-C part way: the same
            _print_ids(getattr(e, "published_ids", []))
            raise
        _print_ids(ids)
        if wait_:
            controlcli.wait_and_exit(spool, ids, None, False, False)
        return
    fields = _job_fields(args, use_argv, kind, job_json, options)
    job_id = spool.enqueue_job(_cwd_here(fields), on_existing=lambda holder: echo(
        f"spoolq: job {holder} holds unique key {fields.get('unique')!r} and has not finished: nothing added",
        err=True))
    _print_ids([job_id])
    if wait_:
        controlcli.wait_and_exit(spool, [job_id], None, False, False)


def _order_options(priority, after, unique, lock, hold) -> dict[str, Any]:
    """The fields of the options that decide when the job may run."""
    options: dict[str, Any] = {}
    if priority:
        options["priority"] = priority
    if after is not None:
        ids = [word.strip() for word in after.split(",") if word.strip()]
        if not ids:
            fail(f"--after {after!r} names no job id", 2)
        options["after"] = ids
    if unique is not None:
        options["unique"] = unique
    if lock:
        options["lock"] = list(lock) if len(lock) > 1 else lock[0]
    if hold:
        options["held"] = True
    return options


def _command_form(args, use_argv, kind, job_json, jsonl):
    """Which form the job is given in: a lone JSON object is --json, several
    words are PROG ARG...; exactly one form must remain. Returns the
    (args, use_argv, job_json) the rest of enqueue goes by."""
    if len(args) == 1 and not use_argv and job_json is None and args[0].lstrip().startswith("{"):
        # queuectl style: `spoolq enqueue '{"command": "sleep 2"}'`. A shell
        # command that is also a JSON object is not a thing (`{ a; }` is not JSON).
        # Lenient here (NaN, any depth), so that an object with a bad value
        # is refused as --json would refuse it, not run as a shell command.
        try:
            if isinstance(json.loads(args[0]), dict):
                job_json, args = args[0], ()
        except json.JSONDecodeError:
            pass  # not JSON: a shell command
        except (ValueError, RecursionError):
            # JSON, but too deep or an integer too long for Python to hold:
            # refused as --json refuses it, never run by sh.
            job_json, args = args[0], ()
    if len(args) > 1 and not use_argv and job_json is None and kind is None and jsonl is None:
        use_argv = True  # `spoolq enqueue make report`: a program and its arguments
        if args[0].lstrip().startswith('{"'):
            fail("the command looks like a JSON job object; give it with --json", 2)
        if any(c.isspace() for c in args[0]):
            # `spoolq enqueue 'make report' --in 5m`: a quoted shell command
            # with words after it, most likely options given too late. As an
            # argv job it would fail at every run; --argv still allows it.
            rest = " ".join(args[1:])
            fail(f"{args[0]!r} is a quoted shell command, yet more words follow it ({rest!r}): options go before "
                 "the command, and a program's arguments are given unquoted (or use --argv)", 2)
    forms = [bool(args) and not use_argv, use_argv, kind is not None, job_json is not None, jsonl is not None]
    if sum(forms) != 1:
        fail("give exactly one of: a command (a shell command, or PROG ARG...), --kind K, --json JSON, --jsonl FILE", 2)
    return args, use_argv, job_json


def _job_options(ctx, payload, job_id, max_attempts, timeout, delay, at, env, cwd) -> dict[str, Any]:
    """The job fields the options give, the same for every form."""
    if delay is not None and at is not None:
        fail("give --in or --at, not both", 2)
    options: dict[str, Any] = {}
    if payload is not None:
        options["payload"] = _json_arg(payload, "--payload")
    if job_id is not None:
        options["id"] = job_id
    if max_attempts is not None:
        options["max_attempts"] = max_attempts
    if timeout is not None:
        if timeout > record.MAX_TIMEOUT:
            fail(f"--timeout {_given(ctx, 'timeout')} is too long: a timeout is at most {record.MAX_TIMEOUT} "
                 "seconds (3650d)", 2)
        options["timeout"] = timeout
    if delay is not None:
        options["run_at"] = time.time() + delay
        if options["run_at"] > record.MAX_EPOCH:
            fail(f"--in {_given(ctx, 'delay')} is too far ahead: a job can be due at the latest at "
                 f"{record.rfc3339(record.MAX_EPOCH)[:19]}Z", 2)
    if at is not None:
        try:
            options["run_at"] = record.parse_time(at)
        except ValueError as e:
            fail(f"--at: {e}", 2)
        if options["run_at"] < time.time() - PAST_NOTED:
            _note(f"--at {at} is in the past ({record.rfc3339(options['run_at'])[:19]}Z): the job is due now")
    if env:
        pairs = {}
        for item in env:
            k, sep, v = item.partition("=")
            if not sep or not k:
                fail(f"--env needs K=V, not {item!r}", 2)
            pairs[k] = v
        options["env"] = pairs
    if cwd is not None:
        options["cwd"] = cwd
    return options


def _job_fields(args, use_argv, kind, job_json, options: dict[str, Any]) -> dict[str, Any]:
    """The one job's fields from its form (--json, argv, --kind or a shell command)."""
    if job_json is not None:
        if job_json == "-" and sys.stdin is None:
            fail("standard input is closed", 2)
        text = sys.stdin.read() if job_json == "-" else job_json
        fields = _json_arg(text, "--json")
        if not isinstance(fields, dict):
            fail("--json must be a JSON object", 2)
        fields.update(options)
    elif use_argv:
        if not args:
            fail("--argv needs PROG [ARG...]", 2)
        fields = {"argv": list(args), **options}
    elif kind is not None:
        if args:
            fail("--kind takes no command arguments (use --payload)", 2)
        fields = {"kind": kind, **options}
    else:
        if args[0].lstrip().startswith('{"'):
            # No shell command starts so (a group is "{ cmd; }"): a job object
            # meant for --json, whose typo would otherwise run as sh and fail.
            fail("the command looks like a JSON job object; give it with --json", 2)
        fields = {"command": args[0], **options}
    return fields


def _cwd_here(fields: dict[str, Any]) -> dict[str, Any]:
    """A command or argv job runs in the directory it was enqueued from
    unless it names one, as with at, nq and tsp (a handler runs in the
    worker and has no use for one). A relative cwd is made absolute by
    ``Spool``, against this same directory."""
    if fields.get("cwd") is None and fields.get("kind") is None:
        try:
            fields["cwd"] = os.getcwd()
        except OSError as e:
            fail(f"cannot read the current directory to run the job in: {e.strerror} (give --cwd DIR)", 1)
    return fields


def _print_ids(ids: list[str]) -> None:
    """Print the ids of jobs just enqueued. They are in the spool already, so
    if stdout cannot take them (closed, a full disk) say that, naming them,
    rather than look like an enqueue that failed and invite a retry."""
    try:
        for job_id in ids:
            echo(job_id)
    except BrokenPipeError:
        raise  # the reader went away: the usual quiet exit
    except OSError as e:
        which = ids[0] if len(ids) == 1 else f"{len(ids)} jobs, {ids[0]} to {ids[-1]}"
        fail(f"enqueued {which}, but cannot print the id: {e.strerror or e}", 1)


def _read_jsonl(source: str, options: dict[str, Any]):
    if source == "-" and sys.stdin is None:
        fail("standard input is closed", 2)
    try:
        stream = sys.stdin.buffer if source == "-" else open(source, "rb")
    except OSError as e:
        fail(f"cannot read {source}: {e.strerror}", 2)
    with stream:
        lineno = 0
        while True:
            try:
                raw = stream.readline()
            except OSError as e:  # e.g. a directory, or a read error
                fail(f"cannot read {source}: {e.strerror}", 2)
            if not raw:
                break
            lineno += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                fail(f"line {lineno}: not UTF-8 (byte {e.start + 1})", 2)
            if lineno == 1 and line.startswith("\ufeff"):
                line = line[1:]  # a byte-order mark, as some editors write: accepted as in a job file
            if not line.strip():
                continue
            try:
                fields = record.loads(line)
            except ValueError as e:
                fail(f"line {lineno}: not valid JSON: {e}", 2)
            if not isinstance(fields, dict):
                fail(f"line {lineno}: not a JSON object", 2)
            fields.update(options)
            yield fields


@cli.command()
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True, help="Jobs to run at once.")
@click.option("--max-jobs", type=click.IntRange(min=0), help="Stop after claiming this many jobs (0: only recover).")
@click.option("--max-time", callback=_duration, metavar="DURATION", help="Stop claiming after this long.")
@click.option("--app", metavar="MODULE:ATTR", help="A mapping of kind to handler function (default: the app setting).")
@click.option("--watch", is_flag=True, help="Keep running and wake on new files.")
@click.option("--poll", type=Seconds(min=0.01), metavar="SECONDS",
              help="Watch by rescanning every SECONDS (no inotify; for network filesystems). Implies --watch.")
@click.option("-q", "--quiet", is_flag=True, help="Log only problems (dead jobs, errors).")
@click.option("-v", "--verbose", is_flag=True, help="Log each scan of the waiting folders as well.")
@click.option("--allow-local-locks", is_flag=True,
              help="Run on a filesystem whose locks other machines do not see (sshfs; NFS with nolock): only when every worker runs on this machine.")
@click.pass_context
def work(ctx, jobs, max_jobs, max_time, app, watch, poll, quiet, verbose, allow_local_locks):
    """Recover, then run due jobs until none is due (or forever with --watch)."""
    spool = _spool(ctx)
    output.require_spool(spool)  # a mistyped path must not become an empty spool that is watched forever
    handlers = {}
    setting = spool.default_app() if not app else None
    if app or setting:
        try:
            handlers = load_app(app or setting)
        except ValueError as e:
            fail(f"the app setting: {e}" if setting else str(e), 2)
    output.log_to_stderr()
    log = output.Log(level=0 if quiet else 2 if verbose else 1)
    result = spool.work(handlers=handlers, jobs=jobs, max_jobs=max_jobs, max_time=max_time,
                        watch=watch or poll is not None, poll=poll, log=log, processes=True,
                        allow_local_locks=allow_local_locks)
    output.log_what_waits(spool, log)
    if not result.clean:
        sys.exit(1)


@cli.command()
@click.option("--to", "to", required=True, metavar="URL", help="The PostgreSQL spool (postgresql://...).")
@click.option("--watch", is_flag=True, help="Keep running and wake on new files.")
@click.option("--poll", type=Seconds(min=0.01), metavar="SECONDS",
              help="Watch by rescanning every SECONDS (no inotify). Implies --watch.")
@click.option("-q", "--quiet", is_flag=True, help="Log only problems.")
@click.pass_context
def relay(ctx, to, watch, poll, quiet):
    """Move this spool's jobs into a PostgreSQL spool (until none is due, or forever with --watch)."""
    spool = _spool(ctx)
    output.require_spool(spool)
    output.log_to_stderr()
    result = spool.relay(to, watch=watch or poll is not None, poll=poll, log=output.Log(level=0 if quiet else 1))
    if result.unavailable:
        fail(f"{result.unavailable}: the jobs wait here for the next relay", 1)
    if result.problems:
        fail(result.problems[0], 1)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--prometheus", is_flag=True, help="Print the Prometheus text format.")
@click.pass_context
def status(ctx, as_json, prometheus):
    """Jobs per state and the live workers."""
    if as_json and prometheus:
        fail("give --json or --prometheus, not both", 2)
    spool = _existing(ctx)
    if prometheus:
        from .metrics import prometheus_text  # imported here: start-up speed (only --prometheus needs it)

        echo(prometheus_text(spool, on_problem=_warn), nl=False)
        return
    counts = spool.status(on_problem=_warn)
    if as_json:
        echo(json.dumps(counts))
        return
    if counts.get("dropped") is not None:
        echo(f"{'dropped':<8}{counts['dropped']:>10}  (in drop/, for a worker to pick up)")
    for state in ("new", "cur", "failed"):
        note = _abandoned(counts["abandoned"]) if state == "cur" else _unhandled(counts.get("unhandled") or {}) if state == "new" else ""
        echo(one_line(f"{state:<8}{counts[state]:>10}{note}"))
    for state, what in (("held", "held until released"), ("waiting", "waiting for their dependencies")):
        if counts.get(state):  # (shown only when some are: most spools never have any)
            echo(f"{state:<8}{counts[state]:>10}  ({what})")
    purged = f"  (and {counts['dead_purged']} purged into index.db)" if counts.get("dead_purged") else ""
    echo(f"{'dead':<8}{counts['dead']:>10}{purged}")
    echo(f"{'done':<8}{counts['done']:>10}  ({counts['done_files']} in done/, {counts['compacted']} compacted)")
    relayed = counts.get("relay")
    if relayed:
        since = f", the oldest since {relayed['since']}" if relayed["since"] else ""
        echo(one_line(f"{'relay':<8}{relayed['waiting']:>10}  (wait to be relayed to {relayed['to']}{since})"))
    workers = counts["workers"]
    if counts.get("workers_seen") is False:
        echo(f"{'workers':<8}{'-':>10}  (seen by the spool's owner only)")
        return
    paused = counts.get("paused")
    echo(f"{'workers':<8}{len(workers):>10}" + (f"  (paused by {paused.get('by')}: 'spoolq resume' lets them claim)"
                                                 if paused else ""))
    for w in workers:
        running = ", ".join(w.get("jobs") or {}) or "idle"
        echo(one_line(f"  {w.get('worker')}  pid {w.get('pid')}  since {w.get('started_at')}  running: {running}"))


def _warn(message: str) -> None:
    echo(f"spoolq: {one_line(message)}", err=True)


def _abandoned(n: int) -> str:
    if not n:
        return ""
    if n == 1:
        return "  (1 abandoned: its worker died; 'spoolq sweep' or the next worker recovers it)"
    return f"  ({n} abandoned: their workers died; 'spoolq sweep' or the next worker recovers them)"


def _unhandled(by_kind: dict[str, int]) -> str:
    if not by_kind:
        return ""
    n = sum(by_kind.values())
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(by_kind.items()))
    return f"  ({n} wait{'s' if n == 1 else ''} for a worker with a handler for {'its' if n == 1 else 'their'} kind: {kinds})"


def _summary(job: dict[str, Any]) -> str:
    target = job.get("command") or (" ".join(job["argv"]) if job.get("argv") else None) or (
        f"kind={job['kind']}" if job.get("kind") else "")
    when = job.get("due_at") or job.get("finished_at") or job.get("mtime") or ""
    attempts = job.get("attempts", "-")
    error = job.get("error") or ""
    line = f"{job['state']:<7} {job['id']:<32} {when:<28} {attempts!s:>3}  {target}"
    if job.get("moved_back_from"):
        # Its last run's error is history now: the job waits for a fresh run.
        line += f"  [{output.moved_back(job)}{'; its last run: ' + error if error else ''}]"
    elif error:
        line += f"  [{error}]"
    elif job.get("outcome") == "cancelled" or (job["state"] == "done" and "outcome" not in job
                                                and job.get("readable") is not False):
        line += "  [cancelled]"  # a done job is a success unless it says so (record.as_done)
    if job.get("abandoned"):
        line += f"  [{output.ABANDONED}]"
    if job.get("readable") is False:
        line += "  [record readable by the spool's owner only]"
    if job["state"] == "dead" and job.get("compacted"):
        line += "  [purged into index.db]"
    if job.get("priority"):
        line += f"  [priority {job['priority']}]"
    if job.get("waits_for_handler"):
        line += f"  [{output.waits_for_handler(job)}]"
    elif job.get("why"):
        line += f"  [{job['why']}]"
    return one_line(line)


LIST_HEADER = f"{'STATE':<7} {'ID':<32} {'DUE OR FINISHED':<28} {'TRY':>3}  JOB"


@cli.command(name="list")
@click.option("--state", type=STATE_CHOICE, help="Only jobs in this state.")
@click.option("--limit", type=click.IntRange(min=0), help="At most this many jobs.")
@click.option("--since", callback=_duration, metavar="DURATION", help="Only jobs due or finished this recently.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON Lines.")
@click.option("--no-header", is_flag=True, help="No header row (printed only on a terminal anyway).")
@click.pass_context
def list_(ctx, state, limit, since, as_json, no_header=False):
    """Jobs, oldest first (by due or finish time, then name)."""
    spool = _existing(ctx)
    since_ts = time.time() - since if since is not None else None
    if not as_json and not no_header and sys.stdout is not None and sys.stdout.isatty():
        echo(LIST_HEADER)  # for a person; a pipe gets only the jobs, one a line
    for job in spool.list(state=state, limit=limit, since=since_ts):
        echo(dumps(job) if as_json else _summary(job))


@cli.command()
@click.argument("job_id", metavar="ID", shell_complete=_id_completer("new", "cur", "failed", "dead", "done"))
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
@click.pass_context
def show(ctx, job_id, as_json):
    """One job's record, wherever it is (compacted jobs included); ID may be the start of one."""
    output.show(_spool(ctx), job_id, as_json)


@cli.command()
@click.argument("job_id", metavar="ID", shell_complete=_id_completer("new", "failed"))
@click.pass_context
def cancel(ctx, job_id):
    """Cancel a job (ID may be the start of one): a waiting one goes to done/
    with outcome cancelled; a running one is killed as `spoolq kill` does."""
    output.refuse_bad_ids((job_id,))
    spool = _existing(ctx)
    try:
        job_id = spool.resolve(job_id, ("new", "failed"), ())
        if (spool.get(job_id) or {}).get("state") == "cur":  # (a role that may kill its running job, not move jobs)
            controlcli.kill_and_say(spool, job_id, None)
            return
        spool.cancel(job_id, check=True, on_note=_note)
    except NotPossible as e:
        if (spool.get(job_id) or {}).get("state") == "cur":
            controlcli.kill_and_say(spool, job_id, None)
            return
        fail(str(e), 1)
    except JobNotFound as e:
        fail(str(e), 1)
    except RequestPending as e:
        fail(str(e), PENDING)
    echo(f"cancelled {job_id}")


@cli.command(name="hold")
@click.argument("job_id", metavar="ID", shell_complete=_id_completer("new", "failed", "waiting"))
@click.pass_context
def hold_job(ctx, job_id):
    """Hold a waiting job: it stays, never claimed, until released; ID may be the start of one."""
    output.refuse_bad_ids((job_id,))
    spool = _existing(ctx)
    try:
        job_id = spool.resolve(job_id, ("new", "failed", "waiting", "held"), ())
        spool.hold(job_id)
    except (JobNotFound, NotPossible) as e:
        fail(str(e), 1)
    echo(f"held {job_id}")


@cli.command(name="release")
@click.argument("job_id", metavar="ID", shell_complete=_id_completer("held"))
@click.option("--now", is_flag=True, help="Due now (by default it keeps its due time).")
@click.pass_context
def release_job(ctx, job_id, now):
    """Release a held job: waiting again as before (new, failed, or waiting for its dependencies)."""
    output.refuse_bad_ids((job_id,))
    spool = _existing(ctx)
    try:
        job_id = spool.resolve(job_id, ("held",), ())
        state = spool.release(job_id, now=now)
    except (JobNotFound, NotPossible) as e:
        fail(str(e), 1)
    echo(f"released {job_id} ({state})")


def _note(message: str) -> None:
    """Something done, with a caveat (not a failure: the exit status stays 0)."""
    try:
        echo(f"spoolq: note: {one_line(message)}", err=True)
    except OSError:
        pass  # stderr on the full disk the note is about: the change is made all the same


@cli.command()
@click.argument("job_ids", nargs=-1, metavar="ID...", shell_complete=_id_completer("dead"))
@click.option("--all", "all_", is_flag=True, help="Every job in dead/.")
@click.pass_context
def retry(ctx, job_ids, all_):
    """Move dead jobs back to new/ with a fresh round of attempts."""
    _retry(ctx, job_ids, all_)


def _retry(ctx, job_ids, all_):
    if all_ == bool(job_ids):
        fail("give job ids or --all", 2)
    spool = _spool(ctx)
    # A name that is no valid id is refused, unless `list` shows a file so named.
    output.refuse_bad_ids(j for j in job_ids if not (spool.exists() and spool.get(j) is not None))
    spool = _existing(ctx)
    problems = 0
    if all_:
        def report(message: str) -> None:
            nonlocal problems
            echo(f"spoolq: {one_line(message)}", err=True)
            problems += 1

        try:
            for jid in spool.retry_all(on_problem=report, on_note=_note):
                echo(one_line(jid))
        except RequestPending as e:
            fail(str(e), PENDING)
        if problems:
            sys.exit(1)
        return
    pending = False
    for jid in job_ids:
        try:
            jid = spool.resolve(jid, ("dead",), ("dead",))
            spool.retry(jid, check=True, on_note=_note)
            echo(one_line(jid))
        except (JobNotFound, NotPossible) as e:
            echo(f"spoolq: {one_line(str(e))}", err=True)
            problems += 1
        except RequestPending as e:
            echo(f"spoolq: {one_line(str(e))}", err=True)
            pending = True
    if problems:
        sys.exit(1)
    if pending:
        sys.exit(PENDING)


@cli.group(cls=SpoolGroup)
def dlq():
    """The dead-letter queue (dead/), for queuectl users: list, retry."""


@dlq.command(name="list")
@click.option("--limit", type=click.IntRange(min=0), help="At most this many jobs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON Lines.")
@click.option("--no-header", is_flag=True, help="No header row (printed only on a terminal anyway).")
@click.pass_context
def dlq_list(ctx, limit, as_json, no_header):
    """Dead jobs, oldest first (spoolq list --state dead)."""
    ctx.invoke(list_, state="dead", limit=limit, since=None, as_json=as_json, no_header=no_header)


@dlq.command(name="retry")
@click.argument("job_ids", nargs=-1, metavar="ID...", shell_complete=_id_completer("dead"))
@click.option("--all", "all_", is_flag=True, help="Every job in dead/.")
@click.pass_context
def dlq_retry(ctx, job_ids, all_):
    """Dead jobs back to new/ with a fresh round (spoolq retry)."""
    _retry(ctx, job_ids, all_)


@cli.command()
@click.option("--allow-local-locks", is_flag=True,
              help="Recover on a filesystem whose locks other machines do not see: only when every worker runs on this machine.")
@click.pass_context
def sweep(ctx, allow_local_locks):
    """Recovery alone: return abandoned jobs from cur/, remove stale tmp/ files."""
    spool = _existing(ctx)
    r = spool.sweep(allow_local_locks=allow_local_locks)
    echo(
        f"recovered {r.recovered} to failed/, {r.dead} to dead/, completed {r.completed}, "
        f"quarantined {r.quarantined}, killed {r.killed} processes, removed {r.tmp_removed} tmp/ files"
    )
    if r.left_running:
        echo(f"left {r.left_running} jobs in cur/: their processes still run and are another user's to kill "
             "(the first sweep or worker start after those end recovers them)")
    if r.picked_up or r.dropped_dead:
        echo(f"picked up {r.picked_up} jobs from drop/, moved {r.dropped_dead} entries of drop/ to dead/")


@cli.command()
@click.option("--keep", callback=_history_duration, metavar="DURATION", help="Drop history older than this (with a unit: 30d, 12h).")
@click.option("--yes", is_flag=True, help="Confirm a --keep under a day (history of jobs that finished today).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def compact(ctx, keep, yes, as_json):
    """Fold done/ into index.db and remove the files; drop old history."""
    if keep == 0 and not yes:
        # Nothing is older than zero seconds ago: every finished job's record
        # goes, the ones this very compaction folds included.
        fail(f"--keep {_given(ctx, 'keep')} would drop the history of every finished job, including the ones this compaction "
             "folds; add --yes to do that", 2)
    if keep is not None and keep < RECENT and not yes:
        fail(f"--keep {_given(ctx, 'keep')} would drop the history of jobs that finished less than a day ago; "
             "add --yes to do that", 2)
    result = _existing(ctx).compact(keep=keep)
    if as_json:
        echo(json.dumps(result))
    else:
        echo(f"folded {result['folded']} jobs into index.db in {result['seconds']}s, left {result['left']}, "
                   f"dropped {result['dropped']} old rows, removed {result['tmp_removed']} tmp/ files")


@cli.command()
@click.option("--dead", "dead", is_flag=True, required=True, help="Purge dead jobs (the only kind there is).")
@click.option("--older-than", "older_than", callback=_history_duration, required=True, metavar="DURATION",
              help="Only dead jobs whose file is older than this (with a unit: 30d, 12h).")
@click.option("--yes", is_flag=True, help="Confirm an --older-than under a day (jobs that died today).")
@click.pass_context
def purge(ctx, dead, older_than, yes):
    """Clear dead jobs into index.db (a deliberate act; compact never touches dead/)."""
    if older_than < RECENT and not yes:
        fail(f"--older-than {_given(ctx, 'older_than')} would purge jobs that died less than a day ago; "
             "add --yes to do that", 2)
    result = _existing(ctx).purge_dead(older_than)
    echo(f"purged {result['purged']} dead jobs into index.db, left {result['left']}")


def _fmt_seconds(v: Any) -> str:
    if v is None:
        return "-"
    if v < 1:
        return f"{v * 1000:.1f}ms"
    return f"{v:.2f}s"


@cli.command()
@click.option("--since", callback=_duration, metavar="DURATION", help="Only jobs and runs that finished this recently.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def stats(ctx, since, as_json):
    """Finished jobs, throughput, wait (due to start) and run time per kind or program."""
    result = _existing(ctx).stats(since=time.time() - since if since is not None else None)
    if as_json:
        echo(json.dumps(result))
        return
    header = ("group", "jobs", "ok", "failed runs", "dead", "cancelled", "jobs/s", "wait p50", "wait p95", "wait max",
              "run p50", "run p95", "run max")
    rows = [header]
    for g in result["groups"] + [dict(result["total"], group="TOTAL")]:
        rows.append((one_line(str(g["group"])), str(g["jobs"]), str(g["succeeded"]), str(g["failed_runs"]), str(g["dead"]),
                     str(g["cancelled"]), "-" if g["throughput_per_s"] is None else f"{g['throughput_per_s']:g}",
                     *(_fmt_seconds(g[k]) for k in ("wait_p50", "wait_p95", "wait_max", "run_p50", "run_p95", "run_max"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        echo("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))


@cli.group(name="config", cls=SpoolGroup)
def config_group():
    """Spool settings (config.json)."""


@config_group.command(name="list")
@click.pass_context
def config_list(ctx):
    """Every setting with its value."""
    for key, value in _existing(ctx).config_list().items():
        echo(f"{one_line(key)} = {json.dumps(value)}")


@config_group.command(name="get")
@click.argument("key")
@click.pass_context
def config_get(ctx, key):
    """One setting's value."""
    echo(json.dumps(_existing(ctx).config_get(key)))


@config_group.command(name="set", context_settings={"ignore_unknown_options": True})
@click.argument("key")
@click.argument("value")
@click.pass_context
def config_set(ctx, key, value):
    """Store a setting (validated; repairs a config.json that does not parse)."""
    spool = _existing(ctx)
    stored = spool.config_set(key, value, on_dropped=_warn)
    echo(f"{spool.setting_name(key)} = {json.dumps(stored)}")


@config_group.command(name="unset")
@click.argument("key")
@click.pass_context
def config_unset(ctx, key):
    """Remove a setting: its default applies again (also repairs config.json)."""
    spool = _existing(ctx)
    held, key = spool.config_unset(key, on_dropped=_warn)
    default = spool.config_default(key)
    echo(f"unset {key}" if held else f"{key} was not set")
    if default is not None:
        echo(f"{key} = {json.dumps(default)} (the default)")


@cli.command()
@click.option("--jobs", "n", type=click.IntRange(min=1000), default=20000, show_default=True, help="Jobs per figure (the scale, history and used sections size themselves: see --scale).")
@click.option("--fsync/--no-fsync", default=None, help="Measure with fsync on or off (default: the spool's setting).")
@click.option("--section", "sections", multiple=True, type=click.Choice(["enqueue", "drain", "true", "latency", "sqlite", "status", "scale", "history", "used"]),
              help="Only these sections (repeatable).")
@click.option("--true-jobs", type=click.IntRange(min=10), help="Jobs for the `true` command drains (default min(jobs, 2000)).")
@click.option("--scale", "scale_sizes", metavar="N,N,...", default="1000,100000", show_default=True,
              help="Queue sizes for the per-job cost comparison.")
@click.option("--compare", type=click.Choice(["sqlite"]), help="Add the SQLite-table queue, measured in the same run.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--keep", is_flag=True, help="Keep the scratch spools (for inspection).")
@click.pass_context
def bench(ctx, n, fsync, sections, true_jobs, scale_sizes, compare, as_json, keep):
    """Measure this machine and filesystem: enqueue and drain rates next to
    bare-loop baselines. Runs in a scratch folder inside the spool, removed after."""
    from . import bench as benchmod  # imported here: start-up speed (only spoolq bench needs it)

    spool = _existing(ctx)
    if fsync is None:
        fsync = bool(spool.settings["fsync"])
    try:
        sizes = tuple(int(x) for x in scale_sizes.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 100:
        fail(f"--scale takes sizes of at least 100 like 1000,100000, not {scale_sizes!r}", 2)
    chosen = tuple(sections) or tuple(x for x in benchmod.SECTIONS if x != "sqlite")
    if compare == "sqlite" and "sqlite" not in chosen:
        chosen += ("sqlite",)
    result = benchmod.run(spool.path, n, fsync, sections=chosen,
                          true_jobs=true_jobs, scale_sizes=sizes, keep=keep, progress=True)  # (to stderr: --json stays clean)
    echo(benchmod.report(result, as_json))


for _command in controlcli.COMMANDS:
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="spoolq")


if __name__ == "__main__":
    main()
