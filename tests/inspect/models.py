"""Tiny models for the probe tests, built identically on every rank."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Tiny(nn.Module):
    """Uneven shapes on purpose: (3, 5) over 2 ranks pads the second shard."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 3)
        self.block = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.tanh(self.embed(x)))


def sharded_and_reference(
    mesh_shape: tuple[int, ...] | None = None, seed: int = 0
) -> tuple[nn.Module, nn.Module]:
    """A fully_shard model and an identical unsharded copy (same seed on every rank)."""
    import torch.distributed as dist

    torch.manual_seed(seed)
    reference = Tiny()
    model = copy.deepcopy(reference)
    shape = mesh_shape or (dist.get_world_size(),)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, reference


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(6, 5, generator=generator), torch.randn(6, 2, generator=generator)


def backward(model: nn.Module, seed: int = 1) -> None:
    x, y = batch(seed)
    nn.functional.mse_loss(model(x), y).backward()


def wrapped_and_reference(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The same model under this package's FullyShardedDataParallel (nested units)."""
    import warnings

    from fsdp_interactive.fsdp import FullyShardedDataParallel
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    reference = Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = FullyShardedDataParallel(
            copy.deepcopy(reference), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential})
        )
    return model, reference
