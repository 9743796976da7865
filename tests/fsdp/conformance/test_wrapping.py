"""Auto-wrap policies and nesting, side by side with torch's FSDP1: the same units (by
clean name), the same per-unit arguments, the same forward outputs bit for bit."""

from __future__ import annotations

import functools

import torch
from torch import nn

from tests.fsdp.conformance._harness import (
    OURS,
    TORCH,
    Check,
    Flavor,
    RankResults,
    assert_all_conform,
    assert_conforms,
    assert_reduced_alike,
    assert_same,
    side_by_side,
    value,
)
from tests.fsdp.conformance._models import (
    Block,
    Frozen,
    Holder,
    Stack,
    UsesHolder,
    features,
    seeded,
    tokens,
)

_PREFIX = "_fsdp_wrapped_module."


def clean(name: str) -> str:
    return name.replace(_PREFIX, "").replace("_fsdp_wrapped_module", "")


def unit_names(fsdp: Flavor, model: nn.Module) -> list[str]:
    """Clean names of every unit in ``model``, in ``named_modules()`` order."""
    return [clean(name) for name, m in model.named_modules() if isinstance(m, fsdp.cls)]


def _wrapped_stack(fsdp: Flavor, policy: object, **kwargs: object) -> dict:
    model = fsdp.wrap(seeded(Stack), auto_wrap_policy=policy, **kwargs)
    with torch.no_grad():
        out = model(tokens())
    return {
        "units": unit_names(fsdp, model),
        "strategies": [str(u.sharding_strategy) for u in fsdp.cls.fsdp_modules(model)],
        "output": out,
    }


def _policies() -> dict[str, object]:
    from torch.distributed.fsdp.wrap import (
        CustomPolicy,
        ModuleWrapPolicy,
        always_wrap_policy,
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    def every_linear(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or isinstance(module, nn.Linear)

    return {
        "module_wrap": ModuleWrapPolicy({Block}),
        "module_wrap_two_classes": ModuleWrapPolicy({Block, nn.Embedding}),
        "custom": CustomPolicy(lambda m: isinstance(m, nn.Linear | nn.LayerNorm)),
        "size_based_100": functools.partial(size_based_auto_wrap_policy, min_num_params=100),
        "size_based_300": functools.partial(size_based_auto_wrap_policy, min_num_params=300),
        "transformer": functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        "lambda": functools.partial(
            lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.LayerNorm)
        ),
        "always": always_wrap_policy,
        "plain_callable": every_linear,
    }


def _policy_check(name: str) -> Check:
    def check(fsdp: Flavor) -> dict:
        return _wrapped_stack(fsdp, _policies()[name])

    check.__name__ = f"policy_{name}"
    return check


POLICIES = [
    _policy_check(name)
    for name in (
        "module_wrap",
        "module_wrap_two_classes",
        "custom",
        "size_based_100",
        "size_based_300",
        "transformer",
        "lambda",
        "always",
        "plain_callable",
    )
]


def custom_policy_overrides_arguments(fsdp: Flavor) -> dict:
    """A ``CustomPolicy`` returning a dict overrides constructor arguments per unit."""
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy

    def per_block(module: nn.Module) -> bool | dict:
        if isinstance(module, Block):
            return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
        return isinstance(module, nn.Embedding)

    return _wrapped_stack(fsdp, CustomPolicy(per_block))


def manual_wrap_with_enable_wrap(fsdp: Flavor) -> dict:
    """``enable_wrap(wrapper_cls=...)`` + ``wrap()``: units by hand, then the root."""
    from torch.distributed.fsdp.wrap import enable_wrap, wrap

    model = seeded(Stack)
    with enable_wrap(wrapper_cls=fsdp.cls, **fsdp.kwargs):
        model.blocks[0] = wrap(model.blocks[0])
        model.head = wrap(model.head)
    root = fsdp.wrap(model)
    with torch.no_grad():
        out = root(tokens())
    return {
        "units": unit_names(fsdp, root),
        "roots": [u.check_is_root() for u in fsdp.cls.fsdp_modules(root)],
        "root_only": len(fsdp.cls.fsdp_modules(root, root_only=True)),
        "output": out,
    }


def nested_by_hand(fsdp: Flavor) -> dict:
    """Units built by hand inside a plain module, then a root around them."""
    model = seeded(Stack)
    model.blocks[0] = fsdp.wrap(model.blocks[0])
    model.blocks[1] = fsdp.wrap(model.blocks[1])
    root = fsdp.wrap(model)
    with torch.no_grad():
        out = root(tokens())
    return {
        "after": [u.check_is_root() for u in fsdp.cls.fsdp_modules(root)],
        "units": unit_names(fsdp, root),
        "output": out,
    }


def asked_for_root_before_nesting(fsdp: Flavor) -> dict:
    """The roots of a plain module holding units (``fsdp_modules(root_only=True)``), then a
    unit built around them, then a forward."""
    model = seeded(Stack)
    model.blocks[0] = fsdp.wrap(model.blocks[0])
    model.blocks[1] = fsdp.wrap(model.blocks[1])
    before = len(fsdp.cls.fsdp_modules(model, root_only=True))
    root = fsdp.wrap(model)
    with torch.no_grad():
        out = root(tokens())
    return {"before": before, "after": model.blocks[0].check_is_root(), "output": out}


def auto_wrap_over_existing_units(fsdp: Flavor) -> list:
    """Finding: an auto-wrap policy over a tree that holds units raises ``ValueError``."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = seeded(Stack)
    model.blocks[0] = fsdp.wrap(model.blocks[0])
    return unit_names(fsdp, fsdp.wrap(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear})))


def ignored_module_is_not_wrapped(fsdp: Flavor) -> dict:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = seeded(Stack)
    wrapped = fsdp.wrap(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block, nn.Linear}),
        ignored_modules=[model.blocks[1]],
    )
    with torch.no_grad():
        out = wrapped(tokens())
    return {
        "units": unit_names(fsdp, wrapped),
        "ignored_stay_plain": [type(p).__name__ for p in model.blocks[1].parameters()],
        "output": out,
    }


def forwardless_module_selected(fsdp: Flavor) -> list:
    """Finding: a selected module without ``forward`` becomes a unit, as in FSDP1."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = fsdp.wrap(seeded(UsesHolder), auto_wrap_policy=ModuleWrapPolicy({Holder}))
    return unit_names(fsdp, model)


def forwardless_module_and_its_children(fsdp: Flavor) -> list:
    """FSDP1's "batch norm always wrapped individually" pattern: an ``_or_policy`` wraps the
    forward-less container and, separately, the normalization layer inside it."""
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy

    def container(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or isinstance(module, Holder)

    policy = functools.partial(
        _or_policy,
        policies=[
            container,
            functools.partial(
                lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.LayerNorm)
            ),
        ],
    )
    model = fsdp.wrap(seeded(UsesHolder), auto_wrap_policy=policy)
    return unit_names(fsdp, model)


def forwardless_unit_trains(fsdp: Flavor) -> dict:
    """By design: the parent's forward uses a forward-less unit's layers. torch's FSDP1
    computes with its sharded flat parameter and fails; here the parent's forward gathers
    the unit and the end of the backward reduces its gradients."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = fsdp.wrap(seeded(UsesHolder), auto_wrap_policy=ModuleWrapPolicy({Holder}))
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(2):
        loss = model(features(step)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    with torch.no_grad():
        evaluated = model(features(5))
    with fsdp.cls.summon_full_params(model, writeback=False):
        params = {clean(n): p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "eval": evaluated, "params": params}


def forwardless_reference() -> dict:
    """:func:`forwardless_unit_trains` without FSDP: every rank's batch, gradients averaged."""
    import torch.distributed as dist

    world = dist.get_world_size()
    model = seeded(UsesHolder)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        loss = sum(model(features(step, rank)).square().mean() for rank in range(world)) / world
        loss.backward()
        optim.step()
        optim.zero_grad()
    with torch.no_grad():
        evaluated = model(features(5))
    return {
        "eval": evaluated,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def mixed_precision_wraps_batch_norm_apart(fsdp: Flavor) -> dict:
    """Under mixed precision, auto-wrap makes batch norm its own unit without it (FSDP1's
    ``_module_classes_to_ignore``) and warns that it did."""
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    model = fsdp.wrap(
        inner,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
    )
    with torch.no_grad():
        out = model(features())
    return {
        "units": unit_names(fsdp, model),
        "param_dtypes": [str(u.mixed_precision.param_dtype) for u in fsdp.cls.fsdp_modules(model)],
        "output": out,
    }


def frozen_and_trainable_in_one_unit(fsdp: Flavor) -> dict:
    """``use_orig_params=True`` (FSDP1 needs it to mix frozen and trainable parameters in
    one unit): the same units, outputs and gradients-free parameters."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = fsdp.wrap(
        seeded(Frozen), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), use_orig_params=True
    )
    with torch.no_grad():
        out = model(features())
    return {"units": unit_names(fsdp, model), "output": out}


def always_wrap_with_a_module_list(fsdp: Flavor) -> dict:
    """``always_wrap_policy`` on a model whose blocks sit in an ``nn.ModuleList``."""
    from torch.distributed.fsdp.wrap import always_wrap_policy

    from tests.models import TinyLM

    torch.manual_seed(0)
    model = fsdp.wrap(TinyLM(n_blocks=2, dim=8, vocab=11), auto_wrap_policy=always_wrap_policy)
    with torch.no_grad():
        out = model(tokens())
    return {"units": unit_names(fsdp, model), "output": out}


def frozen_and_trainable_with_flat_parameters(fsdp: Flavor) -> dict:
    """One unit mixing frozen and trainable parameters, ``use_orig_params=False``."""
    model = fsdp.wrap(seeded(Frozen))
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(features()).square().mean().backward()
    optim.step()
    with fsdp.cls.summon_full_params(model, writeback=False):
        return {clean(n): p.detach().clone() for n, p in model.named_parameters()}


def frozen_and_trainable_with_orig_params(fsdp: Flavor) -> dict:
    model = fsdp.wrap(seeded(Frozen), use_orig_params=True)
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(features()).square().mean().backward()
    optim.step()
    with fsdp.cls.summon_full_params(model, writeback=False):
        return {clean(n): p.detach().clone() for n, p in model.named_parameters()}


def _wrapping() -> dict:
    return side_by_side(
        [
            *POLICIES,
            custom_policy_overrides_arguments,
            manual_wrap_with_enable_wrap,
            nested_by_hand,
            asked_for_root_before_nesting,
            auto_wrap_over_existing_units,
            ignored_module_is_not_wrapped,
            forwardless_module_selected,
            forwardless_module_and_its_children,
            forwardless_unit_trains,
            mixed_precision_wraps_batch_norm_apart,
            frozen_and_trainable_in_one_unit,
            always_wrap_with_a_module_list,
            frozen_and_trainable_with_flat_parameters,
            frozen_and_trainable_with_orig_params,
        ]
    )


def test_policies_choose_the_same_units(ranks):
    results = RankResults.of(ranks, _wrapping)
    assert_all_conform(results, [p for p in POLICIES if p.__name__ != "policy_always"])
    assert_conforms(results[custom_policy_overrides_arguments])


def test_always_wrap_leaves_sequential_containers_to_the_unit_above(ranks):
    """``always_wrap_policy`` selects every module; on :class:`Stack` (no ModuleList) the
    units are the same as FSDP1's."""
    results = RankResults.of(ranks, _wrapping)
    assert_conforms(results["policy_always"])


def test_nesting_by_hand(ranks):
    results = RankResults.of(ranks, _wrapping)
    assert_all_conform(
        results, [manual_wrap_with_enable_wrap, nested_by_hand, ignored_module_is_not_wrapped]
    )


def test_root_is_structural(ranks):
    """By design: torch's FSDP1 decides the roots at the first forward or root query
    (lazily), so units asked for (``fsdp_modules(root_only=True)``, ``check_is_root()``)
    before a unit was built around them stay roots, and the outer unit's forward fails.
    Here a unit stops being a root when a unit is built around it."""
    outcomes = RankResults.of(ranks, _wrapping)[asked_for_root_before_nesting]
    assert outcomes[TORCH].error == "AssertionError", outcomes[TORCH].describe()
    ours = value(outcomes[OURS])
    assert ours["before"] == 2 and ours["after"] is False


def test_auto_wrap_over_existing_units_is_refused(ranks):
    results = RankResults.of(ranks, _wrapping)
    assert_conforms(
        results[auto_wrap_over_existing_units],
        words="FSDP auto wrapping requires modules to not already have FSDP applied",
    )


def test_forwardless_module_becomes_a_unit(ranks):
    results = RankResults.of(ranks, _wrapping)
    assert_all_conform(results, [forwardless_module_selected, forwardless_module_and_its_children])
    assert value(results[forwardless_module_selected][OURS]) == ["", "holder"]


def test_forwardless_unit_trains_here(ranks):
    results = RankResults.of(ranks, _wrapping)
    outcomes = results[forwardless_unit_trains]
    assert outcomes[TORCH].error is not None, "torch's FSDP1 computed through a forward-less unit"
    ours = value(outcomes[OURS])
    reference = ranks.run(forwardless_reference)[0]
    torch.testing.assert_close(ours["eval"], reference["eval"], rtol=1e-5, atol=1e-6)
    for name, param in reference["params"].items():
        torch.testing.assert_close(ours["params"][name], param, rtol=1e-5, atol=1e-6)


def test_mixed_precision_and_frozen_parameters_under_auto_wrap(ranks):
    results = RankResults.of(ranks, _wrapping)
    assert_conforms(
        results[mixed_precision_wraps_batch_norm_apart],
        warns="Both mixed precision and an auto_wrap_policy were specified",
    )
    assert_conforms(results[frozen_and_trainable_in_one_unit])


def test_module_lists_are_not_units(ranks):
    """By design: ``fully_shard`` refuses ``nn.ModuleList`` / ``nn.ModuleDict`` (no forward
    to hook), so where a policy selects one (``always_wrap_policy``) torch's FSDP1 makes a
    unit of it and this package leaves it inside the unit above; its children are units in
    both, and the outputs are the same."""
    outcomes = RankResults.of(ranks, _wrapping)[always_wrap_with_a_module_list]
    theirs, ours = value(outcomes[TORCH]), value(outcomes[OURS])
    assert "blocks" in theirs["units"] and "blocks" not in ours["units"]
    assert [u for u in theirs["units"] if u != "blocks"] == ours["units"]
    assert_same(theirs["output"], ours["output"])


def test_frozen_and_trainable_parameters_in_one_unit(ranks):
    """By design: torch's FSDP1 cannot flatten frozen and trainable parameters into one flat
    parameter (``ValueError`` unless ``use_orig_params=True``); ``fully_shard`` shards
    parameters one by one, so this package trains such a unit either way, as torch's FSDP1
    does with ``use_orig_params=True``."""
    results = RankResults.of(ranks, _wrapping)
    flat = results[frozen_and_trainable_with_flat_parameters]
    assert flat[TORCH].error == "ValueError" and "uniform" in flat[TORCH].message
    assert_reduced_alike(results[frozen_and_trainable_with_orig_params], ranks.world_size)
    assert_same(value(results[frozen_and_trainable_with_orig_params][OURS]), value(flat[OURS]))
