"""Contracts on the documentation: the README stays a short user guide, the
reference and the man page name every command, option and setting the code
has, and the commands CI runs are the ones the README shows."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import click
import pytest

import spoolq
from spoolq.cli import cli
from spoolq.config import DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference.md"
MAN1 = DOCS / "spoolq.1"
MAN5 = DOCS / "spoolq-job.5"


def _commands(group: click.Group = cli, path: tuple[str, ...] = ()):
    """Every command of the CLI as a path of names: ("config", "set"), ..."""
    for name, command in sorted(group.commands.items()):
        yield path + (name,), command
        if isinstance(command, click.Group):
            yield from _commands(command, path + (name,))


def _block_after(text: str, marker: str) -> str:
    """The first fenced code block after an HTML comment marker."""
    rest = text.split(marker, 1)[1]
    match = re.search(r"^```[a-z]*\n(.*?)^```", rest, re.S | re.M)
    assert match, f"no code block after {marker}"
    return match.group(1).strip()


def _doc_files() -> list[Path]:
    return [README] + sorted(p for p in DOCS.rglob("*") if p.is_file())


def test_readme_is_a_short_guide():
    lines = README.read_text().count("\n")
    assert lines <= 320, f"README.md has {lines} lines; move details to docs/"


def test_docs_cite_no_spec_or_issue_numbers():
    for path in _doc_files():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            assert "SPEC" not in line, f"{path.name}:{lineno}: {line}"
            assert not re.search(r"\bissues? #?\d", line, re.I), f"{path.name}:{lineno}: {line}"


def test_reference_names_every_command_and_option():
    text = REFERENCE.read_text()
    for path, command in _commands():
        assert f"spoolq {' '.join(path)}" in text, f"docs/reference.md does not name spoolq {' '.join(path)}"
        for param in command.params:
            for opt in param.opts + param.secondary_opts:
                if opt.startswith("--") and opt != "--help":
                    assert re.search(rf"`[^`]*{re.escape(opt)}\b", text), \
                        f"docs/reference.md does not name {opt} of spoolq {' '.join(path)}"


def test_man_page_names_every_command():
    text = MAN1.read_text()
    for path, _ in _commands():
        for name in path:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), \
                f"docs/spoolq.1 does not name {' '.join(path)}"


def test_every_setting_is_documented():
    reference = REFERENCE.read_text()
    readme = README.read_text()
    section = readme.split("## Settings", 1)[1].split("\n## ", 1)[0]
    table_keys = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))
    for key in DEFAULTS:
        assert f"`{key}`" in reference, f"docs/reference.md does not name the setting {key}"
        assert key in table_keys, f"the README's settings table has no row for {key}"
        assert re.search(rf"\b{key}\b", MAN1.read_text().replace("\\_", "_")), f"docs/spoolq.1 does not name {key}"


def test_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    expected = re.search(r'^TEST_COMMAND="(.*)"$', ci, re.M).group(1)
    assert _block_after(README.read_text(), "<!-- test-command -->") == expected


def test_readme_shows_one_install_and_first_job_command():
    command = _block_after(README.read_text(), "<!-- install-command -->")
    assert "\n" not in command, "the install command is one line"
    assert command.startswith("python3 -m venv .venv && .venv/bin/pip install")
    assert "spoolq enqueue" in command and "spoolq work" in command and "spoolq show" in command


def _drop_recipe() -> str:
    section = README.read_text().split("## Drop a job from any shell", 1)[1]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)


def test_readme_drop_recipe_publishes_a_group_readable_job(tmp_path):
    spool = tmp_path / "spool"
    for folder in ("tmp", "new"):
        (spool / folder).mkdir(parents=True)
    result = subprocess.run(["sh", "-c", "umask 077\n" + _drop_recipe()], env={"SPOOLQ_DIR": str(spool), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    [job] = list((spool / "new").iterdir())
    assert job.name.endswith(".json") and json.loads(job.read_text())["command"]
    assert job.stat().st_mode & 0o040, "the dropped file must be readable by the spool's group"
    assert list((spool / "tmp").iterdir()) == []


def test_readme_drop_recipe_publishes_nothing_when_the_write_fails(tmp_path):
    # A file-size limit of 0 stands for a full disk: the file is created but
    # the write fails. Nothing may reach new/, and the recipe must fail.
    spool = tmp_path / "spool"
    for folder in ("tmp", "new"):
        (spool / folder).mkdir(parents=True)
    script = "trap '' XFSZ\nulimit -f 0\n" + _drop_recipe()
    result = subprocess.run(["sh", "-c", script], env={"SPOOLQ_DIR": str(spool), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert list((spool / "new").iterdir()) == []
    assert list((spool / "tmp").iterdir()) == []


def test_docs_links_resolve():
    for path in [README, *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_packaging_has_one_version_a_license_and_py_typed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "spoolq.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", spoolq.__version__)
    assert project["project"]["license"] == {"text": "MIT"}
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert (ROOT / "spoolq" / "py.typed").exists()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["spoolq"]


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_man_pages_render_without_warnings():
    for page in (MAN1, MAN5):
        result = subprocess.run(["groff", "-ww", "-man", "-Tutf8", "-z", str(page)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stderr == "", f"{page.name}: {result.stderr}"


def test_the_man_pages_name_only_what_an_installed_system_has():
    """A man page is read where spoolq is installed, not in its sources:
    it names no file of the source tree (docs/..., contrib/...), and the
    spoolq pages its SEE ALSO names are the ones pyproject.toml installs."""
    import tomllib

    data_files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    installed = {(Path(f).stem, Path(f).suffix[1:]) for files in data_files.values() for f in files}
    for page in (MAN1, MAN5):
        text = page.read_text()
        assert not re.search(r"(^|[\s(])(docs|contrib)/\S", text, re.M), f"{page.name} names a file of the sources"
        see_also = text.split(".SH SEE ALSO", 1)[1].split(".SH ", 1)[0]
        named = {(name.replace("\\-", "-"), section) for name, section in re.findall(r"^\.BR (\S+) \((\d)\)", see_also, re.M)}
        assert named, f"{page.name} has no SEE ALSO"
        assert {p for p in named if p[0].startswith("spoolq")} <= installed, (page.name, named, installed)
