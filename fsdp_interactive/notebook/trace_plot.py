"""A timeline of every rank's recent collectives (``%fsdp trace --plot``; notebook side).

One panel per process group: collective numbers left to right (the last ``last`` of
the group), ranks top to bottom. Each cell is coloured by the collective the rank issued
under that number; a thick black edge marks one the rank still waits in; a hatched grey
cell a number the rank never issued; a red mark above a column a number the ranks
disagree on (different collectives or shapes). Built from the plain
:class:`pool.RecorderDump` records the ranks sent.
Readable at 8+ ranks and a few hundred collectives per panel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsdp_interactive.pool import CollectiveTrace, RecorderDump

_NOT_ISSUED = "#eeeeee"
_NOT_RECORDED = "#ffffff"


def trace_figure(trace: CollectiveTrace, last: int = 60) -> Any:
    """The timeline of ``trace`` (what ``Pool.trace()`` returns) as a matplotlib Figure
    (not attached to pyplot)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    dumps = trace.dumps
    groups = [g for g in trace.groups() if any(_records(d, g[0]) for d in dumps.values())]
    ranks = sorted(rank for rank, dump in dumps.items() if not dump.note)
    ops = sorted({r.op for d in dumps.values() for r in d.records if not r.p2p})
    palette = _palette(len(ops))
    colour = dict(zip(ops, palette, strict=True))
    columns = max([1] + [len(_window(dumps, g, last)) for g, _ in groups])
    width = min(16.0, 3.0 + 0.14 * columns)
    heights = [0.9 + 0.28 * len(ranks) for _ in groups] or [1.5]
    figure = Figure(figsize=(width, sum(heights) + 0.9))
    if not groups or not ranks:
        axes = figure.add_subplot()
        axes.axis("off")
        notes = sorted({d.note for d in dumps.values() if d.note})
        axes.text(0.5, 0.5, "\n".join(notes) or "no collectives recorded", ha="center")
        return figure
    grid = figure.add_gridspec(len(groups), 1, height_ratios=heights)
    for index, (group, desc) in enumerate(groups):
        axes = figure.add_subplot(grid[index])
        seqs = _window(dumps, group, last)
        for column, seq in enumerate(seqs):
            kinds = set()
            for row, rank in enumerate(ranks):
                by_seq = _records(dumps[rank], group)
                record = by_seq.get(seq)
                if record is None:
                    issued = by_seq and max(by_seq) > seq
                    face = _NOT_RECORDED if issued else _NOT_ISSUED
                    hatch = None if issued else "///"
                    axes.add_patch(
                        Rectangle(
                            (column, row),
                            1,
                            1,
                            facecolor=face,
                            edgecolor="#bbbbbb",
                            hatch=hatch,
                            linewidth=0.3,
                        )
                    )
                    continue
                kinds.add(record.signature())
                waiting = record.completed is False
                axes.add_patch(
                    Rectangle(
                        (column + 0.06, row + 0.08),
                        0.88,
                        0.84,
                        facecolor=colour[record.op],
                        edgecolor="black" if waiting else "none",
                        linewidth=2.0 if waiting else 0,
                    )
                )
            if len(kinds) > 1:
                axes.plot(
                    [column + 0.5],
                    [-0.35],
                    marker="v",
                    color="#d62728",
                    markersize=7,
                    clip_on=False,
                )
        axes.set_xlim(0, max(len(seqs), 1))
        axes.set_ylim(len(ranks), -0.6)
        axes.set_yticks([row + 0.5 for row in range(len(ranks))])
        axes.set_yticklabels([f"rank {rank}" for rank in ranks], fontsize=8)
        step = max(1, len(seqs) // 20)
        ticks = list(range(0, len(seqs), step))
        axes.set_xticks([t + 0.5 for t in ticks])
        axes.set_xticklabels([f"#{seqs[t]}" for t in ticks], fontsize=7, rotation=90)
        axes.tick_params(length=0)
        for side in ("top", "right", "left", "bottom"):
            axes.spines[side].set_visible(False)
        title = "default group" if group == "0" else f"group {group} ({desc})"
        axes.set_title(f"{title}: last {len(seqs)} collectives", fontsize=9, loc="left")
    handles = [Patch(facecolor=colour[op], label=op) for op in ops]
    handles += [
        Patch(facecolor="white", edgecolor="black", linewidth=2.0, label="still waiting"),
        Patch(facecolor=_NOT_ISSUED, edgecolor="#bbbbbb", hatch="///", label="not issued"),
    ]
    figure.legend(
        handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=8, frameon=False
    )
    figure.subplots_adjust(bottom=0.9 / (sum(heights) + 0.9) + 0.05, hspace=0.8)
    return figure


def _records(dump: RecorderDump, group: str) -> dict[int, Any]:
    return {r.seq: r for r in dump.records if r.group == group and not r.p2p}


def _window(dumps: Mapping[int, RecorderDump], group: str, last: int) -> list[int]:
    seqs: set[int] = set()
    for dump in dumps.values():
        seqs |= set(_records(dump, group))
    return sorted(seqs)[-last:]


def _palette(count: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if count <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(count)]
