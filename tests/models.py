"""The toy models of the test suite, one place for every test that needs a model.

Everything is module-level so it pickles into rank processes, and every model is built
from the global torch seed only: the same seed gives the same weights on every rank and in
the single-process references the parity tests compare against. Changing a definition here
changes the numbers those references produce, so each model stays as its tests expect.

* :class:`TinyLM` (with :class:`Block`, :class:`Attention`): a transformer-shaped language
  model for the FSDP tests (auto-wrap by block, parity against unsharded training).
* :class:`Net`: uneven shapes (3 rows over 4 ranks leave one rank an empty shard) and a
  buffer, for the checkpoint tests.
* :class:`Tiny`: uneven shapes over 2 ranks (a padded second shard), for the probes;
  :func:`sharded_and_reference` / :func:`wrapped_and_reference` build it sharded next to
  an unsharded copy, :func:`backward` runs one step on :func:`tiny_batch`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

VOCAB = 32
DIM = 16


class Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        return self.out(weights @ v)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, ``n_blocks`` attention+MLP blocks, final layer norm, head (dim 16, so every
    configuration trains in milliseconds on CPU ranks)."""

    def __init__(self, n_blocks: int = 2, dim: int = DIM, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Net(nn.Module):
    """Uneven shapes (3 rows over 4 ranks leaves one rank an empty shard) and a buffer.

    The buffer is the same on every rank (buffers are replicated, not sharded: a
    rank-divergent buffer such as BatchNorm statistics under data parallelism is saved
    from one rank only, as in FSDP1's full state dict).
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)
        self.body = nn.Sequential(nn.Linear(10, 9), nn.Tanh(), nn.Linear(9, 3))
        self.register_buffer("shift", torch.randn(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.relu(self.norm(self.inp(x)) + self.shift))


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
    """A ``fully_shard`` :class:`Tiny` (its block, then the root) and an identical unsharded
    copy, over the default group (a collective)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    reference = Tiny()
    model = copy.deepcopy(reference)
    shape = mesh_shape or (dist.get_world_size(),)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, reference


def wrapped_and_reference(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The same as :func:`sharded_and_reference` under this package's
    ``FullyShardedDataParallel`` (the block a nested unit)."""
    from fsdp_interactive.fsdp import FullyShardedDataParallel
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    reference = Tiny()
    model = FullyShardedDataParallel(
        copy.deepcopy(reference), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential})
    )
    return model, reference


def tiny_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for :class:`Tiny` (6 samples)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(6, 5, generator=generator), torch.randn(6, 2, generator=generator)


def backward(model: nn.Module, seed: int = 1) -> None:
    """One MSE loss backward of a :class:`Tiny` (sharded or not) on :func:`tiny_batch`."""
    x, y = tiny_batch(seed)
    nn.functional.mse_loss(model(x), y).backward()
