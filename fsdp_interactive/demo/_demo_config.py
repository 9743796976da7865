"""What the demo trains and where it writes; plain data that crosses to the ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoConfig:
    """Model size, schedule and data of the demo run.

    ``batch_size`` is per rank; every rank draws its own deterministic batches, so the
    global batch is ``batch_size * world_size``.
    """

    steps: int = 40
    dim: int = 64
    layers: int = 4
    heads: int = 4
    vocab_size: int = 64
    seq_len: int = 16
    batch_size: int = 8
    lr: float = 3e-3
    max_grad_norm: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "dim", "layers", "heads", "vocab_size", "seq_len", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
