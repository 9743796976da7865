"""The whole package's import graph: acyclic, one direction down the layers, rank side plain.

Read from the source, so every ``import`` counts, also those inside functions and
``TYPE_CHECKING`` blocks (a lazy import is still a dependency a reader has to follow):

* no two modules of the package import each other, directly or around a loop;
* a package (``fsdp_interactive.X``) imports only packages of a lower layer than its own
  (see ``LAYERS``), or modules of its own package;
* rank-side packages import neither IPython, ipywidgets nor matplotlib (they run in
  every engine, and what they return is plain data the notebook side draws).

``tests/notebook/test_layers.py`` adds the top layer's finer rule (other packages only
through their public names).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_interactive"

#: Layer of each package (and each module at the package root), lowest first. A package
#: may import packages of a strictly lower layer only.
LAYERS: dict[str, int] = {
    # leaves shared by several layers; they import nothing of the package
    "_text": 0,
    "_ranks": 0,
    "_torch_compat": 0,
    "_background_groups": 0,
    "_engine_parent": 0,  # run with -m on other hosts: the standard library only
    # rank side: the FSDP1 API, the example models; the pool (notebook side) sits beside
    "fsdp": 1,
    "examples": 1,
    "pool": 1,
    # rank side, built on fsdp
    "inspect": 2,
    "checkpoint": 2,
    # notebook side: magics, widgets and plots
    "notebook": 3,
    # entry points
    "demo": 4,
    "cli": 5,
    "__init__": 6,
    "__main__": 6,
}
RANK_SIDE = ("fsdp", "inspect", "checkpoint", "examples", "_ranks", "_torch_compat")
NOTEBOOK_ONLY_LIBRARIES = ("IPython", "ipywidgets", "matplotlib")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def unit_of(module: str) -> str:
    """``fsdp_interactive.fsdp._wrapping`` -> ``fsdp``; the package's own ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def as_module(dotted: str) -> str | None:
    """The package module a dotted import names (dropping a trailing object name)."""
    parts = dotted.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


@cache
def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(package modules, top-level outside libraries) that ``module`` imports anywhere."""
    path = MODULES[module]
    ours: set[str] = set()
    outside: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "fsdp_interactive":
                target = as_module(name)
                if target is not None and target != module:
                    ours.add(target)
            elif name:
                outside.add(name.split(".")[0])
    return ours, outside


def test_every_package_has_a_layer():
    assert {unit_of(m) for m in MODULES} <= set(LAYERS), (
        f"packages without a layer in LAYERS: {sorted({unit_of(m) for m in MODULES} - set(LAYERS))}"
    )


def test_the_package_has_no_import_cycle():
    graph = {module: imports_of(module)[0] for module in MODULES}
    # Tarjan's strongly connected components, iteratively (no recursion limit to meet).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    assert not cycles, f"modules that import one another (around a loop): {cycles}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    own = unit_of(module)
    upward = sorted(
        target
        for target in imports_of(module)[0]
        if unit_of(target) != own and LAYERS[unit_of(target)] >= LAYERS[own]
    )
    assert not upward, (
        f"{module} (layer {LAYERS[own]}) imports modules of its own or a higher layer: "
        f"{[(t, LAYERS[unit_of(t)]) for t in upward]}"
    )


@pytest.mark.parametrize("module", sorted(m for m in MODULES if unit_of(m) in RANK_SIDE), ids=str)
def test_rank_side_modules_never_import_notebook_libraries(module):
    found = sorted(imports_of(module)[1] & set(NOTEBOOK_ONLY_LIBRARIES))
    assert not found, f"{module} runs on the ranks but imports {found}"


def test_the_rules_catch_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a fake package with a loop and an upward edge."""
    fake = tmp_path / "fsdp_interactive"
    (fake / "fsdp").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "fsdp" / "__init__.py").write_text("")
    (fake / "fsdp" / "a.py").write_text("from fsdp_interactive.fsdp import b\n")
    (fake / "fsdp" / "b.py").write_text(
        "def f():\n    from fsdp_interactive.fsdp.a import x\n    import IPython\n"
    )
    (fake / "fsdp" / "c.py").write_text("import fsdp_interactive.notebook.magics\n")
    (fake / "notebook").mkdir()
    (fake / "notebook" / "__init__.py").write_text("")
    (fake / "notebook" / "magics.py").write_text("")
    globals_ = globals()
    monkeypatch.setitem(globals_, "PACKAGE", fake)
    monkeypatch.setitem(
        globals_, "MODULES", {module_name(p): p for p in sorted(fake.rglob("*.py"))}
    )
    imports_of.cache_clear()
    try:
        with pytest.raises(AssertionError, match="around a loop"):
            test_the_package_has_no_import_cycle()
        with pytest.raises(AssertionError, match="higher layer"):
            test_imports_point_down_the_layers("fsdp_interactive.fsdp.c")
        with pytest.raises(AssertionError, match="IPython"):
            test_rank_side_modules_never_import_notebook_libraries("fsdp_interactive.fsdp.b")
    finally:
        imports_of.cache_clear()
