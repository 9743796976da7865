"""Construction: bad input, rollback on failure, unit selection (vs. torch FSDP1), ignored
states, passthrough, roots, meshes per strategy, module-state sync, manual wrapping.
Mixed precision, prefetch and activation checkpointing: ``test_precision_and_prefetch.py``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.fsdp import _common as C
from tests.models import DIM, VOCAB, Block, TinyLM


def _untouched(model: nn.Module, params_before: list, classes_before: list) -> None:
    assert [type(m) for m in model.modules()] == classes_before, "classes changed"
    params_now = list(model.parameters())
    assert len(params_now) == len(params_before)
    assert all(a is b for a, b in zip(params_now, params_before, strict=True)), "params replaced"
    assert not any(isinstance(p, DTensor) for p in params_now)
    assert all(not m._forward_pre_hooks for m in model.modules()), "hooks left behind"


def bad_inputs() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_interactive.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model = C.make_model(0)
    before, classes = list(model.parameters()), [type(m) for m in model.modules()]
    outsider = nn.Linear(2, 2)
    mesh1d = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    mesh2d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    cases = [
        (TypeError, "module", dict(module=[model])),
        (TypeError, "process_group", dict(process_group="world")),
        (
            ValueError,
            "process_group and device_mesh",
            dict(process_group=dist.group.WORLD, device_mesh=mesh1d),
        ),
        (TypeError, "sharding_strategy", dict(sharding_strategy="FULL_SHARD")),
        (TypeError, "cpu_offload", dict(cpu_offload=True)),
        (TypeError, "auto_wrap_policy", dict(auto_wrap_policy=5)),
        (TypeError, "backward_prefetch", dict(backward_prefetch="pre")),
        (TypeError, "mixed_precision", dict(mixed_precision=torch.bfloat16)),
        (TypeError, "param_dtype", dict(mixed_precision=MixedPrecision(param_dtype=torch.int8))),
        (TypeError, "param_init_fn", dict(param_init_fn="init")),
        (TypeError, "device_id", dict(device_id=1.5)),
        (TypeError, "sync_module_states", dict(sync_module_states="yes")),
        (TypeError, "forward_prefetch", dict(forward_prefetch=1)),
        (TypeError, "device_mesh", dict(device_mesh=(2,))),
        (
            ValueError,
            "mutually exclusive",
            dict(ignored_modules=[model.head], ignored_states=[model.norm]),
        ),
        (TypeError, "ignored_modules", dict(ignored_modules=model.head)),
        (ValueError, "ignored_modules", dict(ignored_modules=[model.head.weight])),
        (ValueError, "not inside module", dict(ignored_modules=[outsider])),
        (ValueError, "itself", dict(ignored_modules=[model])),
        (ValueError, "ignored_states", dict(ignored_states=[model.head, model.norm.weight])),
        (ValueError, "not inside module", dict(ignored_states=[outsider.weight])),
        (
            ValueError,
            "tuple",
            dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=dist.group.WORLD),
        ),
        (
            ValueError,
            "1-D for NO_SHARD",
            dict(sharding_strategy=ShardingStrategy.NO_SHARD, device_mesh=mesh2d),
        ),
        (
            ValueError,
            "2-D for HYBRID_SHARD",
            dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh1d),
        ),
        (ValueError, "1-D for FULL_SHARD", dict(device_mesh=mesh2d)),
        (TypeError, "cpu_offload", dict(cpu_offload=CPUOffload)),
    ]
    if torch.accelerator.current_accelerator() is None:
        cases.append((ValueError, "device_id=0", dict(device_id=0)))
    for exc, match, kwargs in cases:
        kwargs = {"module": model, **kwargs}
        with pytest.raises(exc, match=match):
            FSDP(**kwargs)
        _untouched(model, before, classes)


def _failing_init(calls: list, fail_at: int):
    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        if len(calls) == fail_at:
            raise RuntimeError("init failed on purpose")
        module.to_empty(device="cpu", recurse=False)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)

    return init


class ExplodingHead(nn.Linear):
    """A head whose forward-hook registration fails: fully_shard fails on it mid-wrap."""

    def register_forward_pre_hook(self, *args, **kwargs):
        raise RuntimeError("hook registration failed on purpose")


def failure_midway_restores_module() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    # 1) fully_shard itself fails on the head, after both blocks became units.
    model = C.make_model(0)
    model.head.__class__ = ExplodingHead
    before, classes = list(model.parameters()), [type(m) for m in model.modules()]
    children = {n: c for n, c in model.named_modules()}
    tokens = C.batches(0, 1)[:, :-1]
    model.head.__class__ = nn.Linear
    expected = model(tokens)
    model.head.__class__ = ExplodingHead
    with pytest.raises(RuntimeError, match="on purpose"):
        FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block, ExplodingHead}))
    _untouched(model, before, classes)
    assert dict(model.named_modules()) == children, "units left in place of submodules"
    model.head.__class__ = nn.Linear
    torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)

    # 2) param_init_fn fails while materializing a meta model, after some units were built.
    with torch.device("meta"):
        meta_model = TinyLM()
    before, classes = list(meta_model.parameters()), [type(m) for m in meta_model.modules()]
    calls: list = []
    with pytest.raises(RuntimeError, match="on purpose"):
        FSDP(
            meta_model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            param_init_fn=_failing_init(calls, fail_at=9),
        )
    assert len(calls) == 9
    _untouched(meta_model, before, classes)
    assert all(p.is_meta for p in meta_model.parameters())


def ignored_states_untouched() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    inner = C.make_model(0)
    ignored_weight = inner.head.weight
    model = FSDP(inner, auto_wrap_policy=ModuleWrapPolicy({Block}), ignored_modules=[inner.norm])
    assert not isinstance(model.norm.weight, DTensor) and model.norm.weight.shape == (DIM,)
    assert isinstance(model.embed.weight, DTensor)
    C.lm_loss(model, C.local_part(C.batches(0, world), rank, world)).backward()
    grads = [torch.empty_like(model.norm.weight.grad) for _ in range(world)]
    dist.all_gather(grads, model.norm.weight.grad)
    assert not torch.equal(grads[0], grads[1]), "ignored gradients must not be reduced"

    inner2 = C.make_model(0)
    model2 = FSDP(inner2, ignored_states=[inner2.head.weight])
    assert model2.head.weight is inner2.head.weight and not isinstance(model2.head.weight, DTensor)
    assert isinstance(model2.head.bias, DTensor)
    assert isinstance(model.head.weight, DTensor) and ignored_weight is not model.head.weight


def passthrough_and_roots() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    inner = C.make_model(0)
    model = FSDP(inner, auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert model.module is inner and model._fsdp_wrapped_module is inner
    assert model.blocks is inner.blocks  # attribute passthrough
    assert isinstance(model.blocks[0], FSDP) and isinstance(model.blocks[0].module, Block)
    assert model.blocks[0].attn is model.blocks[0].module.attn
    seq = FSDP(nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2)))
    assert isinstance(seq[1], nn.Linear)  # index passthrough
    units = FSDP.fsdp_modules(model)
    assert units[0] is model and len(units) == 3
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    assert model.check_is_root() and not any(u.check_is_root() for u in units[1:])
    # Manual nesting: the inner unit stops being a root once wrapped.
    block = FSDP(Block(DIM))
    assert block.check_is_root()
    outer = FSDP(nn.Sequential(block, nn.Linear(DIM, DIM)))
    assert outer.check_is_root() and not block.check_is_root()
    holder = nn.ModuleDict({"a": FSDP(nn.Linear(2, 2)), "b": FSDP(nn.Linear(2, 2))})
    assert len(FSDP.fsdp_modules(holder, root_only=True)) == 2
    with pytest.raises(ValueError, match="fully_shard"):
        FSDP(model.blocks[0].module)


def meshes_per_strategy() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp import ShardingStrategy

    world = dist.get_world_size()
    expected = {
        "FULL_SHARD": ((world,), (Shard(0),)),
        "SHARD_GRAD_OP": ((world,), (Shard(0),)),
        "NO_SHARD": ((world, 1), (Replicate(), Shard(0))),
    }
    for name, (shape, placements) in expected.items():
        model = FSDP(C.make_model(0), sharding_strategy=ShardingStrategy[name])
        param = model.embed.weight
        assert tuple(param.device_mesh.shape) == shape, name
        assert tuple(param.placements) == placements, name
        assert model.world_size == (1 if name == "NO_SHARD" else world)
        assert param.to_local().shape[0] == VOCAB // model.world_size


def hybrid_meshes_from_groups_and_env() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp import ShardingStrategy

    rank, world = dist.get_rank(), dist.get_world_size()
    intra, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    inter, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    model = FSDP(
        C.make_model(0),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        process_group=(intra, inter),
    )
    param = model.embed.weight
    assert tuple(param.device_mesh.shape) == (2, 2)
    assert tuple(param.placements) == (Replicate(), Shard(0))
    assert param.device_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    optim = C.make_optimizer(model.parameters())
    for step in range(2):
        C.lm_loss(model, C.local_part(C.batches(step, world), rank, world)).backward()
        optim.step()
        optim.zero_grad()
    ref = C.train_reference(2, world)
    assert C.max_param_diff(C.full_params(model), ref.params) <= 1e-5
    # clip_grad_norm_ over the 2-D mesh: reduced over the shard dimension only.
    C.lm_loss(model, C.local_part(C.batches(5, world), rank, world)).backward()
    reference = C.make_model(0)
    reference.load_state_dict(ref.params)  # the trained reference
    C.lm_loss(reference, C.batches(5, world)).backward()
    for norm_type in (2.0, float("inf")):
        expected = torch.nn.utils.get_total_norm(
            [p.grad for p in reference.parameters()], norm_type
        )
        total = model.clip_grad_norm_(1e9, norm_type)  # no clipping: compare norms only
        assert abs(total.item() - expected.item()) <= 1e-5 * expected.item(), (total, expected)

    # FULL_SHARD over a sub-group: each pair of ranks is its own data-parallel job.
    pair = FSDP(C.make_model(0), process_group=intra)
    assert tuple(pair.embed.weight.device_mesh.shape) == (2,) and pair.world_size == 2
    pair_rank = dist.get_rank(intra)
    pair_optim = C.make_optimizer(pair.parameters())
    for step in range(2):
        C.lm_loss(pair, C.local_part(C.batches(step, 2), pair_rank, 2)).backward()
        pair_optim.step()
        pair_optim.zero_grad()
    assert C.max_param_diff(C.full_params(pair), C.train_reference(2, 2).params) <= 1e-5

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        zero2 = FSDP(C.make_model(0), sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2)
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    assert tuple(zero2.embed.weight.device_mesh.shape) == (2, 2)
    assert zero2.world_size == 2
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    try:
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
            FSDP(C.make_model(0), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def sync_module_states_broadcasts_rank0() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    rank = dist.get_rank()
    inner = C.make_model(seed=rank)  # every rank starts from different weights
    inner.register_buffer("counter", torch.full((3,), float(rank)))
    model = FSDP(inner, auto_wrap_policy=ModuleWrapPolicy({Block}), sync_module_states=True)
    rank0 = dict(C.make_model(seed=0).named_parameters())
    with FSDP.summon_full_params(model, writeback=False):
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, rank0[name], rtol=0, atol=0)
    assert model.module.counter.tolist() == [0.0, 0.0, 0.0]


def device_id_cpu() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(C.make_model(0), device_id=torch.device("cpu"))
    assert model.compute_device == torch.device("cpu")
    assert model.embed.weight.device_mesh.device_type == "cpu"


def test_bad_inputs_raise_and_leave_module_untouched(ranks2):
    ranks2.run(bad_inputs)


def test_no_process_group_is_a_clear_error():
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    if dist.is_initialized():
        pytest.skip("this process has a default group")
    with pytest.raises(RuntimeError, match="init_process_group"):
        FSDP(nn.Linear(2, 2))


def test_failure_midway_restores_the_module(ranks2):
    ranks2.run(failure_midway_restores_module)


def test_ignored_modules_and_parameters(ranks2):
    ranks2.run(ignored_states_untouched)


def test_passthrough_roots_and_fsdp_modules(ranks2):
    ranks2.run(passthrough_and_roots)


def test_meshes_per_strategy(ranks2):
    ranks2.run(meshes_per_strategy)


@pytest.mark.world4
def test_hybrid_mesh_from_group_pair_and_local_world_size(ranks4):
    ranks4.run(hybrid_meshes_from_groups_and_env)


def test_sync_module_states(ranks2):
    ranks2.run(sync_module_states_broadcasts_rank0)


def test_device_id_cpu(ranks2):
    ranks2.run(device_id_cpu)


def manual_wrap_and_named_param_groups() -> None:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import enable_wrap, wrap

    rank, world = dist.get_rank(), dist.get_world_size()
    inner = C.make_model(0)
    with enable_wrap(wrapper_cls=FSDP):
        inner.blocks[0] = wrap(inner.blocks[0])
    model = FSDP(inner, use_orig_params=True)
    assert isinstance(model.blocks[0], FSDP) and not model.blocks[0].check_is_root()

    def groups(named):
        named = list(named)
        return [
            {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.05},
            {"params": [p for n, p in named if not n.endswith("bias")], "lr": 0.1},
        ]

    optim = torch.optim.SGD(groups(model.named_parameters()), momentum=0.9)
    reference = C.make_model(0)
    ref_optim = torch.optim.SGD(groups(reference.named_parameters()), momentum=0.9)
    for step in range(2):
        C.lm_loss(model, C.local_part(C.batches(step, world), rank, world)).backward()
        optim.step()
        optim.zero_grad()
        C.lm_loss(reference, C.batches(step, world)).backward()
        ref_optim.step()
        ref_optim.zero_grad()
    assert C.max_param_diff(C.full_params(model), dict(reference.named_parameters())) <= 1e-5


def test_manual_wrap_and_per_parameter_optimizer_groups(ranks2):
    ranks2.run(manual_wrap_and_named_param_groups)
