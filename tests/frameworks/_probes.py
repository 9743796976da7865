"""What the framework tests ask the ranks about a model (module-level: a pool cell imports
it), as plain data."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

#: A pool expression: :func:`kit_views` of the model named by ``{model}`` on one batch per
#: rank of the recipes' data, beside the clean names of the recipes' Llama.
KIT_VIEWS = (
    "(kit_views({model}, torch.stack([data[i]['input_ids'] for i in range(8 * rank, 8 * rank + 8)])),"
    " sorted(LlamaForCausalLM(config).state_dict()))"
)


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


def kit_views(model: nn.Module, batch: torch.Tensor) -> dict[str, Any]:
    """What the kit's probes show of ``model`` as the framework wrapped it: the names its
    layout lists, and the total gradient norm of one backward on ``batch`` beside the one
    the framework's own ``clip_grad_norm_`` computes (with no limit, so nothing is clipped).
    The gradients are zeroed again afterwards."""
    from fsdp_interactive import inspect

    names = sorted(p.fqn for p in inspect.layout(model).params)
    model.zero_grad()
    model(input_ids=batch, labels=batch).loss.backward()
    probed = inspect.grad_norms(model).total
    if hasattr(model, "clip_grad_norm_"):  # torch FSDP1's own, over its flat shards
        own = model.clip_grad_norm_(float("inf"))
    else:
        own = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    if isinstance(own, DTensor):
        own = own.full_tensor()
    model.zero_grad()
    assert probed > 0, "the backward left no gradient to measure"
    return {"names": names, "grad_norm": float(probed), "framework_grad_norm": float(own)}


def clipped_norms(trainer: Any) -> Any:
    """A Trainer callback that keeps, at every optimizer step, the true global norm of the
    gradients as the Trainer clipped them (torch FSDP1's own ``clip_grad_norm_`` with no
    limit, on every rank): ``callback.after_clip``."""
    from transformers import TrainerCallback

    class ClippedNorms(TrainerCallback):
        def __init__(self) -> None:
            self.after_clip: list[float] = []

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any):
            norm = trainer.model_wrapped.clip_grad_norm_(float("inf"))
            self.after_clip.append(float(norm))

    callback = ClippedNorms()
    trainer.add_callback(callback)
    return callback


def clipped_by_the_true_norm(trainer: Any, callback: Any) -> list[tuple[float, float]]:
    """Each logged step's (gradient norm the Trainer logged and clipped by, true global
    norm of the gradients it clipped): clipping by the true norm ``n`` leaves
    ``min(n, max_grad_norm)``, so the Trainer clipped by the true norm when the second is
    ``min(first, max_grad_norm)``."""
    steps = [int(e["step"]) for e in trainer.state.log_history if "grad_norm" in e]
    norms = [float(e["grad_norm"]) for e in trainer.state.log_history if "grad_norm" in e]
    return [(norm, callback.after_clip[step - 1]) for step, norm in zip(steps, norms, strict=True)]
