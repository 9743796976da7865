"""Tiny models for the conformance checks, each built from the global seed only, so both
flavors of a check (and every rank) start from the same weights.

* :class:`Tied`: input and output embeddings share one parameter (most language models).
* :class:`SharedModule`: one ``Linear`` registered twice and called twice.
* :class:`Mlp`: three ``Linear`` layers and a buffer; :class:`Frozen`: the same with its
  first layer frozen (``requires_grad=False``).
* :class:`Scaled`: layers whose output a buffer scales, for mixed precision.
* :class:`Stack`: embedding, two :class:`Block`\\ s and a head, for auto-wrap and training.
* :class:`Holder` / :class:`UsesHolder`: a module without ``forward`` whose layers its
  parent calls one by one.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 11
DIM = 8
BATCH = 4  # samples per rank
SEQ = 3


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.body(self.embed(tokens))))


class SharedModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.second = self.first
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(torch.relu(self.first(x))))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.stem(x) * self.scale)))


class Frozen(Mlp):
    """:class:`Mlp` with its first layer frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.stem.requires_grad_(False)


class Scaled(nn.Module):
    """Three ``Linear`` layers and a buffer that scales the output (its dtype shows in the
    output's), for mixed precision."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 3)
        self.register_buffer("scale", torch.tensor([0.5, 1.0, 1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(torch.relu(self.stem(x))))) * self.scale


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


class Holder(nn.Module):
    """Layers without a ``forward`` of their own (its parent calls them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)


class UsesHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.holder = Holder()
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.holder.norm(self.holder.lin(x)))


def seeded(cls: type[nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def tokens(step: int = 0, rank: int | None = None) -> torch.Tensor:
    """Token ids for :class:`Tied` / :class:`Stack`: this rank's ``BATCH`` sequences of
    ``step`` (the same on every call)."""
    import torch.distributed as dist

    rank = dist.get_rank() if rank is None else rank
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def features(step: int = 0, rank: int | None = None) -> torch.Tensor:
    """Float inputs of width ``DIM`` for the other models: this rank's ``BATCH`` rows."""
    import torch.distributed as dist

    rank = dist.get_rank() if rank is None else rank
    generator = torch.Generator().manual_seed(100 * step + rank + 7)
    return torch.randn(BATCH, DIM, generator=generator)
