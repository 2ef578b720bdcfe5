"""The shape of the packages: the data flow runs one way, the references stand alone.

`crosscheck`'s subpackages follow the flow fixture -> layout -> step -> gradient -> judge /
diagnose -> report, each importing only those before it (`LAYERS`); inside a subpackage the
modules import each other without a cycle. `jax_impl` and `torch_impl` hold the reference a user
reads and copies: their modules never import their own ``harness`` (what launches and drives
them) nor `crosscheck` (three independent implementations: a shared helper would hide a shared
bug). Only runtime imports count: an import under ``if TYPE_CHECKING:`` runs nowhere.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: crosscheck's layers, bottom first; `exit_codes` and `tables` (terminal layout) are leaves
#: every layer may use.
LAYERS = (
    "exit_codes",
    "tables",
    "contract",
    "fixtures",
    "judge",
    "diagnosis",
    "launch",
    "run",
    "bugs",
    "verification",
    "bench",
    "conformance",
    "cli",
)
#: Above every layer: the public API, `python -m crosscheck` and the pytest plugin.
ENTRY_POINTS = ("__init__", "__main__", "pytest_plugin")
#: The one crosscheck module the reference may import: data, not math (the transformer's
#: configuration and its float64 initial weights, read from one file by numpy), so that the
#: torch and JAX transformers start from the same numbers.
SHARED_DATA_MODULE = "crosscheck.fixtures.transformer_weights"
#: The process layer: starting worker processes, their zygote, the one registry of process
#: groups and its terminator. Process management, not math: written once, and what the torch
#: and JAX harnesses (never their reference modules) start their processes through. The
#: standard library only, so that a worker or a zygote pays nothing for it.
PROCESS_LAYER = (
    "crosscheck.launch.processes",
    "crosscheck.launch.worker_processes",
    "crosscheck.launch.zygote",
    "crosscheck.launch.zygote_server",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, *, type_only_too: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import that runs (and with `type_only_too` also those under
    ``if TYPE_CHECKING:``), relative imports resolved; the names imported `from` a package
    count as submodules when they are files."""
    tree = ast.parse(path.read_text())
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(sub) for sub in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only and not type_only_too:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            package = ROOT / Path(*node.module.split("."))
            for alias in node.names:
                is_module = (package / f"{alias.name}.py").exists() or (
                    package / alias.name
                ).is_dir()
                found.append(
                    (node.lineno, f"{node.module}.{alias.name}" if is_module else node.module)
                )
    return found


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_every_crosscheck_subpackage_is_a_known_layer():
    subpackages = {p.name for p in (ROOT / "crosscheck").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "crosscheck").glob("*.py")}
    assert subpackages | (modules - set(ENTRY_POINTS)) <= set(LAYERS), sorted(
        (subpackages | modules) - set(LAYERS)
    )


def test_the_layers_of_crosscheck_import_one_way():
    upward = []
    for path in _files("crosscheck"):
        mine = path.relative_to(ROOT / "crosscheck").with_suffix("").parts[0]
        if mine in ENTRY_POINTS:
            continue  # the public API and the entry points sit above every layer
        for line, module in _runtime_imports(path):
            parts = module.split(".")
            if parts[0] != "crosscheck":
                continue
            assert len(parts) > 1, f"{path.relative_to(ROOT)}:{line} imports crosscheck itself"
            theirs = parts[1]
            if theirs in LAYERS and LAYERS.index(theirs) > LAYERS.index(mine):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {module}")
    assert upward == []


def test_no_file_imports_itself_back_through_a_cycle():
    """One graph of every file of the three packages; an import under ``if TYPE_CHECKING:`` or
    inside a function counts too: a cycle there is still two files that need each other."""
    packages = ("crosscheck", "jax_impl", "torch_impl")
    graph: dict[str, set[str]] = {}
    for package in packages:
        for path in _files(package):
            graph[_module_name(path)] = {
                module
                for _, module in _runtime_imports(path, type_only_too=True)
                if module.split(".")[0] in packages
            }
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node] & set(graph)):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # A package's __init__ importing its own modules is no cycle of the flow.
    assert [c for c in cycles if c.split(" -> ")[0] not in packages] == []


@pytest.mark.parametrize("package", ["jax_impl", "torch_impl"])
def test_the_reference_imports_neither_its_harness_nor_crosscheck(package):
    bad = []
    for path in _files(package):
        relative = path.relative_to(ROOT)
        in_harness = relative.parts[1] == "harness"
        for line, module in _runtime_imports(path):
            allowed = {SHARED_DATA_MODULE, *(PROCESS_LAYER if in_harness else ())}
            if module.split(".")[0] == "crosscheck" and module not in allowed:
                bad.append(f"{relative}:{line} imports {module}")
            if module.startswith(f"{package}.harness") and not in_harness:
                if relative.name == "__init__.py" and package == "torch_impl":
                    continue  # re-exports `launch` and its errors, documented in the docstring
                bad.append(f"{relative}:{line} imports {module}")
    assert bad == []


def test_the_process_layer_needs_the_standard_library_only():
    """Every worker process and zygote imports it: nothing but the standard library and the
    layer itself (``crosscheck`` and ``crosscheck.launch`` are packages that import nothing)."""
    bad = []
    for module in PROCESS_LAYER:
        path = ROOT / Path(*module.split(".")).with_suffix(".py")
        for line, imported in _runtime_imports(path, type_only_too=True):
            top = imported.split(".")[0]
            if top == "crosscheck":
                if imported not in PROCESS_LAYER:
                    bad.append(f"{module}:{line} imports {imported}")
            elif top not in sys.stdlib_module_names and top != "__future__":
                bad.append(f"{module}:{line} imports {imported}")
    assert bad == []
    for package in ("crosscheck/__init__.py", "crosscheck/launch/__init__.py"):
        imported = {m.split(".")[0] for _, m in _runtime_imports(ROOT / package)}
        assert imported <= set(sys.stdlib_module_names) | {"__future__"}, (package, imported)
