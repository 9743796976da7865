"""The shared measuring vocabulary of every benchmark figure.

* :class:`Stat`: the samples of one measured quantity (median, min, max).
* :func:`measure`: time a callable: warm-up calls first, then the median of several
  repetitions.
* :class:`Comparison`: one side-by-side ratio (ours vs a reference) with its target and
  a verdict that takes the noise into account (:func:`median_interval`): "met" or
  "missed" only when the ratio's confidence interval lies on one side of the target,
  "unresolved" otherwise; the subject may be missing ("not available yet"), in which
  case no ratio is invented.
* :class:`Curve`: one quantity measured at several sizes (ranks, parameters, bytes), for
  the scaling plots and the growth the report states (:mod:`bench.growth`).
* :class:`FigureResult`: what one figure script returns: its comparisons, curves, every
  raw measurement it took, and free-text notes.
* :class:`Settings`: full vs quick mode sizes, shared by the figure scripts.

Nothing here starts processes; figures that need ranks use :mod:`bench.ranks`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal


@dataclass
class Stat:
    """Samples of one quantity in ``unit`` (seconds, steps/s, bytes, ...)."""

    samples: list[float]
    unit: str

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("Stat needs at least one sample")

    @property
    def median(self) -> float:
        return float(statistics.median(self.samples))

    @property
    def min(self) -> float:
        return float(min(self.samples))

    @property
    def max(self) -> float:
        return float(max(self.samples))

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": list(self.samples),
            "unit": self.unit,
            "median": self.median,
            "min": self.min,
            "max": self.max,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Stat:
        return cls(samples=list(data["samples"]), unit=data["unit"])


def median_interval(samples: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: two order statistics.

    The ``k``-th smallest and ``k``-th largest sample, with the largest ``k`` for which the
    median lies outside with probability at most ``1 - confidence`` (binomial with p = 1/2).
    Below 6 samples no such ``k`` exists at 95% and the interval is [min, max], whose
    confidence is lower (94% at 5 samples, 75% at 3).
    """
    if not samples:
        raise ValueError("median_interval needs at least one sample")
    ordered = sorted(samples)
    n = len(ordered)
    alpha = (1.0 - confidence) / 2
    # P(fewer than k + 1 samples fall below the median) <= alpha, k as large as it allows.
    k, below = 0, 1.0 / 2**n
    while k + 1 <= (n - 1) // 2 and below + math.comb(n, k + 1) / 2**n <= alpha:
        below += math.comb(n, k + 1) / 2**n
        k += 1
    return ordered[k], ordered[n - 1 - k]


def measure(fn: Callable[[], Any], *, reps: int, warmup: int = 1, unit: str = "s") -> Stat:
    """Wall time of ``fn()``: ``warmup`` untimed calls, then ``reps`` timed ones."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Stat(samples, unit)


def rotated(names: list[str], round_index: int) -> list[str]:
    """``names`` rotated by ``round_index``: the order of one round of alternated samples.

    Rotating the order from round to round gives every contender every position in turn,
    so what one contender leaves behind (warm caches, a pending garbage collection) does
    not always land on the same other contender.
    """
    if not names:
        return []
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def measure_interleaved(
    fns: dict[str, Callable[[], Any]], *, reps: int, warmup: int = 1, unit: str = "s"
) -> dict[str, Stat]:
    """Like :func:`measure` for several callables, alternated call by call.

    Alternating (a, b, c, b, c, a, ...; see :func:`rotated`) spreads the machine's noise
    evenly over the contenders, which is what makes their ratio meaningful on a shared
    machine: sample ``i`` of every contender comes from the same round (paired samples).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for index in range(reps):
        for name in rotated(list(fns), index):
            start = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: Stat(values, unit) for name, values in samples.items()}


@dataclass
class Target:
    """``ratio <op> value``, e.g. ``Target("<=", 1.2)``."""

    op: Literal["<=", ">=", "<"]
    value: float

    def met(self, ratio: float) -> bool:
        if self.op == "<=":
            return ratio <= self.value
        if self.op == "<":
            return ratio < self.value
        return ratio >= self.value

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}x"


Verdict = Literal["met", "missed", "unresolved"]


@dataclass
class Comparison:
    """One ratio of the report: ``subject`` measured against ``reference``.

    ``ratio`` is ``subject/reference`` of the medians, or ``reference/subject`` when
    ``inverse`` is set (for "N times faster than" figures).  ``paired``: the two were
    sampled alternately, sample ``i`` of one next to sample ``i`` of the other; the ratio
    is then the median of the per-pair ratios, which cancels the machine's drift between
    pairs.  ``interval`` is the ratio's confidence interval (:func:`median_interval` of
    the per-pair ratios; unpaired, the widest ratio the two medians' intervals allow), and
    the verdict is "met" or "missed" only when all of it lies on one side of the target,
    else "unresolved".  When ``subject`` is ``None`` the row says ``unavailable`` (why)
    and carries no ratio.
    """

    figure: str
    case: str
    subject_name: str
    reference_name: str
    subject: Stat | None
    reference: Stat | None
    target: Target | None
    inverse: bool = False
    unavailable: str | None = None
    note: str = ""
    paired: bool = False

    def _pair_ratios(self) -> list[float] | None:
        s, r = self.subject, self.reference
        if not self.paired or s is None or r is None or len(s.samples) != len(r.samples):
            return None
        pairs = zip(s.samples, r.samples, strict=True)
        if self.inverse:
            return [b / a for a, b in pairs if a]
        return [a / b for a, b in pairs if b]

    @property
    def ratio(self) -> float | None:
        if self.subject is None or self.reference is None:
            return None
        pair_ratios = self._pair_ratios()
        if pair_ratios:
            return float(statistics.median(pair_ratios))
        num, den = self.subject.median, self.reference.median
        if self.inverse:
            num, den = den, num
        return num / den if den else None

    @property
    def interval(self) -> tuple[float, float] | None:
        """The ratio's confidence interval (low, high); None without a ratio."""
        if self.ratio is None:
            return None
        pair_ratios = self._pair_ratios()
        if pair_ratios:
            return median_interval(pair_ratios)
        assert self.subject is not None and self.reference is not None
        s_lo, s_hi = median_interval(self.subject.samples)
        r_lo, r_hi = median_interval(self.reference.samples)
        if self.inverse:
            s_lo, s_hi, r_lo, r_hi = r_lo, r_hi, s_lo, s_hi
        if r_lo <= 0 or r_hi <= 0:
            return None
        return s_lo / r_hi, s_hi / r_lo

    @property
    def verdict(self) -> Verdict | None:
        """ "met", "missed", "unresolved" (the interval straddles the target), or None."""
        ratio = self.ratio
        if ratio is None or self.target is None:
            return None
        low, high = self.interval or (ratio, ratio)
        ends = {self.target.met(low), self.target.met(high), self.target.met(ratio)}
        if ends == {True}:
            return "met"
        if ends == {False}:
            return "missed"
        return "unresolved"

    @property
    def met(self) -> bool | None:
        """True when met, False when missed, None when unresolved or without a target."""
        return {"met": True, "missed": False}.get(self.verdict or "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "case": self.case,
            "subject_name": self.subject_name,
            "reference_name": self.reference_name,
            "subject": self.subject.to_dict() if self.subject else None,
            "reference": self.reference.to_dict() if self.reference else None,
            "target": asdict(self.target) if self.target else None,
            "inverse": self.inverse,
            "unavailable": self.unavailable,
            "note": self.note,
            "paired": self.paired,
            "ratio": self.ratio,
            "interval": list(self.interval) if self.interval else None,
            "verdict": self.verdict,
            "met": self.met,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Comparison:
        return cls(
            figure=data["figure"],
            case=data["case"],
            subject_name=data["subject_name"],
            reference_name=data["reference_name"],
            subject=Stat.from_dict(data["subject"]) if data["subject"] else None,
            reference=Stat.from_dict(data["reference"]) if data["reference"] else None,
            target=Target(**data["target"]) if data["target"] else None,
            inverse=data["inverse"],
            unavailable=data["unavailable"],
            note=data["note"],
            paired=data.get("paired", False),
        )


@dataclass
class Curve:
    """One quantity at several sizes: ``values[i]`` measured at ``xs[i]``.

    Curves sharing a ``panel`` are drawn together (one panel of the figure's plot);
    ``reference`` names another curve of the same panel that this one is divided by,
    point by point where both have an x, and ``target`` is what that ratio should meet
    at every x.  ``x_label`` names the size ("ranks", "parameters", "state size") and
    ``x_unit`` its unit as :func:`bench.formatting.fmt_value` knows it ("" for counts, "B").
    ``per`` scales the slope the report states ("per 1,000 parameters": 1000).
    ``paired``: each point's samples were alternated with the reference's.
    """

    figure: str
    panel: str
    name: str
    x_label: str
    xs: list[float]
    values: list[Stat]
    x_unit: str = ""
    per: float = 1.0
    reference: str | None = None
    target: Target | None = None
    ours: bool = True
    paired: bool = False

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.values) or not self.xs:
            raise ValueError(
                f"curve {self.name!r}: {len(self.xs)} x values for {len(self.values)} values"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "panel": self.panel,
            "name": self.name,
            "x_label": self.x_label,
            "xs": list(self.xs),
            "values": [v.to_dict() for v in self.values],
            "x_unit": self.x_unit,
            "per": self.per,
            "reference": self.reference,
            "target": asdict(self.target) if self.target else None,
            "ours": self.ours,
            "paired": self.paired,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Curve:
        return cls(
            figure=data["figure"],
            panel=data["panel"],
            name=data["name"],
            x_label=data["x_label"],
            xs=list(data["xs"]),
            values=[Stat.from_dict(v) for v in data["values"]],
            x_unit=data.get("x_unit", ""),
            per=data.get("per", 1.0),
            reference=data.get("reference"),
            target=Target(**data["target"]) if data.get("target") else None,
            ours=data.get("ours", True),
            paired=data.get("paired", False),
        )


@dataclass
class FigureResult:
    """Everything one figure script measured."""

    key: str
    title: str
    comparisons: list[Comparison] = field(default_factory=list)
    measurements: dict[str, Stat] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    curves: list[Curve] = field(default_factory=list)
    # When it ran and the machine's load then: "2026-12-03 13:10 UTC, load average ...".
    measured: str = ""
    # The command that measured it ("" where it was not recorded).
    command: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "comparisons": [c.to_dict() for c in self.comparisons],
            "curves": [c.to_dict() for c in self.curves],
            "measured": self.measured,
            "command": self.command,
            "measurements": {k: v.to_dict() for k, v in self.measurements.items()},
            "notes": list(self.notes),
            "error": self.error,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FigureResult:
        return cls(
            key=data["key"],
            title=data["title"],
            comparisons=[Comparison.from_dict(c) for c in data["comparisons"]],
            curves=[Curve.from_dict(c) for c in data.get("curves", [])],
            measured=data.get("measured", ""),
            command=data.get("command", ""),
            measurements={k: Stat.from_dict(v) for k, v in data["measurements"].items()},
            notes=list(data["notes"]),
            error=data["error"],
            seconds=data["seconds"],
        )


@dataclass(frozen=True)
class Settings:
    """Sizes and repetition counts; :meth:`quick` is the CI smoke-test variant."""

    quick: bool = False
    #: Alternated one-step samples per contender of the step-time figures (training
    #: step, recorder cost; ``--samples``): more samples narrow their intervals, the A/A
    #: control's included. ``None``: :attr:`step_samples`' default.
    samples: int | None = None

    @property
    def step_samples(self) -> int:
        """Alternated one-step samples per contender: ``samples``, else 200 (6 quick)."""
        return self.samples or (6 if self.quick else 200)

    @property
    def reps(self) -> int:
        return 3 if self.quick else 7

    @property
    def warmup(self) -> int:
        return 1 if self.quick else 2

    @property
    def world_sizes(self) -> tuple[int, ...]:
        """World sizes of the training figures (step, recorder)."""
        return (2,) if self.quick else (2, 4)

    @property
    def scaling_worlds(self) -> tuple[int, ...]:
        """World sizes of the scaling curves (dispatch, start, death, probes)."""
        return (2,) if self.quick else (1, 2, 4, 8)


def figure_main(run: Callable[[Settings], FigureResult], argv: list[str] | None = None) -> int:
    """Command line of one figure script: run it and print its result as JSON."""
    parser = argparse.ArgumentParser(description=run.__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    args = parser.parse_args(argv)
    from bench.run_info import now_and_load

    began = now_and_load()
    result = run(Settings(quick=args.quick))
    result.measured = f"from {began} to {now_and_load()}"
    print(json.dumps(result.to_dict(), indent=2))
    return 0 if result.error is None else 1
