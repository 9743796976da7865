"""``layout(model)``: which rank holds which slice of every parameter (rank side)."""

from __future__ import annotations

import itertools
import socket
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_interactive._torch_compat import local_shape_and_offset, local_tensor
from fsdp_interactive.inspect._records import ParamLayout, RankLayout, ShardSlice
from fsdp_interactive.wrapping import OriginalParam, model_params
from fsdp_interactive.wrapping._param import world


def _tensor_bytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def _param_layout(
    param: OriginalParam, slice_cache: dict[Any, tuple[ShardSlice, ...]]
) -> ParamLayout:
    """How ``param`` is laid out: every rank's slice where this rank can tell (a DTensor's
    from its mesh and placements, a whole tensor's), else this rank's own (torch FSDP1)."""
    if param.kind == "dtensor":
        slices = _dtensor_slices(param, slice_cache)
    elif param.kind == "fsdp1":
        slices = (own_slice(param),)
    else:
        numel = param.numel
        zeros = (0,) * len(param.shape)
        slices = tuple(ShardSlice(r, param.shape, zeros, numel, numel) for r in range(world()[1]))
    mesh = param.tensor.device_mesh if isinstance(param.tensor, DTensor) else None
    return ParamLayout(
        fqn=param.fqn,
        global_shape=param.shape,
        dtype=str(param.dtype).removeprefix("torch."),
        element_size=param.element_size,
        is_dtensor=param.kind == "dtensor",
        placements=param.placements,
        mesh_shape=param.mesh_shape,
        mesh_dim_names=tuple(mesh.mesh_dim_names) if mesh and mesh.mesh_dim_names else None,
        requires_grad=param.requires_grad,
        slices=slices,
        unit=param.unit,
    )


def own_slice(param: OriginalParam) -> ShardSlice:
    """This rank's slice of ``param``, from what the adapter reads on this rank."""
    piece = param.piece()
    numel = piece.values.numel()
    shape = (numel,) if piece.flat else tuple(int(s) for s in piece.values.shape)
    stored = max(numel, param.stored_numel())
    return ShardSlice(world()[0], shape, piece.offset, numel, stored, flat=piece.flat)


def _dtensor_slices(
    param: OriginalParam, slice_cache: dict[Any, tuple[ShardSlice, ...]]
) -> tuple[ShardSlice, ...]:
    tensor = param.tensor
    assert isinstance(tensor, DTensor)
    my_padded = getattr(param, "padded_numel", None)
    # Models repeat the same shapes block after block: compute each distinct slicing once.
    key = (param.shape, tensor.device_mesh, tuple(tensor.placements), my_padded)
    slices = slice_cache.get(key)
    if slices is None:
        slices = _slices(param.shape, tensor.device_mesh, tensor.placements, my_padded)
        slice_cache[key] = slices
    return slices


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

    Parameters are the original ones, by clean FQN, however the model is wrapped
    (:func:`fsdp_interactive.wrapping.model_params`: DTensor models, torch FSDP1 flat or
    with original parameters, DDP, compiled, checkpoint-wrapped, Lightning and accelerate
    wrappers, plain modules, where every rank holds everything); a wrapping it does not
    understand raises ``UnsupportedWrapping``. No communication: a DTensor's slices on
    other ranks are computed from its mesh and placements; torch FSDP1's are known to their
    own ranks only, so each rank reports its own (``RankLayout.own_slices``) and
    ``merge_layouts`` of every rank's answer completes them. The byte totals are this
    rank's own: parameter storage with its padding (torch FSDP1's flat shards whole),
    gradients, optimizer state (every tensor in ``optimizer.state``, local part of
    DTensors) and buffers.

    Every rank describes the same parameters; with ``params_from_rank=r`` only rank ``r``
    does (the others return ``params=()``), which is what a caller merging all ranks'
    answers wants: the description is computed and sent once.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"layout(model): model must be an nn.Module, got {type(model).__name__}")
    rank, world_size = world()
    describe = params_from_rank is None or params_from_rank == rank
    params = model_params(model)
    slice_cache: dict[Any, tuple[ShardSlice, ...]] = {}
    described = tuple(_param_layout(p, slice_cache) for p in params.values()) if describe else ()
    own = {p.fqn: own_slice(p) for p in params.values() if p.kind == "fsdp1"}
    param_bytes, grad_bytes = params.local_bytes()
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
        params=described,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optim_bytes=optim_bytes,
        buffer_bytes=buffer_bytes,
        host=socket.gethostname(),
        own_slices=own,
    )
