"""FULL / SHARDED / LOCAL state dicts of models with tied, shared, frozen and ignored
parameters, side by side with torch's FSDP1: keys, values, round trips, settings."""

from __future__ import annotations

import torch
from torch import nn

from tests.fsdp.conformance._harness import (
    OURS,
    TORCH,
    Check,
    Flavor,
    RankResults,
    assert_conforms,
    assert_same,
    side_by_side,
    value,
)
from tests.fsdp.conformance._models import (
    Frozen,
    Mlp,
    SharedModule,
    Tied,
    features,
    seeded,
    tokens,
)


def local_piece(value: object) -> object:
    """What a rank holds of a state-dict value: the local shard of a DTensor or of torch's
    ShardedTensor (both dim-0 chunks, ``torch.chunk``'s layout), else the value itself."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        if not shards:  # a rank past the last dim-0 chunk
            return torch.empty((0, *value.size()[1:]), dtype=value.dtype)
        return shards[0].tensor.detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def _inputs(model_cls: type) -> torch.Tensor:
    return tokens() if model_cls is Tied else features()


def _model(fsdp: Flavor, name: str, seed: int = 0) -> tuple[nn.Module, type]:
    """Each model of this module by name, wrapped (one unit per ``Linear`` where the model
    has several, so nested units hold their own state)."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    per_linear = ModuleWrapPolicy({nn.Linear})
    if name == "mlp":
        return fsdp.wrap(seeded(Mlp, seed), auto_wrap_policy=per_linear), Mlp
    if name == "tied":
        return fsdp.wrap(seeded(Tied, seed)), Tied
    if name == "shared":
        return fsdp.wrap(seeded(SharedModule, seed)), SharedModule
    if name == "frozen":
        # One unit mixes frozen and trainable parameters: FSDP1 needs use_orig_params.
        return fsdp.wrap(seeded(Frozen, seed), use_orig_params=True), Frozen
    if name == "ignored":
        inner = seeded(Mlp, seed)
        return fsdp.wrap(inner, auto_wrap_policy=per_linear, ignored_modules=[inner.stem]), Mlp
    raise KeyError(name)


MODELS = ("mlp", "tied", "shared", "frozen", "ignored")


def _state_type(fsdp: Flavor, model: nn.Module, kind: str, **config):
    from torch.distributed.fsdp import (
        FullStateDictConfig,
        LocalStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    configs = {
        "FULL": (StateDictType.FULL_STATE_DICT, FullStateDictConfig),
        "SHARDED": (StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig),
        "LOCAL": (StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig),
    }
    state_type, config_cls = configs[kind]
    return fsdp.cls.state_dict_type(model, state_type, config_cls(**config))


def round_trip(fsdp: Flavor, name: str, kind: str) -> dict:
    """Save (``kind``) from a model, load into the same model built from another seed,
    save again; the forward of both."""
    model, model_cls = _model(fsdp, name)
    with _state_type(fsdp, model, kind):
        saved = model.state_dict()
    other, _ = _model(fsdp, name, seed=1)
    with _state_type(fsdp, other, kind):
        incompatible = other.load_state_dict(saved)
        again = {k: local_piece(v) for k, v in other.state_dict().items()}
    with torch.no_grad():
        out, out_other = model(_inputs(model_cls)), other(_inputs(model_cls))
    # Keys sorted: torch's FSDP1 lists the second name of a tied parameter after the
    # unit's other parameters, nn.Module's order lists it where its module is.
    return {
        "keys": sorted(saved),
        "pieces": {k: local_piece(saved[k]) for k in sorted(saved)},
        "after_load": {k: again[k] for k in sorted(again)},
        "incompatible": (list(incompatible.missing_keys), list(incompatible.unexpected_keys)),
        "output": out,
        "output_after_load": out_other,
    }


def _round_trip_check(name: str, kind: str) -> Check:
    def check(fsdp: Flavor) -> dict:
        if kind == "LOCAL" and fsdp.torch:
            # Its flat-parameter format is not this package's (test_local_state_dicts);
            # only its keys are compared.
            model, _ = _model(fsdp, name)
            with _state_type(fsdp, model, kind):
                return {"keys": sorted(model.state_dict())}
        return round_trip(fsdp, name, kind)

    check.__name__ = f"{kind.lower()}_{name}"
    return check


FULL = [_round_trip_check(name, "FULL") for name in MODELS]
SHARDED = [_round_trip_check(name, "SHARDED") for name in MODELS]
LOCAL = [_round_trip_check(name, "LOCAL") for name in MODELS]


def full_rank0_only(fsdp: Flavor) -> dict:
    model, _ = _model(fsdp, "mlp")
    with _state_type(fsdp, model, "FULL", rank0_only=True):
        return {k: local_piece(v) for k, v in model.state_dict().items()}


def full_partial_load(fsdp: Flavor) -> tuple:
    """``load_state_dict(strict=False)`` of a dict with a key missing and one too many:
    the incompatible keys come back under clean names."""
    model, _ = _model(fsdp, "mlp")
    state = model.state_dict()
    state.pop("head.bias")
    state["extra"] = torch.zeros(1)
    incompatible = model.load_state_dict(state, strict=False)
    return sorted(incompatible.missing_keys), sorted(incompatible.unexpected_keys)


def full_strict_load_of_a_partial_dict(fsdp: Flavor) -> None:
    model, _ = _model(fsdp, "mlp")
    state = model.state_dict()
    state.pop("head.bias")
    model.load_state_dict(state)


def settings_api(fsdp: Flavor) -> dict:
    """``set_state_dict_type`` returns the previous settings, ``get_state_dict_type`` the
    current ones, ``state_dict_type`` restores them on exit."""
    from torch.distributed.fsdp import (
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )

    model, _ = _model(fsdp, "mlp")
    default = fsdp.cls.get_state_dict_type(model)
    previous = fsdp.cls.set_state_dict_type(
        model,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(offload_to_cpu=True),
        ShardedOptimStateDictConfig(),
    )
    current = fsdp.cls.get_state_dict_type(model)
    with fsdp.cls.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        inside = fsdp.cls.get_state_dict_type(model).state_dict_type
    restored = fsdp.cls.get_state_dict_type(model)
    return {
        "default": default,
        "previous": previous,
        "current": current,
        "inside": inside,
        "restored": restored,
    }


def settings_of_the_wrong_class(fsdp: Flavor) -> None:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    model, _ = _model(fsdp, "mlp")
    fsdp.cls.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT, FullStateDictConfig())


def _state_dicts() -> dict:
    return side_by_side(
        [
            *FULL,
            *SHARDED,
            *LOCAL,
            full_rank0_only,
            full_partial_load,
            full_strict_load_of_a_partial_dict,
            settings_api,
            settings_of_the_wrong_class,
        ]
    )


def test_full_state_dicts(ranks):
    """Finding: a FULL round trip of tied embeddings failed (the second name of the tied
    parameter was loaded as a plain tensor into a DTensor)."""
    results = RankResults.of(ranks, _state_dicts)
    for rank in range(ranks.world_size):
        for check in FULL:
            assert_conforms(results.on(rank, check))
    assert value(results["full_tied"][OURS])["keys"] == [
        "body.bias",
        "body.weight",
        "embed.weight",
        "out.bias",
        "out.weight",
    ]


def test_full_state_dict_rank0_only(ranks):
    """Rank 0 holds the same full state dict; the other ranks an empty dict, as
    ``FullStateDictConfig(rank0_only=True)`` documents. By design: torch's FSDP1 leaves the
    buffers of units that own no parameters (here the root's ``scale``) in the other
    ranks' dicts."""
    results = RankResults.of(ranks, _state_dicts)
    assert_conforms(results[full_rank0_only])
    for outcomes in results.every_rank(full_rank0_only)[1:]:
        assert value(outcomes[OURS]) == {}
        assert list(value(outcomes[TORCH])) == ["scale"]


def test_loading_a_partial_state_dict(ranks):
    results = RankResults.of(ranks, _state_dicts)
    assert_conforms(results[full_partial_load])
    assert value(results[full_partial_load][OURS]) == (["head.bias"], ["extra"])
    assert_conforms(results[full_strict_load_of_a_partial_dict], words="Missing key")


def test_sharded_state_dicts(ranks):
    """SHARDED values: torch's ShardedTensor and this package's DTensor hold the same
    dim-0 chunk on every rank (compared here); the types differ by design (README)."""
    results = RankResults.of(ranks, _state_dicts)
    for rank in range(ranks.world_size):
        for check in SHARDED:
            assert_conforms(results.on(rank, check))


def test_local_state_dicts(ranks):
    """By design: torch's FSDP1 saves one flattened, padded ``_flat_param`` per unit under
    LOCAL_STATE_DICT (and on CPU ranks cannot load it into a model that has not run a
    forward yet); ``fully_shard`` has no flat parameter, so this package saves each
    parameter's own dim-0 chunk under its FULL key (buffers as they are), and loads it back
    into a model of the same wrapping and world size."""
    results = RankResults.of(ranks, _state_dicts)
    for check in LOCAL:
        theirs, ours = value(results[check][TORCH]), value(results[check][OURS])
        assert any(key.endswith("_flat_param") for key in theirs["keys"])
        assert ours["keys"] == value(results[f"full_{check.__name__[6:]}"][OURS])["keys"]
        assert_same(ours["pieces"], ours["after_load"])
        assert_same(ours["output"], ours["output_after_load"])
        assert ours["incompatible"] == ([], [])


def test_state_dict_settings(ranks):
    """The settings API behaves alike. By design: torch's FSDP1 deprecates it (FutureWarning:
    use DCP's ``get_state_dict``); here it is the supported way to choose a state-dict
    format and does not warn."""
    results = RankResults.of(ranks, _state_dicts)
    assert_conforms(results[settings_api])
    deprecated = "FSDP.set_state_dict_type\\(\\) are being deprecated"
    assert results[settings_api][TORCH].warned(deprecated)
    assert not results[settings_api][OURS].warned(deprecated)
    assert_conforms(
        results[settings_of_the_wrong_class], words="Expected state_dict_config of type"
    )


# ------------------------------------------------------------- offload_to_cpu (ours only)


def full_offloaded_vs_unsharded() -> dict:
    """FULL_STATE_DICT with ``offload_to_cpu=True`` for each model, against the unsharded
    model's own ``state_dict()``. torch's FSDP1 is not run here: on CPU ranks it crashes the
    process in this configuration (a segfault, torch 2.13), so the unsharded model is the
    reference."""
    from tests.fsdp.conformance._harness import flavors

    ours = flavors()[1]
    out = {}
    for name in MODELS:
        model, _ = _model(ours, name)
        reference, _ = _unsharded(name)
        for rank0_only in (False, True):
            with _state_type(ours, model, "FULL", offload_to_cpu=True, rank0_only=rank0_only):
                state = model.state_dict()
            out[f"{name} rank0_only={rank0_only}"] = (
                {k: v.clone() for k, v in state.items()},
                {k: v.clone() for k, v in reference.state_dict().items()},
                sorted({str(v.device) for v in state.values()}),
            )
    return out


def _unsharded(name: str) -> tuple[nn.Module, type]:
    classes = {"mlp": Mlp, "tied": Tied, "shared": SharedModule, "frozen": Frozen, "ignored": Mlp}
    return seeded(classes[name]), classes[name]


def test_full_state_dict_offloaded_to_cpu(ranks):
    for rank, result in enumerate(ranks.run(full_offloaded_vs_unsharded)):
        for case, (state, reference, devices) in result.items():
            if rank != 0 and "rank0_only=True" in case:
                assert state == {}, case
                continue
            assert_same(reference, state, case)
            assert devices == ["cpu"], case


def torch_sharded_state_into_ours() -> dict:
    """torch FSDP1's SHARDED state dict (ShardedTensor values) loaded into this package's
    model of the same architecture: the FULL state dicts agree."""
    from tests.fsdp.conformance._harness import flavors

    theirs_flavor, ours_flavor = flavors()
    out = {}
    for name in MODELS:
        theirs, _ = _model(theirs_flavor, name)
        with _state_type(theirs_flavor, theirs, "SHARDED"):
            saved = theirs.state_dict()
        ours, _ = _model(ours_flavor, name, seed=1)
        with _state_type(ours_flavor, ours, "SHARDED"):
            ours.load_state_dict(saved)
        with _state_type(theirs_flavor, theirs, "FULL"):
            expected = {k: v.clone() for k, v in theirs.state_dict().items()}
        out[name] = (expected, dict(ours.state_dict()))
    return out


def test_torch_sharded_state_dict_loads_here(ranks):
    result = ranks.run(torch_sharded_state_into_ours)[0]
    for name, (expected, loaded) in result.items():
        assert_same(dict(sorted(expected.items())), dict(sorted(loaded.items())), name)
