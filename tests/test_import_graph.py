"""The repository's import graphs: acyclic, one direction down the layers, rank side plain.

Read from the source, so every ``import`` counts, also those inside functions and
``TYPE_CHECKING`` blocks (a lazy import is still a dependency a reader has to follow):

* no two modules import each other, directly or around a loop, in the package, in
  ``bench/`` or in ``tests/`` (its shared helpers);
* a package (``fsdp_interactive.X``) imports only packages of a lower layer than its own
  (see ``LAYERS``), or modules of its own package;
* inside ``pool/``, each folder imports only the folders ``POOL_FOLDERS`` allows it: the
  rank side (``pool/rank/``, code that runs inside every engine) reaches nothing of the
  kernel side, only what both sides share (``pool/common/``);
* rank-side code (``RANK_SIDE``) imports neither IPython, ipywidgets nor matplotlib (it
  runs in every engine, and what it returns is plain data the notebook side draws).

``tests/notebook/test_layers.py`` adds the top layer's finer rule (other packages only
through their public names).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "fsdp_interactive"

#: Layer of each package (and each module at the package root), lowest first. A package
#: may import packages of a strictly lower layer only.
LAYERS: dict[str, int] = {
    # leaves shared by several layers; they import nothing of the package
    "_text": 0,
    "_ranks": 0,
    "_torch_compat": 0,
    "_background_groups": 0,
    "_plain": 0,  # CPU copies of what the ranks send to the kernel: rank side and pool agents
    "_engine_parent": 0,  # run with -m on other hosts: the standard library only
    "_controller_entry": 0,  # run with -m as the pool's controller: ipyparallel, no pool import
    "_private_files": 0,  # folders and files only this user reaches: forker, reaper, ranks
    "_notices": 0,  # what a rank tells the kernel unasked; the pool installs the carrier
    "_lines": 0,  # a stream's lines as shown; each rank's streams cut and tagged (RankLines)
    "_status_line": 0,  # the in-place surface: a text stream's last line, a kernel display
    "_bar_state": 0,  # a rank's progress bar as data, sent to the kernel that draws it
    "_lazy_exports": 0,  # names a package imports when first used (kernel and rank side)
    # an attachable job's records (run with -m over ssh: the standard library only)
    "_attach_records": 1,
    # whether another user could change a path: checkpoints, the pool's socket folder
    "_path_trust": 1,
    # rank side: the FSDP1 API, the example models
    "fsdp": 1,
    "examples": 1,
    # rank side: how a model is wrapped (every original parameter, wherever it is held)
    "wrapping": 2,
    # rank side, built on fsdp and wrapping
    "inspect": 3,
    "checkpoint": 3,
    # the pool (notebook side, and its rank side): drives the rank-side packages, e.g. a
    # recovery restores a snapshot with checkpoint's functions
    "pool": 4,
    # notebook side: magics, widgets and plots
    "notebook": 5,
    # entry points
    "demo": 6,
    "attachable": 6,  # a training job's ranks made attachable (rank side)
    "cli": 7,
    "__init__": 8,
    "__main__": 8,
}
RANK_SIDE = (
    "fsdp",
    "wrapping",
    "inspect",
    "checkpoint",
    "examples",
    "_ranks",
    "_torch_compat",
    "_notices",
    "_plain",
    "_bar_state",
    "_lines",
    "_lazy_exports",
    "_attach_records",
    "attachable",
    "_path_trust",
)
#: Folders of ``pool/`` whose modules run inside the engines (or in both places).
RANK_SIDE_POOL = ("fsdp_interactive.pool.rank", "fsdp_interactive.pool.common")
NOTEBOOK_ONLY_LIBRARIES = ("IPython", "ipywidgets", "matplotlib")
#: Every engine is an IPython kernel: the one rank-side module whose job is to hook into
#: that shell may import IPython (still neither widgets nor plots).
ENGINE_SHELL = "fsdp_interactive.pool.rank._engine_shell"

#: The folders of ``pool/`` and which other parts of ``pool/`` each may import ("" is the
#: folder's top: the kernel side a user holds, ``Pool`` and its parts, which may import
#: every folder; ``errors`` is the module ``pool/errors.py``, a leaf).
POOL_FOLDERS: dict[str, set[str] | None] = {
    "": None,  # anything in pool/
    "common": set(),  # both sides: plain records, the channel's wire, host facts
    "rank": {"common"},  # inside every engine: never the kernel side
    "processes": {"common", "errors"},  # starting, forking, watching, ending engines
    "diagnostics": {"common", "errors"},  # stacks, deaths, interrupts seen from the kernel
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_under(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every Python module under ``root`` (a package folder)."""
    return {
        ".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(root.rglob("*.py"))
    }


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
#: The other trees whose modules must not import one another around a loop.
OTHER_TREES: dict[str, dict[str, Path]] = {
    "bench": modules_under(REPO / "bench"),
    "tests": modules_under(REPO / "tests"),
}


def unit_of(module: str) -> str:
    """``fsdp_interactive.fsdp._wrapping`` -> ``fsdp``; the package's own ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def tree_of(module: str) -> dict[str, Path]:
    """The modules of the tree ``module`` belongs to (the package, bench or tests)."""
    return OTHER_TREES.get(module.split(".")[0], MODULES)


def as_module(dotted: str, tree: dict[str, Path] | None = None) -> str | None:
    """The module of ``tree`` (default: the package) a dotted import names (dropping a
    trailing object name)."""
    tree = MODULES if tree is None else tree
    parts = dotted.split(".")
    while parts:
        if ".".join(parts) in tree:
            return ".".join(parts)
        parts.pop()
    return None


@cache
def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(modules of its own tree, top-level outside libraries) that ``module`` imports
    anywhere."""
    tree = tree_of(module)
    root = module.split(".")[0]
    path = tree[module]
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
            if name.split(".")[0] == root:
                target = as_module(name, tree)
                if target is not None and target != module:
                    ours.add(target)
            elif name:
                outside.add(name.split(".")[0])
    return ours, outside


def test_every_package_has_a_layer():
    assert {unit_of(m) for m in MODULES} <= set(LAYERS), (
        f"packages without a layer in LAYERS: {sorted({unit_of(m) for m in MODULES} - set(LAYERS))}"
    )


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """The groups of ``modules`` that import one another around a loop."""
    graph = {module: imports_of(module)[0] for module in modules}
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
    return cycles


def test_the_package_has_no_import_cycle():
    cycles = import_cycles(MODULES)
    assert not cycles, f"modules that import one another (around a loop): {cycles}"


@pytest.mark.parametrize("tree", sorted(OTHER_TREES))
def test_bench_and_test_helpers_have_no_import_cycle(tree):
    assert OTHER_TREES[tree], f"no modules found under {tree}/"
    cycles = import_cycles(OTHER_TREES[tree])
    assert not cycles, f"{tree}/ modules that import one another (around a loop): {cycles}"


def pool_folder(module: str) -> str | None:
    """``fsdp_interactive.pool.rank._agent`` -> ``"rank"``; ``pool/``'s own modules -> ``""``
    (``pool/errors.py`` -> ``"errors"``); ``None`` outside ``pool/``."""
    parts = module.split(".")
    if parts[:2] != ["fsdp_interactive", "pool"]:
        return None
    if len(parts) == 2:
        return ""
    if f"{'.'.join(parts[:3])}" in MODULES and MODULES[".".join(parts[:3])].name == "__init__.py":
        return parts[2]
    return "errors" if parts[2] == "errors" else ""


POOL_MODULES = sorted(m for m in MODULES if pool_folder(m) not in (None, "", "errors"))


def test_every_pool_folder_has_a_rule():
    folders = {pool_folder(m) for m in MODULES} - {None, "errors"}
    assert folders <= set(POOL_FOLDERS), (
        f"pool/ folders without a rule in POOL_FOLDERS: {sorted(folders - set(POOL_FOLDERS))}"
    )


@pytest.mark.parametrize("module", POOL_MODULES)
def test_pool_folders_import_only_what_their_rule_allows(module):
    own = pool_folder(module)
    allowed = POOL_FOLDERS[own]
    assert allowed is not None
    if own == "common":
        assert "torch" not in imports_of(module)[1], f"{module} is shared but imports torch"
    reached = sorted(
        target
        for target in imports_of(module)[0]
        if pool_folder(target) not in (None, own) and pool_folder(target) not in allowed
    )
    assert not reached, (
        f"{module} (pool/{own}/) imports {reached}; pool/{own}/ may import only its own folder"
        + (f" and pool/{', pool/'.join(sorted(allowed))}" if allowed else "")
    )


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


def is_rank_side(module: str) -> bool:
    return unit_of(module) in RANK_SIDE or module.startswith(RANK_SIDE_POOL)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if is_rank_side(m)), ids=str)
def test_rank_side_modules_never_import_notebook_libraries(module):
    forbidden = set(NOTEBOOK_ONLY_LIBRARIES) - ({"IPython"} if module == ENGINE_SHELL else set())
    found = sorted(imports_of(module)[1] & forbidden)
    assert not found, f"{module} runs on the ranks but imports {found}"


def test_the_rules_catch_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a fake package with a loop, an upward edge and a rank-side
    module of ``pool/`` that reaches the kernel side."""
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
    (fake / "pool" / "rank").mkdir(parents=True)
    (fake / "pool" / "common").mkdir()
    for init in ("pool", "pool/rank", "pool/common"):
        (fake / init / "__init__.py").write_text("")
    (fake / "pool" / "_pool.py").write_text("")
    (fake / "pool" / "common" / "_wire.py").write_text("")
    (fake / "pool" / "rank" / "_agent.py").write_text(
        "from fsdp_interactive.pool.common import _wire\nfrom fsdp_interactive.pool import _pool\n"
    )
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
        with pytest.raises(AssertionError, match=r"imports \['fsdp_interactive.pool._pool'\]"):
            test_pool_folders_import_only_what_their_rule_allows(
                "fsdp_interactive.pool.rank._agent"
            )
    finally:
        imports_of.cache_clear()


#: Past this length a module must say, in the first paragraph of its docstring, the one
#: concept it holds: a long module is fine when it is one idea (ipyparallel's ``Cluster``),
#: not when it is several that grew together.
LONG_MODULE_LINES = 600
#: No module grows past this, whatever it holds.
MAX_MODULE_LINES = 1000


def _concept_sentence(path) -> str:
    """The first paragraph of a module's docstring, on one line ('' when it has none)."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(docstring.split("\n\n", 1)[0].split())


def _too_long(modules) -> dict[str, str]:
    problems = {}
    for name, path in modules.items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            problems[name] = f"{lines} lines, over {MAX_MODULE_LINES}: split it by concept"
        elif lines > LONG_MODULE_LINES and len(_concept_sentence(path).split()) < 6:
            problems[name] = (
                f"{lines} lines and no docstring that opens with the one concept it holds"
            )
    return problems


@pytest.mark.parametrize("tree", ["fsdp_interactive", *sorted(OTHER_TREES)])
def test_a_long_module_holds_one_concept_it_names(tree):
    modules = MODULES if tree == "fsdp_interactive" else OTHER_TREES[tree]
    problems = _too_long(modules)
    assert not problems, f"modules too long for what they say they hold: {problems}"


def test_the_length_rule_fails_a_long_module_without_a_concept(tmp_path):
    body = "x = 1\n" * (LONG_MODULE_LINES + 1)
    (tmp_path / "silent.py").write_text(body)
    (tmp_path / "named.py").write_text(
        '"""The engine pool\'s start: controller, engines, group, in that order."""\n' + body
    )
    (tmp_path / "huge.py").write_text('"""One concept said plainly in a sentence."""\n' + body * 2)
    problems = _too_long({p.stem: p for p in tmp_path.glob("*.py")})
    assert set(problems) == {"silent", "huge"}
    assert "no docstring" in problems["silent"] and "over 1000" in problems["huge"]
