"""The PostgreSQL spool's place in the import graph: spoolq/pgspool/ is one
package behind the storage port. It imports from spoolq only the leaves,
the data layer (errors, ids, procs, record, config, waker), the storage
port (backend) and its own modules, never the directory spool's or anything above them; nothing in
spoolq/ outside it imports it but the facade. Every module of it says what
it owns."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "spoolq"
PGSPOOL = PACKAGE / "pgspool"
ALLOWED = {"backend", "errors", "ids", "procs", "record", "config", "waker"}
FACADE = {"spool"}  # the one module above the port that picks a backend


def spoolq_imports(path: Path, inside_pgspool: bool) -> set[str]:
    """The modules of spoolq (not of pgspool) that ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".") if node.module else []
            if node.level == 0:
                if parts[:1] == ["spoolq"]:
                    found.update(parts[1:2] or [a.name for a in node.names])
            elif inside_pgspool and node.level == 2:
                found.update(parts[:1] or [a.name for a in node.names])
            elif not inside_pgspool and node.level == 1:
                found.update(parts[:1] or [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "spoolq" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_pgspool_imports_only_the_layers_below_the_port():
    for path in sorted(PGSPOOL.glob("*.py")):
        extra = spoolq_imports(path, True) - ALLOWED
        assert not extra, f"pgspool/{path.name} imports {sorted(extra)}"


def test_only_the_facade_imports_pgspool():
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem not in FACADE:
            assert "pgspool" not in spoolq_imports(path, False), f"{path.name} imports pgspool"


def test_every_pgspool_module_says_what_it_owns():
    for path in sorted(PGSPOOL.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.strip().splitlines()[0].strip(), f"pgspool/{path.name} has no docstring"
