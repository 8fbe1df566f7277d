"""The package's import graph: modules in layers, each importing only from
the layers below it, so there is no circle and no upward import; every
module says in its first docstring line what it owns.

``LAYERS`` is the source of truth (``contrib/import-graph`` reads it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "spoolq"

# Bottom first. A module imports only from modules of lower layers (at
# module level or in a function alike); modules of one layer do not import
# each other.
LAYERS = [
    ["errors", "ids", "linux", "words"],  # leaves: import nothing from spoolq
    ["owners", "procs", "record"],
    ["config", "dirspool.protocol"],
    ["output", "waker", "dirspool.ordering"],  # ordering: the order/ folder's files
    ["backend", "dirspool.registry", "runner", "dirspool.watcher"],  # backend: the storage port every spool implements
    ["dirspool.commit", "forkserver", "dirspool.index", "dirspool.transitions"],
    ["dirspool.waits"],  # held jobs and dependents: their moves
    ["dirspool.compact", "dirspool.pickup", "dirspool.recovery"],
    ["dirspool.passes"],  # the directory spool's walk over its due jobs
    ["dirspool.backend"],  # the port over a spool directory
    ["outcomes", "strategies"],  # recording outcomes; -j 1 and -j N
    ["worker"],
    ["pool"],
    ["views", "ordered"],  # the read side of Spool: records, listings, counts; its ordering verbs
    ["spool"],  # the facade: Spool.work is the only way to run workers
    ["bench", "metrics", "testing"],
    ["cli"],
    ["entry"],
    ["__init__", "__main__", "dirspool.__init__"],
]


#: Sub-packages whose modules are nodes of their own ("dirspool.protocol"),
#: and packages that count as one node whatever is imported of them.
SUBPACKAGES = ("dirspool",)
UNITS = ("pgspool",)


def modules() -> list[str]:
    found = [p.stem for p in PACKAGE.glob("*.py")]
    for sub in SUBPACKAGES:
        found += [f"{sub}.{p.stem}" for p in (PACKAGE / sub).glob("*.py")]
    return sorted(found)


def _file(module: str) -> Path:
    return PACKAGE / (module.replace(".", "/") + ".py")


def _node(parts: list[str], names: list[str], known: set[str]) -> set[str]:
    """The graph's nodes for an import of ``names`` from the module path
    ``parts`` (inside spoolq)."""
    if parts and parts[0] in UNITS:
        return {parts[0]}
    if parts and parts[0] in SUBPACKAGES:
        if len(parts) > 1:
            return {f"{parts[0]}.{parts[1]}"}
        return {f"{parts[0]}.{n}" if f"{parts[0]}.{n}" in known else f"{parts[0]}.__init__" for n in names}
    if parts:
        return {parts[0]}
    return {n if n in known else "__init__" for n in names}


def imports(module: str) -> set[str]:
    """The spoolq modules ``module`` imports, anywhere in its code."""
    tree = ast.parse(_file(module).read_text())
    found: set[str] = set()
    known = set(modules())
    package = module.split(".")[:-1]  # where a relative import starts
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "spoolq":
                    found |= _node(parts[1:2], ["__init__"], known) if len(parts) > 1 else {"__init__"}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] != "spoolq":
                continue
            if node.level > len(package) + 1:
                raise AssertionError(f"{module}: an import from above the package")
            path = [p for p in (node.module or "").split(".") if p]
            if node.level == 0:
                path = path[1:]  # drop "spoolq"
            else:
                path = package[:len(package) - (node.level - 1)] + path
            found |= _node(path, [a.name for a in node.names], known)
    found.discard(module)
    return found


def layer_of() -> dict[str, int]:
    return {m: i for i, layer in enumerate(LAYERS) for m in layer}


def test_every_module_is_in_a_layer_once():
    listed = [m for layer in LAYERS for m in layer]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(listed) == modules(), "LAYERS must list every module of spoolq/, and only those"


def test_imports_only_point_down():
    layers = layer_of()
    upward = [f"{m} (layer {layers[m]}) imports {i} (layer {layers[i]})"
              for m in modules() for i in sorted(imports(m)) if layers[i] >= layers[m]]
    assert upward == []


def test_the_leaves_import_nothing_from_spoolq():
    for module in LAYERS[0]:
        assert imports(module) == set(), module


def test_every_module_says_what_it_owns():
    for module in modules():
        doc = ast.get_docstring(ast.parse(_file(module).read_text()))
        assert doc and doc.strip().splitlines()[0].strip(), f"{module}.py has no docstring saying what it owns"


def test_the_import_graph_script_agrees():
    proc = subprocess.run([sys.executable, str(ROOT / "contrib" / "import-graph")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "spool -> worker" in proc.stdout and "layer 0: errors ids linux" in proc.stdout
