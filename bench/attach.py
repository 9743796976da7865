"""Attaching to a job: what an attachable job costs while nobody is attached, how long a
pause takes to reach every rank, and the round trip of status and stacks.

* Step time: the same training step (the model of :mod:`bench.train_step`: ours,
  FULL_SHARD, fp32, AdamW) in a plain group and in a group whose ranks called
  ``fsdp_interactive.attachable()`` first (the optimizer step hook, the idle listener
  thread), and, as the A/A control, in a second plain group. Each sample is a fresh
  group (the attachable module's hook lives as long as its process); the three take turns
  in rounds whose order rotates; a group's sample is the median of its one-step samples
  after warm-up, by rank 0's wall clock; each ratio is the median of the per-round ratios.
* Time to pause: an attachable group trains (the same step) while this process, the
  notebook, attaches and asks for ``pause()`` (every rank stops after the same next
  optimizer step) then ``resume()``, several times; each pause's seconds against one
  step of that group plus 0.1 s.
* Round trips: ``status()`` and ``stacks()`` of an attached job at several world sizes
  (ranks that train with a short sleep between steps, so that the machine is not all
  theirs).

Targets: an attachable job's step at most 1.01x a plain job's; a pause within one step
plus 0.1 s.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.models import ModelSize, batch_for, build_model, wrap_ours
from bench.ranks import run_on_ranks
from bench.runner import (
    Comparison,
    Curve,
    FigureResult,
    Settings,
    Stat,
    Target,
    figure_main,
    measure,
    rotated,
)
from bench.train_step import model_size

CONTENDERS = ("plain", "plain again", "attachable")
PAUSE_MARGIN_S = 0.1


def _rank_steps(attach_dir: str | None, size: ModelSize, reps: int, warmup: int) -> float:
    """This rank's median one-step wall time; attachable first when ``attach_dir``."""
    import torch
    import torch.distributed as dist

    from bench.step_timing import timed_steps

    if attach_dir is not None:
        import fsdp_interactive

        fsdp_interactive.attachable(attach_dir=attach_dir, job_name=f"bench-{os.getppid()}")
    model = wrap_ours(build_model(size), torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = batch_for(size, dist.get_rank())
    for _ in range(warmup):
        timed_steps(model, optim, batch, 1)
    return statistics.median(timed_steps(model, optim, batch, 1).wall for _ in range(reps))


def _rank_train_until(
    attach_dir: str, job: str, size: ModelSize, stop: str, sleep_s: float
) -> dict[str, float]:
    """Train as an attachable job until the file ``stop`` exists; the median step time."""
    import torch
    import torch.distributed as dist

    import fsdp_interactive
    from bench.step_timing import timed_steps

    fsdp_interactive.attachable(attach_dir=attach_dir, job_name=job)
    model = wrap_ours(build_model(size), torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = batch_for(size, dist.get_rank())
    times = []
    flag = torch.zeros(1)
    while True:
        flag.fill_(float(os.path.exists(stop)))
        dist.all_reduce(flag)  # every rank stops after the same step
        if flag.item():
            break
        times.append(timed_steps(model, optim, batch, 1).wall)
        time.sleep(sleep_s)
    if not times:
        raise RuntimeError("the job stopped before it took a step")
    return {"step_s": statistics.median(times[2:] or times), "steps": len(times)}


class _RunningJob:
    """An attachable group training in a thread of this process until :meth:`stop`."""

    def __init__(self, world: int, size: ModelSize, sleep_s: float) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="fsdpi-bench-attach-"))
        self.name = f"bench-{world}"
        self.stop_file = self.folder / "stop"
        self.result: list[Any] = []
        self.error: BaseException | None = None
        args = (str(self.folder / "attach"), self.name, size, str(self.stop_file), sleep_s)

        def run() -> None:
            try:
                self.result = run_on_ranks(world, _rank_train_until, *args, timeout=1800)
            except BaseException as error:
                self.error = error

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def attach(self) -> Any:
        """Attach once every rank has taken a few steps (measured while it trains)."""
        import fsdp_interactive

        attached = fsdp_interactive.attach(self.folder / "attach" / self.name, wait=300)
        deadline = time.monotonic() + 300
        while min(s.step for s in attached.status().states.values()) < 3:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job of {self.name} took no steps within 300 s")
            time.sleep(0.2)
        return attached

    def stop(self) -> list[Any]:
        self.stop_file.touch()
        self.thread.join(600)
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.error is not None:
            raise self.error
        return self.result


def _step_time(result: FigureResult, settings: Settings, size: ModelSize) -> None:
    rounds = 2 if settings.quick else 10
    reps = 5 if settings.quick else 30
    warmup = settings.warmup * 5
    world = 2
    folder = tempfile.mkdtemp(prefix="fsdpi-bench-attach-")
    samples: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    try:
        for index in range(rounds):
            for name in rotated(list(CONTENDERS), index):
                attach_dir = os.path.join(folder, str(index)) if name == "attachable" else None
                per_rank = run_on_ranks(
                    world, _rank_steps, attach_dir, size, reps, warmup, pin_cores=True
                )
                samples[name].append(per_rank[0])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stats = {name: Stat(values, "s") for name, values in samples.items()}
    for name, stat in stats.items():
        result.measurements[f"{world} ranks, step time: {name}"] = stat
    result.notes.append(
        f"Step time: {world} ranks, {size.blocks} blocks of width {size.dim}, batch "
        f"{size.batch}; {rounds} rounds, each a fresh group per contender ({warmup} warm-up "
        f"steps, the median of {reps} one-step samples)."
    )
    for name, target, note in (
        ("attachable", Target("<=", 1.01), "attachable, nobody attached"),
        ("plain again", None, "A/A control: the noise of this comparison"),
    ):
        result.comparisons.append(
            Comparison(
                figure=result.key,
                case=f"{world} ranks, step time",
                subject_name=name,
                reference_name="plain",
                subject=stats[name],
                reference=stats["plain"],
                target=target,
                note=note,
                paired=True,
            )
        )


def _pause_and_round_trips(result: FigureResult, settings: Settings, size: ModelSize) -> None:
    worlds = (2,) if settings.quick else (2, 4, 8)
    pauses = 3 if settings.quick else 10
    status_s: list[Stat] = []
    stacks_s: list[Stat] = []
    for world in worlds:
        job = _RunningJob(world, size, sleep_s=0.0 if world == 2 else 0.05)
        try:
            attached = job.attach()
            try:
                status_s.append(measure(attached.status, reps=settings.reps * 3, warmup=1))
                stacks_s.append(measure(attached.stacks, reps=settings.reps * 3, warmup=1))
                if world == 2:
                    pause_s = []
                    for _ in range(pauses):
                        began = time.perf_counter()
                        attached.pause(timeout=120)
                        pause_s.append(time.perf_counter() - began)
                        attached.resume()
                        time.sleep(0.2)
            finally:
                attached.detach()
        finally:
            per_rank = job.stop()
        if world == 2:
            step = per_rank[0]["step_s"]
            result.measurements["2 ranks: time to pause"] = Stat(pause_s, "s")
            result.measurements["2 ranks: step time of the paused job"] = Stat([step], "s")
            result.comparisons.append(
                Comparison(
                    figure=result.key,
                    case="2 ranks, time to pause",
                    subject_name="pause()",
                    reference_name=f"one step + {PAUSE_MARGIN_S} s",
                    subject=Stat(pause_s, "s"),
                    reference=Stat([step + PAUSE_MARGIN_S] * len(pause_s), "s"),
                    target=Target("<=", 1.0),
                    note=f"slowest pause {max(pause_s):.3f} s; a step {step * 1e3:.1f} ms",
                    paired=True,
                )
            )
    for name, values in (("status()", status_s), ("stacks()", stacks_s)):
        for world, stat in zip(worlds, values, strict=True):
            result.measurements[f"{world} ranks: {name} round trip"] = stat
        result.curves.append(
            Curve(
                figure=result.key,
                panel="round trip of an attached job",
                name=name,
                x_label="ranks",
                xs=[float(w) for w in worlds],
                values=values,
            )
        )


def run(settings: Settings) -> FigureResult:
    """Attaching to a job: step time while attachable, time to pause, status/stacks."""
    result = FigureResult("attach", "Attaching to a running job")
    size = model_size(settings)
    _step_time(result, settings, size)
    _pause_and_round_trips(result, settings, size)
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
