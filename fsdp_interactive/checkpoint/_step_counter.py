"""``StepCounter``: a training step count that snapshots and checkpoints restore.

A plain ``int`` variable is a new object after every ``+= 1``, so nothing can restore it
in place. A ``StepCounter`` is changed in place (``step += 1`` keeps the same object) and
has ``state_dict`` / ``load_state_dict``, so it is a (global) stateful object: give it to
``checkpoint.save(..., stateful={"step": step})``, or as ``snapshot(..., step=step)``,
which also records its value as the snapshot's step. It reads as an int where one is
needed: ``range(step, 100)``, ``step * 7``, ``step % 10``, ``f"{step}"``, comparisons.

A leaf of the package (standard library only): the kernel can unpickle one a rank sends
without importing torch. ``fsdp_interactive.checkpoint.StepCounter`` is this class.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.total_ordering
class StepCounter:
    """A step count changed in place; ``int(counter)`` is its value (``value >= 0``)."""

    def __init__(self, value: int = 0) -> None:
        self.value = _checked(value)

    def __index__(self) -> int:
        return self.value

    __int__ = __index__

    def __iadd__(self, other: int) -> StepCounter:
        self.value = _checked(self.value + int(other))
        return self

    # Arithmetic gives plain ints (only ``+=`` changes the counter).
    def __add__(self, other: int) -> int:
        return self.value + int(other)

    __radd__ = __add__

    def __mul__(self, other: int) -> int:
        return self.value * int(other)

    __rmul__ = __mul__

    def __sub__(self, other: int) -> int:
        return self.value - int(other)

    def __rsub__(self, other: int) -> int:
        return int(other) - self.value

    def __mod__(self, other: int) -> int:
        return self.value % int(other)

    def __floordiv__(self, other: int) -> int:
        return self.value // int(other)

    def __truediv__(self, other: float) -> float:
        return self.value / other

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepCounter | int):
            return self.value == int(other)
        return NotImplemented

    def __lt__(self, other: StepCounter | int) -> bool:
        return self.value < int(other)

    __hash__ = None  # type: ignore[assignment]  # it changes in place

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return f"StepCounter({self.value})"

    def state_dict(self) -> dict[str, Any]:
        """``{"value": step}``: what a checkpoint or snapshot saves."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the step to a saved value (checked to be a non-negative integer)."""
        self.value = _checked(state["value"])


def _checked(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a step count is an int >= 0, got {value!r}")
    return value
