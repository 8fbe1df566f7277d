"""The job-control commands of ``spoolq``: wait, kill, stop, pause, resume,
logs, top (added to the command group by cli.py; they parse, call ``Spool``, print).

Exit status of ``wait`` (and ``enqueue --wait``, ``logs -f``): 0 every job
succeeded; 1 one ended otherwise (dead, cancelled); 2 usage or an unknown
id; 124 the timeout ran out first, as timeout(1) says it.
"""

from __future__ import annotations

import json
from typing import Any

import click

from . import output, record
from .control import signal_name, signal_number
from .errors import JobNotFound, NotPossible, RequestPending
from .jobcontrol import WaitTimeout, describe, finished, succeeded
from .output import echo, fail, one_line

TIMED_OUT = 124
PENDING = 75


def _spool(ctx: click.Context):
    spool = ctx.find_root().obj
    output.require_spool(spool)
    return spool


def _seconds(ctx, param, value):
    if value is None:
        return None
    try:
        return record.parse_duration(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def report_finished(jobs: dict[str, dict[str, Any]], as_json: bool) -> None:
    for job_id, job in jobs.items():
        if as_json:
            echo(json.dumps(job, ensure_ascii=False, sort_keys=True))
            continue
        outcome, said = describe(job)
        echo(f"{job_id} {outcome}" + (f" {output.one_line(said)}" if said else ""))


def wait_and_exit(spool, ids: list[str], timeout: float | None, exit_code: bool, as_json: bool) -> None:
    """Wait for ``ids``, print a line each, and exit with wait's status."""
    try:
        jobs = spool.wait(ids, timeout=timeout)
    except JobNotFound as e:
        fail(str(e), 2)
    except WaitTimeout as e:
        report_finished(e.finished, as_json)
        left = [i for i in ids if i not in e.finished]
        fail(f"timed out waiting for {len(left)} of {len(ids)} jobs: {' '.join(left)}", TIMED_OUT)
    report_finished(jobs, as_json)
    if exit_code:
        job = jobs[ids[0]]
        code = job.get("exit_code")
        own = isinstance(code, int) and 0 <= code < 256 and job.get("outcome") != "cancelled"
        raise SystemExit(code if own else (0 if succeeded(job) else 1))
    raise SystemExit(0 if all(succeeded(j) for j in jobs.values()) else 1)


@click.command()
@click.argument("job_ids", nargs=-1, required=True, metavar="ID...")
@click.option("--timeout", callback=_seconds, metavar="DURATION", help="Give up after this long (exit 124).")
@click.option("--exit-code", is_flag=True, help="Exit with the job's own exit code (one ID).")
@click.option("--json", "as_json", is_flag=True, help="Print each record as JSON.")
@click.pass_context
def wait(ctx, job_ids, timeout, exit_code, as_json):
    """Wait until the jobs have finished; print one line each.

    Exits 0 when all succeeded, 1 when one ended otherwise (dead,
    cancelled), 2 for an unknown id, 124 when --timeout ran out.

    \b
      id=$(spoolq enqueue make report) && spoolq wait "$id"
    """
    if exit_code and len(job_ids) != 1:
        fail("--exit-code takes one ID", 2)
    output.refuse_bad_ids(job_ids)
    wait_and_exit(_spool(ctx), list(job_ids), timeout, exit_code, as_json)


@click.command()
@click.argument("job_id", metavar="ID")
@click.option("--signal", "sig", metavar="SIG", help="Send this signal only (HUP, USR1, 9...): the job goes on.")
@click.pass_context
def kill(ctx, job_id, sig):
    """Cancel a running job: SIGTERM to its processes, SIGKILL after
    timeout_grace; it ends cancelled, and is not retried."""
    number = None
    if sig is not None:
        try:
            number = signal_number(sig)
        except ValueError as e:
            fail(str(e), 2)
    output.refuse_bad_ids((job_id,))
    kill_and_say(_spool(ctx), job_id, number)


def kill_and_say(spool, job_id: str, number: int | None) -> None:
    try:
        job = spool.kill(job_id, number)
    except (JobNotFound, NotPossible) as e:
        fail(str(e), 1)
    except RequestPending as e:
        fail(str(e), PENDING)
    if number is not None:
        echo(f"sent {signal_name(number)} to job {job_id}")
        return
    say_cancelled(job_id, job)


def say_cancelled(job_id: str, job: dict[str, Any]) -> None:
    """What a cancel of a running job came to: cancelled (exit 0); still
    stopping (a run that ignores SIGTERM, before its SIGKILL: exit 0, it
    ends cancelled); ended otherwise before the cancel reached it (exit 1)."""
    if job.get("state") == "cur":
        echo(f"asked job {job_id} to stop; it is still stopping (SIGKILL follows timeout_grace after SIGTERM)")
        return
    if not finished(job):  # its run failed on its own first: it waits for a retry
        echo(one_line(f"{job_id} is {job.get('state')} (its run ended before the cancel reached it; "
                      "`spoolq cancel` it again to cancel it)"))
        raise SystemExit(1)
    outcome, said = describe(job)
    if outcome == "cancelled":
        echo(f"cancelled {job_id}")
    elif job.get("readable") is False:  # a member's view: the outcome is the owner's to read
        echo(f"asked job {job_id} to stop; it has ended (whether cancelled is readable by the spool's owner only)")
    else:
        echo(one_line(f"{job_id} {outcome} {said}".rstrip() + " (it ended before the cancel reached it)"))
        raise SystemExit(1)


@click.command()
@click.option("--now", is_flag=True, help="Kill running jobs too (they go back to failed/, due now).")
@click.option("--wait", "wait_", is_flag=True, help="Return once the workers have exited.")
@click.option("--timeout", callback=_seconds, metavar="DURATION", help="With --wait: give up after this long (124).")
@click.pass_context
def stop(ctx, now, wait_, timeout):
    """Tell every live worker to stop claiming and exit after its running jobs."""
    spool = _spool(ctx)
    try:
        asked = spool.stop_workers(now=now, wait=(timeout or 0) if wait_ else None,
                                   on_gone=lambda w: echo(f"worker {w} exited"))
    except TimeoutError as e:
        fail(str(e), TIMED_OUT)
    if not asked:
        echo("no worker running")
    elif not wait_:
        echo(f"asked {len(asked)} workers to stop" + (" now" if now else ""))


@click.command()
@click.pass_context
def pause(ctx):
    """Workers stay up but claim nothing until `spoolq resume`."""
    changed = _spool(ctx).pause()
    echo("paused" if changed else "already paused")


@click.command()
@click.pass_context
def resume(ctx):
    """Let the workers claim jobs again after `spoolq pause`."""
    changed = _spool(ctx).resume()
    echo("resumed" if changed else "not paused")


@click.command()
@click.argument("job_id", metavar="ID")
@click.option("-f", "--follow", is_flag=True, help="Follow the output as it is written until the job ends; "
              "exit as `wait` does.")
@click.option("--stderr", "which", flag_value="stderr", help="Its stderr instead (printed on stdout).")
@click.option("--both", "which", flag_value="both", help="Both: its stdout on stdout, its stderr on stderr.")
@click.pass_context
def logs(ctx, job_id, follow, which):
    """A job's output: a running job's so far, a finished one's stored
    tail. With -f, followed until the job ends (a waiting job: from its
    start), then exit 0 if it succeeded, 1 otherwise.

    \b
      id=$(spoolq enqueue make report) && spoolq logs -f "$id"
    """
    output.refuse_bad_ids((job_id,))
    spool = _spool(ctx)
    streams = {"stderr": ("stderr",), "both": ("stdout", "stderr")}.get(which, ("stdout",))
    both = which == "both"

    def shown(piece) -> None:
        if piece.skipped:
            kept = "only its tail is kept" if piece.stored else "older output is let go past log_limit"
            output.note(f"job {job_id}'s {piece.stream}: {piece.skipped} earlier bytes are not shown ({kept})")
        output.write_bytes(piece.data, to_stderr=both and piece.stream == "stderr")

    def waiting(job) -> None:
        if job.get("readable") is False and job.get("state") in ("done", "dead", "failed"):
            output.note(f"job {job_id}'s output is in its record, which only the spool's owner reads "
                        "until it is compacted")
        elif not follow:
            output.note(f"job {job_id} has not started yet (it is {job.get('state')}); -f waits for it")

    try:
        job = spool.logs(job_id, streams, follow, shown, waiting)
    except JobNotFound as e:
        fail(str(e), 2)
    if follow:
        raise SystemExit(0 if succeeded(job) else 1)


@click.command()
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True, metavar="SECONDS",
              help="Least time between two refreshes (they come as the spool changes, and every 5 s at least).")
@click.option("-n", "--iterations", type=click.IntRange(min=1), metavar="COUNT", help="Stop after COUNT refreshes.")
@click.pass_context
def top(ctx, interval, iterations):
    """A live view: jobs per state, rates, running jobs, workers, failures.

    Refreshes in place on a terminal as the spool changes (q or Ctrl-C
    quits; space refreshes at once); prints a block per refresh when
    stdout is no terminal (`spoolq top -n 1` is one look).
    """
    spool = _spool(ctx)
    try:
        output.run_top(spool.view(interval=interval), iterations)
    except KeyboardInterrupt:
        pass  # the way out of a live view, as in top(1): not an error


COMMANDS = (wait, kill, stop, pause, resume, logs, top)
