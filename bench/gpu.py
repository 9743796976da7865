"""GPU figure (``python -m bench --gpu``): the kit on CUDA devices with NCCL.

Needs at least two CUDA devices on one host (NCCL refuses two ranks on one device, and at
world size 1 torch's FSDP1 turns FULL_SHARD into NO_SHARD).  At 2 ranks and at every
visible device (up to 8):

* dispatch: ``Pool.run("pass")`` on a pool of CUDA ranks (NCCL group) against raw
  ipyparallel's ``DirectView.execute`` on as many engines, alternated (target <= 1.2x);
* start: ``Pool(N).start()`` with CUDA ranks against torchrun of a script that joins an
  NCCL group (target <= 1.0x);
* training step: steps/s of ours against torch FSDP1 (``device_id`` the rank's device)
  and ``fully_shard`` by hand, bf16 mixed precision, alternated step block by step block
  (targets >= 1.0x FSDP1, >= 0.97x fully_shard); each contender's model FLOP utilisation
  (MFU: ``6 x parameters x rows`` per step over the step's time, divided by the peak a
  large bf16 matmul reaches on the same device, measured first) and its peak memory per
  device (``torch.cuda.max_memory_allocated`` while it builds and trains with no other
  contender's model on the GPU: each is measured alone and freed before the next; the
  alternated timing runs after).

On a machine without two CUDA devices the figure fails with a message saying so.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from bench.cold_start import pool_start_seconds
from bench.dispatch import raw_cluster
from bench.models import ModelSize, batch_for, build_model, wrap_policy
from bench.ranks import run_on_ranks
from bench.runner import (
    Comparison,
    FigureResult,
    Settings,
    Stat,
    Target,
    figure_main,
    measure_interleaved,
    rotated,
)
from bench.torchrun import relaunch

LABELS = {
    "ours": "FullyShardedDataParallel (ours)",
    "fsdp1": "torch FSDP1",
    "fully_shard": "fully_shard by hand",
}


def cuda_devices() -> int:
    """The number of visible CUDA devices (0 where torch has no CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _wrap(name: str, model: Any) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", torch.cuda.current_device())
    model = model.to(device)
    if name == "fully_shard":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cuda", (torch.distributed.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    if name == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    else:
        from fsdp_interactive.fsdp import FullyShardedDataParallel, MixedPrecision
    mp = MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
    )
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=wrap_policy(),
        mixed_precision=mp,
        device_id=device,
        use_orig_params=True,
    )


def _matmul_peak_flops() -> float:
    """FLOP/s of a large bf16 matmul on this rank's device (the MFU denominator)."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _peak_memory_alone(name: str, size: ModelSize, batch: Any, steps: int) -> float:
    """Peak bytes allocated on this rank's GPU while ``name`` builds its model and trains
    ``steps`` steps, with no other contender's model on the GPU (each is freed before the
    next is built, and the peak statistics are reset in between)."""
    import gc

    import torch

    from bench.models import train_step

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = _wrap(name, build_model(size))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(steps):
        train_step(model, optim, batch)
    torch.cuda.synchronize()
    peak = float(torch.cuda.max_memory_allocated())
    del model, optim
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def _rank_train(size: ModelSize, steps: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from bench.models import train_step

    rank = dist.get_rank()
    peak = _matmul_peak_flops()
    batch = batch_for(size, rank).cuda()
    # Memory first, one contender at a time: with all three models resident, every peak
    # would include the other two.
    memory = {name: _peak_memory_alone(name, size, batch, steps) for name in LABELS}
    setups = {}
    for name in LABELS:
        model = _wrap(name, build_model(size))
        setups[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
        train_step(*setups[name], batch)
    rates: dict[str, list[float]] = {name: [] for name in LABELS}
    for index in range(reps):
        for name in rotated(list(LABELS), index):
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                train_step(*setups[name], batch)
            torch.cuda.synchronize()
            dist.barrier()
            rates[name].append(steps / (time.perf_counter() - start))
    return {"rates": rates, "memory": memory, "peak_flops": peak}


def run(settings: Settings) -> FigureResult:
    """GPU: NCCL dispatch, start, steps/s, MFU and memory per device."""
    devices = cuda_devices()
    if devices < 2:
        raise RuntimeError(
            f"the GPU figure needs at least 2 CUDA devices on this host; torch sees {devices}"
        )
    result = FigureResult("gpu", "GPU ranks (CUDA, NCCL)")
    worlds = sorted({2, min(devices, 8)})
    size = (
        ModelSize(dim=1024, blocks=4, batch=16)
        if settings.quick
        else ModelSize(dim=4096, blocks=8, batch=64)
    )
    steps, reps = (3, 3) if settings.quick else (10, 7)
    result.notes.append(
        f"Devices: {devices}; model: {size.blocks} residual MLP blocks of width {size.dim} "
        f"({size.parameters / 1e6:.0f} M parameters), batch {size.batch} rows per rank, bf16 "
        f"mixed precision, fused AdamW; a sample is {steps} steps; {reps} samples each."
    )
    for world in worlds:
        case = f"{world} GPUs"
        from fsdp_interactive.pool import Pool

        with contextlib.ExitStack() as stack:
            raw_view = stack.enter_context(raw_cluster(world))
            pool = Pool(world, show_topology=False).start()
            stack.callback(pool.stop)
            stats = measure_interleaved(
                {
                    "raw ipyparallel DirectView.execute": lambda v=raw_view: v.execute(
                        "pass", block=True
                    ),
                    "Pool.run (ours, NCCL group)": lambda p=pool: p.run("pass"),
                },
                reps=30 if settings.quick else 100,
                warmup=5,
            )
        for name, stat in stats.items():
            result.measurements[f"{case}: {name}"] = stat
        result.comparisons.append(
            Comparison(
                result.key,
                f"{case}, dispatch",
                "Pool.run (ours, NCCL group)",
                "raw ipyparallel DirectView.execute",
                stats["Pool.run (ours, NCCL group)"],
                stats["raw ipyparallel DirectView.execute"],
                Target("<=", 1.2),
                paired=True,
            )
        )
        starts = Stat(
            [pool_start_seconds(world, devices=None)[0] for _ in range(reps // 2 or 1)], "s"
        )
        torchrun = Stat(
            [relaunch(world, backend="nccl").ready_s for _ in range(reps // 2 or 1)], "s"
        )
        result.measurements[f"{case}: Pool(N).start() (ours)"] = starts
        result.measurements[f"{case}: torchrun to a ready NCCL group"] = torchrun
        result.comparisons.append(
            Comparison(
                result.key,
                f"{case}, start",
                "Pool(N).start() (ours)",
                "torchrun to a ready NCCL group",
                starts,
                torchrun,
                Target("<=", 1.0),
            )
        )
        per_rank = run_on_ranks(world, _rank_train, size, steps, reps, backend="nccl")
        train = per_rank[0]
        flops_per_step = 6 * size.parameters * size.batch * world
        peak = min(r["peak_flops"] for r in per_rank) * world
        rates = {name: Stat(values, "steps/s") for name, values in train["rates"].items()}
        for name, stat in rates.items():
            result.measurements[f"{case}: steps/s, {LABELS[name]}"] = stat
            result.measurements[f"{case}: MFU, {LABELS[name]}"] = Stat(
                [r * flops_per_step / peak for r in stat.samples], "of peak"
            )
            result.measurements[f"{case}: peak memory per device, {LABELS[name]}"] = Stat(
                [max(r["memory"][name] for r in per_rank)], "B"
            )
        for ref, target in (("fsdp1", 1.0), ("fully_shard", 0.97)):
            result.comparisons.append(
                Comparison(
                    result.key,
                    f"{case}, training step, bf16",
                    LABELS["ours"],
                    LABELS[ref],
                    rates["ours"],
                    rates[ref],
                    Target(">=", target),
                    paired=True,
                )
            )
        result.notes.append(
            f"{case}: measured matmul peak {peak / world / 1e12:.0f} TFLOP/s per device (bf16)."
        )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
