"""Constructor arguments, their validation and what a unit reports, side by side with torch's
FSDP1; world size 1 on a group of its own."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp.conformance._harness import (
    OURS,
    TORCH,
    Check,
    Flavor,
    RankResults,
    assert_all_conform,
    assert_conforms,
    assert_same,
    side_by_side,
    value,
)
from tests.fsdp.conformance._models import Mlp, features, seeded


def _built(model: nn.Module) -> str:
    return type(model).__name__


# ----------------------------------------------------------------------------- attributes


def reported_attributes(fsdp: Flavor) -> dict:
    """What a unit built with FSDP1's defaults says about itself."""
    model = fsdp.wrap(seeded(Mlp))
    return {
        "sharding_strategy": model.sharding_strategy,
        "mixed_precision": model.mixed_precision,
        "cpu_offload": model.cpu_offload,
        "backward_prefetch": model.backward_prefetch,
        "forward_prefetch": model.forward_prefetch,
        "limit_all_gathers": model.limit_all_gathers,
        "compute_device": model.compute_device,
        "rank": model.rank,
        "world_size": model.world_size,
        "process_group_size": model.process_group.size(),
        "module_is_the_model": isinstance(model.module, Mlp),
        "module_is_wrapped_module": model.module is model._fsdp_wrapped_module,
        "children": [name for name, _ in model.named_children()],
        "is_root": model.check_is_root(),
        "passthrough": model.head is model.module.head,
        "fsdp_modules": len(fsdp.cls.fsdp_modules(model)),
        "training": model.training,
    }


def parameter_names(fsdp: Flavor) -> dict:
    """``named_parameters()`` outside and inside ``summon_full_params`` (``use_orig_params``
    so that torch's FSDP1 names the original parameters too)."""
    model = fsdp.wrap(seeded(Mlp), use_orig_params=True)
    outside = [n for n, _ in model.named_parameters()]
    with fsdp.cls.summon_full_params(model):
        inside = [n for n, _ in model.named_parameters()]
    return {"outside": outside, "inside": inside}


def explicit_arguments(fsdp: Flavor) -> dict:
    """Every scalar argument passed with a non-default value is reported back."""
    from torch.distributed.fsdp import CPUOffload, MixedPrecision
    from torch.distributed.fsdp import ShardingStrategy as S

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fsdp.wrap(
        seeded(Mlp),
        sharding_strategy=S.SHARD_GRAD_OP,
        mixed_precision=mp,
        cpu_offload=CPUOffload(offload_params=False),
        backward_prefetch=None,
        forward_prefetch=True,
        use_orig_params=True,
    )
    return {
        "sharding_strategy": model.sharding_strategy,
        "mixed_precision": model.mixed_precision,
        "backward_prefetch": model.backward_prefetch,
        "forward_prefetch": model.forward_prefetch,
    }


def device_id_as_string(fsdp: Flavor) -> str:
    """``device_id="cpu"``: torch passes every ``device_id`` through ``torch.device()``."""
    return str(fsdp.cls(seeded(Mlp), device_id="cpu").compute_device)


def device_id_as_indexed_cpu(fsdp: Flavor) -> str:
    return str(fsdp.cls(seeded(Mlp), device_id=torch.device("cpu")).compute_device.type)


def device_id_bad_string(fsdp: Flavor) -> str:
    return _built(fsdp.cls(seeded(Mlp), device_id="no-such-device"))


# ----------------------------------------------------------------------------- validation


def not_a_module(fsdp: Flavor) -> str:
    return _built(fsdp.wrap("a string"))


def process_group_and_device_mesh(fsdp: Flavor) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return _built(fsdp.wrap(seeded(Mlp), process_group=dist.group.WORLD, device_mesh=mesh))


def ignored_modules_and_ignored_states(fsdp: Flavor) -> str:
    model = seeded(Mlp)
    return _built(fsdp.wrap(model, ignored_modules=[model.stem], ignored_states=[model.body]))


def ignored_states_of_two_kinds(fsdp: Flavor) -> str:
    model = seeded(Mlp)
    return _built(fsdp.wrap(model, ignored_states=[model.stem, model.body.weight]))


def ignored_module_that_is_a_unit(fsdp: Flavor) -> str:
    model = seeded(Mlp)
    model.body = fsdp.wrap(model.body)
    return _built(fsdp.wrap(model, ignored_modules=[model.body]))


def ignored_module_given_as_one_module(fsdp: Flavor) -> str:
    model = seeded(Mlp)
    return _built(fsdp.wrap(model, ignored_modules=model.stem))


def ignored_states_given_params(fsdp: Flavor) -> list:
    model = seeded(Mlp)
    wrapped = fsdp.wrap(model, ignored_states=[model.head.weight])
    return [
        type(wrapped.module.head.weight).__name__ == "Parameter",
        wrapped.module.head.weight.shape,
    ]


def hybrid_with_one_group(fsdp: Flavor) -> str:
    from torch.distributed.fsdp import ShardingStrategy as S

    return _built(
        fsdp.wrap(seeded(Mlp), sharding_strategy=S.HYBRID_SHARD, process_group=dist.group.WORLD)
    )


def wrap_a_unit_again(fsdp: Flavor) -> str:
    """FSDP1 allows nesting by hand: an outer unit around an inner one."""
    inner = fsdp.wrap(seeded(Mlp))
    outer = fsdp.wrap(nn.Sequential(inner, nn.Linear(3, 3)))
    return [outer.check_is_root(), inner.check_is_root(), len(fsdp.cls.fsdp_modules(outer))]


def _bad_arguments(model: nn.Module) -> dict[str, dict]:
    """Arguments FSDP1 code can get wrong, by name (built on every rank alike)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffload, MixedPrecision
    from torch.distributed.fsdp import ShardingStrategy as S

    world = dist.get_world_size()
    mesh1d = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    mesh2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    return {
        "auto_wrap_policy": dict(auto_wrap_policy=5),
        "device_id": dict(device_id=1.5),
        "device_mesh_of_hybrid": dict(sharding_strategy=S.HYBRID_SHARD, device_mesh=mesh1d),
        "ignored_modules_holding_a_parameter": dict(ignored_modules=[model.head.weight]),
        # Below: torch's FSDP1 takes these as they are, or fails later by accident.
        "process_group": dict(process_group="world"),
        "sharding_strategy": dict(sharding_strategy="FULL_SHARD"),
        "cpu_offload": dict(cpu_offload=True),
        "cpu_offload_class": dict(cpu_offload=CPUOffload),
        "backward_prefetch": dict(backward_prefetch="pre"),
        "mixed_precision": dict(mixed_precision=torch.bfloat16),
        "mixed_precision.param_dtype": dict(mixed_precision=MixedPrecision(param_dtype=torch.int8)),
        "param_init_fn": dict(param_init_fn="init"),
        "sync_module_states": dict(sync_module_states="yes"),
        "forward_prefetch": dict(forward_prefetch=1),
        "device_mesh": dict(device_mesh=(2,)),
        "ignored_modules_outside": dict(ignored_modules=[nn.Linear(2, 2)]),
        "ignored_states_outside": dict(ignored_states=[nn.Linear(2, 2).weight]),
        "ignored_modules_the_root": dict(ignored_modules=[model]),
        "device_mesh_2d_for_no_shard": dict(sharding_strategy=S.NO_SHARD, device_mesh=mesh2d),
        "device_mesh_2d_for_full_shard": dict(device_mesh=mesh2d),
    }


def _bad_argument_check(name: str) -> Check:
    def check(fsdp: Flavor) -> str:
        model = seeded(Mlp)
        kwargs = {**fsdp.kwargs, **_bad_arguments(model)[name]}
        return _built(fsdp.cls(model, **kwargs))

    check.__name__ = f"bad_{name}"
    return check


# torch's FSDP1 raises the same exception type.
BAD_ARGUMENTS_REFUSED_ALIKE = [
    _bad_argument_check(name)
    for name in (
        "auto_wrap_policy",
        "device_id",
        "device_mesh_of_hybrid",
        "ignored_modules_holding_a_parameter",
    )
]
# By design: refused here with an error naming the argument, where torch's FSDP1 fails
# later by accident (AttributeError, KeyError), takes the value as it is (a truthy string
# for a flag, a class for a config), ignores objects outside the model, ignores the whole
# model with only a warning, or uses the wrong dimension of a 2-D mesh (its first, of size
# one here: no sharding and no gradient reduction).
BAD_ARGUMENTS_REFUSED_HERE = {
    _bad_argument_check(name): (error, words)
    for name, error, words in (
        ("process_group", "TypeError", "process_group must be"),
        ("sharding_strategy", "TypeError", "sharding_strategy must be"),
        ("cpu_offload", "TypeError", "cpu_offload must be"),
        ("cpu_offload_class", "TypeError", "cpu_offload must be"),
        ("backward_prefetch", "TypeError", "backward_prefetch must be"),
        ("mixed_precision", "TypeError", "mixed_precision must be"),
        ("mixed_precision.param_dtype", "TypeError", "mixed_precision.param_dtype must be"),
        ("param_init_fn", "TypeError", "param_init_fn must be"),
        ("sync_module_states", "TypeError", "sync_module_states must be"),
        ("forward_prefetch", "TypeError", "forward_prefetch must be"),
        ("device_mesh", "TypeError", "device_mesh must be"),
        (
            "ignored_modules_outside",
            "ValueError",
            "ignored_modules contains a Linear that is not inside",
        ),
        (
            "ignored_states_outside",
            "ValueError",
            "ignored_states contains a parameter that is not inside",
        ),
        (
            "ignored_modules_the_root",
            "ValueError",
            "ignored_modules cannot contain the wrapped module",
        ),
        ("device_mesh_2d_for_no_shard", "ValueError", "device_mesh must be 1-D for NO_SHARD"),
        ("device_mesh_2d_for_full_shard", "ValueError", "device_mesh must be 1-D for FULL_SHARD"),
    )
}


REFUSED_ALIKE = [
    process_group_and_device_mesh,
    ignored_modules_and_ignored_states,
    ignored_states_of_two_kinds,
    ignored_module_that_is_a_unit,
    hybrid_with_one_group,
]
ACCEPTED_ALIKE = [wrap_a_unit_again, ignored_states_given_params]


def _construction() -> dict:
    return side_by_side(
        [
            reported_attributes,
            parameter_names,
            explicit_arguments,
            device_id_as_string,
            device_id_as_indexed_cpu,
            device_id_bad_string,
            not_a_module,
            ignored_module_given_as_one_module,
            *REFUSED_ALIKE,
            *ACCEPTED_ALIKE,
            *BAD_ARGUMENTS_REFUSED_ALIKE,
            *BAD_ARGUMENTS_REFUSED_HERE,
        ]
    )


def test_reported_attributes_match(ranks):
    results = RankResults.of(ranks, _construction)
    assert_all_conform(results, [reported_attributes, explicit_arguments])


def test_parameter_names_are_clean_outside_summon_too(ranks):
    """By design: torch's FSDP1 cleans ``_fsdp_wrapped_module.`` out of parameter names only
    inside ``summon_full_params``; here names are clean always, so optimizer parameter
    groups built by name and DCP's keys match the unwrapped model's."""
    outcomes = RankResults.of(ranks, _construction)[parameter_names]
    theirs, ours = value(outcomes[TORCH]), value(outcomes[OURS])
    assert theirs["inside"] == ours["inside"] == ours["outside"]
    assert all(name.startswith("_fsdp_wrapped_module.") for name in theirs["outside"])


def test_device_id_accepts_a_device_string(ranks):
    """Finding: ``device_id="cpu"`` was refused with a ``TypeError``."""
    results = RankResults.of(ranks, _construction)
    assert_all_conform(results, [device_id_as_string, device_id_as_indexed_cpu])
    assert value(results[device_id_as_string][OURS]) == "cpu"
    assert_conforms(results[device_id_bad_string], words="no-such-device")


def test_argument_validation_raises_what_fsdp1_raises(ranks):
    results = RankResults.of(ranks, _construction)
    assert_all_conform(results, REFUSED_ALIKE + BAD_ARGUMENTS_REFUSED_ALIKE, fails=True)
    assert_all_conform(results, ACCEPTED_ALIKE)


def test_mistyped_arguments_are_refused_by_name(ranks):
    """By design (see ``BAD_ARGUMENTS_REFUSED_HERE``): where torch's FSDP1 accepts a wrong
    argument or fails on it by accident, this package raises ``TypeError`` / ``ValueError``
    naming the argument, before the module is touched."""
    results = RankResults.of(ranks, _construction)
    for check, (error, words) in BAD_ARGUMENTS_REFUSED_HERE.items():
        ours = results[check][OURS]
        assert ours.error == error and words in ours.message, (check.__name__, ours.describe())
    for check, argument in (
        (not_a_module, "module"),
        (ignored_module_given_as_one_module, "ignored_modules"),
    ):
        outcomes = results[check]
        assert outcomes[TORCH].error is not None, outcomes[TORCH].describe()
        assert outcomes[OURS].error == "TypeError" and argument in outcomes[OURS].message


# ----------------------------------------------------------------------------- world size 1


def _train_one_step(fsdp: Flavor, **kwargs) -> dict:
    model = fsdp.wrap(seeded(Mlp), **kwargs)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(features()).square().mean()
    loss.backward()
    optim.step()
    with fsdp.cls.summon_full_params(model, writeback=False):
        params = {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }
    return {"strategy": model.sharding_strategy, "loss": loss.detach(), "params": params}


def _strategy_check(strategy_name: str | None, alone: bool = False) -> Check:
    """A check that trains one step with ``strategy_name`` (``None``: FSDP1's default),
    over the default group or (``alone``) over a one-rank ``process_group``."""

    def check(fsdp: Flavor) -> dict:
        from torch.distributed.fsdp import ShardingStrategy

        kwargs = {}
        if strategy_name is not None:
            kwargs["sharding_strategy"] = ShardingStrategy[strategy_name]
        if alone:
            kwargs["process_group"] = dist.new_subgroups(group_size=1)[0]
        return _train_one_step(fsdp, **kwargs)

    check.__name__ = f"{'alone' if alone else 'one_rank'}_{strategy_name or 'default'}"
    check.strategy = strategy_name or "default"  # type: ignore[attr-defined]
    return check


def _strategy_check_named(strategy_name: str, prefix: str) -> Check:
    check = _strategy_check(strategy_name)
    check.__name__ = f"{prefix}_{strategy_name}"
    return check


ONE_RANK = [_strategy_check(s) for s in (None, "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")]
ONE_RANK_HYBRID = _strategy_check("HYBRID_SHARD")
ALONE = [_strategy_check(s, alone=True) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")]


def _world_of_one() -> dict:
    return side_by_side([*ONE_RANK, ONE_RANK_HYBRID])


def _group_of_one() -> dict:
    return side_by_side(ALONE)


def _assert_switched(results: RankResults, checks: list[Check]) -> None:
    """Both flavors ran NO_SHARD, bit for bit alike, and warned (UserWarning) that they
    replaced the strategy asked for, in FSDP1's words."""
    assert_all_conform(results, checks)
    for check in checks:
        asked = check.strategy  # type: ignore[attr-defined]
        outcomes = results[check]
        assert str(value(outcomes[OURS])["strategy"]) == "ShardingStrategy.NO_SHARD"
        switched = f"instead of ShardingStrategy.{'FULL_SHARD' if asked == 'default' else asked} "
        for outcome in outcomes.values():
            found = outcome.warned("FSDP is switching to use `NO_SHARD`")
            if asked == "NO_SHARD":
                assert found == [], found
            else:
                assert (
                    len(found) == 1 and found[0].startswith("UserWarning") and switched in found[0]
                ), found


def test_world_size_one_switches_to_no_shard(ranks1):
    """Finding: at world size 1 FSDP1 runs and reports NO_SHARD for FULL_SHARD and
    SHARD_GRAD_OP, with a UserWarning naming the strategy it replaced."""
    _assert_switched(RankResults.of(ranks1, _world_of_one), ONE_RANK)


def test_hybrid_shard_without_groups_when_wrapping_by_hand(ranks1):
    """By design: torch's FSDP1 refuses HYBRID_SHARD without ``process_group`` or
    ``device_mesh`` unless an auto-wrap policy builds the units (each unit wrapped by hand
    would make its own node groups). This package builds the hybrid mesh once per default
    group from the world size and ``LOCAL_WORLD_SIZE``, so wrapping by hand works; over one
    rank it runs NO_SHARD, as every strategy does there."""
    outcomes = RankResults.of(ranks1, _world_of_one)[ONE_RANK_HYBRID]
    assert outcomes[TORCH].error == "ValueError"
    assert "requires explicit specification of process group" in outcomes[TORCH].message
    assert str(value(outcomes[OURS])["strategy"]) == "ShardingStrategy.NO_SHARD"


def test_a_group_of_one_switches_to_no_shard(ranks):
    _assert_switched(RankResults.of(ranks, _group_of_one), ALONE)


# ----------------------------------------------------------------------------- init


def _deterministic_init(module: nn.Module) -> None:
    """``param_init_fn``: materialize on CPU, each parameter ``arange / 10`` (no RNG)."""
    module.to_empty(device=torch.device("cpu"), recurse=False)
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.copy_(torch.arange(param.numel(), dtype=param.dtype).reshape(param.shape) / 10)
        for buf in module.buffers(recurse=False):
            buf.fill_(0.5)


def _full(fsdp: Flavor, model: nn.Module) -> dict:
    with fsdp.cls.summon_full_params(model, writeback=False):
        params = {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }
    return {**params, "buffers": [b.clone() for b in model.buffers()]}


def meta_model_with_param_init_fn(fsdp: Flavor) -> dict:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with torch.device("meta"):
        inner = Mlp()
    model = fsdp.wrap(
        inner, param_init_fn=_deterministic_init, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})
    )
    return _full(fsdp, model)


def sync_module_states_on_cpu(fsdp: Flavor) -> dict:
    """Every rank starts from its own seed; ``sync_module_states`` makes rank 0's win."""
    model = fsdp.wrap(seeded(Mlp, seed=dist.get_rank()), sync_module_states=True)
    return _full(fsdp, model)


def cpu_offload_on_cpu(fsdp: Flavor) -> dict:
    from torch.distributed.fsdp import CPUOffload

    return _train_one_step(fsdp, cpu_offload=CPUOffload(offload_params=True))


def _init() -> dict:
    return side_by_side(
        [meta_model_with_param_init_fn, sync_module_states_on_cpu, cpu_offload_on_cpu]
    )


def test_meta_device_model_with_param_init_fn(ranks):
    assert_conforms(RankResults.of(ranks, _init)[meta_model_with_param_init_fn])


def test_sync_module_states_and_cpu_offload_on_cpu_ranks(ranks):
    """By design: torch's FSDP1 needs an accelerator for both (``sync_module_states``
    refuses CPU modules with ``ValueError``; ``CPUOffload(offload_params=True)`` fails);
    this package runs them on CPU ranks: rank 0's weights everywhere, and the same step as
    without offloading."""
    results = RankResults.of(ranks, _init)
    synced = results.every_rank(sync_module_states_on_cpu)
    for outcomes in synced:
        assert outcomes[TORCH].error is not None
    rank0 = value(synced[0][OURS])
    assert_same(_full_reference(), rank0)
    for outcomes in synced[1:]:
        assert_same(rank0, value(outcomes[OURS]))
    offloaded = results[cpu_offload_on_cpu]
    assert offloaded[TORCH].error is not None
    plain = value(RankResults.of(ranks, _world_of_many)["many_FULL_SHARD"][OURS])
    assert_same(plain, value(offloaded[OURS]))


def _full_reference() -> dict:
    model = seeded(Mlp, seed=0)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {**params, "buffers": [b.clone() for b in model.buffers()]}


def _world_of_many() -> dict:
    return side_by_side([_strategy_check_named("FULL_SHARD", "many")])
