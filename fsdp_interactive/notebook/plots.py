"""matplotlib figures built from the probes' plain records (notebook side).

Every function returns a ``matplotlib.figure.Figure`` made without pyplot (no global
figure state, no GUI backend needed); save it with ``figure.savefig(path)`` or show it with
IPython's ``display``.  Nothing here talks to the ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.layout_engine import PlaceHolderLayoutEngine
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from fsdp_interactive._lazy_exports import public_names
from fsdp_interactive._text import human_bytes
from fsdp_interactive.inspect import (
    GradNormRecord,
    GradNorms,
    MemoryStats,
    ModelLayout,
    ParamLayout,
    TensorStats,
    find_spikes,
)
from fsdp_interactive.notebook._groups import (
    LayoutSelection,
    UnitRow,
    host_runs,
    rank_hosts,
    select_layout,
    select_norms,
)
from fsdp_interactive.notebook.render import steps_phrase

__all__ = [
    "grad_norm_bars",
    "grad_norm_history_figure",
    "histogram_figure",
    "layout_figure",
    "memory_figure",
    "rank_color",
]

_RANK_COLORS = (
    "#4C72B0",
    "#DD8452",
    "#55A868",
    "#C44E52",
    "#8172B3",
    "#937860",
    "#DA8BC3",
    "#8C8C8C",
    "#CCB974",
    "#64B5CD",
)


def rank_color(rank: int) -> str:
    """The colour every view draws ``rank`` in (ten colours, then again from the first)."""
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


MAX_FIGURE_HEIGHT = 9.0
"""Inches: a picture taller than a screen is scrolled past, not read."""

MAX_BAR_ROWS = 30
"""Rows drawn in a bar picture; the view's tables list the rest."""

_MEMORY_PARTS = (
    ("params", "param_bytes", "#4C72B0"),
    ("grads", "grad_bytes", "#DD8452"),
    ("optimizer", "optim_bytes", "#55A868"),
    ("buffers", "buffer_bytes", "#8172B3"),
)


def _bar_height(rows: int) -> float:
    return min(MAX_FIGURE_HEIGHT, max(2.8, 0.3 * rows + 1.4))


def _fit_labels(figure: Figure, labels: Sequence[str], fontsize: float, right: float) -> None:
    """Margins for bar pictures, from the longest y label, without a layout pass: a tight
    layout measures every text twice, which costs more than drawing the picture."""
    width_in, height_in = figure.get_size_inches()
    longest = max((len(label) for label in labels), default=4)
    # DejaVu Sans averages about 0.6 em a character; 0.5 in leaves room for the axis label.
    left_in = longest * fontsize * 0.6 / 72 + 0.15
    figure.subplots_adjust(
        left=min(0.6, left_in / width_in),
        right=right,
        bottom=0.6 / height_in,
        top=1 - 0.35 / height_in,
        wspace=0.35,
    )
    # Laid out: figure_png saves it as it is, in one drawing (no cropping pass).
    figure.set_layout_engine(
        PlaceHolderLayoutEngine(adjust_compatible=True, colorbar_gridspec=True)
    )


def layout_figure(
    model_layout: ModelLayout,
    selection: LayoutSelection | None = None,
    max_rows: int = MAX_BAR_ROWS,
) -> Figure:
    """Left: which rank holds what.  Right: bytes per rank (params, grads, optimizer state,
    buffers, one colour each).

    The left picture has one bar per parameter when the selection's parameters fit in
    ``max_rows`` (a small model, a filter, or one unit drilled into): each bar split into
    the element range each rank holds (padding hatched; ranks holding the same slice, as
    the replicas of a hybrid mesh do, stacked in the bar's height).  Otherwise it has one
    bar per row of the unit table (alike units folded into one), split into each rank's
    share of the bytes stored for the unit.  At most ``max_rows`` bars are drawn; the
    figure's height is capped at :data:`MAX_FIGURE_HEIGHT` inches.
    """
    selection = selection or select_layout(model_layout, top=max_rows)
    per_param = selection.param_count <= max_rows
    rows = selection.param_count if per_param else len(selection.rows)
    shown = min(rows, max_rows)
    figure = Figure(figsize=(12, _bar_height(shown)))
    bars, totals = figure.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1.0]})
    if per_param:
        _param_bars(bars, list(selection.params[:shown]))
        bars.set_xlabel("fraction of the parameter's elements (hatched: padding)")
        bars.set_title("which rank holds which slice", fontsize=10)
    else:
        _unit_bars(bars, model_layout, list(selection.rows[:shown]))
        bars.set_xlabel("share of the unit's stored bytes, by rank (hatched: padding)")
        cut = f" (first {shown} of {rows} rows)" if shown < rows else ""
        bars.set_title(f"what each rank holds, per FSDP unit{cut}", fontsize=10)
    _memory_bars(totals, model_layout)
    labels = [t.get_text() for t in bars.get_yticklabels()]
    _fit_labels(figure, labels, 8, right=0.88)
    return figure


def _rank_label_size(ranks: int) -> int:
    return 8 if ranks <= 4 else 7 if ranks <= 8 else 6


LABELLED_ROWS = 8
"""Pictures with more bars label the ranks in the top bar only: the colours carry down
(each label costs a text drawing, the slowest part of a picture)."""


def _param_bars(bars: Axes, params: list[ParamLayout]) -> None:
    for row, param in enumerate(params):
        labelled = row == 0 or len(params) <= LABELLED_ROWS
        y = len(params) - 1 - row
        cursor = 0
        # Plain tensors say "Replicate(world)", torch FSDP1's NO_SHARD "Replicate()".
        fully_replicated = all(p.startswith("Replicate") for p in param.placements)
        # Ranks holding the same slice (the replicas of a hybrid mesh) share its bar height.
        replicas: dict[tuple, list[int]] = {}
        for piece in param.slices:
            replicas.setdefault((piece.offset, piece.local_shape), []).append(piece.rank)
        for piece in param.slices:
            fraction = piece.numel / param.numel if param.numel else 0
            pad = piece.padding / param.numel if param.numel else 0
            start = (
                _flat_start(param.global_shape, piece.offset) / param.numel if param.numel else 0
            )
            band, bands = 0, 1
            if fully_replicated:
                start, fraction = cursor / max(1, len(param.slices)), 1 / max(1, len(param.slices))
                cursor += 1
            else:
                holders = replicas[(piece.offset, piece.local_shape)]
                band, bands = holders.index(piece.rank), len(holders)
            bottom, tall = y - 0.4 + band * 0.8 / bands, 0.8 / bands
            _slice_box(
                bars, piece.rank, start, fraction, pad, bottom, tall, len(param.slices), labelled
            )
    bars.set_xlim(0, 1.15)
    bars.set_ylim(-0.6, len(params) - 0.4)
    bars.set_yticks(range(len(params)))
    bars.set_yticklabels([f"{p.fqn} {tuple(p.global_shape)}" for p in reversed(params)], fontsize=8)


def _slice_box(
    bars: Axes,
    rank: int,
    start: float,
    fraction: float,
    pad: float,
    bottom: float,
    tall: float,
    ranks: int,
    labelled: bool = True,
) -> None:
    bars.add_patch(Rectangle((start, bottom), fraction, tall, color=rank_color(rank), ec="white"))
    # A label only where it fits: with many ranks the colours (and the tables) say the rest.
    if labelled and fraction > 0.045 * max(1, len(f"r{rank}") - 1):
        bars.text(
            start + fraction / 2,
            bottom + tall / 2,
            f"r{rank}",
            ha="center",
            va="center",
            color="white",
            fontsize=_rank_label_size(ranks) if tall > 0.5 else 6,
        )
    if pad > 0:
        bars.add_patch(
            Rectangle(
                (start + fraction, bottom), pad, tall, fill=False, hatch="//", ec=rank_color(rank)
            )
        )


def _unit_bars(bars: Axes, model_layout: ModelLayout, rows: list[UnitRow]) -> None:
    ranks = [t.rank for t in model_layout.ranks]
    for index, row in enumerate(rows):
        y = len(rows) - 1 - index
        stored_total = sum(row.stored) or 1
        start = 0.0
        for rank, held, stored in zip(ranks, row.held, row.stored, strict=True):
            fraction, pad = held / stored_total, (stored - held) / stored_total
            labelled = index == 0 or len(rows) <= LABELLED_ROWS
            _slice_box(bars, rank, start, fraction, pad, y - 0.4, 0.8, len(ranks), labelled)
            start += fraction + pad
    labels = []
    for row in reversed(rows):
        count = f" x{len(row.units)}" if len(row.units) > 1 else ""
        labels.append(f"{row.label}{count}  ({len(row.params)} params, {human_bytes(row.nbytes)})")
    bars.set_xlim(0, 1.0)
    bars.set_ylim(-0.6, len(rows) - 0.4)
    bars.set_yticks(range(len(rows)))
    bars.set_yticklabels(labels, fontsize=8)


def _memory_bars(totals: Axes, model_layout: ModelLayout) -> None:
    """Stacked bytes per rank; the legend beside the plot, top-aligned, in readable type."""
    ranks = [t.rank for t in model_layout.ranks]
    unit, scale = _byte_unit(max((t.total_bytes for t in model_layout.ranks), default=0))
    bottom = [0.0] * len(ranks)
    positions = list(range(len(ranks)))
    for label, attr, colour in _MEMORY_PARTS:
        values = [getattr(t, attr) / scale for t in model_layout.ranks]
        totals.bar(positions, values, bottom=bottom, label=label, color=colour, edgecolor="white")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    totals.set_xticks(positions)
    totals.set_xticklabels(
        [f"r{r}" for r in ranks],
        fontsize=_rank_label_size(len(ranks)),
        rotation=90 if len(ranks) > 8 else 0,
    )
    totals.set_xlabel("rank")
    totals.set_ylabel(unit)
    runs = host_runs(rank_hosts(model_layout))
    # Room above the bars for the host labels when there are hosts to tell apart.
    totals.set_ylim(0, max(bottom, default=0) * (1.2 if runs else 1.05) or 1)
    _host_boundaries(totals, runs, len(ranks))
    totals.set_title("memory per rank", fontsize=10)
    totals.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)


def _host_boundaries(axes: Axes, runs: list[tuple[str, list[int]]], ranks: int) -> None:
    """A dashed line between the bars of ranks on different hosts and each host's name
    above its bars (cut to what its bars' width holds, so 8+ ranks stay readable)."""
    top = axes.get_xaxis_transform()  # x in data (bar positions), y in axes fraction
    for host, at in runs:
        if at[0] > 0:
            axes.axvline(at[0] - 0.5, color="0.35", linestyle="--", linewidth=1)
        room = max(3, 4 * len(at))
        label = host if len(host) <= room else host[: room - 1] + "\u2026"
        axes.text(
            (at[0] + at[-1]) / 2,
            0.98,
            label,
            transform=top,
            ha="center",
            va="top",
            fontsize=_rank_label_size(ranks),
            color="0.2",
        )


def _byte_unit(largest: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return unit, float(scale)
    return "bytes", 1.0


def _flat_start(shape: Sequence[int], offset: Sequence[int]) -> int:
    start, stride = 0, 1
    for size, off in zip(reversed(shape), reversed(offset), strict=True):
        start += off * stride
        stride *= size
    return start


def histogram_figure(stats: TensorStats) -> Figure:
    """Histogram of a summoned tensor's finite values, with its stats in the title."""
    figure = Figure(figsize=(6, 3), layout="tight")
    axes = figure.subplots()
    edges = stats.hist_edges
    widths = [b - a for a, b in itertools.pairwise(edges)]
    axes.bar(
        edges[:-1],
        stats.hist_counts,
        width=widths,
        align="edge",
        color="#4C72B0",
        edgecolor="white",
    )
    axes.set_title(
        f"{stats.fqn or '(model)'} {tuple(stats.shape)}: mean {stats.mean:.3g}, std {stats.std:.3g}"
        + (f", NaN {stats.nan_count}" if stats.nan_count else "")
        + (f", Inf {stats.inf_count}" if stats.inf_count else ""),
        fontsize=9,
    )
    axes.set_xlabel("value")
    axes.set_ylabel("count")
    axes.yaxis.get_major_locator().set_params(integer=True)
    return figure


def grad_norm_bars(
    norms: GradNorms,
    by: str = "params",
    top: int = 30,
    pattern: str | None = None,
    sort: str = "norm",
) -> Figure:
    """Horizontal bars of the norms ``by`` parameter, module or FSDP unit: the ``top``
    largest (or first, ``sort="model"``) matching ``pattern``; NaN/Inf in red.  The global
    norm is not repeated here (the views state it once, above)."""
    items, matched = select_norms(norms, by, pattern, min(top, MAX_BAR_ROWS), sort)
    figure = Figure(figsize=(7, _bar_height(len(items))))
    axes = figure.subplots()
    bad = set(norms.nonfinite)
    names = [k for k, _ in items]
    shown = [v if math.isfinite(v) else 0.0 for _, v in items]
    colors = ["#C44E52" if (k in bad or not math.isfinite(v)) else "#4C72B0" for k, v in items]
    axes.barh(range(len(items)), shown, color=colors)
    for i, (_, v) in enumerate(items):
        if not math.isfinite(v):
            axes.text(0, i, f" {v}", va="center", color="#C44E52", fontsize=8)
    axes.set_yticks(range(len(items)))
    axes.set_yticklabels(names, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel(f"L{norms.norm_type:g} norm of the gradient")
    what = {"params": "parameter", "modules": "module", "units": "FSDP unit"}[by]
    order = "largest" if sort == "norm" else "first"
    cut = f": {order} {len(items)} of {matched}" if len(items) < matched else ""
    axes.set_title(f"gradient norm by {what}{cut}", fontsize=9)
    _fit_labels(figure, names, 8, right=0.96)
    return figure


def plain_number(value: float, _position: object = None) -> str:
    """A tick label as a plain number (``0.7``, ``20``, ``0.0005``), never ``7x10^-1``."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    text = f"{value:.3g}"
    if "e" in text:  # very small or large: positional notation reads better on an axis
        digits = max(0, -math.floor(math.log10(abs(value))))
        text = f"{value:.{digits}f}" if digits <= 8 else text
    return text


def _plain_log_ticks(axes: Axes, values: Sequence[float]) -> None:
    """Log-scale y ticks labelled as plain numbers; over less than two decades the 2x and
    5x ticks get labels too (else one decade would show no label at all)."""
    axes.yaxis.set_major_formatter(FuncFormatter(plain_number))
    low, high = min(values), max(values)
    if high / low < 100:
        axes.yaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
        axes.yaxis.set_minor_formatter(FuncFormatter(plain_number))
    else:
        axes.yaxis.set_minor_formatter(NullFormatter())


def grad_norm_history_figure(
    records: Sequence[GradNormRecord], spike_factor: float = 3.0, window: int = 20
) -> Figure:
    """Global norm per step (log scale); red x at NaN/Inf steps, orange dots at spikes."""
    figure = Figure(figsize=(7, 3), layout="tight")
    axes = figure.subplots()
    steps = [r.step for r in records]
    totals = [r.total for r in records]
    finite = [(s, t) for s, t in zip(steps, totals, strict=True) if math.isfinite(t)]
    if finite:
        axes.plot(
            [s for s, _ in finite],
            [t for _, t in finite],
            color="#4C72B0",
            lw=1.2,
            label="global norm",
        )
    spikes = find_spikes(totals, factor=spike_factor, window=window)
    if spikes:
        axes.scatter(
            [steps[i] for i in spikes],
            [totals[i] for i in spikes],
            color="#DD8452",
            zorder=3,
            label=f"spike (> {spike_factor:g}x median)",
        )
    bad = [r.step for r in records if r.nonfinite]
    for step in bad:
        axes.axvline(step, color="#C44E52", alpha=0.5, lw=1)
    if bad:
        axes.plot([], [], color="#C44E52", label="NaN/Inf step")
    if finite and min(t for _, t in finite) > 0:
        axes.set_yscale("log")
        _plain_log_ticks(axes, [t for _, t in finite])
    axes.set_xlabel("step")
    axes.set_ylabel("gradient norm")
    axes.set_title(f"gradient norm history: {steps_phrase(records)}", fontsize=9)
    if finite or bad:
        axes.legend(fontsize=7)
    return figure


def memory_figure(stats: Sequence[MemoryStats]) -> Figure:
    """Per rank: process RSS, and device allocated/reserved when present."""
    figure = Figure(figsize=(min(12.0, max(5.0, 0.45 * len(stats) + 2)), 2.8), layout="tight")
    axes = figure.subplots()
    ranks = [s.rank for s in stats]
    labels = [f"r{r}" for r in ranks]
    has_device = any(s.allocated_bytes is not None for s in stats)
    if has_device:
        width = 0.38
        xs = range(len(stats))
        axes.bar(
            [x - width / 2 for x in xs],
            [(s.allocated_bytes or 0) / 2**20 for s in stats],
            width,
            label="allocated",
            color="#4C72B0",
        )
        axes.bar(
            [x + width / 2 for x in xs],
            [(s.reserved_bytes or 0) / 2**20 for s in stats],
            width,
            label="reserved",
            color="#55A868",
        )
        axes.set_xticks(list(xs))
        axes.set_xticklabels(labels, fontsize=_rank_label_size(len(ranks)))
        axes.legend(fontsize=7)
        axes.set_title("device memory per rank", fontsize=9)
    else:
        axes.bar(labels, [s.rss_bytes / 2**20 for s in stats], color=[rank_color(r) for r in ranks])
        axes.tick_params(axis="x", labelsize=_rank_label_size(len(ranks)))
        axes.set_title("process RSS per rank (CPU ranks)", fontsize=9)
    axes.set_xlabel("rank")
    axes.set_ylabel("MiB")
    return figure


__dir__ = public_names(__name__)
