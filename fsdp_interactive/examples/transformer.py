"""A tiny decoder-only transformer and a deterministic synthetic language-modelling task.

Rank side: plain ``torch.nn`` only. The model is small enough to train on CPU ranks in
seconds and has every kind of parameter FSDP users meet: an embedding, attention and MLP
blocks (the natural auto-wrap unit is :class:`TransformerBlock`), layer norms and a head.
"""

from __future__ import annotations

import torch
from torch import nn


class TransformerBlock(nn.Module):
    """Pre-norm block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, dim: int, n_heads: int, mlp_ratio: int = 4):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim ({dim}) must be divisible by n_heads ({n_heads})")
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, n_heads, batch_first=True)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), 1)
        h = self.attn_norm(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """Token embedding + learned positions, ``n_layers`` blocks, final norm, LM head."""

    def __init__(
        self,
        vocab_size: int = 64,
        dim: int = 32,
        n_layers: int = 2,
        n_heads: int = 4,
        max_seq_len: int = 32,
    ):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(max_seq_len, dim))
        self.blocks = nn.ModuleList(TransformerBlock(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, seq, vocab)`` for integer ``tokens`` of ``(batch, seq)``."""
        seq = tokens.shape[1]
        if seq > self.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.max_seq_len}")
        x = self.embed(tokens) + self.pos[:seq]
        for block in self.blocks:
            x = block(x)
        # nn.Linear returns a 3-D input's logits as a view of its 2-D product. A view is a
        # poor module output under FSDP: an in-place edit of it by the caller would drop the
        # backward hook that all-gathers the parameters again. The copy owns its storage
        # and holds the same values.
        return self.head(self.norm(x)).clone()


def synthetic_batch(
    step: int,
    rank: int,
    batch_size: int = 8,
    seq_len: int = 16,
    vocab_size: int = 64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic ``(inputs, targets)`` batch for one rank at one step.

    The task is learnable (each target is the next token of an arithmetic sequence whose
    stride depends on the sequence), so losses fall visibly within a few dozen steps. The
    same ``(seed, step, rank)`` always gives the same tensors, on any process.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
    stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    return seq[:, :-1], seq[:, 1:]
