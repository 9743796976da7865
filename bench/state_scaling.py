"""Figure 9, state scaling: memory, meta-init peak and checkpoint throughput against size.

Three model sizes (residual MLP blocks, :mod:`bench.models`; 8 blocks of width 256, 512
and 1,024 in full mode, i.e. about 16, 64 and 256 MiB of fp32 parameters), each in fresh
processes:

* per-rank bytes of ours (parameters, gradients and AdamW state held by the largest rank,
  as in the memory figure) on 4 ranks, against the ideal ``full / N``;
* meta-device init peak of ours (the largest rank's peak RSS increase, as in the memory
  figure) on 4 ranks, against the full model's parameter bytes;
* checkpoint throughput of ours: ``fsdp_interactive.checkpoint.save`` and ``load``
  (verifying checksums) of the model and its AdamW state, against ``torch.save`` of a
  full state dict from rank 0 (fsynced), alternated sample by sample, at every size on
  4 ranks and at the middle size on 2, 4 and 8 ranks; raw DCP (``dcp.save`` of the
  sharded state dicts, fsynced as ours) beside them as a baseline, to tell what ours adds
  from what DCP itself can do against one writer.

Throughput is the state's bytes over the wall time, barrier to barrier on rank 0.
Targets: bytes <= 1.01x full/N and meta peak < 1x the full model at every size; save
>= 2x ``torch.save`` at every size and rank count (as in the checkpoint figure); load has
no target.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.availability import missing
from bench.checkpoint import DCP, TORCH_SAVE, _state_bytes, sharded_state, torch_save_from_rank0
from bench.memory import _rank_memory
from bench.models import WRAPPERS, ModelSize, batch_for, build_model, train_step
from bench.ranks import run_on_ranks
from bench.runner import Comparison, Curve, FigureResult, Settings, Stat, Target, figure_main

SAVE = "checkpoint.save (ours)"
LOAD = "checkpoint.load (ours, verified)"
HELD = "largest rank's params+grads+optimizer (ours)"
IDEAL = "full model / N"
META = "meta-init peak RSS increase (ours)"
FULL = "full model parameters"


def _rank_checkpoint_io(root: str, size: ModelSize, reps: int) -> dict[str, Any]:
    """Seconds per sample of ours' save and load and of torch.save from rank 0."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from bench.runner import rotated
    from fsdp_interactive.checkpoint import load, save

    rank = dist.get_rank()
    model = WRAPPERS["ours"](build_model(size), torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optim, batch_for(size, rank))
    counter = iter(range(1_000_000))
    saved: list[Path] = []

    def fresh() -> Path:
        return Path(root) / f"sample-{next(counter)}"

    def ours_save() -> None:
        path = fresh()
        save(path, model, optim)
        saved.append(path)

    def ours_load() -> None:
        load(saved[-1], model, optim)

    def dcp_save() -> None:
        dcp.save(sharded_state(model, optim), checkpoint_id=str(fresh()))

    def torch_save() -> None:
        # fresh() on every rank: the ranks' counters must stay equal.
        torch_save_from_rank0(fresh(), model, optim)

    actions = {SAVE: ours_save, LOAD: ours_load, TORCH_SAVE: torch_save, DCP: dcp_save}

    def sample(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        actions[name]()
        dist.barrier()
        return time.perf_counter() - start

    ours_save()  # warm-up, and a checkpoint for the first load
    seconds: dict[str, list[float]] = {name: [] for name in actions}
    for index in range(reps):
        for name in rotated(list(actions), index):
            seconds[name].append(sample(name))
        dist.barrier()
        if rank == 0:
            # Keep the newest checkpoint (the next load reads it), drop the rest.
            for path in Path(root).iterdir():
                if path != saved[-1]:
                    shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    return {"seconds": seconds, "bytes": _state_bytes(model, optim)}


def sizes(settings: Settings) -> list[ModelSize]:
    if settings.quick:
        return [ModelSize(dim=64, blocks=2, batch=8)]
    return [ModelSize(dim=d, blocks=8, batch=8) for d in (256, 512, 1024)]


def run(settings: Settings) -> FigureResult:
    """State scaling: memory, meta-init peak and checkpoint throughput vs model size."""
    result = FigureResult("state_scaling", "State scaling (memory and checkpoints vs size)")
    unavailable = missing("fsdp_interactive.fsdp", "FullyShardedDataParallel") or missing(
        "fsdp_interactive.checkpoint", "save", "load"
    )
    if unavailable:
        raise RuntimeError(f"the state-scaling figure needs ours: {unavailable}")
    models = sizes(settings)
    world = 2 if settings.quick else 4
    ckpt_worlds = (2,) if settings.quick else (2, 4, 8)
    # Nine rounds: the fewest whose 95% interval of the median leaves out the extremes,
    # and one fsynced write varies up to 2x from sample to sample on a shared disk.
    reps = 2 if settings.quick else 9
    result.notes.append(
        f"Sizes: {', '.join(f'{m.blocks} blocks of width {m.dim}' for m in models)}; memory on "
        f"{world} ranks, one fresh group per size; checkpoints: {reps} alternated samples per "
        f"contender after one warm-up save, at every size on {world} ranks and at the middle "
        f"size on {', '.join(map(str, ckpt_worlds))} ranks; files go to "
        f"{tempfile.gettempdir()}."
    )
    params = [float(m.parameters) for m in models]
    held, ideal, meta, full = [], [], [], []
    for size in models:
        per_rank = run_on_ranks(world, _rank_memory, ("ours", size), (["ours"], size))
        total = sum(per_rank[0]["held"]["full"].values())
        held.append(Stat([float(max(sum(r["held"]["ours"].values()) for r in per_rank))], "B"))
        ideal.append(Stat([total / world], "B"))
        meta.append(Stat([float(max(r["meta"]["peak_increase"] for r in per_rank))], "B"))
        full.append(Stat([float(size.parameters * 4)], "B"))
    for name, values, reference, target in (
        (HELD, held, IDEAL, Target("<=", 1.01)),
        (IDEAL, ideal, None, None),
        (META, meta, FULL, Target("<", 1.0)),
        (FULL, full, None, None),
    ):
        panel = "Per-rank memory" if name in (HELD, IDEAL) else "Meta-device init peak"
        result.curves.append(
            Curve(
                figure=result.key,
                panel=f"{panel}, {world} ranks",
                name=name,
                x_label="parameters",
                xs=params,
                values=values,
                per=1e6,
                reference=reference,
                target=target,
                ours=reference is not None,
            )
        )
        for x, stat in zip(params, values, strict=True):
            result.measurements[f"{x / 1e6:.1f} M parameters, {world} ranks: {name}"] = stat
    for x, h, i, m, f in zip(params, held, ideal, meta, full, strict=True):
        case = f"{x / 1e6:.1f} M parameters, {world} ranks"
        result.comparisons += [
            Comparison(result.key, case, HELD, IDEAL, h, i, Target("<=", 1.01)),
            Comparison(result.key, case, META, FULL, m, f, Target("<", 1.0)),
        ]
    jobs = [(size, world) for size in models]
    middle = models[len(models) // 2]
    jobs += [(middle, w) for w in ckpt_worlds if w != world]
    # Contender -> {x: throughput}, in the order the ranks report their contenders.
    by_size: defaultdict[str, dict[float, Stat]] = defaultdict(dict)
    by_world: defaultdict[str, dict[float, Stat]] = defaultdict(dict)
    for size, ranks in jobs:
        root = tempfile.mkdtemp(prefix="fsdpi-bench-scaling-")
        try:
            out = run_on_ranks(ranks, _rank_checkpoint_io, root, size, reps, timeout=900)[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        nbytes = out["bytes"]
        case = f"{ranks} ranks, {nbytes / 2**20:.0f} MiB state"
        rates = {
            name: Stat([nbytes / s for s in samples], "B/s")
            for name, samples in out["seconds"].items()
        }
        for name, stat in rates.items():
            result.measurements[f"{case}: {name}"] = stat
            if ranks == world:
                by_size[name][float(nbytes)] = stat
            if size == middle:
                by_world[name][float(ranks)] = stat
        for subject, note in ((SAVE, ""), (DCP, "baseline, same yardstick")):
            result.comparisons.append(
                Comparison(
                    result.key,
                    f"{case}, save throughput",
                    subject,
                    TORCH_SAVE,
                    rates[subject],
                    rates[TORCH_SAVE],
                    Target(">=", 2.0),
                    note=note,
                    paired=True,
                )
            )
    for axis, series, label, unit in (
        ("state size", by_size, f"Checkpoint throughput, {world} ranks", "B"),
        ("ranks", by_world, "Checkpoint throughput, middle size", ""),
    ):
        for name, points in series.items():
            xs = sorted(points)
            result.curves.append(
                Curve(
                    figure=result.key,
                    panel=label,
                    name=name,
                    x_label=axis,
                    xs=xs,
                    values=[points[x] for x in xs],
                    x_unit=unit,
                    per=2**20 if unit == "B" else 1.0,
                    reference=TORCH_SAVE if name == SAVE else None,
                    target=Target(">=", 2.0) if name == SAVE else None,
                    ours=name in (SAVE, LOAD),
                    paired=name == SAVE,
                )
            )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
