"""matplotlib figures built from the probes' plain records (notebook side).

Every function returns a ``matplotlib.figure.Figure`` made without pyplot (no global
figure state, no GUI backend needed); save it with ``figure.savefig(path)`` or show it with
IPython's ``display``.  Nothing here talks to the ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from fsdp_interactive.inspect import (
    GradNormRecord,
    GradNorms,
    MemoryStats,
    ModelLayout,
    TensorStats,
    find_spikes,
)

_RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3")


def rank_color(rank: int) -> str:
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def layout_figure(model_layout: ModelLayout, max_params: int = 40) -> Figure:
    """Left: one bar per parameter, split into the element range each rank holds (padding
    hatched; ranks holding the same slice, as the replicas of a hybrid mesh do, are stacked
    in the bar's height).  Right: bytes per rank (parameters, gradients, optimizer state,
    buffers)."""
    params = list(model_layout.params[:max_params])
    height = max(2.5, 0.32 * len(params) + 1.2)
    figure = Figure(figsize=(11, height))
    bars, totals = figure.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1.3]})
    for row, param in enumerate(params):
        y = len(params) - 1 - row
        cursor = 0
        fully_replicated = not param.is_dtensor or all(
            p.startswith("Replicate") for p in param.placements
        )
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
            bars.add_patch(
                Rectangle((start, bottom), fraction, tall, color=rank_color(piece.rank), ec="white")
            )
            if fraction > 0.06:
                bars.text(
                    start + fraction / 2,
                    bottom + tall / 2,
                    f"r{piece.rank}",
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=8 if bands == 1 else 6,
                )
            if pad > 0:
                bars.add_patch(
                    Rectangle(
                        (start + fraction, bottom),
                        pad,
                        tall,
                        fill=False,
                        hatch="//",
                        ec=rank_color(piece.rank),
                    )
                )
    bars.set_xlim(0, 1.15)
    bars.set_ylim(-0.6, len(params) - 0.4)
    bars.set_yticks(range(len(params)))
    bars.set_yticklabels([f"{p.fqn} {tuple(p.global_shape)}" for p in reversed(params)], fontsize=8)
    bars.set_xlabel("fraction of the parameter's elements (hatched: padding)")
    bars.set_title("which rank holds which slice")
    ranks = [t.rank for t in model_layout.ranks]
    unit, scale = _byte_unit(max((t.total_bytes for t in model_layout.ranks), default=0))
    bottom = [0.0] * len(ranks)
    for label, attr, pattern in (
        ("params", "param_bytes", ""),
        ("grads", "grad_bytes", ".."),
        ("optimizer", "optim_bytes", "xx"),
        ("buffers", "buffer_bytes", "--"),
    ):
        values = [getattr(t, attr) / scale for t in model_layout.ranks]
        totals.bar(
            [f"rank {r}" for r in ranks],
            values,
            bottom=bottom,
            label=label,
            color=[rank_color(r) for r in ranks],
            hatch=pattern,
            edgecolor="black",
        )
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    totals.set_ylabel(unit)
    totals.set_ylim(0, max(bottom, default=0) * 1.12 or 1)
    totals.set_title("memory per rank")
    totals.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    figure.tight_layout()
    return figure


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
    figure = Figure(figsize=(6, 3))
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
    figure.tight_layout()
    return figure


def grad_norm_bars(norms: GradNorms, by: str = "params", top: int = 30) -> Figure:
    """Horizontal bars of per-parameter (``by="params"``) or per-module norms; NaN/Inf in red."""
    if by not in ("params", "modules"):
        raise ValueError(f"by must be 'params' or 'modules', got {by!r}")
    values = dict(norms.params) if by == "params" else {k: v for k, v in norms.modules.items() if k}
    items = list(values.items())[:top]
    figure = Figure(figsize=(7, max(2.5, 0.3 * len(items) + 1.2)))
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
    axes.set_title(f"gradient norms by {by[:-1]}; global norm {norms.total:.4g}", fontsize=9)
    figure.tight_layout()
    return figure


def grad_norm_history_figure(
    records: Sequence[GradNormRecord], spike_factor: float = 3.0, window: int = 20
) -> Figure:
    """Global norm per step (log scale); red x at NaN/Inf steps, orange dots at spikes."""
    figure = Figure(figsize=(7, 3))
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
    axes.set_xlabel("step")
    axes.set_ylabel("gradient norm")
    axes.set_title(f"gradient norm history ({len(records)} steps)", fontsize=9)
    if finite or bad:
        axes.legend(fontsize=7)
    figure.tight_layout()
    return figure


def memory_figure(stats: Sequence[MemoryStats]) -> Figure:
    """Per rank: process RSS, and device allocated/reserved when present."""
    figure = Figure(figsize=(5, 2.8))
    axes = figure.subplots()
    ranks = [s.rank for s in stats]
    labels = [f"rank {r}" for r in ranks]
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
        axes.set_xticklabels(labels)
        axes.legend(fontsize=7)
        axes.set_title("device memory per rank", fontsize=9)
    else:
        axes.bar(labels, [s.rss_bytes / 2**20 for s in stats], color=[rank_color(r) for r in ranks])
        axes.set_title("process RSS per rank (CPU ranks)", fontsize=9)
    axes.set_ylabel("MiB")
    figure.tight_layout()
    return figure
