"""Rank side of the demo: build, train, probe and checkpoint one sharded model.

Every function is called on every rank at once (through ``Pool.call``) and keeps the
training state in this module between calls, as a notebook session would keep it in the
engines' namespaces. Return values are plain data.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_interactive import checkpoint, inspect
from fsdp_interactive.demo._demo_config import DemoConfig
from fsdp_interactive.examples import TinyTransformer, TransformerBlock, synthetic_batch
from fsdp_interactive.fsdp import FullyShardedDataParallel, ShardingStrategy
from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

_session: dict[str, Any] = {}


def setup(config: DemoConfig) -> int:
    """Build the model (same initial weights on every rank), shard it, make the optimizer.

    Returns the number of parameters of the unsharded model.
    """
    torch.manual_seed(config.seed)
    model = TinyTransformer(
        vocab_size=config.vocab_size,
        dim=config.dim,
        n_layers=config.layers,
        n_heads=config.heads,
        max_seq_len=config.seq_len,
    )
    numel = sum(p.numel() for p in model.parameters())
    sharded = FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
        use_orig_params=True,
    )
    # foreach: one DTensor dispatch per operation for all parameters instead of one per
    # parameter (torch's optimizers default to the per-parameter loop on CPU).
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=config.lr, foreach=True)
    _session.clear()
    _session.update(config=config, model=sharded, optimizer=optimizer, step=0)
    return numel


def train(steps: int) -> list[float]:
    """Run ``steps`` optimizer steps; the global mean loss of each step (same on all ranks)."""
    config: DemoConfig = _session["config"]
    model: FullyShardedDataParallel = _session["model"]
    optimizer: torch.optim.Optimizer = _session["optimizer"]
    losses = []
    for _ in range(steps):
        inputs, targets = synthetic_batch(
            _session["step"],
            dist.get_rank(),
            batch_size=config.batch_size,
            seq_len=config.seq_len,
            vocab_size=config.vocab_size,
            seed=config.seed,
        )
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        model.clip_grad_norm_(config.max_grad_norm)
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / dist.get_world_size())
        _session["step"] += 1
    return losses


def probe() -> tuple[inspect.RankLayout, inspect.GradNorms]:
    """This rank's layout (with optimizer state) and the gradients' norms of the last step."""
    model = _session["model"]
    return inspect.layout(model, _session["optimizer"]), inspect.grad_norms(model)


def save(path: str) -> dict[str, Any]:
    """Save model and optimizer to ``path`` (collective); the checkpoint's record as a dict."""
    result = checkpoint.save(
        path,
        _session["model"],
        _session["optimizer"],
        extra={"step": _session["step"], "config": asdict(_session["config"])},
        overwrite=True,
        keep_last=3,
    )
    return {"path": result.path, "seconds": result.seconds, "bytes": result.size_bytes}


def teardown() -> None:
    """Drop the model and optimizer held on this rank."""
    _session.clear()
