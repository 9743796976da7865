"""FSDP1's state-dict API on fully_shard: side by side with torch's FSDP1 (CPU, gloo),
round trips per state-dict type, and the optimizer-state family."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.tensor import DTensor

from fsdp_interactive.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    OptimStateKeyType,
    ShardedStateDictConfig,
    StateDictType,
)
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
from tests.checkpoint import _common as c

KINDS = ["fsdp2", "wrapper"]


def _close(a: dict, b: dict, atol: float = 1e-5) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _side_by_side(kind: str) -> dict:
    warnings.simplefilter("ignore", FutureWarning)
    theirs, ours = c.build("torch_fsdp1"), c.build(kind)
    opt_t, opt_o = c.optimizer(theirs, "adam"), c.optimizer(ours, "adam")
    out = {
        "empty_osd_equal": c.structure(TorchFSDP.optim_state_dict(theirs, opt_t))
        == c.structure(FSDP.optim_state_dict(ours, opt_o)),
        "empty_state_untouched": len(opt_o.state) == 0,
    }
    for step in range(2):
        c.train_step(theirs, opt_t, step)
        c.train_step(ours, opt_o, step)
    with TorchFSDP.state_dict_type(theirs, StateDictType.FULL_STATE_DICT):
        sd_t = theirs.state_dict()
        osd_t = TorchFSDP.optim_state_dict(theirs, opt_t)
    with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT):
        sd_o = ours.state_dict()
        osd_o = FSDP.optim_state_dict(ours, opt_o)
    out["keys_t"], out["keys_o"] = list(sd_t), list(sd_o)
    out["plain_types"] = all(type(v) is torch.Tensor for v in sd_o.values())
    out["value_diff"] = _close(sd_t, sd_o)
    out["osd_structure_equal"] = c.structure(osd_t) == c.structure(osd_o)
    # Values are compared for ``step`` and ``exp_avg_sq`` only: torch 2.13's FSDP1 on CPU
    # returns ``exp_avg_sq``'s values under ``exp_avg`` too in its gathered optimizer state
    # (its own optimizer's local ``exp_avg`` shards match ours).
    out["osd_value_diff"] = max(
        (osd_t["state"][k][n].double() - osd_o["state"][k][n].double()).abs().max().item()
        for k in osd_t["state"]
        for n in ("step", "exp_avg_sq")
    )
    cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    ocfg = FullOptimStateDictConfig(rank0_only=True)
    with TorchFSDP.state_dict_type(theirs, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        r0_t = (len(theirs.state_dict()), len(TorchFSDP.optim_state_dict(theirs, opt_t)))
    with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        r0_o = (len(ours.state_dict()), len(FSDP.optim_state_dict(ours, opt_o)))
    out["rank0_only_sizes"] = (r0_t, r0_o)
    with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT):
        sharded = ours.state_dict()
        osd_sharded = FSDP.optim_state_dict(ours, opt_o)
    out["sharded_keys"] = list(sharded)
    out["sharded_full_diff"] = _close(
        {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sharded.items()}, sd_o
    )
    out["sharded_param_types"] = {type(v).__name__ for k, v in sharded.items() if k != "shift"}
    out["osd_sharded_types"] = {
        type(v).__name__ for s in osd_sharded["state"].values() for n, v in s.items() if n != "step"
    }
    with FSDP.state_dict_type(ours, StateDictType.LOCAL_STATE_DICT):
        local = ours.state_dict()
    out["local_shapes"] = {k: tuple(v.shape) for k, v in local.items()}
    out["settings_restored"] = FSDP.get_state_dict_type(ours).state_dict_type
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_full_state_dict_and_optim_state_dict_match_torch_fsdp1(ranks2, kind):
    results = ranks2.run(_side_by_side, kind)
    for rank, r in enumerate(results):
        assert r["empty_osd_equal"] and r["empty_state_untouched"]
        assert r["keys_o"] == r["keys_t"]
        assert r["plain_types"]
        assert r["value_diff"] < 1e-5
        assert r["osd_structure_equal"]
        assert r["osd_value_diff"] < 1e-5
        t, o = r["rank0_only_sizes"]
        assert t == o
        assert o == ((9, 2) if rank == 0 else (0, 0))
        assert r["sharded_keys"] == r["keys_t"]
        assert r["sharded_full_diff"] == 0.0
        assert r["sharded_param_types"] == {"DTensor"}
        assert r["osd_sharded_types"] == {"DTensor"}
        native = {
            "wrapper": StateDictType.FULL_STATE_DICT,
            "fsdp2": StateDictType.SHARDED_STATE_DICT,
        }
        assert r["settings_restored"] == native[kind]
    # LOCAL: each rank's torch.chunk(dim=0) piece of every parameter (rows 10 -> 5+5, 3 -> 2+1).
    assert results[0]["local_shapes"]["inp.weight"] == (5, 6)
    assert results[0]["local_shapes"]["body.2.weight"] == (2, 9)
    assert results[1]["local_shapes"]["body.2.weight"] == (1, 9)


def _round_trip(kind: str, sd_type: StateDictType) -> dict:
    model, opt = c.build(kind, seed=0), None
    opt = c.optimizer(model, "adamw")
    for step in range(2):
        c.train_step(model, opt, step)
    with FSDP.state_dict_type(model, sd_type):
        # Like torch's, SHARDED/LOCAL values reference the live shards: copy them as a
        # save to disk would before training on.
        sd = c.snapshot(model.state_dict())
        osd = c.snapshot(FSDP.optim_state_dict(model, opt))
    expected_loss = c.train_step(model, opt, 2)
    expected = c.full_values(model)

    fresh = c.build(kind, seed=77)
    fresh_opt = c.optimizer(fresh, "adamw")
    with FSDP.state_dict_type(fresh, sd_type):
        result = fresh.load_state_dict(sd)
        to_load = FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd)
    fresh_opt.load_state_dict(to_load)
    loss = c.train_step(fresh, fresh_opt, 2)
    return {
        "incompatible": (list(result.missing_keys), list(result.unexpected_keys)),
        "loss_diff": abs(loss - expected_loss),
        "param_diff": c.max_diff(expected, c.full_values(fresh)),
        "to_load_keys": sorted(to_load["state"]),
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "sd_type",
    [
        StateDictType.FULL_STATE_DICT,
        StateDictType.SHARDED_STATE_DICT,
        StateDictType.LOCAL_STATE_DICT,
    ],
    ids=["full", "sharded", "local"],
)
def test_round_trip_per_state_dict_type_resumes_exactly(ranks2, kind, sd_type):
    for r in ranks2.run(_round_trip, kind, sd_type):
        assert r["incompatible"] == ([], [])
        assert r["loss_diff"] == 0.0
        assert r["param_diff"] == 0.0
        assert r["to_load_keys"] == list(range(8))


def _plain_interchange() -> dict:
    model = c.build("wrapper", seed=0)
    plain = c.plain_model(seed=0)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        sd = model.state_dict()
    other = c.plain_model(seed=3)
    other.load_state_dict(sd)  # keys of the unwrapped model, plain tensors
    donor = c.plain_model(seed=11)
    wrapped = c.build("wrapper", seed=0)
    wrapped.load_state_dict(donor.state_dict())  # default type is FULL_STATE_DICT
    bad = dict(donor.state_dict())
    bad.pop("inp.bias")
    bad["extra.weight"] = torch.zeros(1)
    try:
        wrapped.load_state_dict(bad)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    report = wrapped.load_state_dict(bad, strict=False)
    return {
        "same_as_plain": c.max_diff(dict(plain.state_dict()), dict(other.state_dict())),
        "loaded_donor": c.max_diff(dict(donor.state_dict()), c.full_values(wrapped)),
        "error": error,
        "report": (list(report.missing_keys), list(report.unexpected_keys)),
    }


def test_full_state_dict_interchanges_with_the_plain_module(ranks2):
    for r in ranks2.run(_plain_interchange):
        assert r["same_as_plain"] == 0.0
        assert r["loaded_donor"] == 0.0
        assert "inp.bias" in r["error"] and "extra.weight" in r["error"]
        assert r["report"] == (["inp.bias"], ["extra.weight"])


def _legacy_family(kind: str) -> dict:
    warnings.simplefilter("always")
    model = c.build(kind, seed=0)
    opt = c.optimizer(model, "sgd")
    # A parameter without optimizer state: it had no gradient at either step.
    for step in range(2):
        x, y = c.batch(step)
        (model(x) - y).square().mean().backward()
        c.by_name(model)["inp.bias"].grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
    expected_loss = None
    with warnings.catch_warnings(record=True) as caught:
        full = FSDP.full_optim_state_dict(model, opt)  # rank0_only=True
        full_all = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
        sharded = FSDP.sharded_optim_state_dict(model, opt)
    legacy_warnings = sorted({str(w.message).split("``")[1] for w in caught})
    ref = {k: v.detach().clone() for k, v in c.full_values(model).items()}
    expected_loss = c.train_step(model, opt, 2)

    outcomes = {}
    for how in ("shard_full", "scatter_full", "flatten_sharded"):
        fresh = c.build(kind, seed=5)
        with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
            fresh.load_state_dict({k: v.clone() for k, v in ref.items()})
        fresh_opt = c.optimizer(fresh, "sgd")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if how == "shard_full":
                loadable = FSDP.shard_full_optim_state_dict(full_all, fresh, optim=fresh_opt)
            elif how == "scatter_full":
                src = full if dist.get_rank() == 0 else None
                loadable = FSDP.scatter_full_optim_state_dict(src, fresh, optim=fresh_opt)
            else:
                loadable = FSDP.flatten_sharded_optim_state_dict(sharded, fresh, fresh_opt)
        fresh_opt.load_state_dict(loadable)
        outcomes[how] = abs(c.train_step(fresh, fresh_opt, 2) - expected_loss)
    by_id = FSDP.rekey_optim_state_dict(full_all, OptimStateKeyType.PARAM_ID, model)
    back = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model)
    mixed = {"state": {0: {}, "inp.weight": {}}, "param_groups": []}
    try:
        FSDP.rekey_optim_state_dict(mixed, OptimStateKeyType.PARAM_ID, model)
        mixed_error = None
    except ValueError as exc:
        mixed_error = str(exc)
    return {
        "full_keys": sorted(full.get("state", {})),
        "warned": legacy_warnings,
        "outcomes": outcomes,
        "id_keys": sorted(by_id["state"]),
        "id_groups": [g["params"] for g in by_id["param_groups"]],
        # rekey sorts each group's ``params`` (torch does the same).
        "back_equal": c.structure(back["state"]) == c.structure(full_all["state"])
        and [g["params"] for g in back["param_groups"]]
        == [sorted(g["params"]) for g in full_all["param_groups"]],
        "mixed_error": mixed_error,
    }


@pytest.mark.parametrize("kind", KINDS)
def test_legacy_optimizer_family_and_rekey(ranks2, kind):
    results = ranks2.run(_legacy_family, kind)
    names = ["body.0.bias", "body.0.weight", "body.2.bias", "body.2.weight"]
    names += ["inp.weight", "norm.bias", "norm.weight"]  # inp.bias: no state yet
    assert results[0]["full_keys"] == names
    assert results[1]["full_keys"] == []
    for r in results:
        assert r["warned"] == [
            "FullyShardedDataParallel.full_optim_state_dict",
            "FullyShardedDataParallel.sharded_optim_state_dict",
        ]
        assert r["outcomes"] == {"shard_full": 0.0, "scatter_full": 0.0, "flatten_sharded": 0.0}
        # IDs follow model.parameters(): inp.weight=0, inp.bias=1, norm.*=2,3, body.*=4..7.
        assert r["id_keys"] == [0, 2, 3, 4, 5, 6, 7]
        assert r["id_groups"] == [[0, 4, 6], [1, 2, 3, 5, 7]]
        assert r["back_equal"]
        assert "Invalid parameter keys" in r["mixed_error"]


def _settings_checks() -> dict:
    wrapped, model = c.build("wrapper"), c.build("fsdp2")
    defaults = (
        FSDP.get_state_dict_type(wrapped).state_dict_type,
        FSDP.get_state_dict_type(model).state_dict_type,
    )
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full_inside = type(model.state_dict()["inp.weight"]).__name__
    native_after = type(model.state_dict()["inp.weight"]).__name__
    errors = {}
    try:
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, LocalStateDictConfig())
    except RuntimeError as exc:
        errors["wrong_config"] = str(exc)
    prev = FSDP.set_state_dict_type(
        model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True)
    )
    now = FSDP.get_state_dict_type(model)
    return {
        "defaults": defaults,
        "types": (full_inside, native_after),
        "errors": errors,
        "prev": prev.state_dict_type,
        "now": (now.state_dict_type, now.state_dict_config.offload_to_cpu),
        "no_units": FSDP.get_state_dict_type(torch.nn.Linear(2, 2)),
    }


def test_set_and_get_state_dict_type_follow_torch(ranks2):
    for r in ranks2.run(_settings_checks):
        assert "Expected state_dict_config of type" in r["errors"]["wrong_config"]
        # FSDP1's default for the wrapper; fully_shard's native DTensor output otherwise,
        # restored when the context exits.
        assert r["defaults"] == (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT)
        assert r["types"] == ("Tensor", "DTensor")
        assert r["prev"] == StateDictType.SHARDED_STATE_DICT
        assert r["now"] == (StateDictType.SHARDED_STATE_DICT, True)
        assert r["no_units"] is None
