"""summon_full_params in all its modes, apply(), and clean names, on two gloo ranks.

Assertions run on the ranks; a failing rank fails the test with its traceback.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tests.fsdp import _common as C
from tests.models import DIM, Block


def _wrapped(strategy: str = "FULL_SHARD", bf16: bool = False) -> nn.Module:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp import MixedPrecision, ShardingStrategy
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    return FSDP(
        C.make_model(0),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None,
        use_orig_params=True,
    )


def summon_read_only_and_identity(strategy: str, bf16: bool) -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model = _wrapped(strategy, bf16)
    reference = dict(C.make_model(0).named_parameters())
    before = {n: p for n, p in model.named_parameters()}
    assert set(before) == set(reference), "named_parameters() must give the unwrapped names"
    assert all(isinstance(p, DTensor) for p in before.values())
    with FSDP.summon_full_params(model, writeback=False):
        inside = dict(model.named_parameters())
        assert set(inside) == set(reference)
        for name, param in inside.items():
            assert not isinstance(param, DTensor), name
            assert param.dtype == torch.float32, f"{name}: summoned in {param.dtype}"
            torch.testing.assert_close(param, reference[name], rtol=0, atol=0)
            param.data.add_(1.0)  # discarded: writeback=False
    after = dict(model.named_parameters())
    assert all(after[n] is before[n] for n in before), "sharded parameter objects must be kept"
    with FSDP.summon_full_params(model, writeback=False):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, reference[name], rtol=0, atol=0)


def summon_writeback_persists(strategy: str) -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model = _wrapped(strategy)
    optim = C.make_optimizer(model.parameters())
    optim_params = [p for g in optim.param_groups for p in g["params"]]
    reference = dict(C.make_model(0).named_parameters())
    with FSDP.summon_full_params(model, writeback=True):
        for _, param in model.named_parameters():
            param.data.mul_(2.0)
        model.head.weight.data[0].fill_(7.0)  # attribute passthrough: head is a unit
    assert [p for g in optim.param_groups for p in g["params"]] == optim_params
    assert all(a is b for a, b in zip(optim_params, model.parameters(), strict=True))
    with FSDP.summon_full_params(model, writeback=False):
        for name, param in model.named_parameters():
            expected = reference[name] * 2.0
            if name == "head.weight":
                expected[0] = 7.0
            torch.testing.assert_close(param, expected, rtol=0, atol=0)
    # A training step still runs on the written-back shards.
    loss = C.lm_loss(model, C.local_part(C.batches(0, 2), dist.get_rank(), 2))
    loss.backward()
    optim.step()


def summon_rank0_only_offload() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model = _wrapped()
    reference = dict(C.make_model(0).named_parameters())
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
        for name, param in model.named_parameters():
            if dist.get_rank() == 0:
                assert param.device.type == "cpu"
                torch.testing.assert_close(param, reference[name], rtol=0, atol=0)
            else:
                assert isinstance(param, DTensor), f"rank {dist.get_rank()} got a full {name}"


def summon_recurse_false_and_nested() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model = _wrapped()
    with FSDP.summon_full_params(model, recurse=False, writeback=False):
        kinds = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
    # The root owns embed/norm/head; the blocks are their own units and stay sharded.
    assert not kinds["embed.weight"] and not kinds["head.weight"]
    assert kinds["blocks.0.attn.qkv.weight"] and kinds["blocks.1.mlp.0.bias"]
    block = model.blocks[0]
    assert isinstance(block, FSDP)
    with FSDP.summon_full_params(block, writeback=False):
        assert block.attn.qkv.weight.shape == (3 * DIM, DIM)
        assert isinstance(model.blocks[1].attn.qkv.weight, DTensor)
        assert isinstance(model.embed.weight, DTensor)
    # A plain container holding units: recurse finds them.
    holder = nn.Sequential(_wrapped())
    with FSDP.summon_full_params(holder, writeback=False):
        assert all(not isinstance(p, DTensor) for p in holder.parameters())


def summon_with_grads() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _wrapped()
    C.lm_loss(model, C.local_part(C.batches(0, world), rank, world)).backward()
    reference = C.make_model(0)
    C.lm_loss(reference, C.batches(0, world)).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        for name, param in model.named_parameters():
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-5, atol=1e-6)
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def summon_uneven_writeback() -> None:
    """Parameters whose dim 0 does not divide by the world size (7 rows on 2 ranks)."""
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 3))
    model = FSDP(nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 3)), auto_wrap_policy=_every_linear)
    with FSDP.summon_full_params(model):
        for (_, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
            p.data.copy_(q.data * 3.0)
    with FSDP.summon_full_params(model, writeback=False):
        for (_, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
            torch.testing.assert_close(p, q * 3.0, rtol=0, atol=0)
    x = torch.randn(5, 4)
    torch.testing.assert_close(model(x), _scaled_forward(plain, x), rtol=1e-5, atol=1e-5)


def _scaled_forward(plain: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    w0, b0 = plain[0].weight * 3.0, plain[0].bias * 3.0
    w1, b1 = plain[1].weight * 3.0, plain[1].bias * 3.0
    return (x @ w0.T + b0) @ w1.T + b1


def _every_linear(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, nn.Linear)


def summon_errors() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model = _wrapped()
    with (
        pytest.raises(NotImplementedError, match="rank0_only"),
        FSDP.summon_full_params(model, rank0_only=True, writeback=True),
    ):
        pass
    with (
        pytest.raises(NotImplementedError, match="with_grads"),
        FSDP.summon_full_params(model, with_grads=True, offload_to_cpu=True),
    ):
        pass
    with (
        pytest.raises(TypeError, match="writeback"),
        FSDP.summon_full_params(model, writeback="yes"),
    ):
        pass
    tokens = C.local_part(C.batches(0, 2), dist.get_rank(), 2)
    with FSDP.summon_full_params(model, writeback=False):
        with (
            pytest.raises(AssertionError, match="already unsharding"),
            FSDP.summon_full_params(model),
        ):
            pass
        with pytest.raises(RuntimeError, match="forward"):
            model(tokens[:, :-1])
    # During backward (from a gradient hook on an activation).
    seen: list[str] = []

    def in_backward(grad: torch.Tensor) -> torch.Tensor:
        try:
            with FSDP.summon_full_params(model):
                seen.append("no error")
        except AssertionError as exc:
            seen.append(str(exc))
        return grad

    logits = model(tokens[:, :-1])
    logits.register_hook(in_backward)
    logits.float().sum().backward()
    assert seen and "backward" in seen[0], seen
    # Still usable afterwards.
    with FSDP.summon_full_params(model, writeback=False):
        pass


def apply_on_full_params() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.copy_(
                    torch.arange(module.weight.numel(), dtype=torch.float32).reshape(
                        module.weight.shape
                    )
                    / 100.0
                )

    model = _wrapped()
    plain = C.make_model(0)
    assert model.apply(init) is model
    plain.apply(init)
    with FSDP.summon_full_params(model, writeback=False):
        for (n, p), (m, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
            assert n == m
            torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_summon_reads_full_original_dtype_params(ranks2, strategy):
    ranks2.run(summon_read_only_and_identity, strategy, strategy == "FULL_SHARD")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_summon_writeback_keeps_parameter_identity(ranks2, strategy):
    ranks2.run(summon_writeback_persists, strategy)


def test_summon_rank0_only_offload_to_cpu(ranks2):
    ranks2.run(summon_rank0_only_offload)


def test_summon_recurse_false_and_nested_units(ranks2):
    ranks2.run(summon_recurse_false_and_nested)


def test_summon_with_grads_gives_full_gradients(ranks2):
    ranks2.run(summon_with_grads)


def test_summon_writeback_with_uneven_shards(ranks2):
    ranks2.run(summon_uneven_writeback)


def test_summon_errors(ranks2):
    ranks2.run(summon_errors)


def test_apply_runs_on_full_params(ranks2):
    ranks2.run(apply_on_full_params)


def summon_after_inference_forward() -> None:
    """SHARD_GRAD_OP keeps parameters unsharded after a forward without backward; summon
    reshards first, so it reads (and writes back to) the sharded parameters."""
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model = _wrapped("SHARD_GRAD_OP")
    sharded = list(model.parameters())
    with torch.no_grad():
        model(C.batches(0, 1)[:, :-1])
    assert not all(isinstance(p, DTensor) for p in model.parameters())
    reference = dict(C.make_model(0).named_parameters())
    with FSDP.summon_full_params(model):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, reference[name], rtol=0, atol=0)
            param.data.zero_()
    assert all(a is b for a, b in zip(model.parameters(), sharded, strict=True))
    assert all(p.to_local().abs().sum() == 0 for p in model.parameters())


def test_summon_after_inference_forward(ranks2):
    ranks2.run(summon_after_inference_forward)
