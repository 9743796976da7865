"""Figure 3, training step: steps/s of ours vs torch FSDP1 vs hand-applied fully_shard.

The same model (:mod:`bench.models`), the same per-rank data, FULL_SHARD, AdamW, at each
world size and in fp32 and bf16 (mixed precision: bf16 parameters and reduction).  All
contenders live in the same rank processes and are timed alternately, step block by
step block, so machine noise hits them alike.  A sample is ``steps`` optimizer steps
between two barriers, timed on rank 0, reported as steps/s.

A third case repeats fp32 with ``AdamW(foreach=True)`` for every contender.  On CPU,
torch's optimizers default to their per-parameter loop (the multi-tensor ``foreach``
path is the default only on accelerators), and with fully_shard every parameter is a
DTensor, so each of the loop's tensor operations is one DTensor dispatch; ``foreach``
makes that one dispatch per operation for all parameters, as it is by default on GPUs.

Three measures per sample (see :mod:`bench.step_timing`): wall time (steps/s between
barriers on rank 0), CPU time (steps per CPU second: the sample's steps over the process
CPU time, ``time.process_time``, summed over every rank, gloo's threads included) and
main-thread CPU time (the same with ``time.thread_time``: the forward, the backward and
the optimizer without the collectives gloo's threads run).  On a shared machine the CPU
clocks are what the other work disturbs least, as time spent waiting to be scheduled is
not CPU time; the main thread's clock, which also leaves out gloo's threads waking and
polling, varies least of all.  A sample is one step, the ranks are pinned one per core
where there are enough cores, and a second copy of ours ("ours, second copy") is an A/A
control: two identical contenders, whose ratio is the noise floor of the run.  The
contenders take turns within a round, the order rotating from round to round, and each
ratio is the median of the per-round ratios with its 95% interval.

Targets: ours >= 1.0x FSDP1 and >= 0.97x fully_shard.
"""

from __future__ import annotations

from typing import Any

from bench.availability import missing
from bench.models import WRAPPERS, ModelSize, batch_for, build_model, train_step
from bench.ranks import cores_for_pinning, run_on_ranks
from bench.runner import Comparison, FigureResult, Settings, Stat, Target, figure_main

# case name -> (dtype name, AdamW keyword arguments)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("fp32", {}),
    "bf16": ("bf16", {}),
    "fp32, AdamW(foreach=True)": ("fp32", {"foreach": True}),
}
LABELS = {
    "ours": "FullyShardedDataParallel (ours)",
    "ours_again": "FullyShardedDataParallel (ours, second copy: A/A control)",
    "fsdp1": "torch FSDP1 (device_id=cpu)",
    "fully_shard": "fully_shard by hand",
}


def model_size(settings: Settings) -> ModelSize:
    if settings.quick:
        return ModelSize(dim=128, blocks=2, batch=16)
    return ModelSize(dim=256, blocks=4, batch=32)


MEASURES = {
    "": ("wall", "steps/s"),
    ", CPU time": ("process_cpu", "steps/CPU-s"),
    ", main-thread CPU time": ("thread_cpu", "steps/CPU-s"),
}


def _rank_train(
    contenders: list[str], size: ModelSize, steps: int, reps: int, warmup: int
) -> dict[str, dict[str, Any]]:
    """Per case: every contender's samples (:class:`StepTimes` as dicts), first-step loss."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from bench.step_timing import alternate, timed_steps

    rank = dist.get_rank()
    batch = batch_for(size, rank)
    out = {}
    for case, (dtype_name, optim_kwargs) in CASES.items():
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
        setups = {}
        for name in contenders:
            model = WRAPPERS[name.removesuffix("_again")](build_model(size), dtype)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3, **optim_kwargs)
            setups[name] = (model, optim)
        first_loss = {name: train_step(*setups[name], batch) for name in contenders}
        samples = alternate(
            contenders,
            lambda name, setups=setups: timed_steps(*setups[name], batch, steps),
            reps=reps,
            warmup=warmup,
        )
        out[case] = {
            "samples": {n: [dataclasses.asdict(t) for t in ts] for n, ts in samples.items()},
            "first_loss": first_loss,
        }
        del setups
    return out


def run(settings: Settings) -> FigureResult:
    """Training step: steps/s of ours vs torch FSDP1 vs fully_shard by hand."""
    result = FigureResult("train_step", "Training step (steps/s, FULL_SHARD, AdamW)")
    size = model_size(settings)
    steps = 1
    unavailable = missing("fsdp_interactive.fsdp", "FullyShardedDataParallel", "MixedPrecision")
    contenders = ["fsdp1", "fully_shard"] + ([] if unavailable else ["ours", "ours_again"])
    reps = settings.step_samples
    # 2 ranks only: on this 2-core machine, more ranks than cores time the scheduler more
    # than the step.
    world = 2
    pinned = cores_for_pinning(world)
    result.notes.append(
        f"Model: {size.blocks} residual MLP blocks of width {size.dim} "
        f"({size.parameters / 1e6:.2f} M parameters), batch {size.batch} per rank, "
        f"one FSDP unit per block; a sample is {steps} step between barriers; {reps} "
        "alternated samples per contender; "
        + (f"ranks pinned to logical CPUs {pinned}." if pinned else "ranks not pinned.")
    )
    per_rank = run_on_ranks(
        world,
        _rank_train,
        contenders,
        size,
        steps,
        reps,
        settings.warmup,
        timeout=2400,
        pin_cores=True,
    )
    for case_name in CASES:
        case = f"{world} ranks, {case_name}"
        for measure, (clock, unit) in MEASURES.items():
            stats = {
                name: Stat(_rates(per_rank, case_name, name, clock, steps), unit)
                for name in contenders
            }
            for name in contenders:
                result.measurements[f"{case}{measure}: {LABELS[name]}"] = stats[name]
            result.comparisons += _comparisons(result.key, case + measure, stats, unavailable)
        out = per_rank[0][case_name]
        losses = ", ".join(f"{LABELS[n]} {v:.6f}" for n, v in out["first_loss"].items())
        result.notes.append(f"{case}: first-step loss on rank 0: {losses}.")
    return result


def _rates(
    per_rank: list[dict[str, Any]], case: str, name: str, clock: str, steps: int
) -> list[float]:
    """Steps per second of each sample: rank 0's wall clock, or all ranks' CPU summed."""
    samples = [rank[case]["samples"][name] for rank in per_rank]
    if clock == "wall":
        return [steps / sample["wall"] for sample in samples[0]]
    return [steps / sum(rank[i][clock] for rank in samples) for i in range(len(samples[0]))]


def _comparisons(
    key: str, case: str, stats: dict[str, Stat], unavailable: str | None
) -> list[Comparison]:
    rows = [
        Comparison(
            figure=key,
            case=case,
            subject_name=LABELS["ours"],
            reference_name=LABELS[ref],
            subject=stats.get("ours"),
            reference=stats[ref],
            target=Target(">=", target),
            unavailable=unavailable,
            paired=True,
        )
        for ref, target in (("fsdp1", 1.0), ("fully_shard", 0.97))
    ]
    if "ours_again" in stats:
        rows.append(
            Comparison(
                figure=key,
                case=case,
                subject_name=LABELS["ours_again"],
                reference_name=LABELS["ours"],
                subject=stats["ours_again"],
                reference=stats["ours"],
                target=None,
                note="A/A control: the run's noise floor, no target",
                paired=True,
            )
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
