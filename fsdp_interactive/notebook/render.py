"""Plain-text and HTML renderings of the probes' records (notebook side).

These are what a view shows outside a live kernel (nbconvert, nbval's ``text/plain``,
a terminal) and what the widgets show in their text panes, so the numbers a test reads
from a view are the numbers a user sees.

Computed floats (norms, statistics) are shown to four significant digits: float32 sums
come out differently in about the seventh digit on different CPU kernel paths (AVX-512,
AVX2, none) and GPUs, and the same notebook should show the same numbers on each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fsdp_interactive._text import human_bytes, number, text_table
from fsdp_interactive.inspect import (
    GradNormRecord,
    GradNorms,
    MemoryStats,
    ModelLayout,
    TensorStats,
    find_spikes,
)
from fsdp_interactive.notebook._format import html_table

_LAYOUT_HEADERS = ("parameter", "shape", "dtype", "placements", "per-rank rows/shape", "padding")


def _layout_rows(model_layout: ModelLayout) -> list[tuple[str, ...]]:
    rows = []
    for p in model_layout.params:
        shapes = " | ".join(
            f"r{s.rank}:{'x'.join(map(str, s.local_shape)) or 'scalar'}" for s in p.slices
        )
        padding = sum(s.padding for s in p.slices)
        rows.append(
            (
                p.fqn,
                "x".join(map(str, p.global_shape)) or "scalar",
                p.dtype,
                ",".join(p.placements),
                shapes,
                str(padding) if padding else "",
            )
        )
    return rows


def _rank_rows(model_layout: ModelLayout) -> list[tuple[str, ...]]:
    return [
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


_RANK_HEADERS = ("rank", "params", "grads", "optimizer", "buffers", "total")


def layout_text(model_layout: ModelLayout) -> str:
    head = (
        f"{len(model_layout.params)} parameters, {human_bytes(model_layout.model_bytes)} "
        f"unsharded, over {model_layout.world_size} ranks"
    )
    return "\n\n".join(
        [
            head,
            text_table(_LAYOUT_HEADERS, _layout_rows(model_layout)),
            text_table(_RANK_HEADERS, _rank_rows(model_layout)),
        ]
    )


def layout_html(model_layout: ModelLayout) -> str:
    head = (
        f"<b>{len(model_layout.params)} parameters, {human_bytes(model_layout.model_bytes)} "
        f"unsharded, over {model_layout.world_size} ranks</b>"
    )
    return (
        head
        + html_table(_LAYOUT_HEADERS, _layout_rows(model_layout))
        + "<br/>"
        + html_table(_RANK_HEADERS, _rank_rows(model_layout))
    )


def _norm_rows(norms: GradNorms, by: str) -> tuple[list[tuple[str, str, str]], set[int]]:
    values = norms.params if by == "params" else {k: v for k, v in norms.modules.items() if k}
    rows, marks = [], set()
    for i, (name, value) in enumerate(values.items()):
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


_NO_GRADS = "no gradients yet: run a backward pass on the ranks first"


def grad_norms_text(norms: GradNorms, by: str = "params") -> str:
    if not norms.params:
        return _NO_GRADS
    rows, _ = _norm_rows(norms, by)
    head = f"global L{norms.norm_type:g} gradient norm: {number(norms.total)}"
    if norms.has_nonfinite:
        head += f"  (NON-FINITE gradients in: {', '.join(norms.nonfinite) or 'total'})"
    return head + "\n\n" + text_table((by[:-1], "norm", "flags"), rows)


def grad_norms_html(norms: GradNorms, by: str = "params") -> str:
    if not norms.params:
        return f"<i>{_NO_GRADS}</i>"
    rows, marks = _norm_rows(norms, by)
    head = f"<b>global L{norms.norm_type:g} gradient norm: {number(norms.total)}</b>"
    if norms.has_nonfinite:
        head += f' <span style="color:#c00">non-finite: {", ".join(norms.nonfinite)}</span>'
    return head + html_table((by[:-1], "norm", "flags"), rows, marks)


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


def stats_text(stats: TensorStats) -> str:
    title = stats.fqn or "(whole model)"
    if len(stats.names) > 1:
        title += f" ({len(stats.names)} parameters)"
    return title + "\n" + text_table(("stat", "value"), _stats_rows(stats))


def stats_html(stats: TensorStats) -> str:
    title = stats.fqn or "(whole model)"
    return f"<b>{title}</b>" + html_table(("stat", "value"), _stats_rows(stats))


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


def memory_text(stats: Sequence[MemoryStats]) -> str:
    return text_table(_MEMORY_HEADERS, _memory_rows(stats))


def memory_html(stats: Sequence[MemoryStats]) -> str:
    return html_table(_MEMORY_HEADERS, _memory_rows(stats))


def _topology_rows(topology: Sequence[Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    fields = ("rank", "local_rank", "host", "pid", "device", "backend")
    rows = [tuple(str(_field(r, f)) for f in fields) for r in topology]
    return fields, rows


def _field(record: Any, name: str) -> Any:
    if isinstance(record, dict):
        return record.get(name, "")
    return getattr(record, name, "")


def topology_text(topology: Sequence[Any]) -> str:
    headers, rows = _topology_rows(topology)
    return text_table(headers, rows)


def topology_html(topology: Sequence[Any]) -> str:
    headers, rows = _topology_rows(topology)
    return html_table(headers, rows)


def history_text(records: Sequence[GradNormRecord], last: int = 10) -> str:
    """Summary of a recorder's history: steps, last norms, NaN/Inf steps and spikes."""
    if not records:
        return "no gradient norms recorded yet"
    totals = [r.total for r in records]
    spikes = [records[i].step for i in find_spikes(totals)]
    bad = [r.step for r in records if r.nonfinite]
    lines = [
        f"{len(records)} steps recorded (steps {records[0].step}..{records[-1].step}); "
        f"last global norm {number(records[-1].total)}",
        f"NaN/Inf at steps: {bad if bad else 'none'}",
        f"spikes at steps: {spikes if spikes else 'none'}",
    ]
    tail = records[-last:]
    lines.append(
        text_table(
            ("step", "global norm", "flags"),
            [(r.step, number(r.total), "NaN/Inf" if r.nonfinite else "") for r in tail],
        )
    )
    return "\n".join(lines)
