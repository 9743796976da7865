"""``clip_grad_norm_``: one global gradient norm over all ranks and all units.

``torch.nn.utils.clip_grad_norm_`` cannot mix DTensor gradients from different meshes (e.g. a
NO_SHARD unit beside FULL_SHARD units), so the norm is assembled here, in float32:

* gradients are grouped by (mesh, mesh dims they are sharded over); each group's local
  ``sum |g|^p`` (``max |g|`` for ``inf``) is all-reduced (SUM / MAX) over exactly the mesh
  dimensions that shard it. Replicated dimensions hold equal copies and are counted once;
* plain-tensor gradients (ignored modules, parameters outside every unit) are added locally,
  as FSDP1 does (they are not communicated, so ranks whose such gradients differ get
  different totals - average them yourself first if they should agree);
* ``total = (sum over groups)^(1/p)``; every gradient is multiplied by
  ``min(1, max_norm / (total + 1e-6))``.

Returns the total norm as a plain tensor in the promoted gradient dtype (float32 with a
warning when this rank has no gradients), on the unit's compute device. Groups are formed
from the parameters (not the gradients) so all ranks issue the same collectives.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fsdp_interactive._torch_compat import local_tensor
from fsdp_interactive.fsdp._comm_device import comm_device
from fsdp_interactive.fsdp._unit_state import require_state


def _check_args(max_norm: object, norm_type: object) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float | torch.Tensor):
        raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}")
    if float(max_norm) < 0:
        raise ValueError(f"max_norm must be >= 0, got {float(max_norm)}")
    try:
        p = float(norm_type)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(
            f"norm_type must be a positive number or 'inf', got {norm_type!r}"
        ) from None
    if not p > 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {p}")
    return p


@torch.no_grad()
def clip_grad_norm(root: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of the parameters under the unit ``root``; the total norm."""
    p = _check_args(max_norm, norm_type)
    device = require_state(root).config.device
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for param in root.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            dims = tuple(i for i, pl in enumerate(param.placements) if isinstance(pl, Shard))
            key: tuple = ("dtensor", id(mesh), dims)
            groups.setdefault(key, [mesh, dims]).append(param)  # type: ignore[arg-type]
        else:
            groups.setdefault(("local",), [None, ()]).append(param)  # type: ignore[arg-type]

    grads: list[torch.Tensor] = []
    combined = torch.zeros((), dtype=torch.float32, device=device)
    for key, (mesh, dims, *params) in groups.items():
        local_grads = [local_tensor(q.grad) for q in params if q.grad is not None]
        grads.extend(q.grad for q in params if q.grad is not None)
        part = _local_part(local_grads, p, device)
        if key[0] == "dtensor":
            for dim in dims:
                group = mesh.get_group(dim)
                if dist.get_world_size(group) > 1:
                    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
                    sent = part.to(comm_device(group))  # itself when computed there
                    dist.all_reduce(sent, op=op, group=group)
                    part = sent.to(device)
        combined = torch.maximum(combined, part) if math.isinf(p) else combined + part
    total = combined if math.isinf(p) else combined ** (1.0 / p)

    if not grads:
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {dist.get_rank()} with no gradients -- "
            "returning the total norm in the default dtype torch.float32",
            stacklevel=3,
        )
        return total
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for grad in grads:
        local = local_tensor(grad)
        local.mul_(coef.to(local.device, local.dtype))
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
    return total.to(dtype)


def _local_part(grads: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """``sum |g|^p`` (or ``max |g|`` for inf) over local gradient tensors, in float32."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack(
        [torch.linalg.vector_norm(g.detach(), p, dtype=torch.float32).to(device) for g in grads]
    )
    if math.isinf(p):
        return norms.max()
    return (norms**p).sum()
