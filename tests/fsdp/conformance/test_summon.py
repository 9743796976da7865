"""``summon_full_params`` (writeback, rank0_only, offload_to_cpu, with_grads, recurse) and
``apply``, side by side with torch's FSDP1: what the context shows, what it writes back,
and the errors it raises."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp.conformance._harness import (
    OURS,
    TORCH,
    Flavor,
    RankResults,
    assert_all_conform,
    assert_conforms,
    assert_reduced_alike,
    assert_same,
    side_by_side,
    value,
)
from tests.fsdp.conformance._models import Block, Mlp, Stack, seeded, tokens

_PREFIX = "_fsdp_wrapped_module."


def _clean(name: str) -> str:
    return name.replace(_PREFIX, "")


def _wrapped(fsdp: Flavor, **kwargs) -> nn.Module:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs.setdefault("auto_wrap_policy", ModuleWrapPolicy({Block}))
    return fsdp.wrap(seeded(Stack), **kwargs)


def _shown(model: nn.Module) -> dict[str, torch.Tensor]:
    return {_clean(n): p.detach().clone() for n, p in model.named_parameters()}


def _full(fsdp: Flavor, model: nn.Module) -> dict[str, torch.Tensor]:
    with fsdp.cls.summon_full_params(model, writeback=False):
        return _shown(model)


def _edit(model: nn.Module, per_rank: bool = False) -> None:
    """Add one to every parameter in place (``per_rank``: the rank's number plus one)."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(dist.get_rank() + 1 if per_rank else 1)


def summon_shows_full_parameters(fsdp: Flavor) -> dict:
    model = _wrapped(fsdp)
    with fsdp.cls.summon_full_params(model):
        shown = _shown(model)
    return {"shown": shown, "reference": dict(seeded(Stack).named_parameters())}


def summon_writes_back(fsdp: Flavor) -> dict:
    """Edits inside ``summon_full_params()`` persist."""
    model = _wrapped(fsdp)
    with fsdp.cls.summon_full_params(model):
        _edit(model)
    with torch.no_grad():
        out = model(tokens())
    return {"params": _full(fsdp, model), "output": out}


def summon_writes_back_per_rank_edits(fsdp: Flavor) -> dict:
    """Every rank edits its own full copy differently: each writes back its own shard."""
    model = _wrapped(fsdp)
    with fsdp.cls.summon_full_params(model):
        _edit(model, per_rank=True)
    return _full(fsdp, model)


def summon_without_writeback(fsdp: Flavor) -> dict:
    model = _wrapped(fsdp)
    with fsdp.cls.summon_full_params(model, writeback=False):
        _edit(model)
    return _full(fsdp, model)


def summon_rank0_only(fsdp: Flavor) -> dict | None:
    """Rank 0 sees full parameters; what the other ranks see differs by design (torch:
    its flat parameters; here: the sharded DTensors), so only rank 0's view is returned."""
    model = _wrapped(fsdp)
    with fsdp.cls.summon_full_params(model, rank0_only=True, writeback=False):
        shown = _shown(model) if dist.get_rank() == 0 else None
    return shown


def summon_rank0_only_with_writeback(fsdp: Flavor) -> None:
    with fsdp.cls.summon_full_params(_wrapped(fsdp), rank0_only=True, writeback=True):
        pass


def summon_with_grads(fsdp: Flavor) -> dict:
    """``with_grads=True`` (FSDP1 needs ``use_orig_params`` for it): full gradients."""
    model = _wrapped(fsdp, use_orig_params=True)
    model(tokens()).float().square().mean().backward()
    with fsdp.cls.summon_full_params(model, with_grads=True):
        return {_clean(n): p.grad.clone() for n, p in model.named_parameters()}


def summon_with_grads_and_flat_parameters(fsdp: Flavor) -> dict:
    model = _wrapped(fsdp)
    model(tokens()).float().square().mean().backward()
    with fsdp.cls.summon_full_params(model, with_grads=True):
        return {_clean(n): p.grad.clone() for n, p in model.named_parameters()}


def summon_without_recursion(fsdp: Flavor) -> dict:
    """``recurse=False`` on the root gathers the root's own parameters only."""
    model = _wrapped(fsdp)
    with fsdp.cls.summon_full_params(model, recurse=False, writeback=False):
        own = {
            _clean(n): p.detach().clone() for n, p in model.named_parameters() if "blocks" not in n
        }
    return own


def summon_a_nested_unit(fsdp: Flavor) -> dict:
    model = _wrapped(fsdp)
    with torch.no_grad():
        model(tokens())  # torch's FSDP1 takes the first unit asked as the root
    inner = fsdp.cls.fsdp_modules(model)[1]
    with fsdp.cls.summon_full_params(inner):
        _edit(inner)
    return _full(fsdp, model)


def summon_inside_summon(fsdp: Flavor) -> None:
    model = _wrapped(fsdp)
    with fsdp.cls.summon_full_params(model), fsdp.cls.summon_full_params(model):
        pass


def summon_during_backward(fsdp: Flavor) -> None:
    """From a gradient hook of the output, during the backward."""
    model = _wrapped(fsdp)
    out = model(tokens())

    def hook(grad: torch.Tensor) -> torch.Tensor:
        with fsdp.cls.summon_full_params(model):
            pass
        return grad

    out.register_hook(hook)
    out.float().square().mean().backward()


def summon_between_forward_and_backward(fsdp: Flavor) -> dict:
    """Allowed in both: units are idle between a forward and its backward."""
    model = _wrapped(fsdp)
    loss = model(tokens()).float().square().mean()
    with fsdp.cls.summon_full_params(model, writeback=False):
        shown = _shown(model)
    loss.backward()
    return shown


def forward_inside_summon(fsdp: Flavor) -> None:
    model = _wrapped(fsdp)
    with fsdp.cls.summon_full_params(model):
        model(tokens())


def apply_initializes(fsdp: Flavor) -> dict:
    """``apply(fn)`` runs ``fn`` on whole parameters and writes the result back."""

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.125)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.eye_(module.weight)

    model = _wrapped(fsdp)
    assert model.apply(init) is model
    return _full(fsdp, model)


def apply_inside_summon(fsdp: Flavor) -> None:
    """Finding: FSDP1 raises ``ValueError`` ("expected to be in states ...")."""
    model = fsdp.wrap(seeded(Mlp))
    with fsdp.cls.summon_full_params(model):
        model.apply(lambda m: None)


def _summons() -> dict:
    return side_by_side(
        [
            summon_shows_full_parameters,
            summon_writes_back,
            summon_writes_back_per_rank_edits,
            summon_without_writeback,
            summon_rank0_only,
            summon_rank0_only_with_writeback,
            summon_with_grads,
            summon_with_grads_and_flat_parameters,
            summon_without_recursion,
            summon_a_nested_unit,
            summon_inside_summon,
            summon_during_backward,
            summon_between_forward_and_backward,
            forward_inside_summon,
            apply_initializes,
            apply_inside_summon,
        ]
    )


def test_summoned_parameters(ranks):
    results = RankResults.of(ranks, _summons)
    assert_all_conform(
        results,
        [
            summon_shows_full_parameters,
            summon_writes_back,
            summon_without_writeback,
            summon_without_recursion,
            summon_a_nested_unit,
            summon_between_forward_and_backward,
        ],
    )
    shown = value(results[summon_shows_full_parameters][OURS])
    assert_same(shown["reference"], shown["shown"])


def test_rank0_only(ranks):
    results = RankResults.of(ranks, _summons)
    for rank in range(ranks.world_size):
        assert_conforms(results.on(rank, summon_rank0_only))
    assert value(results[summon_rank0_only][OURS])
    assert_conforms(
        results[summon_rank0_only_with_writeback],
        words="writeback=True and rank0_only=True is not supported",
    )


def test_with_grads(ranks):
    results = RankResults.of(ranks, _summons)
    for rank in range(ranks.world_size):
        assert_reduced_alike(results.on(rank, summon_with_grads), ranks.world_size)


def test_with_grads_without_use_orig_params(ranks):
    """By design: torch's FSDP1 raises ``NotImplementedError`` for ``with_grads`` over flat
    parameters; there are none here, so the gradients are the same as with
    ``use_orig_params=True``."""
    results = RankResults.of(ranks, _summons)
    outcomes = results[summon_with_grads_and_flat_parameters]
    assert outcomes[TORCH].error == "NotImplementedError"
    assert_same(value(results[summon_with_grads][OURS]), value(outcomes[OURS]))


def test_summon_errors(ranks):
    results = RankResults.of(ranks, _summons)
    assert_conforms(
        results[summon_inside_summon],
        words="Cannot manually unshard parameters when already unsharding parameters",
    )
    assert_conforms(
        results[summon_during_backward],
        words="Cannot manually unshard parameters during forward/backward",
    )


def test_writeback_of_per_rank_edits(ranks):
    """By design: when ranks edit their full copies differently, each rank writes back the
    part it holds, and what a rank holds differs: a slice of the unit's flat parameter in
    torch's FSDP1, each parameter's dim-0 chunk here. So ``embed.weight``'s rows chunk
    ``r`` carries rank ``r``'s edit."""
    results = RankResults.of(ranks, _summons)
    assert_conforms(results[summon_writes_back_per_rank_edits], values=False)
    edited = value(results[summon_writes_back_per_rank_edits][OURS])["embed.weight"]
    reference = seeded(Stack).embed.weight.detach()
    for rank, (new, old) in enumerate(
        zip(edited.chunk(ranks.world_size), reference.chunk(ranks.world_size), strict=True)
    ):
        torch.testing.assert_close(new, old + rank + 1)


def test_forward_inside_summon(ranks):
    """Both refuse; by design with another error: torch's FSDP1 fails an internal assertion
    (``AssertionError: Expects tensor to be unsharded ...``), this package raises a
    ``RuntimeError`` that says what to do."""
    outcomes = RankResults.of(ranks, _summons)[forward_inside_summon]
    assert outcomes[TORCH].error is not None
    assert outcomes[OURS].error == "RuntimeError"
    assert "exit the context first" in outcomes[OURS].message


def test_apply(ranks):
    results = RankResults.of(ranks, _summons)
    assert_conforms(results[apply_initializes])
    assert_conforms(
        results[apply_inside_summon],
        words="^expected to be in states \\[<TrainingState.IDLE: 1>\\] but current state is "
        "TrainingState.SUMMON_FULL_PARAMS",
    )


# ------------------------------------------------------------- offload_to_cpu (ours only)


def summon_offloaded_vs_unsharded() -> dict:
    """``offload_to_cpu=True`` (with and without ``rank0_only``, with NO_SHARD too) against
    the unsharded model. torch's FSDP1 is not run: on CPU ranks its CPU copy fails
    (``setStorage ... out of bounds``, torch 2.13; its FULL state dict crashes the process
    in the same configuration) and it refuses NO_SHARD there by design."""
    from torch.distributed.fsdp import ShardingStrategy

    from tests.fsdp.conformance._harness import flavors, observe

    ours = flavors()[1]
    reference = {n: p.detach().clone() for n, p in seeded(Stack).named_parameters()}
    out = {}
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        for rank0_only in (False, True):
            model = _wrapped(ours, sharding_strategy=strategy)

            def shown(model=model, rank0_only=rank0_only) -> dict:
                with ours.cls.summon_full_params(
                    model, offload_to_cpu=True, rank0_only=rank0_only, writeback=False
                ):
                    return {
                        n: (p.detach().clone(), str(p.device)) for n, p in model.named_parameters()
                    }

            outcome = observe(shown)
            out[f"{strategy.name} rank0_only={rank0_only}"] = (
                outcome.error,
                outcome.value,
                outcome.warned("offload_to_cpu=True and rank0_only=False"),
            )
    return {"reference": reference, "cases": out}


def test_summon_offloaded_to_cpu(ranks):
    for rank, result in enumerate(ranks.run(summon_offloaded_vs_unsharded)):
        for case, (error, shown, warned) in result["cases"].items():
            assert error is None, (case, error)
            # FSDP1's advice against offloading on every rank (host memory) is kept.
            assert bool(warned) == ("rank0_only=False" in case), (case, warned)
            if rank != 0 and "rank0_only=True" in case:
                continue
            assert_same(result["reference"], {n: t for n, (t, _) in shown.items()}, case)
            assert {device for _, device in shown.values()} == {"cpu"}, case
