"""``grad_norms(model)``: per-parameter, per-module and global gradient norms (rank side)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fsdp_interactive.inspect._dtensor import (
    comm_device,
    local_tensor,
    named_parameters,
    replication,
)
from fsdp_interactive.inspect._records import GradNorms


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)) or norm_type == -math.inf:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    return norm_type


def reduce_grad_stats(
    model: nn.Module, norm_type: float
) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per parameter: (names, norm, nan count, inf count, has-grad flag) over the full grads.

    One all-reduce (two for ``norm_type=inf``) over the default group; every rank of it must
    call.  Each rank contributes its local shard's ``sum |g|^p`` divided by how many ranks
    hold the same piece, so replicated pieces count once.  Parameters without a gradient on
    every rank get norm 0 and has-grad 0.  Accumulates in float64 on the group's
    communication device (CUDA for an NCCL group, else CPU); returns CPU tensors.
    """
    device = comm_device()
    f64 = {"dtype": torch.float64, "device": device}
    names: list[str] = []
    counts: list[list[float]] = []  # per parameter: NaN count, Inf count, has-grad weight
    shards: list[tuple[int, torch.Tensor, int]] = []  # (index, local shard, copies)
    for fqn, param in named_parameters(model):
        names.append(fqn)
        counts.append([0.0, 0.0, 0.0])
        if param.grad is None:
            continue
        copies = replication(param.grad)
        counts[-1][2] = 1.0 / copies
        local = local_tensor(param.grad).detach()
        if local.numel():
            shards.append((len(names) - 1, local, copies))
    n = len(names)
    power_vec = torch.zeros(n, **f64)
    if shards:
        # One fused pass over all shards, accumulated in float64; NaN/Inf are counted
        # only for the shards whose norm is not finite.
        indices = torch.tensor([index for index, _, _ in shards], device=device)
        copies = torch.tensor([c for _, _, c in shards], **f64)
        norms = torch.stack(
            torch._foreach_norm([t for _, t, _ in shards], norm_type, dtype=torch.float64)
        ).to(device)
        power_vec[indices] = norms if math.isinf(norm_type) else norms.pow(norm_type) / copies
        for (index, local, c), finite in zip(shards, norms.isfinite().tolist(), strict=True):
            if not finite:
                counts[index][0] = local.isnan().sum().item() / c
                counts[index][1] = local.isinf().sum().item() / c
    count_vec = torch.tensor(counts, **f64).reshape(-1)
    distributed = dist.is_available() and dist.is_initialized()
    if math.isinf(norm_type):
        if distributed:
            dist.all_reduce(power_vec, op=dist.ReduceOp.MAX)
            dist.all_reduce(count_vec)
        norms = power_vec
    else:
        if distributed:
            both = torch.cat([power_vec, count_vec])
            dist.all_reduce(both)
            power_vec, count_vec = both[:n], both[n:]
        norms = power_vec.clamp_min(0).pow(1.0 / norm_type)
    count_vec = count_vec.reshape(n, 3).round().cpu()
    return names, norms.cpu(), count_vec[:, 0], count_vec[:, 1], count_vec[:, 2] > 0


def _combine(norms: list[float], norm_type: float) -> float:
    if not norms:
        return 0.0
    if math.isinf(norm_type):
        return max(norms)
    try:
        return math.fsum(v**norm_type for v in norms) ** (1.0 / norm_type)
    except OverflowError:
        return math.inf


def module_norms(names: list[str], norms: list[float], norm_type: float) -> dict[str, float]:
    """Norm over all parameters below each module prefix ("" is the whole model)."""
    members: dict[str, list[float]] = {}
    for name, value in zip(names, norms, strict=True):
        parts = name.split(".")
        for depth in range(len(parts)):
            members.setdefault(".".join(parts[:depth]), []).append(value)
    return {module: _combine(values, norm_type) for module, values in members.items()}


def grad_norms(model: nn.Module, norm_type: float = 2.0) -> GradNorms:
    """Gradient norms of ``model`` over the full (unsharded) gradients, on every rank.

    A collective: every rank of the default process group must call it (one small
    all-reduce of a few numbers per parameter).  The global norm is defined as
    ``torch.nn.utils.clip_grad_norm_`` defines it: the ``norm_type``-norm of the per-parameter
    norms, over parameters that have a gradient; it agrees with clip_grad_norm_ to float32
    rounding (this probe accumulates in float64).  Gradients are only read, never clipped.
    Assumes every parameter's mesh spans the default group (true for fully_shard models).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"grad_norms(model): model must be an nn.Module, got {type(model).__name__}"
        )
    norm_type = _check_norm_type(norm_type)
    names, norms, nans, infs, has_grad = reduce_grad_stats(model, norm_type)
    kept = [i for i in range(len(names)) if bool(has_grad[i])]
    kept_names = [names[i] for i in kept]
    kept_norms = [float(norms[i]) for i in kept]
    modules = module_norms(kept_names, kept_norms, norm_type)
    total = modules.get("", 0.0) if kept_norms else 0.0
    if any(int(nans[i]) or int(infs[i]) for i in kept):
        total = float("nan") if any(int(nans[i]) for i in kept) else float("inf")
    return GradNorms(
        norm_type=norm_type,
        total=total,
        params=dict(zip(kept_names, kept_norms, strict=True)),
        modules=modules,
        nan_counts={names[i]: int(nans[i]) for i in kept if int(nans[i])},
        inf_counts={names[i]: int(infs[i]) for i in kept if int(infs[i])},
    )
