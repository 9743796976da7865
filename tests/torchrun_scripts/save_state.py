"""What the training scripts here save at their end: each rank's own parameters and
optimizer state (shards, as the rank holds them), one file per rank, for a test to
compare two runs of a script bit for bit."""

from __future__ import annotations

import os

import torch


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a parameter or state tensor (a DTensor's local shard)."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).detach().clone()


def save_state(folder: str, rank: int, model: torch.nn.Module, optimizer) -> str:
    """Write ``rank-N.pt`` in ``folder``: ``{"params": {name: tensor}, "optimizer": {key:
    tensor}}``; its path."""
    os.makedirs(folder, exist_ok=True)
    params = {name: local(p) for name, p in model.named_parameters()}
    state = {}
    for index, (param_id, entries) in enumerate(sorted(optimizer.state_dict()["state"].items())):
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                state[f"{index}.{param_id}.{key}"] = local(value)
    path = os.path.join(folder, f"rank-{rank}.pt")
    torch.save({"params": params, "optimizer": state}, path)
    return path
