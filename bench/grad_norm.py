"""Figure 5, gradient-norm recorder cost: step time with ``GradNormRecorder`` attached.

Three identical sharded models (ours when available, else fully_shard by hand; the
recorder reads DTensor gradients either way) train side by side in the same ranks, one
with ``GradNormRecorder(model).attach(optimizer)`` (one record per step), two without:
the second of those is an A/A control, whose ratio to the first shows how far two
identical steps differ in this run (the noise floor the 3% target sits in).  They are
timed alternately; a sample is the mean seconds per step over a block of steps
between barriers, on rank 0.  Two measurements isolate the recorder's cost from step
noise: the attached recorder's step pre-hook, timed by hooks registered just before and
after it (attached, the all-gather of the norms runs in the background, so this is what
the step waits for), and afterwards ``record()`` on its own (between barriers, on the
last step's gradients), which gathers within the call.  Target: <= 1.03x the plain
step.
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
CONTROL = "step without recorder, second model (A/A control)"
RECORD = "GradNormRecorder.record() alone (gathers in the call)"
HOOK = "attached recorder's hook alone (what the step waits for)"


def _rank_recorder_cost(
    wrapper: str, size: ModelSize, steps: int, reps: int, warmup: int
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from fsdp_interactive.inspect import GradNormRecorder

    batch = batch_for(size, dist.get_rank())
    setups = {}
    recorder = None
    hook_seconds: list[float] = []
    began: list[float] = []
    for name in (WITHOUT, CONTROL, WITH):
        model = WRAPPERS[wrapper](build_model(size), torch.float32)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if name == WITH:
            # Step pre-hooks run in registration order: these two bracket the recorder's.
            optim.register_step_pre_hook(lambda *_: began.append(time.perf_counter()))
            recorder = GradNormRecorder(model).attach(optim)
            optim.register_step_pre_hook(
                lambda *_: hook_seconds.append(time.perf_counter() - began.pop())
            )
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
    samples[HOOK] = hook_seconds[-len(samples[WITH]) * steps :]
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
    reps = settings.reps if settings.quick else 6 * settings.reps
    result.notes.append(
        f"Model: as in the training-step figure, sharded with "
        f"{'FullyShardedDataParallel (ours)' if wrapper == 'ours' else 'fully_shard by hand'}; "
        f"{reps} alternated samples of {steps} steps each."
    )
    for world in settings.world_sizes:
        case = f"{world} ranks, fp32"
        subject = reference = control = None
        if not unavailable:
            out = run_on_ranks(
                world, _rank_recorder_cost, wrapper, size, steps, reps, settings.warmup
            )[0]
            subject = Stat(out["samples"][WITH], "s")
            reference = Stat(out["samples"][WITHOUT], "s")
            control = Stat(out["samples"][CONTROL], "s")
            result.measurements[f"{case}: {WITH}"] = subject
            result.measurements[f"{case}: {WITHOUT}"] = reference
            result.measurements[f"{case}: {CONTROL}"] = control
            alone = Stat(out["samples"][RECORD], "s")
            hook = Stat(out["samples"][HOOK], "s")
            result.measurements[f"{case}: {RECORD}"] = alone
            result.measurements[f"{case}: {HOOK}"] = hook
            result.notes.append(
                f"{case}: the recorder kept {out['records']} records (last global norm "
                f"{out['last_norm']:.4g}); per step, the attached recorder's hook takes "
                f"{hook.median / reference.median:.1%} of a plain step, a record() call that "
                f"gathers in the call {alone.median / reference.median:.1%} (medians)."
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
        result.comparisons.append(
            Comparison(
                figure=result.key,
                case=case,
                subject_name=CONTROL,
                reference_name=WITHOUT,
                subject=control,
                reference=reference,
                target=None,
                unavailable=unavailable,
                note="A/A control: the run's noise floor, no target",
            )
        )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
