"""Figure 6, checkpoint: sharded DCP saves vs ``torch.save`` from rank 0, and async saves.

The state is a sharded model plus its AdamW state after one step.  Contenders, each
timed barrier to barrier on rank 0 and alternated sample by sample:

* ``torch.save`` of a full state dict from rank 0 (reference): full model and optimizer
  state dicts gathered to rank 0 (``get_model_state_dict`` / ``get_optimizer_state_dict``
  with ``full_state_dict=True, cpu_offload=True``), then one ``torch.save`` there, fsynced:
  the DCP contenders fsync every file they write (``FileSystemWriter``'s default), so the
  reference gives the same guarantee (the checkpoint survives a crash of the machine);
* the same ``torch.save`` without the fsync, as most scripts write it (a baseline: its
  file may still be in the page cache when the call returns);
* raw DCP: ``torch.distributed.checkpoint.save`` of the sharded state dicts (baseline);
* ours: ``fsdp_interactive.checkpoint.save`` (DCP plus a manifest with checksums and an
  atomic publish).

Throughput is the full state's bytes divided by the save's wall time.  For async saves
(raw ``dcp.async_save`` and ours ``async_save``) the blocking time, until the call returns
and training could go on, is compared with the same layer's sync save; the background
write is then awaited, untimed.  Every sample writes a fresh folder under a temporary
directory, removed afterwards.  Targets: sync DCP throughput >= 2x torch.save; async
blocking <= 20% of sync.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.availability import missing
from bench.models import WRAPPERS, ModelSize, batch_for, build_model, train_step
from bench.ranks import run_on_ranks
from bench.runner import Comparison, FigureResult, Settings, Stat, Target, figure_main

TORCH_SAVE = "torch.save of a full state dict from rank 0, fsynced"
TORCH_SAVE_NO_FSYNC = "torch.save of a full state dict from rank 0, not fsynced"
DCP = "raw DCP save"
DCP_ASYNC = "raw DCP async_save (blocking part)"
OURS = "fsdp_interactive.checkpoint.save (ours)"
OURS_ASYNC = "fsdp_interactive.checkpoint.async_save (ours, blocking part)"


def _state_bytes(model: Any, optim: Any) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    total = 0
    for param in model.parameters():
        total += param.numel() * param.element_size()
    for state in optim.state.values():
        for value in state.values():
            if isinstance(value, DTensor | torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def sharded_state(model: Any, optim: Any) -> dict[str, Any]:
    """The model's and its optimizer's sharded state dicts, as raw DCP saves them."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def torch_save_from_rank0(path: Path, model: Any, optim: Any, *, durable: bool = True) -> None:
    """Gather full state dicts to rank 0's CPU and ``torch.save`` them to ``path/state.pt``.

    Every rank must call it (the gather is a collective); only rank 0 creates ``path`` and
    writes.  ``durable``: flush and fsync the file before returning, as DCP's writer does.
    """
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {
        "model": get_model_state_dict(model, options=options),
        "optim": get_optimizer_state_dict(model, optim, options=options),
    }
    if dist.get_rank() == 0:
        path.mkdir(parents=True)
        with open(path / "state.pt", "wb") as f:
            torch.save(state, f)
            if durable:
                f.flush()
                os.fsync(f.fileno())


def _rank_checkpoint(
    root: str, size: ModelSize, contenders: list[str], ours_wrapper: str, reps: int, warmup: int
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    batch = batch_for(size, rank)

    def trained(wrapper: str) -> tuple[Any, Any]:
        model = WRAPPERS[wrapper](build_model(size), torch.float32)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train_step(model, optim, batch)
        return model, optim

    base_model, base_optim = trained("fully_shard")
    ours_model, ours_optim = (
        trained(ours_wrapper) if OURS in contenders else (base_model, base_optim)
    )
    counter = iter(range(1_000_000))

    def fresh_path() -> Path:
        return Path(root) / f"sample-{next(counter)}"

    def torch_save(path: Path, durable: bool = True) -> None:
        torch_save_from_rank0(path, base_model, base_optim, durable=durable)

    def dcp_save(path: Path) -> None:
        dcp.save(sharded_state(base_model, base_optim), checkpoint_id=str(path))

    def ours_save(path: Path) -> None:
        from fsdp_interactive.checkpoint import save

        save(path, ours_model, ours_optim)

    pending: list[Any] = []
    # async_save's background collectives get their own gloo group, as torch documents:
    # sharing the default group with the main thread's collectives would interleave them.
    async_group = dist.new_group(backend="gloo")

    def dcp_async(path: Path) -> None:
        pending.append(
            dcp.async_save(
                sharded_state(base_model, base_optim),
                checkpoint_id=str(path),
                process_group=async_group,
            )
        )

    def ours_async(path: Path) -> None:
        from fsdp_interactive.checkpoint import async_save

        pending.append(async_save(path, ours_model, ours_optim))

    actions = {
        TORCH_SAVE: torch_save,
        TORCH_SAVE_NO_FSYNC: lambda path: torch_save(path, durable=False),
        DCP: dcp_save,
        OURS: ours_save,
        DCP_ASYNC: dcp_async,
        OURS_ASYNC: ours_async,
    }

    def sample(name: str) -> float:
        path = fresh_path()
        dist.barrier()
        start = time.perf_counter()
        actions[name](path)
        dist.barrier()
        elapsed = time.perf_counter() - start
        while pending:
            handle = pending.pop()
            if hasattr(handle, "result"):
                handle.result()
            else:
                handle.wait()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        return elapsed

    for _ in range(warmup):
        for name in contenders:
            sample(name)
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name in contenders:
            seconds[name].append(sample(name))
    nbytes = _state_bytes(base_model, base_optim)
    dist.destroy_process_group(async_group)
    return {"seconds": seconds, "bytes": nbytes}


def size_for(settings: Settings) -> tuple[ModelSize, int]:
    if settings.quick:
        return ModelSize(dim=256, blocks=2, batch=8), 4
    return ModelSize(dim=1024, blocks=4, batch=8), 4


def run(settings: Settings) -> FigureResult:
    """Checkpoint: DCP save throughput vs torch.save from rank 0; async blocking time."""
    result = FigureResult("checkpoint", "Checkpoint save (model + AdamW state)")
    unavailable = missing("fsdp_interactive.checkpoint", "save", "async_save")
    ours_wrapper = (
        "fully_shard" if missing("fsdp_interactive.fsdp", "FullyShardedDataParallel") else "ours"
    )
    contenders = [TORCH_SAVE, TORCH_SAVE_NO_FSYNC, DCP, DCP_ASYNC]
    contenders += [] if unavailable else [OURS, OURS_ASYNC]
    size, world = size_for(settings)
    reps = settings.reps if settings.quick else max(3, settings.reps // 2)
    root = tempfile.mkdtemp(prefix="fsdpi-bench-ckpt-")
    try:
        out = run_on_ranks(
            world,
            _rank_checkpoint,
            root,
            size,
            contenders,
            ours_wrapper,
            reps,
            settings.warmup,
            timeout=300 if settings.quick else 900,
        )[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = out["bytes"]
    case = f"{world} ranks, {nbytes / 2**20:.0f} MiB state"
    result.notes.append(
        f"State: {size.blocks} blocks of width {size.dim} ({size.parameters / 1e6:.1f} M "
        f"parameters) plus AdamW moments, {nbytes / 2**20:.1f} MiB in all; {reps} alternated "
        f"samples per contender after {settings.warmup} warm-up round(s); files go to "
        f"{tempfile.gettempdir()}."
    )
    seconds = {name: Stat(values, "s") for name, values in out["seconds"].items()}
    for name, stat in seconds.items():
        result.measurements[f"{case}: {name}"] = stat

    def throughput(name: str) -> Stat | None:
        if name not in seconds:
            return None
        return Stat([nbytes / s for s in seconds[name].samples], "B/s")

    for name, reference, target, note, why in (
        (OURS, TORCH_SAVE, Target(">=", 2.0), "", unavailable),
        (DCP, TORCH_SAVE, Target(">=", 2.0), "baseline, same yardstick", None),
        (OURS, TORCH_SAVE_NO_FSYNC, None, "reference not fsynced: no target", unavailable),
    ):
        result.comparisons.append(
            Comparison(
                figure=result.key,
                case=f"{case}, sync save throughput",
                subject_name=name,
                reference_name=reference,
                subject=throughput(name),
                reference=throughput(reference),
                target=target,
                unavailable=why,
                note=note,
            )
        )
    for name, sync, note, why in (
        (OURS_ASYNC, OURS, "", unavailable),
        (DCP_ASYNC, DCP, "baseline, same yardstick", None),
    ):
        result.comparisons.append(
            Comparison(
                figure=result.key,
                case=f"{case}, async blocking time vs sync",
                subject_name=name,
                reference_name=sync,
                subject=seconds.get(name),
                reference=seconds.get(sync),
                target=Target("<=", 0.2),
                unavailable=why,
                note=note,
            )
        )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
