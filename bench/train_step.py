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
    "fsdp1": "torch FSDP1 (device_id=cpu)",
    "fully_shard": "fully_shard by hand",
}


def model_size(settings: Settings) -> ModelSize:
    if settings.quick:
        return ModelSize(dim=128, blocks=2, batch=16)
    return ModelSize(dim=256, blocks=4, batch=32)


def _rank_train(
    contenders: list[str], size: ModelSize, steps: int, reps: int, warmup: int
) -> dict[str, dict[str, Any]]:
    """Per case: steps/s samples of every contender and its first-step loss (rank 0)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    batch = batch_for(size, rank)
    out = {}
    for case, (dtype_name, optim_kwargs) in CASES.items():
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
        setups = {}
        for name in contenders:
            model = WRAPPERS[name](build_model(size), dtype)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3, **optim_kwargs)
            setups[name] = (model, optim)

        def block(name: str, setups: dict[str, Any] = setups) -> float:
            return steps_per_second(*setups[name], batch, steps)

        first_loss = {name: train_step(*setups[name], batch) for name in contenders}
        for _ in range(warmup):
            for name in contenders:
                block(name)
        rates: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(reps):
            for name in contenders:
                rates[name].append(block(name))
        out[case] = {"rates": rates, "first_loss": first_loss}
        del setups
    return out


def run(settings: Settings) -> FigureResult:
    """Training step: steps/s of ours vs torch FSDP1 vs fully_shard by hand."""
    result = FigureResult("train_step", "Training step (steps/s, FULL_SHARD, AdamW)")
    size = model_size(settings)
    steps = 3 if settings.quick else 5
    unavailable = missing("fsdp_interactive.fsdp", "FullyShardedDataParallel", "MixedPrecision")
    contenders = ["fsdp1", "fully_shard"] + ([] if unavailable else ["ours"])
    result.notes.append(
        f"Model: {size.blocks} residual MLP blocks of width {size.dim} "
        f"({size.parameters / 1e6:.2f} M parameters), batch {size.batch} per rank, "
        f"one FSDP unit per block; a sample is {steps} steps between barriers."
    )
    for world in settings.world_sizes:
        per_dtype = run_on_ranks(
            world, _rank_train, contenders, size, steps, settings.reps, settings.warmup
        )[0]
        for case_name in CASES:
            case = f"{world} ranks, {case_name}"
            out = per_dtype[case_name]
            stats = {name: Stat(rates, "steps/s") for name, rates in out["rates"].items()}
            for name, stat in stats.items():
                result.measurements[f"{case}: {LABELS[name]}"] = stat
            losses = ", ".join(f"{LABELS[n]} {v:.6f}" for n, v in out["first_loss"].items())
            result.notes.append(f"{case}: first-step loss on rank 0: {losses}.")
            for ref, target in (("fsdp1", 1.0), ("fully_shard", 0.97)):
                result.comparisons.append(
                    Comparison(
                        figure=result.key,
                        case=case,
                        subject_name=LABELS["ours"],
                        reference_name=LABELS[ref],
                        subject=stats.get("ours"),
                        reference=stats[ref],
                        target=Target(">=", target),
                        unavailable=unavailable,
                    )
                )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
