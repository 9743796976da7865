"""Plain-text formatting shared by every layer: byte sizes, numbers, fixed-width tables.

A leaf module: it imports nothing from the package, so the notebook views, the demo and
the command line can all use it without depending on one another.
"""

from __future__ import annotations

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
    """``value`` to ``digits`` significant digits (``0.5817``); NaN/Inf as such, ``None`` as ``-``.

    Four digits by default: a computed float32 differs between CPU kernel paths and devices
    in about its seventh digit, which more digits would show.
    """
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
