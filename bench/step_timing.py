"""Timing training steps side by side on the ranks: the step-time figures' shared method.

Rank-side helpers of :mod:`bench.train_step` and :mod:`bench.grad_norm`:

* :func:`timed_steps`: one sample, ``steps`` training steps between two barriers, with
  three clocks: wall time, this process's CPU time (every thread, gloo's included) and
  this thread's CPU time (the main thread: the forward, the backward, the optimizer and
  the Python around them, without the collectives that gloo's threads run).
* :func:`alternate`: samples of several contenders, taken in turns whose order rotates
  from round to round, so that sample ``i`` of every contender comes from the same round.

Why one step per sample: on a shared virtual machine, the CPU time of the same step
varies by about 10% from moment to moment (other guests take the host's cores), and
the variation lasts for seconds. Short samples taken in quick turns see the same machine
state, so the per-round ratio cancels it; 200 rounds of one step resolve about 1% (the
A/A control of the main-thread CPU time), where 40 rounds of five steps resolved 3%.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from bench.models import train_step
from bench.runner import rotated

T = TypeVar("T")


@dataclass(frozen=True)
class StepTimes:
    """Seconds one sample of steps took on this rank, by three clocks."""

    wall: float
    process_cpu: float
    thread_cpu: float


def timed_steps(model: Any, optim: Any, batch: Any, steps: int) -> StepTimes:
    """``steps`` training steps between two barriers, timed on this rank.

    The CPU clocks stop before the closing barrier, so waiting for the slowest rank is
    not counted as this rank's work; the wall clock includes it (what a user waits for).
    """
    import torch.distributed as dist

    dist.barrier()
    wall, process, thread = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(steps):
        train_step(model, optim, batch)
    thread, process = time.thread_time() - thread, time.process_time() - process
    dist.barrier()
    return StepTimes(time.perf_counter() - wall, process, thread)


def alternate(
    names: Iterable[str], sample: Callable[[str], T], *, reps: int, warmup: int
) -> dict[str, list[T]]:
    """``reps`` samples of each name, ``sample(name)`` called in rotating turns.

    ``warmup`` untimed rounds first. Sample ``i`` of every name comes from round ``i``.
    """
    order = list(names)
    for _ in range(warmup):
        for name in order:
            sample(name)
    samples: dict[str, list[T]] = {name: [] for name in order}
    for index in range(reps):
        for name in rotated(order, index):
            samples[name].append(sample(name))
    return samples
