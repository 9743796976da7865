"""The top layer (notebook, demo, cli) depends on the layers below one way only.

Read from the source (every ``import``, also inside functions and ``TYPE_CHECKING``
blocks): the top layer imports other packages through their public names only, the
shared modules it reaches at the package root are leaves, nothing below imports the top
layer, and the top layer's own modules import one another without cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_interactive"
TOP = ("notebook", "demo", "cli")
BELOW = ("pool", "fsdp", "checkpoint", "inspect")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(package: str) -> dict[str, Path]:
    folder = PACKAGE / package
    return {module_name(path): path for path in sorted(folder.rglob("*.py"))}


def imported(path: Path) -> set[str]:
    """Every fsdp_interactive module or name the file imports (``pkg.mod`` or ``pkg.mod.name``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("fsdp_interactive.")}


def as_module(name: str) -> str:
    """The module an imported dotted name refers to (drops a trailing object name)."""
    parts = name.split(".")
    while len(parts) > 1:
        candidate = PACKAGE.parent.joinpath(*parts)
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return parts[0]


TOP_MODULES = {name: path for package in TOP for name, path in modules_of(package).items()}


@pytest.mark.parametrize("module", sorted(TOP_MODULES))
def test_other_packages_are_reached_through_public_names(module):
    own = module.split(".")[1]
    targets = [as_module(name).split(".") for name in imported(TOP_MODULES[module])]
    private = sorted(
        ".".join(parts)
        for parts in targets
        if parts[1:2] != [own] and any(part.startswith("_") for part in parts[2:])
    )
    assert not private, f"{module} imports private modules of other packages: {private}"


def test_shared_root_modules_of_the_top_layer_are_leaves():
    shared = {
        as_module(name)
        for path in TOP_MODULES.values()
        for name in imported(path)
        if as_module(name).count(".") == 1 and as_module(name).split(".")[1].startswith("_")
    }
    assert "fsdp_interactive._text" in shared
    for module in sorted(shared):
        path = PACKAGE / f"{module.split('.')[1]}.py"
        assert not imported(path), (
            f"{module} is shared by several layers but imports {imported(path)}"
        )


def test_nothing_below_imports_the_top_layer():
    upward = sorted(
        f"{module} -> {name}"
        for package in BELOW
        for module, path in modules_of(package).items()
        for name in imported(path)
        if name.split(".")[1] in TOP
    )
    assert not upward, f"lower layers import the top layer: {upward}"


def test_the_top_layer_has_no_import_cycles():
    graph = {
        module: {as_module(name) for name in imported(path)} & set(TOP_MODULES) - {module}
        for module, path in TOP_MODULES.items()
    }
    # a package's __init__ that re-exports its modules is not a cycle with them
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycle = [*trail[trail.index(target) :], target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*trail, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
