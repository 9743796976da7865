"""register_comm_hook with torch's default FSDP hooks: the hook really reduces the gradients
(it is called, and training still matches the single-process reference)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.fsdp import _common as C
from tests.models import Block

STEPS = 2


class CountingHook:
    """Wraps an FSDP1 hook and counts calls (picklable, module-level)."""

    def __init__(self, hook):
        self.hook = hook
        self.calls = 0
        self.arities: set[int] = set()

    def __call__(self, state, grad, output=None):
        self.calls += 1
        if output is None:
            self.arities.add(2)
            return self.hook(state, grad)
        self.arities.add(3)
        return self.hook(state, grad, output)


def train_with_hook(strategy: str, hook_name: str) -> tuple[list[float], float, int, set]:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp import ShardingStrategy
    from fsdp_interactive.fsdp._traversal import unit_states
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(
        C.make_model(0),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
    )
    group = dist.distributed_c10d._get_default_group()
    if hook_name == "default":
        hook = (
            default_hooks.allreduce_hook
            if strategy == "NO_SHARD"
            else default_hooks.reduce_scatter_hook
        )
        state = default_hooks.DefaultState(group)
        hook = CountingHook(hook)  # proves the user's callable itself runs
    else:
        # torch's compression hooks as they are (on CPU they run as their equivalent).
        hook = getattr(default_hooks, hook_name)
        state = default_hooks.LowPrecisionState(group)
    model.register_comm_hook(state, hook)
    optim = C.make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = C.lm_loss(model, C.local_part(C.batches(step, world), rank, world))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(C.global_mean(loss))
    ref = C.train_reference(STEPS, world)
    diff = C.max_param_diff(C.full_params(model), ref.params)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref.losses, strict=True))
    runners = [unit.comm_hook_runner for unit in unit_states(model)]
    runner_calls = sum(r.calls for r in runners)
    kinds = {type(r).__name__ for r in runners}
    if isinstance(hook, CountingHook):
        assert hook.calls == runner_calls
        assert hook.arities == ({2} if strategy == "NO_SHARD" else {3})
    return [loss_diff], diff, runner_calls, kinds


@pytest.mark.parametrize(
    "strategy,hook_name,tol",
    [
        ("FULL_SHARD", "default", 1e-5),
        ("SHARD_GRAD_OP", "default", 1e-5),
        ("NO_SHARD", "default", 1e-5),
        ("FULL_SHARD", "bf16_compress_hook", 5e-3),
        ("NO_SHARD", "fp16_compress_hook", 1e-3),
    ],
)
def test_comm_hook_reduces_gradients(ranks2, strategy, hook_name, tol):
    loss_diffs, diff, calls, kinds = ranks2.run(train_with_hook, strategy, hook_name)[0]
    print(
        f"{strategy} {hook_name}: calls {calls}, loss diff {loss_diffs[0]:.2e}, param diff {diff:.2e}"
    )
    # 3 units (root + 2 blocks), one reduction each per backward.
    assert calls == 3 * STEPS
    assert kinds == ({"HookAllReduce"} if strategy == "NO_SHARD" else {"HookReduceScatter"})
    assert loss_diffs[0] <= tol and diff <= tol


def comm_hook_errors() -> None:
    from torch.distributed.algorithms._comm_hooks import default_hooks
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp import ShardingStrategy
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    state = default_hooks.DefaultState(dist.distributed_c10d._get_default_group())
    model = FSDP(C.make_model(0), auto_wrap_policy=ModuleWrapPolicy({Block}))
    with pytest.raises(AssertionError, match="root instance"):
        model.blocks[0].register_comm_hook(state, default_hooks.reduce_scatter_hook)
    with pytest.raises(ValueError, match="callable"):
        model.register_comm_hook(state, "not a hook")
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    with pytest.raises(AssertionError, match="already registered"):
        model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    hybrid = FSDP(
        C.make_model(0), sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh
    )
    with pytest.raises(AssertionError, match="hybrid strategies"):
        hybrid.register_comm_hook(state, default_hooks.reduce_scatter_hook)


def test_comm_hook_errors(ranks2):
    ranks2.run(comm_hook_errors)
