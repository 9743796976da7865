"""Two FSDP1 behaviours on fully_shard: torch's ``ShardedTensor`` accepted as load input, and
the state dict of an optimizer that has not stepped yet.

* ``load_state_dict`` under SHARDED_STATE_DICT takes torch FSDP1's own sharded state dict
  (``ShardedTensor`` values): as is where the pieces match, resharded where they do not
  (torch's 4-rank chunks into a (2, 2) HYBRID_SHARD mesh); a wrong shape is refused.
* ``optim_state_dict`` of a fresh optimizer under SHARDED_STATE_DICT holds placeholders that
  a load fills; the optimizer itself is not changed, unfilled placeholders leave it fresh,
  and a checkpoint of the never-stepped optimizer resumes like a fresh start.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
from fsdp_interactive.fsdp import StateDictType
from tests.checkpoint import _common as c
from tests.checkpoint import test_fsdp1_recipes as recipes


def load_torch_sharded_state(reader: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    warnings.simplefilter("ignore", FutureWarning)
    theirs = c.build("torch_fsdp1", seed=0)
    with TorchFSDP.state_dict_type(theirs, StateDictType.SHARDED_STATE_DICT):
        sd = theirs.state_dict()
    kinds = sorted({type(v).__name__ for v in sd.values()})
    with TorchFSDP.state_dict_type(theirs, StateDictType.FULL_STATE_DICT):
        expected = {k: v.clone() for k, v in theirs.state_dict().items()}
    ours, _ = recipes._build(reader, seed=9, optim="sgd")
    with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT):
        result = ours.load_state_dict(sd)
    error = None
    try:
        # A ShardedTensor of the wrong global shape: the (10, 6) weight offered as the bias.
        with FSDP.state_dict_type(ours, StateDictType.SHARDED_STATE_DICT):
            ours.load_state_dict({"inp.bias": sd["inp.weight"]}, strict=False)
    except ValueError as exc:
        error = str(exc)
    return {
        "kinds": kinds,
        "incompatible": (list(result.missing_keys), list(result.unexpected_keys)),
        "diff": c.max_diff(expected, c.full_values(ours)),
        "error": error,
    }


def test_torch_fsdp1_sharded_state_dict_loads_on_2_ranks(ranks2):
    for r in ranks2.run(load_torch_sharded_state, "wrapper"):
        assert "ShardedTensor" in r["kinds"]
        assert r["incompatible"] == ([], [])
        assert r["diff"] == 0.0
        assert "ShardedTensor of global shape (10, 6)" in r["error"], r["error"]
        assert "shape (10,)" in r["error"]


@pytest.mark.world4
def test_torch_fsdp1_sharded_state_dict_reshards_into_a_hybrid_mesh(ranks4):
    for r in ranks4.run(load_torch_sharded_state, "hybrid"):
        assert "ShardedTensor" in r["kinds"]
        assert r["incompatible"] == ([], [])
        assert r["diff"] == 0.0


def _load_into_fresh(path: str, optim_kind: str) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """A fresh model and optimizer; the recipe: ``dcp.load`` into ``optim_state_dict``."""
    model = c.build("wrapper", seed=0)
    optim = c.optimizer(model, optim_kind)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
        loadable = FSDP.optim_state_dict_to_load(model, optim, state["optim"])
    return model, optim, loadable


def fresh_optimizer(path: str) -> dict:
    warnings.simplefilter("ignore", FutureWarning)
    model = c.build("wrapper", seed=0)
    optim = c.optimizer(model, "adam")
    grads_before = [p.grad for p in model.parameters()]
    values_before = c.full_values(model)
    lrs_before = [g["lr"] for g in optim.param_groups]
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        template = FSDP.optim_state_dict(model, optim)
        untouched_load = FSDP.optim_state_dict_to_load(model, optim, template)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = FSDP.optim_state_dict(model, optim)
    out = {
        "template_keys": sorted(template["state"]),
        "template_entry": sorted(template["state"]["inp.weight"]),
        "template_step": float(template["state"]["inp.weight"]["step"]),
        "template_types": sorted(
            {type(v).__name__ for s in template["state"].values() for n, v in s.items()}
        ),
        "optimizer_still_fresh": len(optim.state) == 0,
        "grads_kept": all(
            a is b for a, b in zip(grads_before, [p.grad for p in model.parameters()], strict=True)
        ),
        "params_kept": c.max_diff(values_before, c.full_values(model)),
        "lrs_kept": lrs_before == [g["lr"] for g in optim.param_groups],
        "untouched_state": untouched_load["state"],
        "full_state": full["state"],
    }
    # A checkpoint of the never-stepped optimizer resumes like a fresh optimizer.
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"optim": template}, storage_writer=dcp.FileSystemWriter(path))
    fresh_losses = [c.train_step(model, optim, step) for step in range(3)]
    again, again_optim, loadable = _load_into_fresh(path, "adam")
    again_optim.load_state_dict(loadable)
    out["loaded_entries"] = len(loadable["state"])
    out["step0_resume_diff"] = max(
        abs(a - c.train_step(again, again_optim, step)) for step, a in enumerate(fresh_losses)
    )
    return out


def test_fresh_optimizer_gets_fillable_placeholders_and_stays_fresh(ranks2, tmp_path):
    path = os.path.join(tmp_path, "step0")
    for r in ranks2.run(fresh_optimizer, path):
        assert len(r["template_keys"]) == 8
        assert r["template_entry"] == ["exp_avg", "exp_avg_sq", "step"]
        assert r["template_step"] == 0.0  # the value Adam starts from, not after a step
        assert r["template_types"] == ["DTensor", "Tensor"]
        assert r["optimizer_still_fresh"] and r["grads_kept"] and r["lrs_kept"]
        assert r["params_kept"] == 0.0
        assert r["untouched_state"] == {}, "unfilled placeholders must not be applied"
        assert r["full_state"] == {}, "FULL keeps torch FSDP1's empty state"
        assert r["loaded_entries"] == 8
        assert r["step0_resume_diff"] == 0.0


def dcp_load_counts(path: str) -> int:
    """Placeholders the DCP load wrote into count as loaded (the recipe tests cover values)."""
    model = c.build("wrapper", seed=0)
    optim = c.optimizer(model, "sgd")
    c.train_step(model, optim, 0)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save(
            {"optim": FSDP.optim_state_dict(model, optim)},
            storage_writer=dcp.FileSystemWriter(path),
        )
    return len(_load_into_fresh(path, "sgd")[2]["state"])


def test_placeholders_filled_by_dcp_load_are_applied_for_sgd(ranks2, tmp_path):
    assert ranks2.run(dcp_load_counts, os.path.join(tmp_path, "sgd")) == [8, 8]
