"""The shared measuring vocabulary of every benchmark figure.

* :class:`Stat`: the samples of one measured quantity (median, min, max).
* :func:`measure`: time a callable: warm-up calls first, then the median of several
  repetitions.
* :class:`Comparison`: one side-by-side ratio (ours vs a reference) with its target; the
  subject may be missing ("not available yet"), in which case no ratio is invented.
* :class:`FigureResult`: what one figure script returns: its comparisons, every raw
  measurement it took, and free-text notes.
* :class:`Settings`: full vs quick mode sizes, shared by the figure scripts.

Nothing here starts processes; figures that need ranks use :mod:`bench.ranks`.
"""

from __future__ import annotations

import argparse
import json
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


def measure_interleaved(
    fns: dict[str, Callable[[], Any]], *, reps: int, warmup: int = 1, unit: str = "s"
) -> dict[str, Stat]:
    """Like :func:`measure` for several callables, alternated call by call.

    Alternating (a, b, c, a, b, c, ...) spreads the machine's noise evenly over the
    contenders, which is what makes their ratio meaningful on a shared machine.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
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


@dataclass
class Comparison:
    """One ratio of the report: ``subject`` measured against ``reference``.

    ``ratio`` is ``subject/reference`` of the medians, or ``reference/subject`` when
    ``inverse`` is set (for "N times faster than" figures).  When ``subject`` is ``None``
    the row says ``unavailable`` (why) and carries no ratio.
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

    @property
    def ratio(self) -> float | None:
        if self.subject is None or self.reference is None:
            return None
        num, den = self.subject.median, self.reference.median
        if self.inverse:
            num, den = den, num
        return num / den if den else None

    @property
    def met(self) -> bool | None:
        ratio = self.ratio
        if ratio is None or self.target is None:
            return None
        return self.target.met(ratio)

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
            "ratio": self.ratio,
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "comparisons": [c.to_dict() for c in self.comparisons],
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
            measurements={k: Stat.from_dict(v) for k, v in data["measurements"].items()},
            notes=list(data["notes"]),
            error=data["error"],
            seconds=data["seconds"],
        )


@dataclass(frozen=True)
class Settings:
    """Sizes and repetition counts; :meth:`quick` is the CI smoke-test variant."""

    quick: bool = False

    @property
    def reps(self) -> int:
        return 3 if self.quick else 7

    @property
    def warmup(self) -> int:
        return 1 if self.quick else 2

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return (2,) if self.quick else (2, 4)


def figure_main(run: Callable[[Settings], FigureResult], argv: list[str] | None = None) -> int:
    """Command line of one figure script: run it and print its result as JSON."""
    parser = argparse.ArgumentParser(description=run.__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    args = parser.parse_args(argv)
    result = run(Settings(quick=args.quick))
    print(json.dumps(result.to_dict(), indent=2))
    return 0 if result.error is None else 1
