"""The import direction of the package (docs/contributing.md, "Where the code lives"): each package
imports only the packages below it, at run time (imports made for type checking only do not
count), so that the folders read as the data flows and no module sits in an import circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import daskjobs

PACKAGE = Path(daskjobs.__file__).resolve().parent

LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "_version": set(),
    "_config": {"errors"},
    "_model": {"errors"},
    "_execution": {"errors", "_model"},
    "session": {"errors", "_config", "_model", "_execution"},
    "checkpoint": {"errors", "_version", "_config", "_model", "_execution"},
    "data": {"errors", "_model", "checkpoint"},
    "runner": {"errors", "_config", "_model", "_execution", "session", "checkpoint", "data"},
    "testing": {"errors", "_model", "session", "checkpoint", "runner"},
    "demo": {"errors", "_model", "data"},
    "cli": {"errors", "_version", "_model", "session", "checkpoint", "runner", "testing", "demo"},
    "__main__": {"cli"},
    "__init__": {"errors", "_version", "_model", "data", "checkpoint", "runner", "session", "testing"},
}
"""Part of daskjobs -> the parts it may import at run time (itself always)."""


def part_of(module: str) -> str:
    """``daskjobs.checkpoint._protocol.store`` -> ``checkpoint``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["daskjobs", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append((".".join(parts), path))
    return found


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def runtime_imports(module: str, path: Path) -> set[str]:
    """The daskjobs modules ``module`` imports at run time (at module level or inside functions)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("daskjobs"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("daskjobs"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


MODULES = {name for name, _ in modules()}


@pytest.mark.parametrize(("module", "path"), modules(), ids=[name for name, _ in modules()])
def test_each_module_imports_only_the_layers_below_its_own(module, path):
    """A module of one part imports only its own part and the parts that part may import."""
    mine = part_of(module)
    allowed = LAYERS[mine] | {mine}
    wrong = sorted(t for t in runtime_imports(module, path) if t != "daskjobs" and part_of(t) not in allowed)
    assert wrong == [], f"{module} ({mine}) imports {wrong}; {mine} may import {sorted(LAYERS[mine])}"


CHECKPOINT_LAYERS: dict[str, set[str]] = {
    "_format": set(),
    "_storage": {"_format"},
    "_protocol": {"_format", "_storage"},
    "_node": {"_format", "_storage", "_protocol"},
    "_managers": {"_format", "_storage", "_protocol", "_node"},
}
"""Part of :mod:`daskjobs.checkpoint` -> the parts of it it may import at run time (itself always)."""

CHECKPOINT_MODULES = [(m, p) for m, p in modules() if m.startswith("daskjobs.checkpoint.")]


@pytest.mark.parametrize(("module", "path"), CHECKPOINT_MODULES, ids=[name for name, _ in CHECKPOINT_MODULES])
def test_each_checkpoint_module_imports_only_the_checkpoint_parts_below_its_own(module, path):
    """Inside the checkpoint package: format <- storage <- protocol <- node steps <- managers."""
    mine = module.split(".")[2]
    allowed = CHECKPOINT_LAYERS[mine] | {mine}
    inside = (t for t in runtime_imports(module, path) if t.startswith("daskjobs.checkpoint."))
    wrong = sorted(t for t in inside if t.split(".")[2] not in allowed)
    assert wrong == [], f"{module} ({mine}) imports {wrong}; {mine} may import {sorted(CHECKPOINT_LAYERS[mine])}"


def test_the_format_is_pure():
    """The checkpoint format's modules do no I/O: they import no storage library and call no ``open``."""
    for module, path in CHECKPOINT_MODULES:
        if module.split(".")[2] == "_format":
            tree = ast.parse(path.read_text())
            imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            calls = (ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call))
            opens = [call for call in calls if call in {"open", "os.open"}]
            assert not imported & {"zarr", "fsspec", "shutil", "pathlib", "io"}, module
            assert opens == [], module


def test_every_part_has_a_layer_and_a_docstring_saying_what_it_owns():
    """Every module belongs to a known part; every package's __init__ says what it owns and may import."""
    assert {part_of(m) for m in MODULES} <= set(LAYERS)
    for package in PACKAGE.iterdir():
        init = package / "__init__.py"
        if init.exists():
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc, f"{init} has no docstring"
            assert "import" in doc, f"{init}'s docstring does not say what the package may import"


def test_no_import_circle_between_modules():
    """No two modules import each other, directly or through others (run-time imports)."""
    graph = {m: {t for t in runtime_imports(m, p) if t in MODULES and t != m} for m, p in modules()}
    # a package's __init__ importing its own modules (a face) is not a circle
    for module in list(graph):
        graph[module] = {t for t in graph[module] if not module.startswith(t + ".")}
    state: dict[str, int] = {}

    def cycle_from(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*trail[trail.index(target) :], target] if target in trail else [node, target]
            if target not in state:
                found = cycle_from(target, [*trail, target])
                if found:
                    return found
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = cycle_from(module, [module])
            assert cycle is None, " -> ".join(cycle)
