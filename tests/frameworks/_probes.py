"""What the framework tests ask the ranks about a model (module-level: a pool cell imports
it), as plain data."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor


def sharding(model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """The model's class, how its parameters are held (``DTensor`` with which placements,
    or plain: torch FSDP1's views of this rank's flat shard), how many elements this rank
    holds, and whether ``optimizer`` holds exactly the model's parameters."""
    params = list(model.parameters())
    out = {
        "class": type(model).__name__,
        "placements": sorted(
            {str(tuple(p.placements)) if isinstance(p, DTensor) else "plain" for p in params}
        ),
        "local": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
    }
    if optimizer is not None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        out["optimizer_holds_the_model"] = held == {id(p) for p in params}
    return out


def logged(trainer: Any) -> list[tuple[float, float]]:
    """The losses and gradient norms (before clipping) the Trainer logged, in order."""
    return [
        (float(entry["loss"]), float(entry["grad_norm"]))
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
