"""Rank side: optimizer step boundaries, counted, and a stop in the training thread after
a chosen one.

A training step ends when the optimizer's ``step()`` returns: gradients are applied,
nothing of the step is in flight, and the next step has not begun. That is where a
person can look at a job without changing what it computes. :func:`install` registers
one global optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``,
public since torch 2.0), which works for any optimizer, the script unmodified:

* ``boundary.count``: the optimizer steps completed in this process so far. The count
  follows one optimizer, the first that steps (a script with two optimizers, a GAN's,
  counts the first one's steps), or the one given to :meth:`StepBoundary.follow`;
* ``boundary.stop_at(step, on_stop)``: right after step ``step`` (``None``: the next
  one) completes, the training thread calls ``on_stop(StopPoint)`` and goes on when it
  returns (an exception it raises comes out of ``optimizer.step()``); the request replaces
  an earlier one and returns the count at the moment it was set (a count at or past
  ``step`` means this rank passed it: the request stays, and does not fire);
  ``boundary.target``: the step asked for;
* ``boundary.cancel()``; ``boundary.stopped``: the :class:`StopPoint` while ``on_stop``
  runs, else ``None``.

Steps taken while ``on_stop`` runs (a cell that trains) are not counted, and stop nothing.

The cost while no stop is requested: one Python call per optimizer step, which reads a
counter under a lock. Free of IPython; it imports torch only in :func:`install`.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

_TORCH_OR_OURS = ("/torch/", "/fsdp_interactive/")


@dataclass(frozen=True)
class StopPoint:
    """Where the training thread stopped: after optimizer step ``step``, in the thread
    ``thread``, called from ``frame`` (the innermost frame outside torch and this package:
    the training loop that called ``optimizer.step()``)."""

    step: int
    thread: int
    frame: FrameType | None
    optimizer: Any


class StepBoundary:
    """The step boundaries of this process (see the module); one per process."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._followed: weakref.ref[Any] | None = None
        self._target: int | None = None
        self._on_stop: Callable[[StopPoint], None] | None = None
        self.stopped: StopPoint | None = None
        self._handle: Any = None

    def follow(self, optimizer: Any) -> None:
        """Count the steps of ``optimizer`` (instead of the first optimizer that steps)."""
        self._followed = weakref.ref(optimizer)

    def stop_at(self, step: int | None, on_stop: Callable[[StopPoint], None]) -> int:
        """Stop the training thread after optimizer step ``step`` (``None``: the next one,
        chosen under the same lock as the count); the count when the request was set
        (see the module)."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
            raise ValueError(f"step must be an optimizer step number >= 1, got {step!r}")
        with self._lock:
            self._target = self.count + 1 if step is None else step
            self._on_stop = on_stop
            return self.count

    def cancel(self) -> None:
        """Withdraw the stop request (a stop in progress is the handler's to end)."""
        with self._lock:
            self._target = self._on_stop = None

    @property
    def target(self) -> int | None:
        return self._target

    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer step post-hook (:func:`install` registers it once per process)."""
        if self.stopped is not None:
            return  # a step taken while stopped (a cell's): not the job's
        followed = self._followed() if self._followed is not None else None
        if followed is None:
            self._followed = weakref.ref(optimizer)
        elif followed is not optimizer:
            return
        with self._lock:
            self.count += 1
            if self._target is None or self.count != self._target:
                return
            on_stop = self._on_stop
        if on_stop is None:
            return
        self.stopped = StopPoint(
            self.count, threading.get_ident(), caller_frame(sys._getframe(1)), optimizer
        )
        try:
            on_stop(self.stopped)
        finally:
            self.stopped = None


def caller_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame from ``frame`` outwards whose code is outside torch and this
    package (the training loop), else ``None``."""
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if not any(part in path for part in _TORCH_OR_OURS):
            return frame
        frame = frame.f_back
    return None


_BOUNDARY: StepBoundary | None = None
_INSTALL_LOCK = threading.Lock()


def install() -> StepBoundary:
    """This process's :class:`StepBoundary`, its hook registered on first use."""
    global _BOUNDARY
    with _INSTALL_LOCK:
        if _BOUNDARY is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            boundary = StepBoundary()
            boundary._handle = register_optimizer_step_post_hook(boundary.after_step)
            _BOUNDARY = boundary
        return _BOUNDARY


def current() -> StepBoundary | None:
    """The installed boundary, if any (nothing is installed by asking)."""
    return _BOUNDARY
