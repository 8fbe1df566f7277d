"""What a user meets first: where jobs run, how `enqueue` reads its
arguments, which spool a command uses and what it says when that is no spool,
and shell completion of job ids."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import SPOOLQ, SpoolFixture


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SPOOLQ_DIR", None)
    env.update(extra)
    return env


def test_help_shows_the_spool_in_use(tmp_path):
    where = "/srv/queue-from-env"  # only shown, never opened
    proc = subprocess.run(SPOOLQ + ["--help"], env=_env(SPOOLQ_DIR=where), capture_output=True, text=True)
    assert proc.returncode == 0 and f"[default: {where}]" in proc.stdout and "[default: spool]" not in proc.stdout
    proc = subprocess.run(SPOOLQ + ["--help"], env=_env(), capture_output=True, text=True)
    assert "[default: spool]" in proc.stdout
