"""The scaling section of the report: curves as a table, growth in words and a plot.

:func:`curves_markdown` renders every :class:`~bench.runner.Curve` of a run: one table
per panel (median with its 95% interval at each size, and the ratio to the panel's
reference where the curve has one, with its verdict against the target), followed by
the growth of each curve in words (:func:`bench.growth.describe`).  :func:`render_curves`
draws the same panels into one PNG: the values on log axes with their intervals, and
under each panel that has ratios the ratios against their target.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.formatting import fmt_value
from bench.growth import describe
from bench.runner import Comparison, Curve, FigureResult, Stat, median_interval

# Units :func:`fmt_value` scales; others print as plain numbers.
_SECONDS = "s"


def _signed(value: float, unit: str) -> str:
    return ("-" if value < 0 else "") + fmt_value(abs(value), unit)


def _fmt_x(x: float, unit: str) -> str:
    if unit:
        return fmt_value(x, unit)
    return f"{x:,.0f}"


def panels(figures: list[FigureResult]) -> dict[tuple[str, str], list[Curve]]:
    """(figure title, panel) -> its curves, in report order."""
    out: dict[tuple[str, str], list[Curve]] = {}
    for figure in figures:
        if figure.error:
            continue
        for curve in figure.curves:
            out.setdefault((figure.title, curve.panel), []).append(curve)
    return out


def ratio_at(curve: Curve, reference: Curve, x: float) -> Comparison | None:
    """The comparison of ``curve`` with ``reference`` at size ``x`` (None if either lacks it)."""
    if x not in curve.xs or x not in reference.xs:
        return None
    return Comparison(
        figure=curve.figure,
        case=f"{x:g} {curve.x_label}",
        subject_name=curve.name,
        reference_name=reference.name,
        subject=curve.values[curve.xs.index(x)],
        reference=reference.values[reference.xs.index(x)],
        target=curve.target,
        paired=curve.paired,
    )


def _half_width(stat: Stat) -> float:
    low, high = median_interval(stat.samples)
    return (high - low) / 2


def growth_sentence(curve: Curve) -> str:
    """ "X grows 0.9 ms per rank (from ... to ...); bends at ..." for one curve."""
    unit = curve.values[0].unit
    medians = [v.median for v in curve.values]
    first, last = curve.values[0], curve.values[-1]
    span = (
        f"{fmt_value(first.median, unit)} at {_fmt_x(curve.xs[0], curve.x_unit)} to "
        f"{fmt_value(last.median, unit)} at {_fmt_x(curve.xs[-1], curve.x_unit)} {curve.x_label}"
    )
    if len(set(curve.xs)) < 2:
        return f"{curve.name}: {fmt_value(first.median, unit)} (one size only)."
    growth = describe(curve.xs, medians, [_half_width(v) for v in curve.values])
    per = curve.per
    singular = curve.x_label.rstrip("s") if curve.x_label.endswith("s") else curve.x_label
    if curve.x_unit:
        per_text = f"per {_fmt_x(per, curve.x_unit)} of {curve.x_label}"
    else:
        per_text = f"per {per:,.0f} {curve.x_label}" if per != 1 else f"per {singular}"
    slope = growth.line.slope * per
    sign = "grows" if slope >= 0 else "falls"
    text = f"{curve.name}: {sign} {fmt_value(abs(slope), unit)} {per_text} ({span})"
    if growth.exponent is not None:
        text += f"; log-log slope {growth.exponent:.2f}"
    if growth.bend is not None:
        bend = growth.bend
        text += (
            f"; bends at {_fmt_x(bend.knot, curve.x_unit)} {curve.x_label}: "
            f"{_signed(bend.slope * per, unit)} {per_text} before, "
            f"{_signed(bend.slope_after * per, unit)} after"
        )
    else:
        text += "; no bend the noise resolves"
    return text + "."


def curves_markdown(figures: list[FigureResult], plot_name: str) -> list[str]:
    """Markdown lines of the scaling section (empty when the run has no curves)."""
    grouped = panels(figures)
    if not grouped:
        return []
    lines = [
        "## Scaling curves",
        "",
        "How each cost grows with ranks, parameters or state size.  Each cell is the median "
        "with its 95% confidence interval (two order statistics) in brackets; where a curve "
        "has a reference in its panel, the ratio (median of the per-round ratios when the "
        "two were alternated) and its verdict follow.  A verdict is `met` or `missed` only "
        "when the whole interval of the ratio lies on one side of the target, else "
        "`unresolved`.  Growth is the least-squares slope through the medians; a bend is "
        "reported only where a two-piece line fits at least 4 times better and the straight "
        "line misses a point by more than its noise.",
        "",
        f"![Scaling curves]({plot_name})",
        "",
    ]
    for (title, panel), curves in grouped.items():
        lines += [f"### {title}: {panel}", ""]
        xs = sorted({x for c in curves for x in c.xs})
        x_unit = curves[0].x_unit
        label = curves[0].x_label
        header = "| Curve | " + " | ".join(
            f"{_fmt_x(x, x_unit)} {label.removesuffix('s') if x == 1 else label}" for x in xs
        )
        lines += [header + " |", "| --- |" + " --- |" * len(xs)]
        by_name = {c.name: c for c in curves}
        for curve in curves:
            cells = []
            for x in xs:
                if x not in curve.xs:
                    cells.append("—")
                    continue
                stat = curve.values[curve.xs.index(x)]
                low, high = median_interval(stat.samples)
                cell = (
                    f"{fmt_value(stat.median, stat.unit)} "
                    f"[{fmt_value(low, stat.unit)}, {fmt_value(high, stat.unit)}]"
                )
                reference = by_name.get(curve.reference or "")
                comparison = ratio_at(curve, reference, x) if reference else None
                if comparison is not None and comparison.ratio is not None:
                    interval = comparison.interval or (comparison.ratio, comparison.ratio)
                    cell += f"<br>{comparison.ratio:.3f}x [{interval[0]:.3f}, {interval[1]:.3f}]"
                    if comparison.verdict:
                        cell += f" {comparison.target}: {comparison.verdict}"
                cells.append(cell)
            lines.append(f"| {curve.name} | " + " | ".join(cells) + " |")
        lines.append("")
        for curve in curves:
            lines.append(f"- {growth_sentence(curve)}")
        lines.append("")
    return lines


def render_curves(figures: list[FigureResult], path: Path) -> bool:
    """Draw every panel into ``path`` (PNG); False (and nothing written) without curves."""
    grouped = panels(figures)
    if not grouped:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells: list[tuple[str, str, list[Curve], bool]] = []
    for (title, panel), curves in grouped.items():
        cells.append((title, panel, curves, False))
        if any(c.reference for c in curves):
            cells.append((title, panel, curves, True))
    columns = 2
    rows = math.ceil(len(cells) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(13, 3.6 * rows), squeeze=False)
    for ax, (title, panel, curves, ratios) in zip(axes.flat, cells, strict=False):
        _draw(ax, title, panel, curves, ratios)
    for ax in list(axes.flat)[len(cells) :]:
        ax.set_axis_off()
    fig.suptitle(
        "fsdp_interactive scaling: medians with 95% intervals; ratio panels show the ratio "
        "to the reference (dashed: target)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _draw(ax: Any, title: str, panel: str, curves: list[Curve], ratios: bool) -> None:
    ax.set_title(f"{title}\n{panel}" + (": ratio to reference" if ratios else ""), fontsize=8)
    by_name = {c.name: c for c in curves}
    xs_all = sorted({x for c in curves for x in c.xs})
    for curve in curves:
        style = "-o" if curve.ours else "--s"
        if ratios:
            reference = by_name.get(curve.reference or "")
            if reference is None:
                continue
            points = [(x, ratio_at(curve, reference, x)) for x in curve.xs]
            points = [(x, c) for x, c in points if c is not None and c.ratio is not None]
            if not points:
                continue
            ys = [c.ratio for _, c in points]
            lows = [c.ratio - (c.interval or (c.ratio, c.ratio))[0] for _, c in points]
            highs = [(c.interval or (c.ratio, c.ratio))[1] - c.ratio for _, c in points]
            ax.errorbar(
                [x for x, _ in points],
                ys,
                yerr=[lows, highs],
                fmt=style,
                capsize=3,
                ms=4,
                lw=1,
                label=f"{curve.name} / {reference.name}",
            )
            if curve.target is not None:
                ax.axhline(curve.target.value, color="black", ls="--", lw=1)
            ax.set_ylabel("ratio", fontsize=7)
            continue
        unit = curve.values[0].unit
        scale = 1e3 if unit == _SECONDS else (1 / 2**20 if unit.startswith("B") else 1.0)
        ys = [v.median * scale for v in curve.values]
        intervals = [median_interval(v.samples) for v in curve.values]
        lows = [y - lo * scale for y, (lo, _) in zip(ys, intervals, strict=True)]
        highs = [hi * scale - y for y, (_, hi) in zip(ys, intervals, strict=True)]
        ax.errorbar(
            curve.xs, ys, yerr=[lows, highs], fmt=style, capsize=3, ms=4, lw=1, label=curve.name
        )
        label = {"s": "ms", "B": "MiB", "B/s": "MiB/s"}.get(unit, unit)
        ax.set_ylabel(label, fontsize=7)
        if all(y > 0 for y in ys):
            ax.set_yscale("log")
    if len(xs_all) > 1 and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 8:
        ax.set_xscale("log", base=2 if curves[0].x_label == "ranks" else 10)
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(xs_all)
    ax.set_xticklabels([_fmt_x(x, curves[0].x_unit) for x in xs_all], fontsize=7)
    ax.set_xlabel(curves[0].x_label, fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=6, loc="best")
    ax.grid(True, which="both", alpha=0.3)
