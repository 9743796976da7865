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

Two measures per sample: wall time (steps/s between barriers on rank 0) and CPU time
(steps per CPU second: the block's steps over the process CPU time, ``time.process_time``,
summed over every rank, gloo's threads included).  On a shared machine the CPU time is
what the other work disturbs least: time a rank spends waiting to be scheduled is not
CPU time.  A second copy of ours ("ours, second copy") is an A/A control: two identical
contenders, whose ratio is the noise floor of the run.  The contenders take turns within
a round, the order rotating from round to round, and each ratio is the median of the
per-round ratios with its 95% interval.

Targets: ours >= 1.0x FSDP1 and >= 0.97x fully_shard.
"""

from __future__ import annotations

from typing import Any

from bench.availability import missing
from bench.models import (
    WRAPPERS,
    ModelSize,
    batch_for,
    build_model,
    steps_per_second,
    train_step,
)
from bench.ranks import run_on_ranks
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


def _timed_block(model: Any, optim: Any, batch: Any, steps: int) -> tuple[float, float]:
    """(wall steps/s on this rank, this rank's process CPU seconds) of one block of steps."""
    import time

    cpu = time.process_time()
    rate = steps_per_second(model, optim, batch, steps)
    return rate, time.process_time() - cpu


def _rank_train(
    contenders: list[str], size: ModelSize, steps: int, reps: int, warmup: int
) -> dict[str, dict[str, Any]]:
    """Per case: wall steps/s and CPU seconds per block of every contender, first-step loss."""
    import torch
    import torch.distributed as dist

    from bench.runner import rotated

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

        def block(name: str, setups: dict[str, Any] = setups) -> tuple[float, float]:
            return _timed_block(*setups[name], batch, steps)

        first_loss = {name: train_step(*setups[name], batch) for name in contenders}
        for _ in range(warmup):
            for name in contenders:
                block(name)
        rates: dict[str, list[float]] = {name: [] for name in contenders}
        cpu: dict[str, list[float]] = {name: [] for name in contenders}
        for index in range(reps):
            for name in rotated(contenders, index):
                rate, seconds = block(name)
                rates[name].append(rate)
                cpu[name].append(seconds)
        out[case] = {"rates": rates, "cpu": cpu, "first_loss": first_loss}
        del setups
    return out


def run(settings: Settings) -> FigureResult:
    """Training step: steps/s of ours vs torch FSDP1 vs fully_shard by hand."""
    result = FigureResult("train_step", "Training step (steps/s, FULL_SHARD, AdamW)")
    size = model_size(settings)
    steps = 3 if settings.quick else 5
    unavailable = missing("fsdp_interactive.fsdp", "FullyShardedDataParallel", "MixedPrecision")
    contenders = ["fsdp1", "fully_shard"] + ([] if unavailable else ["ours", "ours_again"])
    reps = settings.samples or (settings.reps if settings.quick else 12)
    result.notes.append(
        f"Model: {size.blocks} residual MLP blocks of width {size.dim} "
        f"({size.parameters / 1e6:.2f} M parameters), batch {size.batch} per rank, "
        f"one FSDP unit per block; a sample is {steps} steps between barriers; {reps} "
        "alternated samples per contender."
    )
    # 2 ranks only: on this 2-core machine, more ranks than cores time the scheduler more
    # than the step, and 12 alternated samples at 4 ranks take over half an hour.
    for world in (2,):
        # 12 alternated samples of 4 contenders in 3 cases: on a loaded 2-core machine
        # that takes well over the default 10 minutes.
        per_rank = run_on_ranks(
            world, _rank_train, contenders, size, steps, reps, settings.warmup, timeout=2400
        )
        for case_name in CASES:
            case = f"{world} ranks, {case_name}"
            out = per_rank[0][case_name]
            walls = {name: Stat(rates, "steps/s") for name, rates in out["rates"].items()}
            # Steps per CPU second of the whole group: the block's steps over the CPU
            # seconds all ranks spent on it.
            cpus = {
                name: Stat(
                    [
                        steps / sum(rank[case_name]["cpu"][name][i] for rank in per_rank)
                        for i in range(reps)
                    ],
                    "steps/CPU-s",
                )
                for name in contenders
            }
            for name in contenders:
                result.measurements[f"{case}: {LABELS[name]}"] = walls[name]
                result.measurements[f"{case}, CPU time: {LABELS[name]}"] = cpus[name]
            losses = ", ".join(f"{LABELS[n]} {v:.6f}" for n, v in out["first_loss"].items())
            result.notes.append(f"{case}: first-step loss on rank 0: {losses}.")
            for measure, stats in (("", walls), (", CPU time", cpus)):
                result.comparisons += _comparisons(result.key, case + measure, stats, unavailable)
    return result


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
