"""``layout(model)``: which rank holds which slice of every parameter (rank side)."""

from __future__ import annotations

import itertools
import socket
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import local_shape_and_offset, padded_shard_numels
from fsdp_interactive.inspect._dtensor import local_tensor, named_parameters, unit_names, world
from fsdp_interactive.inspect._records import ParamLayout, RankLayout, ShardSlice


def _tensor_bytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def _param_layout(
    fqn: str,
    param: torch.Tensor,
    padded: dict[int, int],
    unit: str | None,
    slice_cache: dict[Any, tuple[ShardSlice, ...]],
) -> ParamLayout:
    global_shape = tuple(int(s) for s in param.shape)
    dtype = str(param.dtype).removeprefix("torch.")
    if not isinstance(param, DTensor):
        rank_count = world()[1]
        numel = param.numel()
        slices = tuple(
            ShardSlice(r, global_shape, (0,) * len(global_shape), numel, numel)
            for r in range(rank_count)
        )
        return ParamLayout(
            fqn=fqn,
            global_shape=global_shape,
            dtype=dtype,
            element_size=param.element_size(),
            is_dtensor=False,
            placements=("Replicate(world)",),
            mesh_shape=(rank_count,),
            mesh_dim_names=None,
            requires_grad=param.requires_grad,
            slices=slices,
            unit=unit,
        )
    mesh = param.device_mesh
    mesh_shape = tuple(int(s) for s in mesh.shape)
    my_padded = padded.get(id(param))
    # Models repeat the same shapes block after block: compute each distinct slicing once.
    key = (global_shape, mesh, tuple(param.placements), my_padded)
    slices = slice_cache.get(key)
    if slices is None:
        slices = _slices(global_shape, mesh, param.placements, my_padded)
        slice_cache[key] = slices
    return ParamLayout(
        fqn=fqn,
        global_shape=global_shape,
        dtype=dtype,
        element_size=param.element_size(),
        is_dtensor=True,
        placements=tuple(repr(p) for p in param.placements),
        mesh_shape=mesh_shape,
        mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        requires_grad=param.requires_grad,
        slices=slices,
        unit=unit,
    )


def _slices(
    global_shape: tuple[int, ...], mesh: Any, placements: Any, my_padded: int | None
) -> tuple[ShardSlice, ...]:
    ranks = mesh.mesh.tolist()
    slices = []
    for coordinate in itertools.product(*(range(int(s)) for s in mesh.shape)):
        shape, offset = local_shape_and_offset(global_shape, mesh, placements, coordinate)
        numel = 1
        for s in shape:
            numel *= s
        # fully_shard pads every shard to the size of the first: the same for all ranks.
        stored = max(my_padded, numel) if my_padded is not None else numel
        rank = ranks
        for index in coordinate:
            rank = rank[index]
        slices.append(ShardSlice(int(rank), shape, offset, numel, stored))
    return tuple(sorted(slices, key=lambda s: s.rank))


def layout(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    params_from_rank: int | None = None,
) -> RankLayout:
    """Describe how ``model``'s parameters are laid out, as seen from this rank.

    Works for any model whose parameters are DTensors (fully_shard, the FSDP wrapper, any
    DTensor-parallel model) and for plain modules (every rank then holds everything).  No
    communication: the slices of other ranks are computed from each parameter's mesh and
    placements; the byte totals are this rank's own (merge the per-rank answers with
    ``merge_layouts``).  Padding is known only for parameters managed by fully_shard.
    Optimizer state counts every tensor in ``optimizer.state`` (local part of DTensors).

    Every rank describes the same parameters; with ``params_from_rank=r`` only rank ``r``
    does (the others return ``params=()``), which is what a caller merging all ranks'
    answers wants: the description is computed and sent once.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"layout(model): model must be an nn.Module, got {type(model).__name__}")
    rank, world_size = world()
    describe = params_from_rank is None or params_from_rank == rank
    padded = padded_shard_numels(model)
    units = unit_names(model) if describe else {}
    slice_cache: dict[Any, tuple[ShardSlice, ...]] = {}
    params = []
    param_bytes = grad_bytes = 0
    for fqn, param in named_parameters(model):
        if describe:
            params.append(_param_layout(fqn, param, padded, units.get(id(param)), slice_cache))
        stored = padded.get(id(param))
        param_bytes += stored * param.element_size() if stored is not None else _tensor_bytes(param)
        if param.grad is not None:
            grad_bytes += _tensor_bytes(param.grad)
    optim_bytes = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    optim_bytes += _tensor_bytes(value)
    buffer_bytes = sum(_tensor_bytes(b) for b in model.buffers())
    return RankLayout(
        rank=rank,
        world_size=world_size,
        params=tuple(params),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optim_bytes=optim_bytes,
        buffer_bytes=buffer_bytes,
        host=socket.gethostname(),
    )
