"""Side by side with torch's own FSDP1 (``device_id=torch.device("cpu")``) on one script:
same losses, same clip norms and same parameters after a few steps (with no_sync and
clip_grad_norm_ in the loop)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tests.fsdp import _common as C
from tests.models import Block

STEPS = 3


def _script(fsdp_cls, strategy: str, bf16: bool, **extra) -> tuple[list, list, dict]:
    """An FSDP1 training script; only the wrapper class changes."""
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    model = fsdp_cls(
        C.make_model(0),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None,
        **extra,
    )
    optim = C.make_optimizer(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        tokens = C.local_part(C.batches(step, world), rank, world)
        first, second = tokens.chunk(2)
        with model.no_sync():
            C.lm_loss(model, first).backward()
        loss = C.lm_loss(model, second)
        loss.backward()
        norms.append(model.clip_grad_norm_(0.5).item())
        optim.step()
        optim.zero_grad()
        losses.append(C.global_mean(loss))
    with fsdp_cls.summon_full_params(model, writeback=False):
        params = {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }
    return losses, norms, params


def side_by_side(strategy: str, bf16: bool) -> tuple[float, float, float]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _script(TorchFSDP, strategy, bf16, device_id=torch.device("cpu"))
        ours = _script(FSDP, strategy, bf16)
    loss_diff = max(abs(a - b) for a, b in zip(ours[0], theirs[0], strict=True))
    norm_diff = max(abs(a - b) for a, b in zip(ours[1], theirs[1], strict=True))
    return loss_diff, norm_diff, C.max_param_diff(ours[2], theirs[2])


@pytest.mark.parametrize(
    "strategy,bf16,tol",
    [
        ("FULL_SHARD", False, 1e-5),
        ("SHARD_GRAD_OP", False, 1e-5),
        ("NO_SHARD", False, 1e-5),
        ("FULL_SHARD", True, 1e-2),
    ],
)
def test_same_training_as_torch_fsdp1(ranks2, strategy, bf16, tol):
    loss_diff, norm_diff, param_diff = ranks2.run(side_by_side, strategy, bf16)[0]
    print(
        f"{strategy} bf16={bf16}: vs torch FSDP1 max loss diff {loss_diff:.2e}, "
        f"clip norm diff {norm_diff:.2e}, param diff {param_diff:.2e}"
    )
    assert loss_diff <= tol and norm_diff <= tol and param_diff <= tol


def _bn_script(fsdp_cls, **extra) -> tuple[list, dict, list]:
    from torch import nn
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = fsdp_cls(
        nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        **extra,
    )
    units_without_mp = sorted(
        "BatchNorm1d" if isinstance(m.module, nn.BatchNorm1d) else type(m.module).__name__
        for m in fsdp_cls.fsdp_modules(model)
        if m.mixed_precision is None or m.mixed_precision.param_dtype is None
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4 * world, 8, generator=gen).chunk(world)[rank]
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(C.global_mean(loss))
    with fsdp_cls.summon_full_params(model, writeback=False):
        params = {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }
    return losses, params, units_without_mp


def batch_norm_side_by_side() -> tuple[float, float, list, list]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _bn_script(TorchFSDP, device_id=torch.device("cpu"))
        ours = _bn_script(FSDP)
    loss_diff = max(abs(a - b) for a, b in zip(ours[0], theirs[0], strict=True))
    return loss_diff, C.max_param_diff(ours[1], theirs[1]), ours[2], theirs[2]


def test_batch_norm_runs_without_mixed_precision_like_torch_fsdp1(ranks2):
    loss_diff, param_diff, ours, theirs = ranks2.run(batch_norm_side_by_side)[0]
    print(f"BatchNorm under bf16: loss diff {loss_diff:.2e}, param diff {param_diff:.2e}")
    assert ours == theirs == ["BatchNorm1d"]
    assert loss_diff <= 1e-6 and param_diff <= 1e-6
