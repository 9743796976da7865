"""Text and HTML building blocks shared by every view (notebook side, no widgets)."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from typing import Any


def human_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def number(value: float | None, digits: int = 4) -> str:
    """Compact float text that keeps NaN/Inf visible."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}g}"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (right-aligned numbers, left-aligned text)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


_CELL = "padding:1px 10px;text-align:left"


def html_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], marks: set[int] = frozenset()
) -> str:
    """An HTML table; rows whose index is in ``marks`` are highlighted."""
    head = "".join(f'<th style="{_CELL}">{html.escape(str(h))}</th>' for h in headers)
    body = []
    for i, row in enumerate(rows):
        style = ' style="background:#fdd"' if i in marks else ""
        cells = "".join(f'<td style="{_CELL}">{html.escape(str(c))}</td>' for c in row)
        body.append(f"<tr{style}>{cells}</tr>")
    return (
        '<table class="fsdp-interactive" style="border-collapse:collapse;font-family:monospace">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def figure_png(figure: Any) -> bytes:
    """PNG bytes of a matplotlib Figure (rendered with the Agg canvas, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return buffer.getvalue()


def figure_html(figure: Any, alt: str) -> str:
    data = base64.b64encode(figure_png(figure)).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"/>'
