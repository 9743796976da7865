"""Training side by side with torch's FSDP1: every sharding strategy, ``no_sync``,
``clip_grad_norm_`` and its root rule, mixed precision, communication hooks. Losses, norms
and parameters are compared bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.fsdp.conformance._harness import (
    OURS,
    TORCH,
    Check,
    Flavor,
    RankResults,
    assert_close,
    assert_conforms,
    assert_reduced_alike,
    assert_same,
    side_by_side,
    value,
)
from tests.fsdp.conformance._models import (
    VOCAB,
    Block,
    Mlp,
    Scaled,
    Stack,
    features,
    seeded,
    tokens,
)

STEPS = 2


def clean_params(fsdp: Flavor, model: nn.Module) -> dict[str, torch.Tensor]:
    with fsdp.cls.summon_full_params(model, writeback=False):
        return {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }


def lm_loss(model: nn.Module, step: int) -> torch.Tensor:
    batch = tokens(step)
    logits = model(batch)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch.roll(1, dims=1).reshape(-1))


def train(
    fsdp: Flavor,
    *,
    steps: int = STEPS,
    accumulate: bool = False,
    clip: float | None = None,
    norm_type: float = 2.0,
    **kwargs,
) -> dict:
    """:class:`Stack` wrapped per block, ``steps`` SGD steps (with ``accumulate``, one
    ``no_sync`` micro-batch first; with ``clip``, clipped with ``clip_grad_norm_``)."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs.setdefault("auto_wrap_policy", ModuleWrapPolicy({Block}))
    model = fsdp.wrap(seeded(Stack), **kwargs)
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses, norms = [], []
    for step in range(steps):
        if accumulate:
            with model.no_sync():
                lm_loss(model, 100 + step).backward()
        loss = lm_loss(model, step)
        loss.backward()
        if clip is not None:
            norms.append(model.clip_grad_norm_(clip, norm_type))
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "norms": norms, "params": clean_params(fsdp, model)}


def _strategy_check(strategy: str, **extra) -> Check:
    def check(fsdp: Flavor) -> dict:
        from torch.distributed.fsdp import ShardingStrategy

        return train(fsdp, sharding_strategy=ShardingStrategy[strategy], **extra)

    check.__name__ = f"train_{strategy.lower()}"
    return check


STRATEGIES = [_strategy_check(s) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")]


def _hybrid_mesh(replicas: int):
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh(
        "cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard")
    )


def train_hybrid_shard(fsdp: Flavor) -> dict:
    """HYBRID_SHARD on a (world/2, 2) mesh: shard groups of two ranks."""
    from torch.distributed.fsdp import ShardingStrategy

    return train(
        fsdp,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_mesh=_hybrid_mesh(dist.get_world_size() // 2),
    )


def train_hybrid_replicas_only(fsdp: Flavor) -> dict:
    """HYBRID_SHARD on a (world, 1) mesh: every rank a replica of its own."""
    from torch.distributed.fsdp import ShardingStrategy

    return train(
        fsdp,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_mesh=_hybrid_mesh(dist.get_world_size()),
    )


def train_with_no_sync(fsdp: Flavor) -> dict:
    return train(fsdp, accumulate=True)


def train_clip_two_norm(fsdp: Flavor) -> dict:
    return train(fsdp, clip=0.5)


def train_clip_inf_norm(fsdp: Flavor) -> dict:
    return train(fsdp, norm_type=float("inf"), clip=0.05)


def train_clip_one_norm(fsdp: Flavor) -> dict:
    return train(fsdp, norm_type=1.0, clip=0.5)


def train_use_orig_params(fsdp: Flavor) -> dict:
    return train(fsdp, use_orig_params=True)


def train_hybrid_shard_zero2(fsdp: Flavor) -> dict:
    """_HYBRID_SHARD_ZERO2 on the (world/2, 2) mesh."""
    from torch.distributed.fsdp import ShardingStrategy

    return train(
        fsdp,
        sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2,
        device_mesh=_hybrid_mesh(dist.get_world_size() // 2),
    )


def train_prefetching(fsdp: Flavor) -> dict:
    """``forward_prefetch=True``, ``backward_prefetch=None``, ``limit_all_gathers=False``:
    scheduling arguments, the same numbers."""
    return train(fsdp, forward_prefetch=True, backward_prefetch=None, limit_all_gathers=False)


def train_backward_post(fsdp: Flavor) -> dict:
    from torch.distributed.fsdp import BackwardPrefetch

    return train(fsdp, backward_prefetch=BackwardPrefetch.BACKWARD_POST)


def train_ignored_module(fsdp: Flavor) -> dict:
    """An ignored module trains on each rank's own gradient (not reduced), as in FSDP1."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    inner = seeded(Stack)
    model = fsdp.wrap(
        inner, auto_wrap_policy=ModuleWrapPolicy({Block}), ignored_modules=[inner.head]
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        lm_loss(model, step).backward()
        optim.step()
        optim.zero_grad()
    return {"params": clean_params(fsdp, model), "ignored": inner.head.weight.detach().clone()}


CLIPPED = [train_clip_two_norm, train_clip_inf_norm, train_clip_one_norm]
SCHEDULING = [train_prefetching, train_backward_post]


def reference_training() -> dict:
    """:func:`train` without FSDP: every rank's batch in one model, gradients averaged."""
    world = dist.get_world_size()
    model = seeded(Stack)
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(STEPS):
        batches = [tokens(step, rank) for rank in range(world)]
        total = 0
        for batch in batches:
            logits = model(batch)
            total = total + F.cross_entropy(
                logits.reshape(-1, VOCAB), batch.roll(1, dims=1).reshape(-1)
            )
        (total / world).backward()
        optim.step()
        optim.zero_grad()
        losses.append(total.detach() / world)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ----------------------------------------------------------------------------- clip rules


def clip_on_a_non_root_unit(fsdp: Flavor) -> None:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = fsdp.wrap(seeded(Stack), auto_wrap_policy=ModuleWrapPolicy({Block}))
    lm_loss(model, 0).backward()
    inner = fsdp.cls.fsdp_modules(model)[1]
    inner.clip_grad_norm_(1.0)


def clip_without_gradients(fsdp: Flavor) -> torch.Tensor:
    model = fsdp.wrap(seeded(Mlp))
    return model.clip_grad_norm_(1.0)


def clip_inside_summon(fsdp: Flavor) -> None:
    model = fsdp.wrap(seeded(Mlp))
    model(features()).sum().backward()
    with fsdp.cls.summon_full_params(model):
        model.clip_grad_norm_(1.0)


def no_sync_on_a_non_root_unit(fsdp: Flavor) -> None:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = fsdp.wrap(seeded(Stack), auto_wrap_policy=ModuleWrapPolicy({Block}))
    lm_loss(model, 0).backward()  # torch's FSDP1 knows its root from the first forward on
    with fsdp.cls.fsdp_modules(model)[1].no_sync():
        pass


def no_sync_inside_summon(fsdp: Flavor) -> None:
    model = fsdp.wrap(seeded(Mlp))
    with fsdp.cls.summon_full_params(model), model.no_sync():
        pass


def gradients_in_no_sync(fsdp: Flavor) -> list:
    """``.grad`` of the parameters after a backward inside ``no_sync`` (NO_SHARD)."""
    model = fsdp.wrap(seeded(Mlp), sharding_strategy=_no_shard())
    with model.no_sync():
        model(features()).square().mean().backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _no_shard():
    from torch.distributed.fsdp import ShardingStrategy

    return ShardingStrategy.NO_SHARD


RULES = [clip_on_a_non_root_unit, clip_without_gradients, clip_inside_summon]


# ----------------------------------------------------------------------------- precision


class _DtypeProbe:
    """Records the dtype of each ``Linear``'s weight and input during forward."""

    def __init__(self, model: nn.Module):
        self.seen: list[tuple[str, str]] = []
        for module in model.modules():
            if type(module) is nn.Linear or isinstance(module, nn.Linear):
                module.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: tuple) -> None:
        self.seen.append((str(module.weight.dtype), str(args[0].dtype)))


def _mixed_precision_run(fsdp: Flavor, auto_wrap: bool = True, **mp_kwargs) -> dict:
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    inner = seeded(Scaled)
    probe = _DtypeProbe(inner)
    model = fsdp.wrap(
        inner,
        mixed_precision=MixedPrecision(**mp_kwargs),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}) if auto_wrap else None,
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    out = model(features())
    loss = out.float().square().mean()
    loss.backward()
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    optim.step()
    with fsdp.cls.summon_full_params(model, writeback=False):
        param_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {
        "seen": probe.seen,
        "output_dtype": str(out.dtype),
        "loss": loss.detach(),
        "grad_dtypes": grad_dtypes,
        "param_dtypes": param_dtypes,
        "buffer_dtype": str(model.module.scale.dtype),
        "params": clean_params(fsdp, model),
    }


def mp_param_dtype(fsdp: Flavor) -> dict:
    return _mixed_precision_run(fsdp, param_dtype=torch.bfloat16)


def mp_reduce_in_float32(fsdp: Flavor) -> dict:
    return _mixed_precision_run(fsdp, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def mp_buffer_dtype(fsdp: Flavor) -> dict:
    return _mixed_precision_run(fsdp, param_dtype=torch.float16, buffer_dtype=torch.float16)


def mp_no_root_input_cast(fsdp: Flavor) -> dict:
    """``cast_root_forward_inputs=False`` with one unit: the input stays float32 and the
    bfloat16 layer refuses it, in both."""
    return _mixed_precision_run(
        fsdp, auto_wrap=False, param_dtype=torch.bfloat16, cast_root_forward_inputs=False
    )


def mp_cast_every_unit_input(fsdp: Flavor) -> dict:
    return _mixed_precision_run(fsdp, param_dtype=torch.bfloat16, cast_forward_inputs=True)


def mp_keep_low_precision_grads(fsdp: Flavor) -> dict:
    return _mixed_precision_run(fsdp, param_dtype=torch.bfloat16, keep_low_precision_grads=True)


MIXED_PRECISION = [
    mp_param_dtype,
    mp_reduce_in_float32,
    mp_buffer_dtype,
    mp_no_root_input_cast,
    mp_cast_every_unit_input,
]


# ----------------------------------------------------------------------------- comm hooks


def _hooked_training(fsdp: Flavor, strategy: str, hook_name: str) -> dict:
    from torch.distributed.algorithms._comm_hooks import default_hooks
    from torch.distributed.fsdp import ShardingStrategy

    model = fsdp.wrap(seeded(Mlp), sharding_strategy=ShardingStrategy[strategy])
    model.register_comm_hook(
        default_hooks.DefaultState(dist.group.WORLD), getattr(default_hooks, hook_name)
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        model(features(step)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    return clean_params(fsdp, model)


def hook_reduce_scatter_full_shard(fsdp: Flavor) -> dict:
    return _hooked_training(fsdp, "FULL_SHARD", "reduce_scatter_hook")


def hook_allreduce_no_shard(fsdp: Flavor) -> dict:
    return _hooked_training(fsdp, "NO_SHARD", "allreduce_hook")


def hook_on_a_non_root_unit(fsdp: Flavor) -> None:
    from torch.distributed.algorithms._comm_hooks import default_hooks
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = fsdp.wrap(seeded(Stack), auto_wrap_policy=ModuleWrapPolicy({Block}))
    lm_loss(model, 0).backward()  # torch's FSDP1 knows its root from the first forward on
    state = default_hooks.DefaultState(dist.group.WORLD)
    fsdp.cls.fsdp_modules(model)[1].register_comm_hook(state, default_hooks.allreduce_hook)


def hook_registered_twice(fsdp: Flavor) -> None:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    model = fsdp.wrap(seeded(Mlp))
    state = default_hooks.DefaultState(dist.group.WORLD)
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)


def hook_not_callable(fsdp: Flavor) -> None:
    from torch.distributed.algorithms._comm_hooks import default_hooks

    model = fsdp.wrap(seeded(Mlp))
    model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD), "hook")


HOOK_ERRORS = {
    hook_on_a_non_root_unit: "register_comm_hook can only be called on a root instance",
    hook_registered_twice: "A communication hook is already registered",
    hook_not_callable: "The communication hook must be callable",
}


def _training() -> dict:
    return side_by_side(
        [
            *STRATEGIES,
            train_hybrid_shard,
            train_hybrid_replicas_only,
            train_with_no_sync,
            *CLIPPED,
            train_use_orig_params,
            train_hybrid_shard_zero2,
            *SCHEDULING,
            train_ignored_module,
            *RULES,
            no_sync_on_a_non_root_unit,
            no_sync_inside_summon,
            gradients_in_no_sync,
            *MIXED_PRECISION,
            mp_keep_low_precision_grads,
            hook_reduce_scatter_full_shard,
            hook_allreduce_no_shard,
            *HOOK_ERRORS,
        ]
    )


def assert_trained_alike(
    results: RankResults, checks: list[Check], world: int, *, low_precision: bool = False
) -> None:
    for check in checks:
        assert_reduced_alike(results[check], world, low_precision=low_precision)


def test_every_strategy_trains_alike(ranks):
    results = RankResults.of(ranks, _training)
    checks = [*STRATEGIES, train_hybrid_shard, train_hybrid_shard_zero2, train_use_orig_params]
    assert_trained_alike(results, checks, ranks.world_size)


def test_ignored_module_trains_on_local_gradients(ranks):
    results = RankResults.of(ranks, _training)
    assert_trained_alike(results, [train_ignored_module], ranks.world_size)
    ignored = [value(results.on(r, train_ignored_module)[OURS])["ignored"] for r in range(2)]
    assert not torch.equal(*ignored), "an ignored module's gradients were reduced"


def test_scheduling_arguments_change_no_numbers(ranks):
    """By design for warnings only: ``BACKWARD_POST`` and ``limit_all_gathers=False``
    cannot be honoured by ``fully_shard`` (it always prefetches before the gradient
    computation and bounds the all-gathers in flight), so they warn here (UserWarning),
    where torch's FSDP1 runs them silently; the numbers are the same."""
    results = RankResults.of(ranks, _training)
    for check, words in zip(SCHEDULING, ("limit_all_gathers", "BACKWARD_POST"), strict=True):
        outcomes = results[check]
        assert outcomes[OURS].warned(words) and not outcomes[TORCH].warned(words)
        for flavor in (TORCH, OURS):
            assert outcomes[flavor].error is None, outcomes[flavor].describe()
        if ranks.world_size == 2:
            assert_same(value(outcomes[TORCH]), value(outcomes[OURS]))
        else:
            assert_close(value(outcomes[TORCH]), value(outcomes[OURS]), rtol=1e-5, atol=1e-6)


def test_hybrid_shard_with_one_rank_per_shard_group(ranks):
    """By design: over a (world, 1) mesh torch's FSDP1 switches to NO_SHARD over the
    one-rank shard group and never reduces across the replicas (each rank trains on its
    own batch); here gradients are averaged across the replicas, as the data-parallel
    reference (one model, every rank's batch) computes them."""
    results = RankResults.of(ranks, _training)
    outcomes = results[train_hybrid_replicas_only]
    reference = ranks.run(reference_training)[0]["params"]
    for name, param in reference.items():
        torch.testing.assert_close(
            value(outcomes[OURS])["params"][name], param, rtol=1e-4, atol=1e-5
        )
    theirs = value(outcomes[TORCH])["params"]
    assert any(not torch.allclose(theirs[n], p, rtol=1e-4, atol=1e-5) for n, p in reference.items())


def test_no_sync_accumulates_alike(ranks):
    results = RankResults.of(ranks, _training)
    assert_trained_alike(results, [train_with_no_sync], ranks.world_size)


def test_unreduced_gradients_live_on_the_whole_parameters(ranks):
    """By design: after a backward inside ``no_sync``, torch's FSDP1 (NO_SHARD) keeps each
    rank's own gradient in ``.grad``; ``fully_shard`` keeps it on the unsharded parameters
    until the next synchronizing backward reduces it, so ``.grad`` is ``None`` here until
    then. The accumulated result is the same (``test_no_sync_accumulates_alike``)."""
    outcomes = RankResults.of(ranks, _training)[gradients_in_no_sync]
    assert all(g is not None for g in value(outcomes[TORCH]))
    assert all(g is None for g in value(outcomes[OURS]))


def test_clip_grad_norm_with_every_norm_type(ranks):
    """Norms and clipped parameters agree to rounding: FSDP1 adds up per-rank norms of its
    flat-parameter shards, this package of per-parameter dim-0 shards, so the same
    gradients are summed in another grouping (a last-bit difference of the norm)."""
    results = RankResults.of(ranks, _training)
    for check in CLIPPED:
        outcomes = results[check]
        assert_conforms(outcomes, values=False)
        assert_close(value(outcomes[TORCH]), value(outcomes[OURS]), rtol=1e-5, atol=1e-6)


def test_root_only_and_idle_only_rules(ranks):
    results = RankResults.of(ranks, _training)
    assert_conforms(
        results[clip_on_a_non_root_unit],
        words="`clip_grad_norm_\\(\\)` should only be called on the root FSDP instance",
    )
    assert_conforms(
        results[no_sync_on_a_non_root_unit], words="on inner FSDP instances is not supported"
    )
    for check in (clip_inside_summon, no_sync_inside_summon):
        assert_conforms(
            results[check], words="^expected to be in states \\[<TrainingState.IDLE: 1>\\]"
        )


def test_clip_without_gradients_warns(ranks):
    results = RankResults.of(ranks, _training)
    assert_conforms(results[clip_without_gradients], warns="with no gradients")


def test_mixed_precision(ranks):
    results = RankResults.of(ranks, _training)
    checks = [c for c in MIXED_PRECISION if c is not mp_no_root_input_cast]
    assert_trained_alike(results, checks, ranks.world_size, low_precision=True)
    assert_conforms(results[mp_no_root_input_cast], words="must have the same dtype")


def test_keep_low_precision_grads(ranks):
    """By design: ``fully_shard`` reduces gradients into the parameters' own dtype, so
    ``keep_low_precision_grads=True`` warns here and gradients stay float32, where torch's
    FSDP1 hands out bfloat16 gradients. Forward and parameters otherwise agree."""
    outcomes = RankResults.of(ranks, _training)[mp_keep_low_precision_grads]
    theirs, ours = value(outcomes[TORCH]), value(outcomes[OURS])
    assert theirs["grad_dtypes"] == ["torch.bfloat16"]
    assert ours["grad_dtypes"] == ["torch.float32"]
    assert outcomes[OURS].warned("keep_low_precision_grads")
    assert_same(theirs["seen"], ours["seen"])
    assert_same(theirs["loss"], ours["loss"])


def test_communication_hooks(ranks):
    results = RankResults.of(ranks, _training)
    checks = [hook_reduce_scatter_full_shard, hook_allreduce_no_shard]
    assert_trained_alike(results, checks, ranks.world_size)
    for check, words in HOOK_ERRORS.items():
        assert_conforms(results[check], words=words)


def test_fsdp1_deprecations_are_not_repeated(ranks):
    """By design: torch's FSDP1 deprecates its NO_SHARD (FutureWarning: use DDP); here
    NO_SHARD runs on ``fully_shard`` and is supported, so it does not warn."""
    outcomes = RankResults.of(ranks, _training)["train_no_shard"]
    deprecated = "The `NO_SHARD` sharding strategy is deprecated"
    assert any(c == "FutureWarning" for c, _ in outcomes[TORCH].warnings)
    assert outcomes[TORCH].warned(deprecated) and not outcomes[OURS].warned(deprecated)
