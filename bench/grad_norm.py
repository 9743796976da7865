"""Figure 5, gradient-norm recorder cost: step time with ``GradNormRecorder`` attached.

Three identical sharded models (ours when available, else fully_shard by hand; the
recorder reads DTensor gradients either way) train side by side in the same ranks, one
with ``GradNormRecorder(model).attach(optimizer)`` (one record per step), two without:
the second of those is an A/A control, whose ratio to the first shows how far two
identical steps differ in this run (the noise floor the 3% target sits in).  They take
turns, the order rotating from round to round (:mod:`bench.step_timing`); a sample is
one step between barriers, with the ranks pinned one per core where there are enough
cores, timed by two clocks: the wall time on rank 0 and the CPU time of every rank's
process summed (the recorder's background gather runs on a thread of its own, so the
main thread's clock alone would leave it out).  Each ratio is the median of the
per-round ratios.  Two measurements isolate the recorder's cost from step
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
from bench.models import WRAPPERS, ModelSize, batch_for, build_model
from bench.ranks import cores_for_pinning, run_on_ranks
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
    import dataclasses

    import torch
    import torch.distributed as dist

    from bench.step_timing import alternate, timed_steps
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

    samples = {
        name: [dataclasses.asdict(t) for t in times]
        for name, times in alternate(
            setups,
            lambda name: timed_steps(*setups[name], batch, steps),
            reps=reps,
            warmup=warmup,
        ).items()
    }
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
    records = len(recorder)
    last = recorder.history()[-1].total if records else float("nan")
    return {
        "samples": samples,
        "record_alone": record_alone,
        "hook": hook_seconds[-len(samples[WITH]) * steps :],
        "records": records,
        "last_norm": last,
    }


MEASURES = {"": ("wall", "s"), ", CPU time": ("process_cpu", "CPU-s")}


def run(settings: Settings) -> FigureResult:
    """Gradient-norm recorder cost on the training step."""
    result = FigureResult("grad_norm", "Gradient-norm recorder cost (s/step)")
    unavailable = missing("fsdp_interactive.inspect", "GradNormRecorder")
    wrapper = (
        "fully_shard" if missing("fsdp_interactive.fsdp", "FullyShardedDataParallel") else "ours"
    )
    size = model_size(settings)
    steps = 1
    reps = settings.step_samples
    result.notes.append(
        f"Model: as in the training-step figure, sharded with "
        f"{'FullyShardedDataParallel (ours)' if wrapper == 'ours' else 'fully_shard by hand'}; "
        f"{reps} alternated samples of {steps} step each."
    )
    for world in settings.world_sizes:
        case = f"{world} ranks, fp32"
        stats: dict[str, dict[str, Stat]] = {measure: {} for measure in MEASURES}
        if not unavailable:
            per_rank = run_on_ranks(
                world,
                _rank_recorder_cost,
                wrapper,
                size,
                steps,
                reps,
                settings.warmup,
                pin_cores=True,
            )
            out = per_rank[0]
            for measure, (clock, unit) in MEASURES.items():
                for name in (WITH, WITHOUT, CONTROL):
                    stats[measure][name] = Stat(_per_step(per_rank, name, clock, steps), unit)
                    result.measurements[f"{case}{measure}: {name}"] = stats[measure][name]
            alone = Stat(out["record_alone"], "s")
            hook = Stat(out["hook"], "s")
            result.measurements[f"{case}: {RECORD}"] = alone
            result.measurements[f"{case}: {HOOK}"] = hook
            plain = stats[""][WITHOUT].median
            pinned = cores_for_pinning(world)
            result.notes.append(
                f"{case}: the recorder kept {out['records']} records (last global norm "
                f"{out['last_norm']:.4g}); per step, the attached recorder's hook takes "
                f"{hook.median / plain:.1%} of a plain step, a record() call that "
                f"gathers in the call {alone.median / plain:.1%} (medians); "
                + (f"ranks pinned to logical CPUs {pinned}." if pinned else "ranks not pinned.")
            )
        for measure in MEASURES:
            for subject, target, note in (
                (WITH, Target("<=", 1.03), ""),
                (CONTROL, None, "A/A control: the run's noise floor, no target"),
            ):
                result.comparisons.append(
                    Comparison(
                        figure=result.key,
                        case=case + measure,
                        subject_name=subject,
                        reference_name=WITHOUT,
                        subject=stats[measure].get(subject),
                        reference=stats[measure].get(WITHOUT),
                        target=target,
                        unavailable=unavailable,
                        note=note,
                        paired=True,
                    )
                )
    return result


def _per_step(per_rank: list[dict[str, Any]], name: str, clock: str, steps: int) -> list[float]:
    """Seconds per step of each sample: rank 0's wall clock, or all ranks' CPU summed."""
    samples = [rank["samples"][name] for rank in per_rank]
    if clock == "wall":
        return [sample["wall"] / steps for sample in samples[0]]
    return [sum(rank[i][clock] for rank in samples) / steps for i in range(len(samples[0]))]


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
