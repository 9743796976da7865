"""How a measured quantity grows with a size (ranks, parameters, bytes), in words.

:func:`describe` fits a straight line by least squares through a curve's medians (the
slope is the growth the report states, e.g. "0.9 ms per rank"), a power law through the
same points on log-log axes (its exponent says whether growth is faster than linear),
and for every interior point a continuous two-piece line bending there (a hinge).  A bend
is reported only where the hinge is much better than the straight line:

* its residual sum of squares is at most a quarter of the line's, and
* the line misses at least one point by more than that point's uncertainty (the wider of
  10% of its value and half its median's confidence interval), so a bend is never read
  into noise that a straight line already passes through.

Everything here is plain arithmetic on floats; nothing is measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# A hinge must cut the line's residual sum of squares at least this many times.
BEND_GAIN = 4.0
# ... and the line must miss some point by more than this share of its value.
BEND_MISS = 0.10


@dataclass(frozen=True)
class Line:
    intercept: float
    slope: float
    sse: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass(frozen=True)
class Hinge:
    """``y = intercept + slope * x + extra * max(0, x - knot)``."""

    knot: float
    intercept: float
    slope: float
    extra: float
    sse: float

    @property
    def slope_after(self) -> float:
        return self.slope + self.extra


@dataclass(frozen=True)
class Growth:
    """The fitted growth of one curve (see the module docstring)."""

    line: Line
    exponent: float | None  # log-log slope; None where a value or x is not positive
    bend: Hinge | None
    x_first: float
    x_last: float


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Line:
    """Least-squares straight line; needs at least two distinct x."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError(f"fit_line needs two or more (x, y) pairs, got {n} x and {len(ys)} y")
    mean_x = sum(xs) / n
    mean_y = sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_line needs at least two distinct x values")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = mean_y - slope * mean_x
    sse = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return Line(intercept, slope, sse)


def fit_hinge(xs: Sequence[float], ys: Sequence[float], knot: float) -> Hinge:
    """Least-squares continuous two-piece line bending at ``knot`` (normal equations)."""
    rows = [(1.0, x, max(0.0, x - knot)) for x in xs]
    # Solve the 3x3 normal equations (A^T A) b = A^T y by Gaussian elimination.
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(3)]
    coef = _solve3(ata, aty)
    if coef is None:
        raise ValueError(f"a hinge at {knot} is not determined by these points")
    a, b, c = coef
    sse = sum((y - a - b * r[1] - c * r[2]) ** 2 for r, y in zip(rows, ys, strict=True))
    return Hinge(knot, a, b, c, sse)


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float] | None:
    m = [[*row, value] for row, value in zip(m, v, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, max(abs(x) for row in m for x in row)):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for row in range(3):
            if row != col:
                factor = m[row][col] / m[col][col]
                m[row] = [a - factor * b for a, b in zip(m[row], m[col], strict=True)]
    return m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]


def power_exponent(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Slope of log y against log x (least squares); None unless every value is > 0."""
    if len(xs) < 2 or min(xs) <= 0 or min(ys) <= 0 or len(set(xs)) < 2:
        return None
    return fit_line([math.log(x) for x in xs], [math.log(y) for y in ys]).slope


def describe(
    xs: Sequence[float], ys: Sequence[float], uncertainty: Sequence[float] | None = None
) -> Growth:
    """Fit ``ys`` (medians) against ``xs``; ``uncertainty``: per point, half its CI width."""
    noise = list(uncertainty) if uncertainty is not None else [0.0] * len(xs)
    points = sorted(zip(xs, ys, noise, strict=True))
    xs = [float(x) for x, _, _ in points]
    ys = [float(y) for _, y, _ in points]
    noise = [float(u) for _, _, u in points]
    line = fit_line(xs, ys)
    bend = None
    misses = any(
        abs(y - line.at(x)) > max(BEND_MISS * abs(y), u)
        for x, y, u in zip(xs, ys, noise, strict=True)
    )
    if len(set(xs)) >= 3 and misses:
        hinges = []
        for knot in sorted(set(xs))[1:-1]:
            try:
                hinges.append(fit_hinge(xs, ys, knot))
            except ValueError:
                continue
        best = min(hinges, key=lambda h: h.sse, default=None)
        if best is not None and best.sse * BEND_GAIN <= line.sse:
            bend = best
    return Growth(line, power_exponent(xs, ys), bend, xs[0], xs[-1])
