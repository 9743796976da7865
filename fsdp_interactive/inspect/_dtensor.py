"""Small DTensor helpers shared by the probes (rank side)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from fsdp_interactive._torch_compat import (
    compute_local_shape_and_global_offset_at,
    dtensor_local_tensor,
    managed_parameters,
)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's local shard, a plain tensor itself).

    Read without autograd: ``to_local()`` goes through an autograd function on every call,
    which is most of a probe's cost for a model of a few hundred parameters.
    """
    if isinstance(tensor, DTensor):
        return dtensor_local_tensor(tensor).detach()
    return tensor.detach()


def world() -> tuple[int, int]:
    """(rank, world size) of the default group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def comm_device() -> torch.device:
    """Where tensors for the default group's collectives must live.

    CUDA (this rank's current device) when the group is NCCL-only, else CPU (gloo, or a
    group that has a CPU backend besides NCCL).
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def replication(tensor: torch.Tensor) -> int:
    """How many ranks hold an identical copy of this rank's piece of ``tensor``.

    For a DTensor: the product of the mesh sizes of its Replicate dimensions (Partial
    placements do not occur for parameters or gradients).  For a plain tensor: the world size,
    since every rank holds all of it.
    """
    if isinstance(tensor, DTensor):
        return _replicated_copies(tensor.device_mesh, tensor.placements)
    return world()[1]


@functools.lru_cache(maxsize=256)
def _replicated_copies(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> int:
    return math.prod(
        size
        for size, placement in zip(mesh.shape, placements, strict=True)
        if placement.is_replicate()
    )


def local_shape_and_offset(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int], placements
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of the piece held at ``coordinate`` of a mesh."""
    shape, offset = compute_local_shape_and_global_offset_at(
        global_shape, mesh_shape, coordinate, placements
    )
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def padded_numels(model: nn.Module) -> dict[int, int]:
    """id(sharded parameter) -> elements FSDP stores for it on this rank (with padding).

    Read from fully_shard's per-parameter state; parameters not managed by fully_shard are
    absent.
    """
    from torch.distributed.fsdp import FSDPModule

    sizes: dict[int, int] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for param, padded_size in managed_parameters(module):
            sizes[id(param)] = math.prod(padded_size)
    return sizes


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``model.named_parameters()``, each parameter once."""
    yield from model.named_parameters(remove_duplicate=True)
