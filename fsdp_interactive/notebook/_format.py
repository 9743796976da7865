"""HTML tables and inline figures shared by every view (notebook side, no widgets).

Plain-text building blocks live in :mod:`fsdp_interactive._text`.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from typing import Any

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
    """PNG bytes of a matplotlib Figure (rendered with the Agg canvas, no pyplot state).

    A figure with a layout engine (``Figure(..., layout="tight")``) is saved as it lays
    itself out, in one drawing; any other is cropped to its content (``bbox_inches=
    "tight"``), which draws it twice.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    crop = None if figure.get_layout_engine() is not None else "tight"
    figure.savefig(buffer, format="png", dpi=90, bbox_inches=crop)
    return buffer.getvalue()


def figure_html(figure: Any, alt: str) -> str:
    data = base64.b64encode(figure_png(figure)).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"/>'
