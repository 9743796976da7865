"""``grad_norms(model)``: per-parameter, per-module and global gradient norms (rank side)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fsdp_interactive._torch_compat import foreach_norm
from fsdp_interactive.fsdp._comm_device import comm_device
from fsdp_interactive.inspect._inputs import ProbeInputError
from fsdp_interactive.inspect._records import GradNorms, combine_norms
from fsdp_interactive.wrapping import ModelParams, model_params


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)) or norm_type == -math.inf:
        raise ProbeInputError(f"norm_type must be > 0 or inf, got {norm_type}")
    return norm_type


GradStats = tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def reduce_grad_stats(params: ModelParams, norm_type: float) -> GradStats:
    """Per parameter: (names, norm, nan count, inf count, has-grad flag) over the full grads.

    ``params``: the model's original parameters (:func:`fsdp_interactive.wrapping.model_params`),
    whatever wraps it. One all-gather of a few numbers per parameter over the default group;
    every rank of it must call.  Each rank contributes its piece of each gradient's
    ``sum |g|^p`` (``max |g|`` for ``norm_type=inf``) divided by how many ranks hold the
    same piece, so replicated pieces count once; every rank then combines the gathered rows
    in rank order, so all ranks get bit-identical results.  Parameters without a gradient on
    every rank get norm 0 and has-grad 0.  Returns float64 CPU tensors.

    Precision: each shard's norm is taken in float32 (as ``clip_grad_norm_`` takes it) and
    combined in float64; a shard whose float32 norm is not finite is measured again in
    float64, so an overflow of float32 is not reported as an infinite gradient, and NaN/Inf
    elements are counted only in such shards.  An all-gather rather than an all-reduce:
    for a few hundred bytes it needs half the message rounds (gloo's all-reduce is a
    reduce-scatter plus an all-gather).
    """
    names, row = local_grad_row(params, norm_type)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return combine_grad_rows(names, row.unsqueeze(0), norm_type)
    row = row.to(comm_device(None))
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    return combine_grad_rows(names, torch.stack(rows).cpu(), norm_type)


def local_grad_row(params: ModelParams, norm_type: float) -> tuple[list[str], torch.Tensor]:
    """This rank's contribution to :func:`reduce_grad_stats`: parameter names and one row.

    The row (float64, CPU) holds per parameter the shard's power sum (or max for inf) and
    then (NaN count, Inf count, has-grad weight), each divided by the shard's copies.
    """
    names: list[str] = []
    counts: list[list[float]] = []  # per parameter: NaN count, Inf count, has-grad weight
    shards: list[tuple[int, torch.Tensor, int]] = []  # (index, local shard, copies)
    for fqn, param in params.items():
        names.append(fqn)
        counts.append([0.0, 0.0, 0.0])
        local = param.grad_piece()
        if local is None:
            continue
        copies = param.copies
        counts[-1][2] = 1.0 / copies
        if local.numel():
            shards.append((len(names) - 1, local, copies))
    power_vec = torch.zeros(len(names), dtype=torch.float64)
    if shards:
        norms = _shard_norms([t for _, t, _ in shards], norm_type)
        indices = torch.tensor([index for index, _, _ in shards])
        copies = torch.tensor([c for _, _, c in shards], dtype=torch.float64)
        power_vec[indices] = norms if math.isinf(norm_type) else norms.pow(norm_type) / copies
        for (index, local, c), finite in zip(shards, norms.isfinite().tolist(), strict=True):
            if not finite:
                counts[index][0] = local.isnan().sum().item() / c
                counts[index][1] = local.isinf().sum().item() / c
    return names, torch.cat([power_vec, torch.tensor(counts, dtype=torch.float64).reshape(-1)])


def combine_grad_rows(names: list[str], rows: torch.Tensor, norm_type: float) -> GradStats:
    """:func:`reduce_grad_stats`'s result from every rank's row (``rows``: one per rank)."""
    n = len(names)
    if math.isinf(norm_type):
        norms = rows[:, :n].amax(0)
    else:
        norms = rows[:, :n].sum(0).clamp_min(0).pow(1.0 / norm_type)
    counts = rows[:, n:].sum(0).reshape(n, 3).round()
    return names, norms, counts[:, 0], counts[:, 1], counts[:, 2] > 0


def _shard_norms(shards: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """float64 norms of ``shards``: float32 passes, float64 again where not finite."""
    low = [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in shards]
    cpu64 = {"dtype": torch.float64, "device": "cpu"}
    norms = torch.stack(foreach_norm(low, norm_type)).to(**cpu64)
    if not bool(norms.isfinite().all()):
        redo = [i for i, ok in enumerate(norms.isfinite().tolist()) if not ok]
        exact = foreach_norm([shards[i] for i in redo], norm_type, dtype=torch.float64)
        norms[torch.tensor(redo)] = torch.stack(exact).to(**cpu64)
    return norms


def module_norms(names: list[str], norms: list[float], norm_type: float) -> dict[str, float]:
    """Norm over all parameters below each module prefix ("" is the whole model)."""
    members: dict[str, list[float]] = {}
    for name, value in zip(names, norms, strict=True):
        parts = name.split(".")
        for depth in range(len(parts)):
            members.setdefault(".".join(parts[:depth]), []).append(value)
    return {module: combine_norms(values, norm_type) for module, values in members.items()}


def grad_norms(model: nn.Module, norm_type: float = 2.0) -> GradNorms:
    """Gradient norms of ``model`` over the full (unsharded) gradients, on every rank.

    A collective: every rank of the default process group must call it (one small
    all-reduce of a few numbers per parameter).  The global norm is defined as
    ``torch.nn.utils.clip_grad_norm_`` defines it: the ``norm_type``-norm of the per-parameter
    norms, over parameters that have a gradient; it agrees with clip_grad_norm_ to float32
    rounding (this probe accumulates in float64).  Gradients are only read, never clipped.
    ``units`` holds the norm over each FSDP unit's parameters (see ``GradNorms``).
    Parameters are named by their clean FQNs and read through
    :func:`fsdp_interactive.wrapping.model_params`, so the norms are the framework's own
    (``clip_grad_norm_`` of torch FSDP1, DDP, a compiled model) whatever wraps the model;
    a wrapping it does not understand raises ``UnsupportedWrapping``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"grad_norms(model): model must be an nn.Module, got {type(model).__name__}"
        )
    norm_type = _check_norm_type(norm_type)
    params = model_params(model)
    names, norms, nans, infs, has_grad = reduce_grad_stats(params, norm_type)
    kept = [i for i in range(len(names)) if bool(has_grad[i])]
    kept_names = [names[i] for i in kept]
    kept_norms = [float(norms[i]) for i in kept]
    modules = module_norms(kept_names, kept_norms, norm_type)
    unit_of = {name: params[name].unit for name in kept_names if params[name].unit is not None}
    members: dict[str, list[float]] = {}
    for name, value in zip(kept_names, kept_norms, strict=True):
        if name in unit_of:
            members.setdefault(unit_of[name], []).append(value)
    units = {unit: combine_norms(values, norm_type) for unit, values in members.items()}
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
        units=units,
        unit_of=unit_of,
    )
