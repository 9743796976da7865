"""What a wrapped model does at run time beyond parity: mixed-precision casts of root inputs
and buffers, the forward/backward prefetch settings and the collective order they give,
and activation checkpointing composed with the wrapper."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.fsdp import _common as C
from tests.models import Block


class RecordsInputDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return self.lin(x) * self.scale


def mixed_precision_inputs_and_buffers() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp import MixedPrecision

    x = torch.randn(3, 4)
    mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(RecordsInputDtype(), mixed_precision=mp)
    out = model(x)
    assert model.module.seen == [torch.bfloat16], (
        "root inputs must be cast (cast_root_forward_inputs)"
    )
    assert out.dtype == torch.bfloat16
    assert model.module.scale.dtype == torch.bfloat16
    no_cast = FSDP(
        RecordsInputDtype(),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, cast_root_forward_inputs=False),
    )
    with pytest.raises(RuntimeError):
        no_cast(x)  # fp32 input against bf16 parameters: nothing casts it
    assert no_cast.module.seen == [torch.float32]


def prefetch_settings() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp._unit_state import unit_state
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    policy = ModuleWrapPolicy({Block})
    pre = FSDP(C.make_model(0), auto_wrap_policy=policy)
    assert all(
        not u.fsdp_module._get_fsdp_state()._states_to_backward_prefetch
        for u in FSDP.fsdp_modules(pre)
    )
    none = FSDP(
        C.make_model(0), auto_wrap_policy=policy, backward_prefetch=None, forward_prefetch=True
    )
    for unit in FSDP.fsdp_modules(none):
        state = unit.fsdp_module._get_fsdp_state()
        assert state._states_to_backward_prefetch == [state], "backward prefetch not disabled"
    optim = C.make_optimizer(none.parameters())
    for step in range(2):
        C.lm_loss(none, C.local_part(C.batches(step, world), rank, world)).backward()
        optim.step()
        optim.zero_grad()
        if step == 0:
            order = [u.sharded_module._get_fsdp_state() for u in unit_state(none).forward_order]
            assert len(order) == 3
            for current, following in itertools.pairwise(order):
                assert current._states_to_forward_prefetch == [following]
    ref = C.train_reference(2, world)
    assert C.max_param_diff(C.full_params(none), ref.params) <= 1e-5


def test_mixed_precision_root_inputs_and_buffers(ranks2):
    ranks2.run(mixed_precision_inputs_and_buffers)


def test_prefetch_arguments_change_the_schedule(ranks2):
    ranks2.run(prefetch_settings)


class CollectiveLog(TorchDispatchMode):
    """Records the order of all-gathers, reduce-scatters and marked forward starts."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "allgather" in name:
            self.events.append("AG")
        elif "reduce_scatter" in name:
            self.events.append("RS")
        return func(*args, **(kwargs or {}))


def _schedule(backward_prefetch, forward_prefetch: bool) -> tuple[list, list]:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(
        C.make_model(0),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
    )
    tokens = C.local_part(C.batches(0, world), rank, world)
    C.lm_loss(model, tokens).backward()  # first iteration: forward order is recorded
    log = CollectiveLog()
    for i, block in enumerate(model.blocks):
        block.module.register_forward_pre_hook(lambda *_, i=i: log.events.append(f"fwd{i}"))
    with log:
        loss = C.lm_loss(model, tokens)
        forward = list(log.events)
        log.events.clear()
        loss.backward()
    return forward, log.events


def prefetch_schedules() -> dict:
    from fsdp_interactive.fsdp import BackwardPrefetch

    plain_fwd, pre_bwd = _schedule(BackwardPrefetch.BACKWARD_PRE, False)
    prefetch_fwd, no_prefetch_bwd = _schedule(None, True)
    return {
        "forward": plain_fwd,
        "forward_prefetch": prefetch_fwd,
        "backward_pre": pre_bwd,
        "backward_none": no_prefetch_bwd,
    }


def test_prefetch_arguments_change_the_collective_order(ranks2):
    s = ranks2.run(prefetch_schedules)[0]
    print(s)
    # forward_prefetch: block 1's all-gather is issued before block 0 computes.
    assert s["forward"] == ["AG", "AG", "fwd0", "AG", "fwd1"]
    assert s["forward_prefetch"] == ["AG", "AG", "AG", "fwd0", "fwd1"]
    # BACKWARD_PRE: the next unit's all-gather precedes the current unit's reduce-scatter;
    # backward_prefetch=None: each all-gather waits until the previous unit reduced.
    first_rs = s["backward_pre"].index("RS")
    assert s["backward_pre"][:first_rs].count("AG") == 2
    first_rs = s["backward_none"].index("RS")
    assert s["backward_none"][:first_rs].count("AG") == 1


def activation_checkpointing_composes() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(C.make_model(0), auto_wrap_policy=ModuleWrapPolicy({Block}))
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    block = model.blocks[0]
    assert isinstance(block.module, Block) and block.module is block.fsdp_module
    plain_names = [n for n, _ in C.make_model(0).named_parameters()]
    assert [n for n, _ in model.named_parameters()] == plain_names
    optim = C.make_optimizer(model.parameters())
    for step in range(2):
        C.lm_loss(model, C.local_part(C.batches(step, world), rank, world)).backward()
        optim.step()
        optim.zero_grad()
    assert sorted(get_optimizer_state_dict(model, optim)["state"]) == sorted(plain_names)
    assert C.max_param_diff(C.full_params(model), C.train_reference(2, world).params) <= 1e-5


def test_activation_checkpointing_composes(ranks2):
    ranks2.run(activation_checkpointing_composes)
