"""Figure 4, memory: what one rank holds under FULL_SHARD, and meta-device init's peak.

Part 1, per-rank bytes.  After one AdamW step, each rank sums the bytes of the storages
behind its parameters, gradients and optimizer state (local shards of DTensors, FSDP1's
flat parameters; every storage counted once, padding included because it is real
memory).  The largest rank is compared with the ideal ``full / N``, where ``full`` is the
same sum for the unsharded model with a plain AdamW.  Target: ``<= full/N + 1%``.
torch FSDP1 and hand-applied fully_shard are shown with the same yardstick.

Part 2, meta-device init.  A model as large as ``N`` ranks' shares is built on the meta
device and materialized by each contender on ``N`` ranks, in fresh processes per
contender.  The increase of each rank's peak RSS over its RSS just before (Linux
``VmHWM``, reset through ``/proc/self/clear_refs``; the lifetime ``ru_maxrss`` where that
is unsupported) is compared with the full model's parameter bytes; below 1x, no rank's
peak reached the full model's size.  The RSS still held once glibc's ``malloc_trim`` has
returned freed heap memory is recorded too: the gap between the two is memory the
allocator kept, not memory the model holds.  The reference "materialize, then shard"
builds the model on the CPU first, as code without meta init does.
"""

from __future__ import annotations

import resource
from typing import Any

from bench.availability import missing
from bench.models import WRAPPERS, ModelSize, batch_for, build_model, train_step
from bench.ranks import run_on_ranks
from bench.runner import Comparison, FigureResult, Settings, Stat, Target, figure_main

LABELS = {
    "ours": "FullyShardedDataParallel (ours)",
    "fsdp1": "torch FSDP1 (device_id=cpu)",
    "fully_shard": "fully_shard by hand",
    "materialize": "materialize, then fully_shard",
}


def _ranks(world: int) -> str:
    return "1 rank" if world == 1 else f"{world} ranks"


def _storage_bytes(tensors: list[Any]) -> int:
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _held_bytes(model: Any, optim: Any) -> dict[str, int]:
    import torch

    params = list(model.parameters())
    states = [
        value
        for state in optim.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "parameters": _storage_bytes(params),
        "gradients": _storage_bytes([p.grad for p in params]),
        "optimizer": _storage_bytes(states),
    }


def _rank_bytes(contenders: list[str], size: ModelSize) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    batch = batch_for(size, dist.get_rank())
    held = {}
    for name in ["full", *contenders]:
        model = build_model(size)
        if name != "full":
            model = WRAPPERS[name](model, torch.float32)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train_step(model, optim, batch)
        held[name] = _held_bytes(model, optim)
        del model, optim
    return held


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs``); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _meta_init(contender: str, size: ModelSize) -> Any:
    import torch

    if contender == "materialize":
        return WRAPPERS["fully_shard"](build_model(size), torch.float32)
    with torch.device("meta"):
        model = build_model(size)
    if contender != "fully_shard":
        return WRAPPERS[contender](model, torch.float32)
    model = WRAPPERS["fully_shard"](model, torch.float32)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model


def _rank_meta_init(contender: str, size: ModelSize) -> dict[str, int]:
    import gc

    # Warm the code paths on a tiny model first: lazily imported modules and one-time
    # caches are not what this figure measures.
    _meta_init(contender, ModelSize(dim=8, blocks=1, batch=1))
    gc.collect()
    _reset_peak_rss()
    before = _rss_bytes()
    model = _meta_init(contender, size)
    peak = _peak_rss_bytes()
    meta_left = [n for n, p in model.named_parameters() if p.is_meta]
    if meta_left:
        raise RuntimeError(f"{contender}: parameters still on meta after init: {meta_left}")
    gc.collect()
    trimmed = _malloc_trim()
    return {
        "peak_increase": max(0, peak - before),
        "live_increase": max(0, _rss_bytes() - before) if trimmed else None,
    }


def _malloc_trim() -> bool:
    """Hand freed heap memory back to the OS (glibc only); False where unavailable."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):
        return False
    if trim is None:
        return False
    trim(0)
    return True


def _rank_memory(
    meta: tuple[str, ModelSize] | None, held: tuple[list[str], ModelSize] | None
) -> dict[str, Any]:
    """Meta-init peak first (while the process is fresh), then per-rank bytes."""
    out: dict[str, Any] = {}
    if meta is not None:
        out["meta"] = _rank_meta_init(*meta)
    if held is not None:
        out["held"] = _rank_bytes(*held)
    return out


def sizes(settings: Settings) -> tuple[ModelSize, ModelSize, int]:
    """(model for part 1, model for part 2, world size of part 2)."""
    if settings.quick:
        return ModelSize(dim=128, blocks=2, batch=8), ModelSize(dim=512, blocks=4, batch=8), 2
    return ModelSize(dim=256, blocks=4, batch=8), ModelSize(dim=1024, blocks=8, batch=8), 4


def run(settings: Settings) -> FigureResult:
    """Memory: per-rank bytes under FULL_SHARD vs full/N, and meta-device init peak RSS."""
    result = FigureResult("memory", "Memory per rank (FULL_SHARD, AdamW)")
    unavailable = missing("fsdp_interactive.fsdp", "FullyShardedDataParallel")
    contenders = ["fsdp1", "fully_shard"] + ([] if unavailable else ["ours"])
    bytes_size, meta_size, meta_world = sizes(settings)
    worlds = (2,) if settings.quick else (1, 2, 4)
    meta_reps = 1 if settings.quick else 2
    meta_contenders = [
        c for c in ["ours", "fsdp1", "fully_shard", "materialize"] if c != "ours" or not unavailable
    ]
    # One process group per (world size, meta contender, repetition); the per-rank bytes
    # ride along with the first meta-init run at the same world size.
    jobs: list[tuple[int, str | None, bool]] = [
        (meta_world, name, False) for _ in range(meta_reps) for name in meta_contenders
    ]
    jobs[0] = (meta_world, jobs[0][1], meta_world in worlds)
    jobs += [(world, None, True) for world in worlds if world != meta_world]
    held_by_world: dict[int, list[dict[str, Any]]] = {}
    meta_samples: dict[str, list[float]] = {name: [] for name in meta_contenders}
    live_samples: dict[str, list[float]] = {name: [] for name in meta_contenders}
    for world, meta_name, with_held in jobs:
        per_rank = run_on_ranks(
            world,
            _rank_memory,
            (meta_name, meta_size) if meta_name else None,
            (contenders, bytes_size) if with_held else None,
        )
        if meta_name:
            meta_samples[meta_name].append(float(max(r["meta"]["peak_increase"] for r in per_rank)))
            live = [r["meta"]["live_increase"] for r in per_rank]
            if None not in live:
                live_samples[meta_name].append(float(max(1, *live)))
        if with_held:
            held_by_world[world] = [r["held"] for r in per_rank]

    result.notes.append(
        f"Per-rank bytes: {bytes_size.blocks} blocks of width {bytes_size.dim} "
        f"({bytes_size.parameters / 1e6:.2f} M parameters), after one AdamW step."
    )
    for world in worlds:
        per_rank = held_by_world[world]
        full = sum(per_rank[0]["full"].values())
        ideal = full / world
        result.measurements[f"{_ranks(world)}: full/N"] = Stat([ideal], "B")
        for name in contenders:
            totals = [sum(rank_held[name].values()) for rank_held in per_rank]
            stat = Stat([float(max(totals))], "B")
            result.measurements[f"{_ranks(world)}: {LABELS[name]} (largest rank)"] = stat
            parts = per_rank[max(range(world), key=lambda r, t=totals: t[r])][name]
            if name == "ours" or world == max(worlds):
                result.notes.append(
                    f"{_ranks(world)}, {LABELS[name]}: "
                    + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in parts.items())
                    + f" (full/N = {ideal / 2**20:.2f} MiB)."
                )
        for name in ["ours", *[c for c in contenders if c != "ours"]]:
            key = f"{_ranks(world)}: {LABELS[name]} (largest rank)"
            result.comparisons.append(
                Comparison(
                    figure=result.key,
                    case=f"{_ranks(world)}, params+grads+optimizer",
                    subject_name=LABELS[name],
                    reference_name="full model / N",
                    subject=result.measurements.get(key),
                    reference=result.measurements[f"{_ranks(world)}: full/N"],
                    target=Target("<=", 1.01),
                    unavailable=unavailable if name == "ours" else None,
                    note="" if name == "ours" else "baseline, same yardstick",
                )
            )

    full_param_bytes = float(meta_size.parameters * 4)
    result.measurements["meta init: full model parameters"] = Stat([full_param_bytes], "B")
    result.measurements["meta init: one rank's share"] = Stat([full_param_bytes / meta_world], "B")
    result.notes.append(
        f"Meta-device init: {meta_size.blocks} blocks of width {meta_size.dim} "
        f"({full_param_bytes / 2**20:.0f} MiB of fp32 parameters) on {meta_world} ranks, "
        f"i.e. {meta_world}x one rank's share ({full_param_bytes / meta_world / 2**20:.0f} MiB); "
        f"{meta_reps} fresh process group(s) per contender, largest rank's increase."
    )
    for name in ["ours", "fsdp1", "fully_shard", "materialize"]:
        stat = None
        if meta_samples.get(name):
            stat = Stat(meta_samples[name], "B")
            result.measurements[f"meta init peak RSS increase: {LABELS[name]}"] = stat
            if live_samples[name]:
                result.measurements[f"meta init RSS kept after malloc_trim: {LABELS[name]}"] = Stat(
                    live_samples[name], "B"
                )
        result.comparisons.append(
            Comparison(
                figure=result.key,
                case=f"meta-device init, {meta_world} ranks, peak RSS increase",
                subject_name=LABELS[name] if name != "ours" else LABELS["ours"] + " (meta)",
                reference_name="full model parameters",
                subject=stat,
                reference=result.measurements["meta init: full model parameters"],
                target=Target("<", 1.0),
                unavailable=unavailable if name == "ours" else None,
                note="" if name == "ours" else "baseline, same yardstick",
            )
        )
    return result


if __name__ == "__main__":
    raise SystemExit(figure_main(run))
