"""torch's documented FSDP1 checkpoint recipes, run unchanged on this package's
``FullyShardedDataParallel``, and checkpoints exchanged with torch's own FSDP1 (CPU, gloo).

Every recipe trains 2 steps, saves, trains 2 more (the expected losses), then a fresh model
of the reading implementation loads the checkpoint and trains the same 2 steps: the losses
must be the writer's. Within one implementation they are equal to the last bit. Between
torch's FSDP1 and this package (or a HYBRID_SHARD reader, which reduces gradients in two
stages) gradients may be summed in another order: measured 0 at 2 ranks and up to 6e-8 (one
float32 ulp of a loss near 1) at 4 ranks, asserted at 1e-6.

Recipes (torch docs of ``state_dict_type``, ``optim_state_dict``,
``load_sharded_optimizer_state_dict`` and the DCP tutorial):

* ``sharded_lsosd``: SHARDED_STATE_DICT through ``dcp.save``/``dcp.load`` with
  ``FileSystemWriter``/``FileSystemReader``, the optimizer through
  ``load_sharded_optimizer_state_dict`` (``ShardedTensor`` values) and
  ``optim_state_dict_to_load``;
* ``sharded_template``: the same, but ``dcp.load`` fills ``optim_state_dict(model, optim)``
  of the fresh optimizer (torch FSDP1 leaves that optimizer fresh without a word; not run
  with torch as reader);
* ``full``: FULL_STATE_DICT with ``rank0_only`` (``offload_to_cpu=False``: torch FSDP1's
  ``offload_to_cpu=True`` crashes on CPU) and ``optim_state_dict``, ``torch.save`` on rank 0;
* ``full_legacy_scatter`` / ``full_legacy_shard``: ``full_optim_state_dict`` read back with
  ``scatter_full_optim_state_dict`` (rank 0's copy) or ``shard_full_optim_state_dict``
  (every rank reads the file);
* ``local``: LOCAL_STATE_DICT, one ``torch.save`` file per rank (this package only: torch's
  LOCAL values are flat parameters, not exchangeable).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

from fsdp_interactive.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    StateDictType,
)
from tests.checkpoint import _common as c

CROSS_TOL = 1e-6


def _api(kind: str):
    if kind == "torch_fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel
    from fsdp_interactive.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _build(kind: str, seed: int, optim: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    if kind == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
        from fsdp_interactive.fsdp import ShardingStrategy

        mesh = init_device_mesh(
            "cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard")
        )
        model = FSDP(
            c.plain_model(seed),
            auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=mesh,
        )
    else:
        model = c.build(kind, seed)
    return model, c.optimizer(model, optim)


_FULL = (
    FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
    FullOptimStateDictConfig(rank0_only=True),
)


def _save(path: str, how: str, kind: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    api, rank = _api(kind), dist.get_rank()
    if how.startswith("sharded"):
        with api.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": api.optim_state_dict(model, optim)}
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    elif how == "full":
        with api.state_dict_type(model, StateDictType.FULL_STATE_DICT, *_FULL):
            state = {"model": model.state_dict(), "optim": api.optim_state_dict(model, optim)}
        if rank == 0:
            torch.save(state, f"{path}.pt")
    elif how.startswith("full_legacy"):
        with api.state_dict_type(model, StateDictType.FULL_STATE_DICT, _FULL[0]):
            state = {"model": model.state_dict()}
        state["optim"] = api.full_optim_state_dict(model, optim)  # rank0_only by default
        if rank == 0:
            torch.save(state, f"{path}.pt")
    elif how == "local":
        with api.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            state = {"model": model.state_dict(), "optim": api.optim_state_dict(model, optim)}
            torch.save(state, f"{path}.rank{rank}.pt")
    else:
        raise ValueError(how)
    dist.barrier()


def _load(path: str, how: str, kind: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    api, rank = _api(kind), dist.get_rank()
    if how == "sharded_lsosd":
        with api.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model_sd = model.state_dict()
            state = {"model": model_sd}
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
            model.load_state_dict(state["model"])
            osd = load_sharded_optimizer_state_dict(
                model_state_dict=model_sd,
                optimizer_key="optim",
                storage_reader=dcp.FileSystemReader(path),
            )
            optim.load_state_dict(api.optim_state_dict_to_load(model, optim, osd["optim"]))
    elif how == "sharded_template":
        with api.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": api.optim_state_dict(model, optim)}
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
            model.load_state_dict(state["model"])
            optim.load_state_dict(api.optim_state_dict_to_load(model, optim, state["optim"]))
    elif how.startswith("full"):
        state = torch.load(f"{path}.pt", weights_only=False)
        with api.state_dict_type(model, StateDictType.FULL_STATE_DICT, *_FULL):
            model.load_state_dict(state["model"])
            if how == "full":
                mine = state["optim"] if rank == 0 else {}
                optim.load_state_dict(api.optim_state_dict_to_load(model, optim, mine))
        if how == "full_legacy_scatter":
            mine = state["optim"] if rank == 0 else None
            optim.load_state_dict(api.scatter_full_optim_state_dict(mine, model, optim=optim))
        elif how == "full_legacy_shard":
            optim.load_state_dict(
                api.shard_full_optim_state_dict(state["optim"], model, optim=optim)
            )
    elif how == "local":
        state = torch.load(f"{path}.rank{rank}.pt", weights_only=False)
        with api.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            model.load_state_dict(state["model"])
            optim.load_state_dict(api.optim_state_dict_to_load(model, optim, state["optim"]))


def _optimizer_for(how: str, writer: str) -> str:
    # torch 2.13's FSDP1 on CPU gathers wrong ``exp_avg`` values into its FULL optimizer
    # state (its ``exp_avg_sq`` and ``step`` are right; see test_fsdp1_api), so a FULL
    # checkpoint it writes cannot resume Adam anywhere: those cases use SGD with momentum.
    return "sgd" if how.startswith("full") and writer == "torch_fsdp1" else "adam"


def resume(path: str, how: str, writer: str, reader: str) -> dict:
    """On every rank: write with ``writer``, read into a fresh ``reader`` model, compare."""
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", UserWarning)
    optim_kind = _optimizer_for(how, writer)
    model, optim = _build(writer, seed=0, optim=optim_kind)
    for step in range(2):
        c.train_step(model, optim, step)
    _save(path, how, writer, model, optim)
    expected = [c.train_step(model, optim, step) for step in (2, 3)]
    fresh, fresh_optim = _build(reader, seed=3, optim=optim_kind)
    _load(path, how, reader, fresh, fresh_optim)
    resumed = [c.train_step(fresh, fresh_optim, step) for step in (2, 3)]
    return {"diff": max(abs(a - b) for a, b in zip(expected, resumed, strict=True))}


def _run(group, tmp_path, how: str, writer: str, reader: str) -> None:
    path = os.path.join(tmp_path, f"{how}-{writer}-{reader}")
    tol = 0.0 if writer == reader else CROSS_TOL
    for r in group.run(resume, path, how, writer, reader):
        assert r["diff"] <= tol, r


RECIPES = ["sharded_lsosd", "sharded_template", "full", "full_legacy_scatter", "full_legacy_shard"]
PAIRS = [("wrapper", "wrapper"), ("torch_fsdp1", "wrapper"), ("wrapper", "torch_fsdp1")]


def _cases() -> list:
    cases = [(how, w, r) for how in RECIPES for w, r in PAIRS]
    # torch's FSDP1 leaves a fresh optimizer fresh in the template recipe: nothing to check.
    cases = [x for x in cases if not (x[0] == "sharded_template" and x[2] == "torch_fsdp1")]
    return [*cases, ("local", "wrapper", "wrapper")]


@pytest.mark.parametrize(("how", "writer", "reader"), _cases())
def test_recipe_resumes_identically_on_2_ranks(ranks2, tmp_path, how, writer, reader):
    _run(ranks2, tmp_path, how, writer, reader)


@pytest.mark.world4
@pytest.mark.parametrize(
    ("how", "writer", "reader"),
    [
        ("sharded_lsosd", "torch_fsdp1", "wrapper"),
        ("sharded_lsosd", "wrapper", "torch_fsdp1"),
        ("sharded_template", "torch_fsdp1", "wrapper"),
        ("full", "torch_fsdp1", "wrapper"),
        ("full", "wrapper", "torch_fsdp1"),
        ("full_legacy_scatter", "torch_fsdp1", "wrapper"),
        ("full_legacy_shard", "wrapper", "torch_fsdp1"),
        ("local", "wrapper", "wrapper"),
        # torch's ShardedTensors are chunked over 4 ranks; a (2, 2) HYBRID_SHARD mesh holds
        # other pieces: the values are resharded.
        ("sharded_lsosd", "torch_fsdp1", "hybrid"),
        ("sharded_template", "wrapper", "hybrid"),
    ],
)
def test_recipe_resumes_identically_on_4_ranks(ranks4, tmp_path, how, writer, reader):
    _run(ranks4, tmp_path, how, writer, reader)
