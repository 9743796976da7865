"""The optimizer-state-dict functions side by side with torch's FSDP1: ``optim_state_dict`` /
``optim_state_dict_to_load`` under FULL and SHARDED types, the legacy ``full_``,
``sharded_``, ``shard_full_``, ``scatter_full_``, ``flatten_sharded_`` functions and
``rekey_optim_state_dict``.

Saved optimizer states are compared directly where both sides save the same thing (FULL:
unflattened tensors keyed by parameter name). What a function hands to
``optim.load_state_dict`` differs by design (torch: slices of flat parameters; here each
parameter's DTensor shard), so those functions are compared by what they do: an optimizer
restored through them takes the next step exactly as the one that saved.
"""

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
    assert_close,
    assert_conforms,
    assert_same,
    side_by_side,
    value,
)
from tests.fsdp.conformance._models import Mlp, features, seeded
from tests.fsdp.conformance.test_state_dict import local_piece


def _wrapped(
    fsdp: Flavor, seed: int = 0, **kwargs: object
) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = fsdp.wrap(seeded(Mlp, seed), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kwargs)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    model(features(step)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _full_params(fsdp: Flavor, model: nn.Module) -> dict[str, torch.Tensor]:
    with fsdp.cls.summon_full_params(model, writeback=False):
        return {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in model.named_parameters()
        }


def _state_type(fsdp: Flavor, model: nn.Module, kind: str, **optim_config):
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    if kind == "FULL":
        return fsdp.cls.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(),
            FullOptimStateDictConfig(**optim_config),
        )
    return fsdp.cls.state_dict_type(
        model,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(),
        ShardedOptimStateDictConfig(**optim_config),
    )


def comparable(osd: dict) -> dict:
    """A copy of an optimizer state dict with every value as the rank holds it (local
    shards), in sorted order: the order of keys differs by design (torch's FSDP1 orders a
    parameter's entries tensors first and ``rekey_optim_state_dict``'s result by name; this
    package keeps the optimizer's own order: Adam's ``step`` first, parameters in model
    order)."""
    state = osd.get("state", {})
    return {
        "state": {
            key: {name: local_piece(state[key][name]) for name in sorted(state[key])}
            for key in sorted(state, key=str)
        },
        "param_groups": osd.get("param_groups", []),
    }


def _restore_and_continue(fsdp: Flavor, save, load) -> dict:
    """Train a step; save the optimizer state with ``save(model, optim)``; build the model
    again from another seed, load the model's FULL state dict and the optimizer state with
    ``load(model, optim, saved)``; one more step on both. The second model must end where
    the first does."""
    model, optim = _wrapped(fsdp)
    _step(model, optim, 0)
    saved = save(model, optim)
    snapshot = comparable(saved) if saved else {}
    model_state = model.state_dict()
    other, other_optim = _wrapped(fsdp, seed=1)
    other.load_state_dict(model_state)
    load(other, other_optim, saved)
    _step(model, optim, 1)
    _step(other, other_optim, 1)
    return {
        "saved": snapshot,
        "after_next_step": comparable(saved) if saved else {},
        "continued": _full_params(fsdp, model),
        "restored": _full_params(fsdp, other),
    }


def _load_to(fsdp: Flavor, kind: str):
    def load(model: nn.Module, optim: torch.optim.Optimizer, saved: dict) -> None:
        with _state_type(fsdp, model, kind):
            optim.load_state_dict(fsdp.cls.optim_state_dict_to_load(model, optim, saved))

    return load


def optim_state_full(fsdp: Flavor) -> dict:
    def save(model, optim):
        with _state_type(fsdp, model, "FULL"):
            return fsdp.cls.optim_state_dict(model, optim)

    return _restore_and_continue(fsdp, save, _load_to(fsdp, "FULL"))


def optim_state_full_rank0_only(fsdp: Flavor) -> dict:
    """``FullOptimStateDictConfig(rank0_only=True)``: rank 0 saves, the others get ``{}``
    and load rank 0's state through ``optim_state_dict_to_load``."""

    def save(model, optim):
        with _state_type(fsdp, model, "FULL", rank0_only=True):
            return fsdp.cls.optim_state_dict(model, optim)

    def load(model, optim, saved):
        with _state_type(fsdp, model, "FULL", rank0_only=True):
            optim.load_state_dict(fsdp.cls.optim_state_dict_to_load(model, optim, saved))

    return _restore_and_continue(fsdp, save, load)


def optim_state_sharded(fsdp: Flavor) -> dict:
    def save(model, optim):
        with _state_type(fsdp, model, "SHARDED"):
            return fsdp.cls.optim_state_dict(model, optim)

    return _restore_and_continue(fsdp, save, _load_to(fsdp, "SHARDED"))


def legacy_full_then_shard(fsdp: Flavor) -> dict:
    """``full_optim_state_dict`` (every rank) -> ``shard_full_optim_state_dict``."""

    def save(model, optim):
        return fsdp.cls.full_optim_state_dict(model, optim, rank0_only=False)

    def load(model, optim, saved):
        optim.load_state_dict(fsdp.cls.shard_full_optim_state_dict(saved, model, optim=optim))

    return _restore_and_continue(fsdp, save, load)


def legacy_full_then_scatter(fsdp: Flavor) -> dict:
    """``full_optim_state_dict`` (rank 0 only) -> ``scatter_full_optim_state_dict``."""

    def save(model, optim):
        return fsdp.cls.full_optim_state_dict(model, optim)

    def load(model, optim, saved):
        full = saved if dist.get_rank() == 0 else None
        optim.load_state_dict(fsdp.cls.scatter_full_optim_state_dict(full, model, optim=optim))

    return _restore_and_continue(fsdp, save, load)


def legacy_sharded_then_flatten(fsdp: Flavor) -> dict:
    """``sharded_optim_state_dict`` -> ``flatten_sharded_optim_state_dict``."""

    def save(model, optim):
        return fsdp.cls.sharded_optim_state_dict(model, optim)

    def load(model, optim, saved):
        optim.load_state_dict(fsdp.cls.flatten_sharded_optim_state_dict(saved, model, optim))

    return _restore_and_continue(fsdp, save, load)


def _plain_optimizer_state() -> dict:
    """``optim.state_dict()`` (keyed by parameter ID) of an unwrapped :class:`Mlp` after
    one Adam step: the checkpoint of a model trained without FSDP."""
    plain = seeded(Mlp)
    plain_optim = torch.optim.Adam(plain.parameters(), lr=0.05)
    plain(features(0)).square().mean().backward()
    plain_optim.step()
    return plain_optim.state_dict()


def rekey_by_name_and_back(fsdp: Flavor) -> dict:
    """``rekey_optim_state_dict`` of a plain optimizer's state (by parameter ID) against the
    wrapped model: by name (FSDP1's way to load a checkpoint of a model trained without
    FSDP), by ID again, and by name once more (returned unchanged). With
    ``use_orig_params``: torch's FSDP1 cannot name a flat parameter by one name."""
    from torch.distributed.fsdp import OptimStateKeyType

    model = fsdp.wrap(seeded(Mlp), use_orig_params=True)
    plain = _plain_optimizer_state()
    by_name = fsdp.cls.rekey_optim_state_dict(plain, OptimStateKeyType.PARAM_NAME, model)
    by_id = fsdp.cls.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, model)
    again = fsdp.cls.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_NAME, model)
    return {
        "by_name": comparable(by_name),
        "name_groups": [g["params"] for g in by_name["param_groups"]],
        "by_id": comparable(by_id),
        "id_groups": [g["params"] for g in by_id["param_groups"]],
        "plain": comparable(plain),
        "unchanged_when_already_by_name": again is by_name,
    }


def rekey_mixed_keys(fsdp: Flavor) -> None:
    from torch.distributed.fsdp import OptimStateKeyType

    model = fsdp.wrap(seeded(Mlp), use_orig_params=True)
    osd = fsdp.cls.rekey_optim_state_dict(
        _plain_optimizer_state(), OptimStateKeyType.PARAM_NAME, model
    )
    name = next(iter(osd["state"]))
    osd["state"][0] = osd["state"].pop(name)
    fsdp.cls.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, model)


def fresh_optimizer_full_state(fsdp: Flavor) -> dict:
    """An optimizer that has not stepped: no state, its parameter groups by name."""
    model, optim = _wrapped(fsdp)
    with _state_type(fsdp, model, "FULL"):
        return comparable(fsdp.cls.optim_state_dict(model, optim))


ROUND_TRIPS = [
    optim_state_full,
    optim_state_full_rank0_only,
    optim_state_sharded,
    legacy_full_then_shard,
    legacy_full_then_scatter,
    legacy_sharded_then_flatten,
]
LEGACY = [legacy_full_then_shard, legacy_full_then_scatter, legacy_sharded_then_flatten]


def _optim_states() -> dict:
    return side_by_side(
        [
            *ROUND_TRIPS,
            rekey_by_name_and_back,
            rekey_mixed_keys,
            fresh_optimizer_full_state,
        ]
    )


def _assert_same_training(results: RankResults, check: Check, world: int) -> None:
    """The restored optimizer continues exactly as the saving one, in both flavors; the
    flavors agree bit for bit on 2 ranks, to rounding beyond (``assert_reduced_alike``)."""
    outcomes = results[check]
    assert_conforms(outcomes, values=False)
    for flavor in (TORCH, OURS):
        result = value(outcomes[flavor])
        assert_same(result["continued"], result["restored"], f"{flavor} {check.__name__}")
    theirs, ours = value(outcomes[TORCH]), value(outcomes[OURS])
    if world == 2:
        assert_same(theirs["continued"], ours["continued"])
    else:
        assert_close(theirs["continued"], ours["continued"], rtol=1e-5, atol=1e-6)


def test_optimizer_state_round_trips(ranks):
    results = RankResults.of(ranks, _optim_states)
    for check in ROUND_TRIPS:
        _assert_same_training(results, check, ranks.world_size)


def test_saved_full_optimizer_state(ranks):
    """FULL optimizer states hold the same keys, parameter groups and (2 ranks: bit for
    bit) values; with ``rank0_only`` the other ranks save ``{}``."""
    results = RankResults.of(ranks, _optim_states)
    for rank in range(ranks.world_size):
        for check in (optim_state_full, optim_state_full_rank0_only, legacy_full_then_scatter):
            theirs = value(results.on(rank, check)[TORCH])["saved"]
            ours = value(results.on(rank, check)[OURS])["saved"]
            if ranks.world_size == 2:
                assert_same(theirs, ours, check.__name__)
            else:
                assert_close(theirs, ours, rtol=1e-5, atol=1e-6, path=check.__name__)
            if check is not optim_state_full:
                assert bool(ours) == (rank == 0), check.__name__


def test_saved_sharded_optimizer_state(ranks):
    """SHARDED optimizer states hold the same dim-0 chunks (torch: ShardedTensor; here:
    DTensor, by design)."""
    results = RankResults.of(ranks, _optim_states)
    for check in (optim_state_sharded, legacy_sharded_then_flatten):
        theirs = value(results[check][TORCH])["saved"]
        ours = value(results[check][OURS])["saved"]
        if ranks.world_size == 2:
            assert_same(theirs, ours, check.__name__)
        else:
            assert_close(theirs, ours, rtol=1e-5, atol=1e-6, path=check.__name__)


def test_sharded_optimizer_state_holds_the_live_shards(ranks):
    """By design: a SHARDED optimizer state dict holds the optimizer's own shards, as
    ``Optimizer.state_dict()`` and DCP's ``get_optimizer_state_dict`` do (no copy of the
    optimizer state per save); torch's FSDP1 builds new ShardedTensors. So after another
    step the dict shows the new values here, the saved ones in torch's FSDP1; copy it (or
    write it out) before training on if it is to be kept. FULL states are copies in both."""
    results = RankResults.of(ranks, _optim_states)
    for flavor in (TORCH, OURS):
        full = value(results[optim_state_full][flavor])
        assert_same(full["saved"], full["after_next_step"])
    theirs = value(results[optim_state_sharded][TORCH])
    assert_same(theirs["saved"], theirs["after_next_step"])
    ours = value(results[optim_state_sharded][OURS])
    moments = [entry["exp_avg"] for entry in ours["saved"]["state"].values()]
    later = [entry["exp_avg"] for entry in ours["after_next_step"]["state"].values()]
    assert any(not torch.equal(a, b) for a, b in zip(moments, later, strict=True))


def test_legacy_functions_warn_as_deprecated(ranks):
    results = RankResults.of(ranks, _optim_states)
    for check in LEGACY:
        assert_conforms(results[check], values=False, warns="deprecated")
        for outcome in results[check].values():
            assert any(c == "FutureWarning" for c, _ in outcome.warnings), outcome.warnings


def test_rekey(ranks):
    results = RankResults.of(ranks, _optim_states)
    assert_conforms(results[rekey_by_name_and_back])
    ours = value(results[rekey_by_name_and_back][OURS])
    assert ours["unchanged_when_already_by_name"]
    assert_same(ours["plain"], ours["by_id"])
    assert sorted(ours["by_name"]["state"]) == sorted(
        f"{m}.{p}" for m in ("stem", "body", "head") for p in ("weight", "bias")
    )
    assert_conforms(results[rekey_mixed_keys], words="Invalid parameter keys")


def test_fresh_optimizer(ranks):
    results = RankResults.of(ranks, _optim_states)
    assert_conforms(results[fresh_optimizer_full_state])
    assert value(results[fresh_optimizer_full_state][OURS])["state"] == {}
