"""Plain-text and HTML renderings of the probes' records (notebook side).

These are what a view shows outside a live kernel (nbconvert, nbval's ``text/plain``,
a terminal) and what the widgets show in their text panes, so the numbers a test reads
from a view are the numbers a user sees.

A record is rendered once, into a :class:`Rendering`: headings, notes and tables whose
rows are computed once; ``.text()`` and ``.html()`` format those same rows. Each record
type's renderer is registered with :func:`renders`, and :func:`render` finds it by the
type of what a probe answered (one record, or a list of them): a new probe's record is
shown by registering one function here. A record type without a renderer of its own is
shown as a table of its fields.

Computed floats (norms, statistics) are shown to four significant digits: float32 sums
come out differently in about the seventh digit on different CPU kernel paths (AVX-512,
AVX2, none) and GPUs, and the same notebook should show the same numbers on each.
"""

from __future__ import annotations

import dataclasses
import html as html_lib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_interactive._text import human_bytes, number, text_table
from fsdp_interactive.inspect import (
    NO_GRADIENTS,
    GradNormRecord,
    GradNorms,
    MemoryStats,
    ModelLayout,
    ParamLayout,
    TensorStats,
    find_spikes,
)
from fsdp_interactive.notebook._format import html_table
from fsdp_interactive.notebook._groups import (
    LayoutSelection,
    host_runs,
    hosts_phrase,
    rank_hosts,
    rank_span,
    select_layout,
    select_norms,
)


@dataclass(frozen=True)
class Piece:
    """A line of a rendering as it reads in text and as it is marked up in HTML (either
    may be empty: a text-only note, an HTML-only break)."""

    as_text: str
    as_html: str

    def text(self) -> str:
        return self.as_text

    def html(self) -> str:
        return self.as_html


def bold(text: str, shown: str | None = None) -> Piece:
    """``text``; in HTML ``shown`` (``text`` by default) in bold."""
    return Piece(text, f"<b>{html_lib.escape(text if shown is None else shown)}</b>")


def note(text: str) -> Piece:
    """A remark in italics (nothing, in either format, when ``text`` is empty)."""
    return Piece(text, f"<div><i>{html_lib.escape(text)}</i></div>" if text else "")


@dataclass(frozen=True)
class Table:
    """Rows under headers; ``marks``: indices of rows shown highlighted in HTML.

    ``caption`` is the line above the table in text; in HTML it is shown as
    ``caption_style`` says: ``"bold"``, ``"italic"`` or ``None`` (not at all).
    """

    headers: Sequence[str]
    rows: Sequence[Sequence[Any]]
    marks: frozenset[int] = frozenset()
    caption: str = ""
    caption_style: str | None = "italic"

    def text(self) -> str:
        return (f"{self.caption}\n" if self.caption else "") + text_table(self.headers, self.rows)

    def html(self) -> str:
        tag = {"bold": "b", "italic": "i"}.get(self.caption_style or "")
        caption = html_lib.escape(self.caption)
        head = f"<div><{tag}>{caption}</{tag}></div>" if tag and self.caption else ""
        return head + html_table(self.headers, self.rows, set(self.marks))


Block = Piece | Table


@dataclass(frozen=True)
class Rendering:
    """A record as shown: its blocks, formatted as text (the non-empty ones, one
    ``separator`` apart) or as HTML (one after the other)."""

    blocks: Sequence[Block]
    separator: str = "\n"

    def text(self) -> str:
        return self.separator.join(t for block in self.blocks if (t := block.text()))

    def html(self) -> str:
        return "".join(block.html() for block in self.blocks)


#: The renderer of each record type (:func:`renders`), used by :func:`render`.
_RENDERERS: dict[type, Callable[..., Rendering]] = {}


def renders(record_type: type) -> Callable[[Callable[..., Rendering]], Callable[..., Rendering]]:
    """Register the decorated function as the renderer of ``record_type``: it takes what
    a probe answers (a record, or a list of them for a probe every rank answers for
    itself) and the view's options, and returns a :class:`Rendering`."""

    def register(renderer: Callable[..., Rendering]) -> Callable[..., Rendering]:
        _RENDERERS[record_type] = renderer
        return renderer

    return register


def render(answer: Any, record_type: type | None = None, **options: Any) -> Rendering:
    """``answer`` (one record, or a list of records) rendered by the renderer of its
    record type (``record_type``: the type of an empty list's records); a type without
    one is shown as a table of its fields."""
    if record_type is None:
        many = isinstance(answer, list | tuple)
        record_type = type(answer[0]) if many and answer else None if many else type(answer)
    renderer = _RENDERERS.get(record_type) if record_type is not None else None
    if renderer is not None:
        return renderer(answer, **options)
    return _fields(answer, record_type)


def _cell(value: Any) -> str:
    return number(value) if isinstance(value, float) else str(value)


def _fields(answer: Any, record_type: type | None) -> Rendering:
    """A record as (field, value) rows; records as one row each, a column per field."""
    name = f"{record_type.__name__} records" if record_type is not None else "records"
    if not isinstance(answer, list | tuple):
        rows = [(f.name, _cell(getattr(answer, f.name))) for f in dataclasses.fields(answer)]
        return Rendering([bold(type(answer).__name__), Table(("field", "value"), rows)])
    if not answer:
        return Rendering([note(f"no {name}")])
    headers = [f.name for f in dataclasses.fields(answer[0])]
    rows = [tuple(_cell(getattr(record, h)) for h in headers) for record in answer]
    return Rendering([bold(f"{len(answer)} {name}"), Table(headers, rows)])


_PARAM_HEADERS = ("parameter", "shape", "dtype", "placements", "per-rank rows/shape", "padding")
_UNIT_HEADERS = ("unit", "params", "size", "held per rank", "padding")


def _shapes_by_rank(param: ParamLayout) -> str:
    """``r0-2:2x5 | r3:1x5``: ranks holding equal shapes share one entry (8+ ranks stay short)."""
    by_shape: dict[str, list[int]] = {}
    for s in param.slices:
        by_shape.setdefault("x".join(map(str, s.local_shape)) or "scalar", []).append(s.rank)
    return " | ".join(f"{rank_span(ranks)}:{shape}" for shape, ranks in by_shape.items())


def _param_rows(params: Sequence[ParamLayout]) -> list[tuple[str, ...]]:
    rows = []
    for p in params:
        padding = sum(s.padding for s in p.slices)
        rows.append(
            (
                p.fqn,
                "x".join(map(str, p.global_shape)) or "scalar",
                p.dtype,
                ",".join(p.placements),
                _shapes_by_rank(p),
                str(padding) if padding else "",
            )
        )
    return rows


def _spread(values: Sequence[int]) -> str:
    """One size when every rank holds the same, else the smallest and the largest."""
    if not values:
        return "-"
    low, high = min(values), max(values)
    return (
        f"{human_bytes(low)} each" if low == high else f"{human_bytes(low)} .. {human_bytes(high)}"
    )


def _unit_rows(selection: LayoutSelection) -> list[tuple[str, ...]]:
    rows = []
    for row in selection.rows:
        count = len(row.units)
        per_unit = f" ({len(row.units[0].params)} each)" if count > 1 else ""
        padding = sum(row.stored) - sum(row.held)
        rows.append(
            (
                row.label + (f"  x{count}" if count > 1 else ""),
                f"{len(row.params)}{per_unit}",
                human_bytes(row.nbytes),
                _spread(row.held),
                human_bytes(padding) if padding else "",
            )
        )
    return rows


def _rank_table(model_layout: ModelLayout) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Headers and rows of the bytes-per-rank table; ranks on several hosts get a
    ``host`` column naming each host on the first row of its ranks."""
    rows = [
        (
            f"rank {t.rank}",
            human_bytes(t.param_bytes),
            human_bytes(t.grad_bytes),
            human_bytes(t.optim_bytes),
            human_bytes(t.buffer_bytes),
            human_bytes(t.total_bytes),
        )
        for t in model_layout.ranks
    ]
    runs = host_runs(rank_hosts(model_layout))
    if not runs:
        return _RANK_HEADERS, rows
    labels = [""] * len(rows)
    for host, at in runs:
        labels[at[0]] = host
    return ("host", *_RANK_HEADERS), [
        (label, *row) for label, row in zip(labels, rows, strict=True)
    ]


_RANK_HEADERS = ("rank", "params", "grads", "optimizer", "buffers", "total")


def _layout_head(model_layout: ModelLayout, selection: LayoutSelection) -> str:
    head = (
        f"{len(model_layout.params)} parameters in {selection.units} FSDP units, "
        f"{human_bytes(model_layout.model_bytes)} unsharded, over {model_layout.world_size} ranks"
    )
    hosts = hosts_phrase(rank_hosts(model_layout), [t.rank for t in model_layout.ranks])
    if hosts:
        head += f" on {hosts}"
    if selection.pattern:
        head += f"; filter {selection.pattern!r}"
    return head


def _cut_note(shown: int, matched: int, what: str) -> str:
    """Says what was left out and how to see it (empty when nothing was)."""
    if shown >= matched:
        return ""
    return f"showing {shown} of {matched} {what}: filter, drill into a unit or raise top"


def _param_caption(selection: LayoutSelection) -> str:
    where = f" of {selection.unit}" if selection.unit is not None else ""
    order = "largest first" if selection.sort == "size" else "model order"
    return f"parameters{where} ({order})"


@renders(ModelLayout)
def render_layout(model_layout: ModelLayout, selection: LayoutSelection | None = None) -> Rendering:
    """The unit table, the parameter table and the bytes per rank (``selection``: what to
    show, :func:`select_layout`; by default every unit and the first 30 parameters)."""
    selection = selection or select_layout(model_layout)
    return Rendering(
        [
            bold(_layout_head(model_layout, selection)),
            Table(_UNIT_HEADERS, _unit_rows(selection), caption="units", caption_style=None),
            note(_cut_note(len(selection.rows), selection.row_count, "unit rows")),
            Table(
                _PARAM_HEADERS,
                _param_rows(selection.params),
                caption=_param_caption(selection),
                caption_style="bold",
            ),
            note(_cut_note(len(selection.params), selection.param_count, "parameters")),
            Piece("", "<br/>"),
            Table(*_rank_table(model_layout)),
        ],
        separator="\n\n",
    )


def _norm_rows(
    norms: GradNorms, items: Sequence[tuple[str, float]]
) -> tuple[list[tuple[str, str, str]], set[int]]:
    rows, marks = [], set()
    for i, (name, value) in enumerate(items):
        flags = []
        if norms.nan_counts.get(name):
            flags.append(f"NaN x{norms.nan_counts[name]}")
        if norms.inf_counts.get(name):
            flags.append(f"Inf x{norms.inf_counts[name]}")
        if not math.isfinite(value) and not flags:
            flags.append("non-finite")
        if flags:
            marks.add(i)
        rows.append((name, number(value), ", ".join(flags)))
    return rows, marks


_ROW_NAMES = {"params": "parameter", "modules": "module", "units": "unit"}


def global_norm_line(norms: GradNorms) -> str:
    """The one line that states the global norm (and where it is not finite)."""
    head = f"global L{norms.norm_type:g} gradient norm: {number(norms.total)}"
    if norms.has_nonfinite:
        head += f"  (NON-FINITE gradients in: {', '.join(norms.nonfinite) or 'total'})"
    return head


def _norm_caption(norms: GradNorms, by: str, shown: int, matched: int, sort: str) -> str:
    what = _ROW_NAMES[by]
    order = "largest first" if sort == "norm" else "model order"
    caption = f"{shown} of {matched} {what}s, {order}" if shown < matched else f"{matched} {what}s"
    return caption


@renders(GradNorms)
def render_grad_norms(
    norms: GradNorms,
    by: str = "params",
    pattern: str | None = None,
    top: int = 30,
    sort: str = "norm",
    head: bool = True,
) -> Rendering:
    """The global norm (``head=False`` leaves it out, for a view that shows it elsewhere)
    and the norms ``by`` parameter, module or unit: :func:`select_norms` picks the rows."""
    if not norms.params:
        return Rendering([Piece(NO_GRADIENTS, f"<i>{NO_GRADIENTS}</i>")])
    items, matched = select_norms(norms, by, pattern, top, sort)
    rows, marks = _norm_rows(norms, items)
    table = Table(
        (_ROW_NAMES[by], "norm", "flags"),
        rows,
        frozenset(marks),
        caption=_norm_caption(norms, by, len(items), matched, sort),
    )
    if not head:
        return Rendering([table])
    head_html = f"<b>global L{norms.norm_type:g} gradient norm: {number(norms.total)}</b>"
    if norms.has_nonfinite:
        head_html += f' <span style="color:#c00">non-finite: {", ".join(norms.nonfinite)}</span>'
    return Rendering([Piece(global_norm_line(norms), head_html), table], separator="\n\n")


def _stats_rows(stats: TensorStats) -> list[tuple[str, str]]:
    return [
        ("shape", "x".join(map(str, stats.shape))),
        ("dtype", stats.dtype),
        ("numel", str(stats.numel)),
        ("mean", number(stats.mean)),
        ("std", number(stats.std)),
        ("min", number(stats.min)),
        ("max", number(stats.max)),
        ("norm", number(stats.norm)),
        ("NaN", str(stats.nan_count)),
        ("Inf", str(stats.inf_count)),
    ]


@renders(TensorStats)
def render_stats(stats: TensorStats) -> Rendering:
    """The statistics of one parameter (or of a module's parameters together)."""
    title = stats.fqn or "(whole model)"
    counted = f"{title} ({len(stats.names)} parameters)" if len(stats.names) > 1 else title
    return Rendering([bold(counted, shown=title), Table(("stat", "value"), _stats_rows(stats))])


def _memory_rows(stats: Sequence[MemoryStats]) -> list[tuple[str, ...]]:
    return [
        (
            str(s.rank),
            s.host,
            str(s.pid),
            s.device,
            human_bytes(s.rss_bytes),
            human_bytes(s.allocated_bytes),
            human_bytes(s.reserved_bytes),
            human_bytes(s.max_allocated_bytes),
        )
        for s in stats
    ]


_MEMORY_HEADERS = ("rank", "host", "pid", "device", "RSS", "allocated", "reserved", "peak")


@renders(MemoryStats)
def render_memory(stats: Sequence[MemoryStats]) -> Rendering:
    """Every rank's memory, one row per rank."""
    return Rendering([Table(_MEMORY_HEADERS, _memory_rows(stats))])


def _topology_rows(topology: Sequence[Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    fields = ("rank", "local_rank", "host", "pid", "device", "backend")
    rows = [tuple(str(_field(r, f)) for f in fields) for r in topology]
    return fields, rows


def _field(record: Any, name: str) -> Any:
    if isinstance(record, dict):
        return record.get(name, "")
    return getattr(record, name, "")


def _topology_hosts(topology: Sequence[Any]) -> str:
    """``"2 hosts: hosta r0-1, hostb r2"`` for ranks on several hosts, else empty."""
    return hosts_phrase(
        [str(_field(r, "host")) for r in topology], [int(_field(r, "rank")) for r in topology]
    )


def render_topology(topology: Sequence[Any]) -> Rendering:
    """The rank table; ranks on several hosts are headed by which ranks each host holds."""
    hosts = _topology_hosts(topology)
    return Rendering([*([bold(hosts)] if hosts else []), Table(*_topology_rows(topology))])


def steps_phrase(records: Sequence[GradNormRecord]) -> str:
    """``10 steps (steps 0..9)``: the count the monitor's summary and its plot both show."""
    if not records:
        return "0 steps"
    count = f"{len(records)} step{'s' if len(records) != 1 else ''}"
    return f"{count} (steps {records[0].step}..{records[-1].step})"


@renders(GradNormRecord)
def render_history(records: Sequence[GradNormRecord], last: int = 10) -> Rendering:
    """Summary of a recorder's history: steps, last norms, NaN/Inf steps and spikes, and
    the ``last`` steps' norms."""
    if not records:
        return Rendering([note("no gradient norms recorded yet")])
    totals = [r.total for r in records]
    spikes = [records[i].step for i in find_spikes(totals)]
    bad = [r.step for r in records if r.nonfinite]
    lines = [
        f"{steps_phrase(records)} recorded; last global norm {number(records[-1].total)}",
        f"NaN/Inf at steps: {bad if bad else 'none'}",
        f"spikes at steps: {spikes if spikes else 'none'}",
    ]
    tail = records[-last:]
    table = Table(
        ("step", "global norm", "flags"),
        [(r.step, number(r.total), "NaN/Inf" if r.nonfinite else "") for r in tail],
    )
    return Rendering([*(note(line) for line in lines), table])
