"""How measurements read in the report: values with their units, ratios and verdicts."""

from __future__ import annotations

from bench.runner import Comparison, Stat


def fmt_value(value: float, unit: str) -> str:
    if unit == "s":
        if value < 1e-3:
            return f"{value * 1e6:.0f} µs"
        if value < 1.0:
            return f"{value * 1e3:.1f} ms"
        return f"{value:.2f} s"
    if unit == "B":
        return f"{value / 2**20:.2f} MiB"
    if unit == "B/s":
        return f"{value / 2**20:.0f} MiB/s"
    return f"{value:.3g} {unit}"


def fmt_stat(stat: Stat | None) -> str:
    if stat is None:
        return "—"
    if len(stat.samples) == 1:
        return fmt_value(stat.median, stat.unit)
    return (
        f"{fmt_value(stat.median, stat.unit)} "
        f"[{fmt_value(stat.min, stat.unit)} to {fmt_value(stat.max, stat.unit)}]"
    )


def fmt_ratio(comparison: Comparison) -> str:
    if comparison.unavailable:
        return "not available yet"
    ratio = comparison.ratio
    if ratio is None:
        return "—"
    if ratio >= 100:
        return f"{ratio:.0f}x"
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.3f}x"


def verdict(comparison: Comparison) -> str:
    """ "met", "**missed**", "unresolved [low, high]" (the noise straddles the target)."""
    if comparison.unavailable:
        return "—"
    outcome = comparison.verdict
    if outcome is None:
        return "n/a"
    if outcome == "unresolved":
        low, high = comparison.interval or (comparison.ratio, comparison.ratio)
        return f"unresolved [{low:.3f}, {high:.3f}]"
    return "met" if outcome == "met" else "**missed**"


def ratio_range(comparison: Comparison) -> tuple[float, float] | None:
    """The widest ratio the samples allow: (low, high), or None without both sides."""
    s, r = comparison.subject, comparison.reference
    if s is None or r is None or not s.min or not r.min:
        return None
    low, high = s.min / r.max, s.max / r.min
    if comparison.inverse:
        low, high = r.min / s.max, r.max / s.min
    return low, high
