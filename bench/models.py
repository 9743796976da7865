"""The model, data and wrapping recipes every FSDP figure shares.

The model is a stack of residual MLP blocks (the shape of a transformer's feed-forward
half), each block one FSDP unit.  Three ways to shard the very same model are offered:

* :func:`wrap_ours`: ``fsdp_interactive.fsdp.FullyShardedDataParallel`` with a block-level
  auto-wrap policy;
* :func:`wrap_fsdp1`: torch's own ``FullyShardedDataParallel`` with
  ``device_id=torch.device("cpu")`` and the same policy;
* :func:`wrap_fully_shard`: ``torch.distributed.fsdp.fully_shard`` applied by hand to each
  block, then to the root.

All three use FULL_SHARD semantics (every block's parameters resharded after forward; the
root's kept for backward, as FSDP1 does) and
the same mixed precision when ``dtype`` is ``torch.bfloat16`` (parameters and gradient
reduction in bf16).  These functions run on a rank inside an initialized process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSize:
    """``blocks`` residual MLP blocks of width ``dim`` (hidden ``4 * dim``)."""

    dim: int
    blocks: int
    batch: int

    @property
    def parameters(self) -> int:
        per_block = 2 * self.dim * 4 * self.dim + 4 * self.dim + self.dim
        return self.blocks * per_block + 2 * self.dim


class Block(nn.Module):
    """``x + W2 gelu(W1 norm(x))``."""

    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class BlockStack(nn.Module):
    def __init__(self, size: ModelSize):
        super().__init__()
        self.blocks = nn.ModuleList(Block(size.dim) for _ in range(size.blocks))
        self.norm = nn.LayerNorm(size.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build_model(size: ModelSize, seed: int = 0) -> BlockStack:
    """The same initial weights on every rank and for every contender."""
    torch.manual_seed(seed)
    return BlockStack(size)


def batch_for(size: ModelSize, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's fixed input batch (targets are the input, so the loss is reconstruction)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(size.batch, size.dim, generator=gen, dtype=dtype)


def wrap_policy():
    """The block-level auto-wrap policy, from torch's FSDP1 wrap module."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({Block})


def wrap_fsdp1(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

    mp = None
    if dtype != torch.float32:
        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    return FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=wrap_policy(),
        mixed_precision=mp,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )


def wrap_ours(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    from fsdp_interactive.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy

    mp = None
    if dtype != torch.float32:
        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    return FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=wrap_policy(),
        mixed_precision=mp,
        use_orig_params=True,
    )


def wrap_fully_shard(model: BlockStack, dtype: torch.dtype) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy()
    if dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    # The root keeps its parameters between forward and backward, as FSDP1's FULL_SHARD does
    # (and fully_shard's own default for the root).
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    return model


WRAPPERS = {
    "ours": wrap_ours,
    "fsdp1": wrap_fsdp1,
    "fully_shard": wrap_fully_shard,
}


def train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One forward, backward and optimizer step; returns the loss."""
    optim.zero_grad(set_to_none=True)
    out = model(batch)
    loss = nn.functional.mse_loss(out.float(), batch.float())
    loss.backward()
    optim.step()
    return float(loss.detach())


def steps_per_second(
    model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor, steps: int
) -> float:
    """``steps`` training steps between two barriers, timed on this rank: steps/s."""
    import time

    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        train_step(model, optim, batch)
    dist.barrier()
    return steps / (time.perf_counter() - start)
