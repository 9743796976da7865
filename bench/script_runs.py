"""Figure: scripts in and jobs out: ``%fsdp run`` against a torchrun launch, and
``%fsdp export`` of a 20-cell session.

* From ``Pool.run_script`` (``%fsdp run``) to the script paused after its first optimizer
  step (the call returns: the model can be looked at), the pool warm (started, the script
  run once before), against ``torchrun --standalone`` of the same script from its launch
  to the line rank 0 prints right after its first step (what a user waits for per
  relaunch of a training script), alternated sample by sample
  (``bench/scripts/first_step_rank.py``: torch's FSDP on the CPU, gloo). The pool's run is
  ended (untimed) before the next sample. Target: ours <= 0.2x torchrun's.
* ``Pool.export`` of a session of 20 journaled cells (a pushed value, a model built with
  this package's FSDP, 18 small training cells, each with its generator states), writing
  the script and its values file; target <= 1 s.

    .venv/bin/python -m bench.script_runs [--quick]
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench.availability import missing
from bench.runner import Comparison, FigureResult, Settings, Stat, Target, figure_main
from bench.torchrun import launch, stop_session

SCRIPT = Path(__file__).resolve().parent / "scripts" / "first_step_rank.py"
OURS = "Pool.run_script to the first step (ours, pool warm)"
TORCHRUN = "torchrun launch to the first step"
EXPORT = "Pool.export of a 20-cell session (ours)"
EXPORT_BUDGET = 1.0
BUILD = """
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
torch.manual_seed(0)
model = FSDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)))
optimizer = torch.optim.SGD(model.parameters(), lr=lr)
"""
TRAIN = "model(torch.randn(4, 32)).square().mean().backward()\noptimizer.step()\noptimizer.zero_grad()\n"


def _first_step(text: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith("FIRST_STEP ")]
    if not lines:
        raise RuntimeError(f"the script printed no FIRST_STEP line:\n{text[-2000:]}")
    return float(lines[0].split()[1])


def torchrun_first_step(world: int, timeout: float = 120.0) -> float:
    """Seconds from a torchrun launch of the script to its first optimizer step."""
    began = time.time()
    process = launch(world, SCRIPT)
    try:
        out, err = process.communicate(timeout=timeout)
    except Exception:
        stop_session(process)
        raise
    if process.returncode != 0:
        raise RuntimeError(f"torchrun exited with {process.returncode}:\n{err[-3000:]}")
    return _first_step(out) - began


def pool_first_step(pool) -> float:
    """Seconds from ``pool.run_script`` to the script paused after its first optimizer step
    (the call returns then: the user can look at the model)."""
    began = time.perf_counter()
    pool.run_script(SCRIPT, ["--steps", "3"], stop_at=1, stream=False)
    seconds = time.perf_counter() - began
    pool.continue_script(stop=True, stream=False)
    return seconds


def export_seconds(pool, folder: str, reps: int) -> Stat:
    """``pool.export`` of a 20-cell journal, ``reps`` times (a fresh file each time)."""
    pool.restart()
    pool.push({"lr": 0.01})
    pool.run(BUILD, cell=1, stream=False)
    for number in range(2, 21):
        pool.run(TRAIN, cell=number, stream=False)
    samples = []
    for index in range(reps):
        began = time.perf_counter()
        pool.export(os.path.join(folder, f"session{index}.py"))
        samples.append(time.perf_counter() - began)
    return Stat(samples, "s")


def run(settings: Settings) -> FigureResult:
    """%fsdp run to the first step vs torchrun; export of a 20-cell session."""
    result = FigureResult("script_runs", "Scripts in, jobs out (%fsdp run, %fsdp export)")
    unavailable = missing("fsdp_interactive.pool", "Pool")
    world = 2
    reps = settings.reps
    result.notes.append(
        f"{world} CPU ranks (gloo); {reps} alternated samples per contender after "
        f"{settings.warmup} warm-up run(s) each; the export: {reps} exports of one session."
    )
    from fsdp_interactive.pool import Pool

    pool = Pool(world, devices="cpu", show_topology=False)
    try:
        pool.start()
        for _ in range(settings.warmup):
            pool_first_step(pool)
            torchrun_first_step(world)
        ours, reference = [], []
        for index in range(reps):
            order = [pool_first_step, torchrun_first_step]
            if index % 2:
                order.reverse()
            for measure in order:
                value = measure(pool) if measure is pool_first_step else measure(world)
                (ours if measure is pool_first_step else reference).append(value)
        with tempfile.TemporaryDirectory() as folder:
            exported = export_seconds(pool, folder, reps)
    finally:
        pool.stop()
    result.measurements[OURS] = Stat(ours, "s")
    result.measurements[TORCHRUN] = Stat(reference, "s")
    result.measurements[EXPORT] = exported
    result.comparisons.append(
        Comparison(
            figure=result.key,
            case=f"{world} ranks",
            subject_name=OURS,
            reference_name=TORCHRUN,
            subject=result.measurements[OURS],
            reference=result.measurements[TORCHRUN],
            target=Target("<=", 0.2),
            unavailable=unavailable,
            paired=True,
        )
    )
    result.comparisons.append(
        Comparison(
            figure=result.key,
            case="20 cells",
            subject_name=EXPORT,
            reference_name="1 s budget",
            subject=exported,
            reference=Stat([EXPORT_BUDGET], "s"),
            target=Target("<=", 1.0),
            unavailable=unavailable,
        )
    )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
