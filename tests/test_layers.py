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
    ["config"],
    ["output", "waker", "control"],  # control: job-control requests, the worker's ear, signals
    ["backend", "runner"],  # backend: the storage port every spool implements; runner: one run
    ["forkserver", "liveout", "outcomes", "strategies"],  # the worker's parts: running jobs' output; recording outcomes; -j 1 and -j N
    ["worker", "relay"],  # the loop, and the relay between two spools: through the port only
    ["pool"],
    # The directory spool, behind the port (imported only by the facade and bench):
    ["dirspool.mounts", "dirspool.protocol"],  # which filesystem the spool is on; paths, locks, syncs, renames
    ["dirspool.control", "dirspool.ordering", "dirspool.registry", "dirspool.watcher"],  # ordering: the order/ folder's files
    ["dirspool.commit", "dirspool.index", "dirspool.transitions"],
    ["dirspool.waits"],  # held jobs and dependents: their moves
    ["dirspool.autocompact", "dirspool.compact", "dirspool.metrics", "dirspool.pickup", "dirspool.recovery"],
    ["dirspool.passes", "dirspool.reads"],  # a worker's walk over the due jobs; the read side
    ["dirspool.ordered", "dirspool.working"],  # the ordering verbs (hold, release, an ordered enqueue); the worker's verbs
    ["dirspool.backend"],  # DirBackend: the port over a spool directory
    ["pgspool"],  # the PostgreSQL spool, behind the port (see test_pg_layers.py)
    ["follow", "jobcontrol", "top"],  # the facade's logs; wait, kill, stop, pause; the live view (through the port)
    ["spool"],  # the facade: picks the backend; Spool.work is the only way to run workers
    ["bench", "metrics", "testing"],
    ["controlcli"],  # the job-control commands (wait, kill, stop, pause, resume)
    ["cli"],
    ["entry"],
    ["__init__", "__main__", "dirspool.__init__"],
]

#: The only modules above the port that may import a backend package:
#: the facade picks one; bench measures the directory spool on purpose.
PICK_BACKEND = {"spool", "bench"}


#: Sub-packages whose modules are nodes of their own ("dirspool.protocol"),
#: and packages that count as one node whatever is imported of them.
SUBPACKAGES = ("dirspool",)
UNITS = ("pgspool",)


def modules() -> list[str]:
    found = [p.stem for p in PACKAGE.glob("*.py")] + [u for u in UNITS if (PACKAGE / u).is_dir()]
    for sub in SUBPACKAGES:
        found += [f"{sub}.{p.stem}" for p in (PACKAGE / sub).glob("*.py")]
    return sorted(found)


def _file(module: str) -> Path:
    if module in UNITS:
        return PACKAGE / module / "__init__.py"
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
    """The spoolq modules ``module`` imports, anywhere in its code (a
    package counted as one node: any of its files)."""
    if module in UNITS:
        return set().union(*(imports_of(p, [module]) for p in sorted((PACKAGE / module).glob("*.py")))) - {module}
    return imports_of(_file(module), module.split(".")[:-1]) - {module}


def imports_of(path: Path, package: list[str]) -> set[str]:
    """What one file imports; ``package``: where its relative imports start."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    known = set(modules())
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
                raise AssertionError(f"{path}: an import from above the package")
            parts = [p for p in (node.module or "").split(".") if p]
            if node.level == 0:
                parts = parts[1:]  # drop "spoolq"
            else:
                parts = package[:len(package) - (node.level - 1)] + parts
            found |= _node(parts, [a.name for a in node.names], known)
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


def test_nothing_above_the_port_imports_a_backend_but_the_facade():
    """The worker, the read side, the CLI, metrics and testing know only
    the port: which spool they have is the facade's business."""
    above = [m for m in modules() if "." not in m and m not in PICK_BACKEND]
    found = [f"{m} imports {i}" for m in above for i in sorted(imports(m))
             if i.startswith("dirspool") or i == "pgspool"]
    assert found == []


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
