"""Plain-text formatting shared by every layer: byte sizes, numbers, fixed-width tables,
long lists cut short, and the close matches of a name that does not exist.

A leaf module: it imports nothing from the package, so the notebook views, the demo and
the command line can all use it without depending on one another.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
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
    """A plain fixed-width table: the headers, a rule of dashes, one line per row.

    Every column is left-aligned and as wide as its widest cell, columns are two spaces
    apart and lines carry no trailing spaces.  Cells are shown as ``str(cell)``: numbers
    are not parsed, re-formatted or aligned on their decimal point, so what the caller
    formatted (``number()``, ``human_bytes()``) is what the table shows.  The one table
    format of the package (views, pool topology, demo, command line).  Raises
    ``ValueError`` for a row whose length differs from the headers'.
    """
    cells = [[str(c) for c in row] for row in rows]
    for index, row in enumerate(cells):
        if len(row) != len(headers):
            raise ValueError(
                f"rows[{index}] has {len(row)} cells; the table has {len(headers)} headers"
            )
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def first_few(items: Sequence[str], shown: int = 3, separator: str = "; ") -> str:
    """The first ``shown`` of ``items`` joined by ``separator``, and how many more:
    ``"a; b; c; and 25 more"``; all of them when there are no more than ``shown + 1``."""
    if len(items) <= shown + 1:
        return separator.join(items)
    return separator.join([*items[:shown], f"and {len(items) - shown} more"])


def close_matches(name: str, candidates: Iterable[str], count: int = 3) -> list[str]:
    """The ``count`` names of ``candidates`` closest to ``name`` (closest first), those
    close enough to be a typo of it (difflib's ratio of 0.6 or more)."""
    return difflib.get_close_matches(name, list(dict.fromkeys(candidates)), count, 0.6)


def did_you_mean(name: str, candidates: Iterable[str], count: int = 3) -> str:
    """``"did you mean 'model'?"`` (``"'a', 'b' or 'c'"`` for several) naming the close
    matches of ``name`` among ``candidates``; ``""`` when none is close."""
    found = [repr(match) for match in close_matches(name, candidates, count)]
    if not found:
        return ""
    names = found[0] if len(found) == 1 else ", ".join(found[:-1]) + " or " + found[-1]
    return f"did you mean {names}?"
