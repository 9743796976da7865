"""Shared pieces for the FSDP tests: the seeded model (:class:`tests.models.TinyLM`), data,
reference training.

Everything here is module-level so it pickles into the rank processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.models import VOCAB, TinyLM

SEQ = 6
LOCAL_BATCH = 2


def make_model(seed: int = 0, **kwargs: Any) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


def batches(step: int, world_size: int, local_batch: int = LOCAL_BATCH) -> torch.Tensor:
    """The global batch of ``step``: ``world_size * local_batch`` token sequences (+1 target)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (world_size * local_batch, SEQ + 1), generator=gen)


def local_part(global_batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return global_batch.chunk(world_size)[rank]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:].reshape(-1).to(logits.device)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@dataclass
class TrainResult:
    losses: list[float]
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def train_reference(steps: int, world_size: int, seed: int = 0) -> TrainResult:
    """One process, unwrapped model, the concatenated global batch each step."""
    model = make_model(seed)
    optim = make_optimizer(model.parameters())
    losses = []
    for step in range(steps):
        loss = lm_loss(model, batches(step, world_size))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return TrainResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def global_mean(value: torch.Tensor) -> float:
    t = value.detach().float().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters under clean names, via summon_full_params (collective)."""
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)
