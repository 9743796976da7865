"""Grouping, filtering and top-k over many parameters (notebook side, plain data only).

Real models have hundreds of parameters (Llama-7B 291, 70B 723), so the views show them
by FSDP unit: a unit is the module ``fully_shard`` was applied to, named by its FQN
(``""``, shown as ``(root)``, for the root).  Where the probes know no unit (a model
without ``fully_shard``), a parameter's group is its top-level module, with the index of a
numbered child (``layers.3``), so plain and tensor-parallel models group the same way.

Consecutive units that are alike (names differing only in one increasing index, the same
parameters, shapes, dtypes and placements, the same bytes per rank) fold into one run,
labelled ``blocks.{0..31}``: a stack of identical blocks reads as one row, whatever its
depth.  Filters are a substring of the parameter's FQN, or a glob when they contain
``*``, ``?`` or ``[`` (``blocks.1*.mlp.*``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fsdp_interactive.inspect import GradNorms, ModelLayout, ParamLayout

ROOT = "(root)"
"""How the root unit (FQN ``""``) is shown."""

_GLOB = frozenset("*?[")


def unit_label(unit: str) -> str:
    return unit if unit else ROOT


def unit_name(label: str) -> str:
    """Inverse of :func:`unit_label`."""
    return "" if label == ROOT else label


def fallback_group(fqn: str) -> str:
    """The group of a parameter no FSDP unit manages: its top-level module (``"embed"``),
    with a numbered child's index (``"layers.3"``); ``""`` for the root's own parameters."""
    parts = fqn.split(".")
    if len(parts) == 1:
        return ""
    if len(parts) > 2 and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def check_pattern(pattern: str | None, argument: str = "pattern") -> str | None:
    """``pattern`` stripped (``None`` or empty: no filter); a clear error for a non-string."""
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise TypeError(
            f"{argument} must be a string (a substring or a glob such as 'blocks.1*') or None, "
            f"got {type(pattern).__name__}"
        )
    return pattern.strip() or None


def check_top(top: int, argument: str = "top") -> int:
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(
            f"{argument} must be a positive integer (how many rows to show), got {top!r}"
        )
    return top


def matches(name: str, pattern: str | None) -> bool:
    """True when ``name`` contains ``pattern``, or matches it as a glob (``*``, ``?``, ``[``)."""
    if not pattern:
        return True
    if _GLOB.intersection(pattern):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


@dataclass(frozen=True)
class Group:
    """One unit (or fallback group) and the FQNs of its parameters, in model order."""

    name: str
    members: tuple[str, ...]

    @property
    def label(self) -> str:
        return unit_label(self.name)

    def relative(self, fqn: str) -> str:
        """``fqn`` without the unit's prefix (``blocks.3.mlp.weight`` -> ``mlp.weight``)."""
        prefix = f"{self.name}." if self.name else ""
        return fqn.removeprefix(prefix)


def group_names(names: Iterable[str], unit_of: Mapping[str, str | None]) -> list[Group]:
    """Group parameter FQNs by unit (``unit_of``; missing or ``None``: :func:`fallback_group`),
    units in the order of their first parameter."""
    members: dict[str, list[str]] = {}
    for name in names:
        unit = unit_of.get(name)
        members.setdefault(fallback_group(name) if unit is None else unit, []).append(name)
    return [Group(name, tuple(fqns)) for name, fqns in members.items()]


def _index_step(previous: str, current: str) -> int | None:
    """The position of the one dot-separated component in which ``current`` is ``previous``
    with its number plus one, else None."""
    a, b = previous.split("."), current.split(".")
    if len(a) != len(b) or not a[0]:
        return None
    diffs = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if len(diffs) != 1:
        return None
    i = diffs[0]
    if not (a[i].isdigit() and b[i].isdigit()) or int(b[i]) != int(a[i]) + 1:
        return None
    return i


@dataclass(frozen=True)
class Run:
    """Consecutive alike groups, shown as one row; ``position`` is the dot-separated
    component holding the index that counts up (None for a single group)."""

    groups: tuple[Group, ...]
    position: int | None = None

    @property
    def label(self) -> str:
        if len(self.groups) == 1 or self.position is None:
            return self.groups[0].label
        parts = self.groups[0].name.split(".")
        first, last = parts[self.position], self.groups[-1].name.split(".")[self.position]
        parts[self.position] = f"{{{first}..{last}}}"
        return ".".join(parts)

    @property
    def first(self) -> Group:
        return self.groups[0]

    def __len__(self) -> int:
        return len(self.groups)


def fold_alike(groups: Sequence[Group], signature: Callable[[Group], Hashable]) -> list[Run]:
    """Fold consecutive groups whose names count up in one index and whose ``signature``
    is equal into runs (see the module docstring)."""
    runs: list[Run] = []
    signatures = [signature(g) for g in groups]
    start = 0
    while start < len(groups):
        end, position = start + 1, None
        while end < len(groups) and signatures[end] == signatures[start]:
            step = _index_step(groups[end - 1].name, groups[end].name)
            if step is None or (position is not None and step != position):
                break
            position = step
            end += 1
        runs.append(Run(tuple(groups[start:end]), position))
        start = end
    return runs


def rank_span(ranks: Sequence[int]) -> str:
    """``r0-3``, ``r0,r2``, ``r0-3,r6-7``: ranks compressed into ranges."""
    parts: list[str] = []
    ordered = sorted(ranks)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(f"r{ordered[i]}" if i == j else f"r{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def top_k(
    items: Iterable[tuple[str, float]], k: int, pattern: str | None = None
) -> tuple[list[tuple[str, float]], int]:
    """The ``k`` largest ``(name, value)`` matching ``pattern`` (ties in the given order;
    non-finite values first, as they are what a user looks for) and how many matched."""
    matched = [(n, v) for n, v in items if matches(n, pattern)]

    def key(item: tuple[str, float]) -> tuple[int, float]:
        value = item[1]
        finite = value == value and abs(value) != float("inf")
        return (0 if finite else 1, value if finite else 0.0)

    ranked = sorted(matched, key=key, reverse=True)
    return ranked[:k], len(matched)


# ---------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class UnitLayout:
    """One unit of a :class:`ModelLayout`: its parameters and what each rank holds of them.

    ``held``/``stored`` are per rank, in the order of ``ModelLayout.ranks``: bytes of real
    elements, and bytes stored (with padding).
    """

    group: Group
    params: tuple[ParamLayout, ...]
    held: tuple[int, ...]
    stored: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def padding_bytes(self) -> int:
        return sum(self.stored) - sum(self.held)

    def signature(self) -> Hashable:
        """What must be equal for two units to fold into one run."""
        return (
            tuple(
                (
                    self.group.relative(p.fqn),
                    p.global_shape,
                    p.dtype,
                    p.placements,
                    tuple((s.rank, s.numel, s.padded_numel) for s in p.slices),
                )
                for p in self.params
            ),
            self.held,
            self.stored,
        )


def layout_units(model_layout: ModelLayout, pattern: str | None = None) -> list[UnitLayout]:
    """The units of ``model_layout`` in model order, each with its parameters matching
    ``pattern`` (units without a match are left out)."""
    params = [p for p in model_layout.params if matches(p.fqn, pattern)]
    by_name = {p.fqn: p for p in params}
    groups = group_names(by_name, {p.fqn: p.unit for p in params})
    ranks = [t.rank for t in model_layout.ranks]
    units = []
    for group in groups:
        members = tuple(by_name[n] for n in group.members)
        held, stored = [], []
        for rank in ranks:
            pieces = [(p, p.slice_of(rank)) for p in members]
            held.append(sum(s.numel * p.element_size for p, s in pieces if s is not None))
            stored.append(sum(s.padded_numel * p.element_size for p, s in pieces if s is not None))
        units.append(UnitLayout(group, members, tuple(held), tuple(stored)))
    return units


def fold_units(units: Sequence[UnitLayout]) -> list[tuple[Run, list[UnitLayout]]]:
    """:func:`fold_alike` over layout units: each run with its units."""
    by_name = {u.name: u for u in units}
    runs = fold_alike([u.group for u in units], lambda g: by_name[g.name].signature())
    return [(run, [by_name[g.name] for g in run.groups]) for run in runs]


def rank_hosts(model_layout: ModelLayout) -> list[str]:
    """The host of each rank (``ModelLayout.ranks`` order); empty strings when unknown."""
    return [t.host for t in model_layout.ranks]


def host_runs(hosts: Sequence[str]) -> list[tuple[str, list[int]]]:
    """``(host, positions)`` for each run of consecutive entries of ``hosts`` on one host.

    Empty when every entry names the same host or a host is unknown (``""``): views then
    show no host boundaries. A pool's ranks are contiguous per host, so each host is
    usually one run; a host that comes back later is a run of its own.
    """
    if len(set(hosts)) < 2 or "" in hosts:
        return []
    runs: list[tuple[str, list[int]]] = []
    for position, host in enumerate(hosts):
        if runs and runs[-1][0] == host:
            runs[-1][1].append(position)
        else:
            runs.append((host, [position]))
    return runs


def hosts_phrase(hosts: Sequence[str], ranks: Sequence[int]) -> str:
    """``"2 hosts: hosta r0-1, hostb r2-3"`` (empty for one host): which ranks each holds."""
    runs = host_runs(hosts)
    if not runs:
        return ""
    named = ", ".join(f"{host} {rank_span([ranks[i] for i in at])}" for host, at in runs)
    return f"{len({host for host, _ in runs})} hosts: {named}"


# ---------------------------------------------------------------------------- selections

SORTS = ("model", "size")
"""Orders of the layout tables: model order, or largest first."""


def check_sort(sort: str, choices: Sequence[str] = SORTS, argument: str = "sort") -> str:
    if sort not in choices:
        raise ValueError(f"{argument} must be one of {', '.join(map(repr, choices))}, got {sort!r}")
    return sort


@dataclass(frozen=True)
class UnitRow:
    """One row of the unit table: a run of alike units (one unit when nothing folds)."""

    run: Run
    units: tuple[UnitLayout, ...]

    @property
    def label(self) -> str:
        return self.run.label

    @property
    def params(self) -> tuple[ParamLayout, ...]:
        return tuple(p for u in self.units for p in u.params)

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def held(self) -> tuple[int, ...]:
        """Bytes of real elements per rank, summed over the row's units."""
        return tuple(map(sum, zip(*(u.held for u in self.units), strict=True)))

    @property
    def stored(self) -> tuple[int, ...]:
        return tuple(map(sum, zip(*(u.stored for u in self.units), strict=True)))


@dataclass(frozen=True)
class LayoutSelection:
    """What the layout view shows for one filter/drill-down/top-k choice.

    ``rows``: the unit table (every matching unit row, sorted, at most ``top``);
    ``row_count``: how many rows matched before the cut.  ``params``: the parameter table
    (the matching parameters of the drilled-into row, or of the whole model, sorted, at
    most ``top``); ``param_count``: how many matched.  ``units``: how many FSDP units (or
    fallback groups) the whole model has.
    """

    pattern: str | None
    unit: str | None
    top: int
    sort: str
    rows: tuple[UnitRow, ...]
    row_count: int
    params: tuple[ParamLayout, ...]
    param_count: int
    units: int


def unit_rows(
    model_layout: ModelLayout, pattern: str | None = None, fold: bool = True
) -> list[UnitRow]:
    """The unit table in model order: alike consecutive units folded into one row unless
    ``fold=False``; only parameters matching ``pattern`` count."""
    units = layout_units(model_layout, pattern)
    if fold:
        return [UnitRow(run, tuple(members)) for run, members in fold_units(units)]
    return [UnitRow(Run((u.group,)), (u,)) for u in units]


def select_layout(
    model_layout: ModelLayout,
    pattern: str | None = None,
    unit: str | None = None,
    top: int = 30,
    sort: str = "model",
    fold: bool = True,
) -> LayoutSelection:
    """Filter (``pattern``), drill into one unit row (``unit``: a label of the unit table,
    such as ``"(root)"``, ``"layers.3"`` or a folded ``"layers.{0..31}"``), sort
    (``"model"`` order or ``"size"``, largest first) and cut to the ``top`` rows."""
    pattern = check_pattern(pattern)
    top = check_top(top)
    sort = check_sort(sort)
    rows = unit_rows(model_layout, pattern, fold)
    total_units = len(
        {p.unit if p.unit is not None else fallback_group(p.fqn) for p in model_layout.params}
    )
    if unit is not None:
        chosen = [r for r in rows if r.label == unit or any(g.label == unit for g in r.run.groups)]
        if not chosen:
            labels = [r.label for r in rows]
            raise ValueError(
                f"unit={unit!r} is not a row of the unit table"
                + (f" matching {pattern!r}" if pattern else "")
                + f"; choose one of {', '.join(labels[:8])}{', ...' if len(labels) > 8 else ''}"
            )
        row = chosen[0]
        groups = {g.name for g in row.run.groups} if row.label == unit else {unit_name(unit)}
        params = [p for u in row.units if u.name in groups for p in u.params]
    else:
        params = [p for r in rows for p in r.params]
    if sort == "size":
        rows = sorted(rows, key=lambda r: r.nbytes, reverse=True)
        params = sorted(params, key=lambda p: p.nbytes, reverse=True)
    return LayoutSelection(
        pattern=pattern,
        unit=unit,
        top=top,
        sort=sort,
        rows=tuple(rows[:top]),
        row_count=len(rows),
        params=tuple(params[:top]),
        param_count=len(params),
        units=total_units,
    )


# ---------------------------------------------------------------------------- norms

NORM_GROUPS = ("params", "modules", "units")
"""What the gradient-norm view shows one row per."""


def norm_values(norms: GradNorms, by: str) -> dict[str, float]:
    """The norms ``by`` parameter, module (the root left out: it is the global norm) or
    FSDP unit (labelled as in :func:`unit_label`), in model order."""
    check_sort(by, NORM_GROUPS, "by")
    if by == "params":
        return dict(norms.params)
    if by == "modules":
        return {k: v for k, v in norms.modules.items() if k}
    return {unit_label(k): v for k, v in norms.units.items()}


def select_norms(
    norms: GradNorms,
    by: str = "params",
    pattern: str | None = None,
    top: int = 30,
    sort: str = "norm",
) -> tuple[list[tuple[str, float]], int]:
    """The rows of the gradient-norm table and figure: matching ``pattern``, the ``top``
    largest (``sort="norm"``, non-finite first) or the first ``top`` in model order
    (``sort="model"``), and how many matched."""
    pattern = check_pattern(pattern)
    top = check_top(top)
    check_sort(sort, ("norm", "model"))
    values = norm_values(norms, by)
    if sort == "norm":
        return top_k(values.items(), top, pattern)
    matched = [(n, v) for n, v in values.items() if matches(n, pattern)]
    return matched[:top], len(matched)
