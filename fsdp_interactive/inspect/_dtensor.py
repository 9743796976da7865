"""Small DTensor helpers shared by the probes (rank side).

What reads torch internals (a DTensor's local shard, the local shape at a mesh coordinate,
``fully_shard``'s padding) comes from :mod:`fsdp_interactive._torch_compat`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Placement

from fsdp_interactive import _torch_compat


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's local shard, a plain tensor itself), detached."""
    return _torch_compat.local_tensor(tensor).detach()


def world() -> tuple[int, int]:
    """(rank, world size) of the default group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``model.named_parameters()``, each parameter once."""
    yield from model.named_parameters(remove_duplicate=True)


def unit_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> FQN of the FSDP unit managing it ("" for ``model`` itself).

    A unit is a module ``fully_shard`` was applied to; it manages the DTensor parameters
    below it that no nested unit manages, so each parameter goes to its nearest unit above
    it.  Wrapper segments (``_fsdp_wrapped_module``) are left out of the names, as in
    ``named_parameters()``.  Parameters no unit manages (plain tensors, ignored ones) are
    absent.
    """
    from fsdp_interactive.fsdp.fully_sharded_data_parallel import clean_name

    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    owner: dict[int, str] = {}
    # Deepest units first: a parameter belongs to the nearest unit above it.
    for name, unit in sorted(units, key=lambda item: -len(item[0])):
        for param in unit.parameters():
            if isinstance(param, DTensor) and id(param) not in owner:
                owner[id(param)] = clean_name(name + ".").removesuffix(".")
    return owner
