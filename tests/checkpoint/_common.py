"""Models, optimizers and comparisons shared by the checkpoint tests (run on the ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.models import Net

WRAPPED = "_fsdp_wrapped_module."


def plain_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def build(kind: str = "fsdp2", seed: int = 0) -> nn.Module:
    """The same seeded model, sharded over the default group.

    ``fsdp2``: torch's ``fully_shard`` per block plus the root; ``wrapper``: this
    package's ``FullyShardedDataParallel`` with the same units.
    """
    model = plain_model(seed)
    if kind == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model.inp, mesh=mesh)
        fully_shard(model.body, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if kind == "wrapper":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    if kind == "torch_fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return TorchFSDP(
            model,
            device_id=torch.device("cpu"),
            use_orig_params=True,
            auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
        )
    raise ValueError(kind)


def by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n.replace(WRAPPED, ""): p for n, p in nn.Module.named_parameters(model)}


def optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    """Two parameter groups (weights / biases+norm) with different hyper-parameters."""
    params = by_name(model)
    weights = [p for n, p in params.items() if n.endswith("weight") and "norm" not in n]
    others = [p for n, p in params.items() if not (n.endswith("weight") and "norm" not in n)]
    groups = [{"params": weights}, {"params": others, "lr": 0.05}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.02, momentum=0.9)
    raise ValueError(kind)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full CPU tensor, by clean name (independent of
    the code under test: DTensor's own ``full_tensor``)."""
    out = {}
    items = list(nn.Module.named_parameters(model)) + list(nn.Module.named_buffers(model))
    for name, value in items:
        value = value.full_tensor() if isinstance(value, DTensor) else value
        out[name.replace(WRAPPED, "")] = value.detach().cpu().clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(
        (a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0 for k in a
    )


def structure(obj: Any) -> Any:
    """Nested keys, tensor shapes and plain values (for comparing state-dict layouts)."""
    if isinstance(obj, dict):
        return {k: structure(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(structure(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), str(obj.dtype))
    return obj


def snapshot(obj: Any) -> Any:
    """Deep copy of the tensors in a nested state (state dicts hold live references)."""
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return obj


def reseal(folder: Any) -> None:
    """Seal the checkpoint ``folder`` again with this user's key after a test changed its
    manifest on purpose, as the checkpoint's own user could: what a load checks below
    the seal is then what refuses it (another user's change fails the seal first)."""
    from pathlib import Path

    from fsdp_interactive.checkpoint._format import _owner_seal

    folder = Path(folder)
    extra = folder / "extra.json"
    _owner_seal.write_seal(
        folder,
        (folder / "manifest.json").read_text(),
        extra.read_text() if extra.exists() else None,
    )
