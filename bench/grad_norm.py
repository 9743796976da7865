"""Figure 5, gradient-norm recorder cost: step time with ``GradNormRecorder`` attached.

Two identical sharded models (ours when available, else fully_shard by hand; the
recorder reads DTensor gradients either way) train side by side in the same ranks, one
with ``GradNormRecorder(model).attach(optimizer)`` (one record per step), one without.
They are timed alternately; a sample is the mean seconds per step over a block of steps
between barriers, on rank 0.  Afterwards ``record()`` is also timed on its own (between
barriers, on the last step's gradients), which isolates the recorder's cost from step
noise.  Target: <= 1.03x the plain step.
"""

from __future__ import annotations

import time
from typing import Any

from bench.availability import missing
from bench.models import WRAPPERS, ModelSize, batch_for, build_model, train_step
from bench.ranks import run_on_ranks
from bench.runner import Comparison, FigureResult, Settings, Stat, Target, figure_main
from bench.train_step import model_size

WITH = "step with GradNormRecorder (ours)"
WITHOUT = "step without recorder"
RECORD = "GradNormRecorder.record() alone"


def _rank_recorder_cost(
    wrapper: str, size: ModelSize, steps: int, reps: int, warmup: int
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from fsdp_interactive.inspect import GradNormRecorder

    batch = batch_for(size, dist.get_rank())
    setups = {}
    recorder = None
    for name in (WITHOUT, WITH):
        model = WRAPPERS[wrapper](build_model(size), torch.float32)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if name == WITH:
            recorder = GradNormRecorder(model).attach(optim)
        setups[name] = (model, optim)

    def block(name: str) -> float:
        model, optim = setups[name]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            train_step(model, optim, batch)
        dist.barrier()
        return (time.perf_counter() - start) / steps

    for _ in range(warmup):
        for name in setups:
            block(name)
    samples: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(reps):
        for name in setups:
            samples[name].append(block(name))
    assert recorder is not None
    # record() on its own, on the gradients the last step left: the recorder's whole cost
    # in one collective call, much less exposed to machine noise than a step-time ratio.
    record_alone = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        recorder.record()
        dist.barrier()
        record_alone.append(time.perf_counter() - start)
    samples[RECORD] = record_alone
    records = len(recorder)
    last = recorder.history()[-1].total if records else float("nan")
    return {"samples": samples, "records": records, "last_norm": last}


def run(settings: Settings) -> FigureResult:
    """Gradient-norm recorder cost on the training step."""
    result = FigureResult("grad_norm", "Gradient-norm recorder cost (s/step)")
    unavailable = missing("fsdp_interactive.inspect", "GradNormRecorder")
    wrapper = (
        "fully_shard" if missing("fsdp_interactive.fsdp", "FullyShardedDataParallel") else "ours"
    )
    size = model_size(settings)
    steps = 3 if settings.quick else 5
    reps = settings.reps if settings.quick else 2 * settings.reps
    result.notes.append(
        f"Model: as in the training-step figure, sharded with "
        f"{'FullyShardedDataParallel (ours)' if wrapper == 'ours' else 'fully_shard by hand'}; "
        f"{reps} alternated samples of {steps} steps each."
    )
    for world in settings.world_sizes:
        case = f"{world} ranks, fp32"
        subject = reference = None
        if not unavailable:
            out = run_on_ranks(
                world, _rank_recorder_cost, wrapper, size, steps, reps, settings.warmup
            )[0]
            subject = Stat(out["samples"][WITH], "s")
            reference = Stat(out["samples"][WITHOUT], "s")
            result.measurements[f"{case}: {WITH}"] = subject
            result.measurements[f"{case}: {WITHOUT}"] = reference
            alone = Stat(out["samples"][RECORD], "s")
            result.measurements[f"{case}: {RECORD}"] = alone
            result.notes.append(
                f"{case}: the recorder kept {out['records']} records (last global norm "
                f"{out['last_norm']:.4g}); record() alone takes "
                f"{alone.median / reference.median:.1%} of a plain step (medians)."
            )
        result.comparisons.append(
            Comparison(
                figure=result.key,
                case=case,
                subject_name=WITH,
                reference_name=WITHOUT,
                subject=subject,
                reference=reference,
                target=Target("<=", 1.03),
                unavailable=unavailable,
            )
        )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
