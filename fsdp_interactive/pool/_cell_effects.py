"""What a cell's code does to the names of a rank's namespace, read from its source with
:mod:`ast` (never by running it): the kernel side of the recovery's slice (:mod:`._slice`).

For one cell, :func:`effects_of` gives a :class:`CellEffects`:

* ``defines``: every name the cell binds in the namespace (assignments, ``import``,
  ``def``, ``class``, ``for`` and ``with`` targets, ``:=``, names a function declares
  ``global`` and assigns), wherever it stands;
* ``kills``: the names it binds on every path through the cell (top-level statements and
  ``with`` bodies, not the bodies of ``if``/``for``/``while``/``try``): an earlier cell's
  binding of such a name can no longer matter after it;
* ``reads_now``: names it reads while it runs that it has not bound itself before;
  ``reads_later``: names the bodies of its functions and lambdas read from the namespace,
  when called;
* ``reshapes``: names whose object it changes in a way no ``state_dict`` holds, so that no
  snapshot can give it back: a hook or a buffer registered (``register_*``,
  ``add_module``, ``add_param_group``), a submodule or attribute set or deleted
  (``model.head = ...``), the dtype, device or ``requires_grad`` changed (``.to()``,
  ``.half()``, ``.requires_grad_()``), a module sharded or wrapped in place
  (``fully_shard(model.layers[0])``, ``apply_activation_checkpointing(model)``, ``prune``);
* ``mutates``: names whose object it may change in any way: ``reshapes``, plus items set
  and calls whose result is dropped (``data.append(x)``, ``optim.step()``,
  ``train(model)``: the heuristic ipyflow applies to method calls at run time, a call made
  for its effect); what a snapshot restores ignores these, every other object does not;
* ``settings``: statements that change the process rather than a name
  (``torch.set_default_dtype(...)``, ``sys.path.append(...)``, ``os.environ[k] = v``,
  ``warnings.filterwarnings(...)``), recognised by the call's name on an imported module
  (``set_*``, ``use_deterministic_algorithms``, ``filterwarnings``, ...; seeds are not
  settings: the journal keeps the generators themselves);
* ``definitions_only``: the cell only imports, defines functions and classes and binds
  constants (no call at run time but decorators), so running it again costs nothing.

Which calls reshape, mutate or set what is told by their names (:mod:`._call_effects`).

What it cannot see (a function that rebinds a global or registers a hook when a later cell
calls it, ``exec``, ``globals()[name] = ...``) the ranks report after each cell
(:mod:`.rank._cell_watch`). Lines of IPython syntax (``%magic``, ``!shell``) are blanked
first (:func:`._cell_imports.parse`); a cell that still does not parse has ``parsed=False``
and is treated as touching everything.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from fsdp_interactive.pool._call_effects import (
    PURE_STATEMENT_CALLS,
    RESHAPING_FUNCTIONS,
    RESHAPING_METHODS,
    dotted_name,
    is_setting,
    part_of,
    root_of,
)
from fsdp_interactive.pool._cell_imports import parse

#: Names every rank's namespace holds before any cell runs (the pool puts them there).
PREFILLED = frozenset({"torch", "dist", "rank", "world_size", "local_rank", "device"})
#: Modules among them (calls on them may be process settings).
PREFILLED_MODULES = frozenset({"torch", "dist"})
_BUILTINS = frozenset(dir(builtins))


@dataclass(frozen=True)
class CellEffects:
    """What one cell does to the namespace (see the module's docstring)."""

    defines: frozenset[str] = frozenset()
    kills: frozenset[str] = frozenset()
    reads_now: frozenset[str] = frozenset()
    reads_later: frozenset[str] = frozenset()
    reshapes: dict[str, str] = field(default_factory=dict)
    mutates: dict[str, str] = field(default_factory=dict)
    #: ``(root name, what)`` of statements that may change the process; the slice keeps
    #: those whose root is a module.
    setting_candidates: tuple[tuple[str, str], ...] = ()
    #: Names bound by ``import`` (modules, or objects of modules).
    imports: frozenset[str] = frozenset()
    definitions_only: bool = False
    parsed: bool = True

    @property
    def reads(self) -> frozenset[str]:
        return self.reads_now | self.reads_later

    def settings(self, modules: Iterable[str]) -> list[str]:
        """The statements that change the process, given the names that hold modules."""
        known = set(modules)
        return list(dict.fromkeys(what for root, what in self.setting_candidates if root in known))


def _target_names(target: ast.AST) -> list[str]:
    """Plain names a target binds (``a``, ``a, (b, *c)``); attributes and items bind none."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List):
        return [n for element in target.elts for n in _target_names(element)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def _function_locals(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    """Names local to a function: its parameters and what its body binds, less what it
    declares ``global`` or ``nonlocal``."""
    args = node.args
    local = {
        a.arg
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        if a is not None
    }
    if isinstance(node, ast.Lambda):
        return local
    declared: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Global | ast.Nonlocal):
            declared.update(sub.names)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store | ast.Del):
            local.add(sub.id)
        elif (
            isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and sub is not node
        ):
            local.add(sub.name)
        elif isinstance(sub, ast.alias):
            local.add((sub.asname or sub.name).split(".")[0])
        elif isinstance(sub, ast.ExceptHandler) and sub.name:
            local.add(sub.name)
    return local - declared


def _declared_globals(node: ast.AST) -> set[str]:
    """Names a function (or anything nested in it) declares ``global`` and assigns."""
    declared = {n for sub in ast.walk(node) if isinstance(sub, ast.Global) for n in sub.names}
    stored = {
        sub.id
        for sub in ast.walk(node)
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store) and sub.id in declared
    }
    return stored


class _Reader(ast.NodeVisitor):
    """Collects what one statement reads and changes, outside nested function bodies (whose
    free names are collected separately as ``later``). ``aliases``: names the cell bound to
    a part of another name's object (a loop over ``model.layers``), whose changes are that
    name's."""

    def __init__(self, bound: set[str], aliases: dict[str, str] | None = None) -> None:
        self.bound = bound
        self.aliases = {} if aliases is None else aliases
        self.now: set[str] = set()
        self.later: set[str] = set()
        self.reshapes: dict[str, str] = {}
        self.mutates: dict[str, str] = {}
        self.settings: list[tuple[str, str]] = []
        self.calls = False

    # -- names
    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and node.id not in self.bound:
            self.now.add(node.id)

    def _function_body(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        local = _function_locals(node)
        body = node.body if isinstance(node.body, list) else [node.body]
        for sub in body:
            for inner in ast.walk(sub):
                loaded = isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Load)
                if loaded and inner.id not in local:
                    self.later.add(inner.id)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        self._function_body(node)

    def _comprehension(self, node: ast.AST, elements: list[ast.AST]) -> None:
        generators = node.generators  # type: ignore[attr-defined]
        targets = {n for g in generators for n in _target_names(g.target)}
        self.visit(generators[0].iter)  # evaluated in the enclosing scope
        inner = _Reader(self.bound | targets, self.aliases)
        for generator in generators:
            for condition in generator.ifs:
                inner.visit(condition)
        for generator in generators[1:]:
            inner.visit(generator.iter)
        for element in elements:
            inner.visit(element)
        self._take(inner)

    def visit_ListComp(self, node: ast.ListComp) -> None:
        self._comprehension(node, [node.elt])

    visit_SetComp = visit_ListComp  # type: ignore[assignment]
    visit_GeneratorExp = visit_ListComp  # type: ignore[assignment]

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self._comprehension(node, [node.key, node.value])

    def _take(self, other: _Reader) -> None:
        self.now |= other.now
        self.later |= other.later
        for name, why in other.reshapes.items():
            self.reshapes.setdefault(name, why)
        for name, why in other.mutates.items():
            self.mutates.setdefault(name, why)
        self.settings += other.settings
        self.calls = self.calls or other.calls

    # -- changes
    def changed(self, target: ast.AST, why: str, reshaping: bool = True) -> None:
        root = root_of(target)
        if root is None:
            return
        name = self.aliases.get(root.id, root.id)
        self.mutates.setdefault(name, why)
        if reshaping:
            self.reshapes.setdefault(name, why)

    def visit_Call(self, node: ast.Call) -> None:
        self.calls = True
        self.call(node, statement=False)
        self.generic_visit(node)

    def call(self, node: ast.Call, *, statement: bool) -> None:
        """Record what a call changes; ``statement``: its result is dropped."""
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        dotted = dotted_name(func)
        if isinstance(func, ast.Attribute):
            if name.startswith("register_") or name in RESHAPING_METHODS:
                self.changed(func.value, f"{dotted}()")
            elif statement:
                self.changed(func.value, f"{dotted}()", reshaping=False)
            root = root_of(func.value)
            if root is not None and statement and is_setting(func, name):
                self.settings.append((root.id, f"{dotted}()"))
        if node.args and (name in RESHAPING_FUNCTIONS or ".prune." in f".{dotted}."):
            self.changed(node.args[0], f"{dotted}({dotted_name(node.args[0])})")
        elif statement and name not in PURE_STATEMENT_CALLS:
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                self.changed(arg, f"{dotted}({dotted_name(arg)})", reshaping=False)


_NO_CALLS = (ast.Call, ast.Await, ast.Yield, ast.YieldFrom, ast.ListComp, ast.SetComp)
_NO_CALLS += (ast.DictComp, ast.GeneratorExp)


def _cheap_value(node: ast.AST | None) -> bool:
    """A value computed without calling anything (constants, names, arithmetic, lambdas)."""
    if node is None:
        return True
    for sub in ast.walk(node):
        if isinstance(sub, ast.Lambda):
            continue
        if isinstance(sub, _NO_CALLS):
            return False
    return True


def _is_definition(stmt: ast.stmt) -> bool:
    """A statement that only defines: import, def, class (of definitions), a constant."""
    if isinstance(stmt, ast.Import | ast.ImportFrom | ast.Pass):
        return True
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
        return all(_cheap_value(d) for d in [*stmt.args.defaults, *stmt.args.kw_defaults])
    if isinstance(stmt, ast.ClassDef):
        return all(_is_definition(s) for s in stmt.body)
    if isinstance(stmt, ast.Assign | ast.AnnAssign):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        plain = all(_target_names(t) and not isinstance(t, ast.Starred) for t in targets)
        return plain and _cheap_value(stmt.value)
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


class _Cell:
    """Walks a cell's statements in order, keeping what is bound on every path so far."""

    def __init__(self) -> None:
        self.defines: set[str] = set()
        self.kills: set[str] = set()
        self.imports: set[str] = set()
        self.aliases: dict[str, str] = {}
        self.reader = _Reader(set(), self.aliases)

    def block(self, stmts: list[ast.stmt], bound: set[str], certain: bool) -> None:
        for stmt in stmts:
            self.statement(stmt, bound, certain)

    def _bind(
        self, names: Iterable[str], bound: set[str], certain: bool, source: ast.AST | None = None
    ) -> None:
        """``names`` bound (on every path: ``certain``); ``source``: the value they are
        bound to, when it is (a part of) another name's object."""
        names = list(names)
        owner = part_of(source)
        for name in names:
            if owner is not None:
                self.aliases[name] = self.aliases.get(owner.id, owner.id)
            else:
                self.aliases.pop(name, None)
        self.defines.update(names)
        bound.update(names)
        if certain:
            self.kills.update(names)

    def _read(self, nodes: Iterable[ast.AST | None], bound: set[str]) -> None:
        reader = _Reader(bound, self.aliases)
        for node in nodes:
            if node is not None:
                reader.visit(node)
        self.reader._take(reader)

    def statement(self, stmt: ast.stmt, bound: set[str], certain: bool) -> None:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            names = [(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"]
            self.imports.update(names)
            self._bind(names, bound, certain)
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            self._definition(stmt, bound, certain)
        elif isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            value = stmt.value
            reads: list[ast.AST | None] = [value]
            reads += [t for t in targets if not isinstance(t, ast.Name | ast.Tuple | ast.List)]
            self._read(reads, bound)
            target = stmt.target if isinstance(stmt, ast.AugAssign) else None
            if isinstance(target, ast.Name) and target.id not in bound:  # x += 1 reads x
                self.reader.now.add(target.id)
            names = [n for t in targets for n in _target_names(t)]
            for target in targets:
                self._store_target(target)
            single = len(targets) == 1 and isinstance(targets[0], ast.Name)
            self._bind(
                names,
                bound,
                certain and not isinstance(stmt, ast.AugAssign),
                source=value if single else None,
            )
            if isinstance(stmt, ast.AugAssign):
                self.defines.update(names)
        elif isinstance(stmt, ast.Delete):
            for target in stmt.targets:
                if not isinstance(target, ast.Name):
                    self.reader.changed(target, f"del {dotted_name(target)}")
        elif isinstance(stmt, ast.Expr):
            if isinstance(stmt.value, ast.Call):
                self.reader.call(stmt.value, statement=True)
            self._read([stmt.value], bound)
        elif isinstance(stmt, ast.For | ast.AsyncFor):
            self._read([stmt.iter], bound)
            inner = set(bound)
            self._bind(_target_names(stmt.target), inner, False, source=stmt.iter)
            self._store_target(stmt.target)
            self.block(stmt.body, inner, False)
            self.block(stmt.orelse, set(bound), False)
        elif isinstance(stmt, ast.While | ast.If):
            self._read([stmt.test], bound)
            self.block(stmt.body, set(bound), False)
            self.block(stmt.orelse, set(bound), False)
        elif isinstance(stmt, ast.With | ast.AsyncWith):
            self._read([item.context_expr for item in stmt.items], bound)
            for item in stmt.items:
                if item.optional_vars is not None:
                    self._bind(_target_names(item.optional_vars), bound, certain)
                    self._store_target(item.optional_vars)
            self.block(stmt.body, bound, certain)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            self.block(stmt.body, set(bound), False)
            for handler in stmt.handlers:
                self._read([handler.type], bound)
                inner = set(bound)
                if handler.name:
                    self._bind([handler.name], inner, False)
                self.block(handler.body, inner, False)
            self.block(stmt.orelse, set(bound), False)
            self.block(stmt.finalbody, bound, certain)
        elif isinstance(stmt, ast.Match):
            self._read([stmt.subject], bound)
            for case in stmt.cases:
                inner = set(bound)
                captured = [
                    n.name
                    for n in ast.walk(case.pattern)
                    if isinstance(n, ast.MatchAs | ast.MatchStar) and n.name
                ]
                self._bind(captured, inner, False)
                self._read([case.guard], inner)
                self.block(case.body, inner, False)
        else:  # return, raise, assert, global, pass, ...
            self._read([stmt], bound)
        # Names bound by := anywhere in the statement live in the namespace.
        walrus = [
            n.target.id
            for n in ast.walk(stmt)
            if isinstance(n, ast.NamedExpr) and isinstance(n.target, ast.Name)
        ]
        if walrus and not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            self._bind(walrus, bound, False)

    def _store_target(self, target: ast.AST) -> None:
        """An attribute or item as an assignment target changes its root's object."""
        if isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                self._store_target(element)
        elif isinstance(target, ast.Attribute):
            self.reader.changed(target, f"sets {dotted_name(target)}")
            root = root_of(target)
            if root is not None:
                self.reader.settings.append((root.id, f"sets {dotted_name(target)}"))
        elif isinstance(target, ast.Subscript):
            self.reader.changed(target, f"sets {dotted_name(target)}", reshaping=False)
            root = root_of(target)
            if root is not None:
                self.reader.settings.append((root.id, f"sets {dotted_name(target)}"))

    def _definition(
        self,
        stmt: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef,
        bound: set[str],
        certain: bool,
    ) -> None:
        at_definition: list[ast.AST | None] = list(stmt.decorator_list)
        if isinstance(stmt, ast.ClassDef):
            at_definition += [*stmt.bases, *(k.value for k in stmt.keywords)]
            class_reader = _Reader(bound, self.aliases)
            for sub in stmt.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                    for decorator in sub.decorator_list:
                        class_reader.visit(decorator)
                    class_reader._function_body(sub)
                    self.defines.update(_declared_globals(sub))
                else:
                    class_reader.visit(sub)
            # A class body's own names are class attributes, not reads of the namespace.
            own = {n for sub in stmt.body for n in _bound_by(sub)}
            class_reader.now -= own
            self.reader._take(class_reader)
        else:
            at_definition += [*stmt.args.defaults, *stmt.args.kw_defaults]
            reader = _Reader(bound, self.aliases)
            reader._function_body(stmt)
            self.reader._take(reader)
            self.defines.update(_declared_globals(stmt))
        self._read(at_definition, bound)
        self._bind([stmt.name], bound, certain)


def _bound_by(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [n for t in stmt.targets for n in _target_names(t)]
    if isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        return _target_names(stmt.target)
    return []


@lru_cache(maxsize=1024)
def effects_of(source: str) -> CellEffects:
    """What the cell ``source`` does to the namespace (see :class:`CellEffects`)."""
    tree = parse(source)
    if tree is None:
        return CellEffects(parsed=False)
    cell = _Cell()
    cell.block(tree.body, set(), True)
    reader = cell.reader
    drop = _BUILTINS | PREFILLED
    return CellEffects(
        defines=frozenset(cell.defines),
        kills=frozenset(cell.kills),
        reads_now=frozenset(reader.now - drop),
        reads_later=frozenset(reader.later - drop - cell.kills),
        reshapes=dict(reader.reshapes),
        mutates=dict(reader.mutates),
        setting_candidates=tuple(reader.settings),
        imports=frozenset(cell.imports),
        definitions_only=all(_is_definition(s) for s in tree.body),
    )
