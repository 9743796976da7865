"""no_sync() accumulation and clip_grad_norm_() against single-process references."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from tests.fsdp import _common as C
from tests.models import Block

MICRO_STEPS = 3


def _reduce_scatter_count(counts: dict) -> int:
    return sum(
        n
        for op, n in counts.items()
        if "reduce_scatter" in str(op) or "allreduce" in str(op) or "all_reduce" in str(op)
    )


def no_sync_accumulation(strategy: str) -> tuple[list[int], float]:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp import ShardingStrategy
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(
        C.make_model(0),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
    )
    optim = C.make_optimizer(model.parameters())
    reduce_counts = []
    for micro in range(MICRO_STEPS):
        tokens = C.local_part(C.batches(micro, world), rank, world)
        last = micro == MICRO_STEPS - 1
        with CommDebugMode() as comm:
            if last:
                C.lm_loss(model, tokens).backward()
            else:
                with model.no_sync():
                    C.lm_loss(model, tokens).backward()
        reduce_counts.append(_reduce_scatter_count(comm.get_comm_counts()))
    optim.step()

    reference = C.make_model(0)
    ref_optim = C.make_optimizer(reference.parameters())
    for micro in range(MICRO_STEPS):
        C.lm_loss(reference, C.batches(micro, world)).backward()
    ref_optim.step()
    diff = C.max_param_diff(C.full_params(model), dict(reference.named_parameters()))
    return reduce_counts, diff


def no_sync_inner_unit_rejected() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(C.make_model(0), auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert model.check_is_root() and not model.blocks[0].check_is_root()
    with pytest.raises(RuntimeError, match="root"), model.blocks[0].no_sync():
        pass


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_no_sync_accumulates_then_reduces_the_sum(ranks2, strategy):
    results = ranks2.run(no_sync_accumulation, strategy)
    counts, diff = results[0]
    print(f"{strategy}: gradient reductions per micro-step {counts}, max param diff {diff:.2e}")
    assert counts[:-1] == [0] * (MICRO_STEPS - 1), f"no_sync() still reduced gradients: {counts}"
    assert counts[-1] > 0, "the synced backward after no_sync() reduced nothing"
    assert diff <= 1e-5


def test_no_sync_only_on_root(ranks2):
    ranks2.run(no_sync_inner_unit_rejected)


def _clip_model():
    """Root FULL_SHARD; blocks[0] a NO_SHARD unit (another mesh); final norm ignored."""
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp import ShardingStrategy
    from fsdp_interactive.fsdp.wrap import CustomPolicy

    inner = C.make_model(0)
    first_block = inner.blocks[0]

    def policy(module: nn.Module):
        if module is first_block:
            return {"sharding_strategy": ShardingStrategy.NO_SHARD}
        return isinstance(module, Block)

    model = FSDP(
        inner,
        auto_wrap_policy=CustomPolicy(policy),
        ignored_modules=[inner.norm],
        use_orig_params=True,
    )
    assert model.blocks[0].sharding_strategy == ShardingStrategy.NO_SHARD
    assert model.blocks[1].sharding_strategy == ShardingStrategy.FULL_SHARD
    return model


def clip_parity(norm_type: float, max_norm: float) -> tuple[float, float, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _clip_model()
    optim = C.make_optimizer(model.parameters())
    C.lm_loss(model, C.local_part(C.batches(0, world), rank, world)).backward()
    # The ignored module's gradients are not reduced by FSDP: average them like a user would.
    for param in model.norm.parameters():
        dist.all_reduce(param.grad)
        param.grad /= world
    total = model.clip_grad_norm_(max_norm, norm_type)
    assert type(total) is torch.Tensor and total.dtype == torch.float32
    optim.step()

    reference = C.make_model(0)
    ref_optim = C.make_optimizer(reference.parameters())
    C.lm_loss(reference, C.batches(0, world)).backward()
    ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    ref_optim.step()
    diff = C.max_param_diff(C.full_params(model), dict(reference.named_parameters()))
    return total.item(), ref_total.item(), diff


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")], ids=["l2", "l1", "inf"])
def test_clip_grad_norm_matches_torch_on_the_reference(ranks2, norm_type):
    results = ranks2.run(clip_parity, norm_type, 0.05)
    for rank, (total, ref_total, diff) in enumerate(results):
        print(
            f"norm {norm_type} rank {rank}: total {total:.6f} ref {ref_total:.6f} diff {diff:.2e}"
        )
        assert total == pytest.approx(ref_total, rel=1e-5), (rank, total, ref_total)
        assert total > 0.05, "the test must actually clip"
        assert diff <= 1e-5


def clip_errors() -> None:
    model = _clip_model()
    with pytest.raises(RuntimeError, match="root"):
        model.blocks[1].clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="norm_type"):
        model.clip_grad_norm_(1.0, norm_type=-1)
    with pytest.raises(ValueError, match="max_norm"):
        model.clip_grad_norm_(-1.0)
    with pytest.raises(TypeError, match="max_norm"):
        model.clip_grad_norm_("big")
    with pytest.warns(UserWarning, match="no gradients"):
        total = model.clip_grad_norm_(1.0)
    assert total.item() == 0.0


def test_clip_grad_norm_errors(ranks2):
    ranks2.run(clip_errors)
