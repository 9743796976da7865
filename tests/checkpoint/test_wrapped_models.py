"""Checkpoints of the models users bring (torch FSDP1 flat and with original parameters under
FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD, DDP, ``torch.compile``, activation
checkpointing, Lightning Fabric, accelerate), at 2 and 4 ranks:

* save, then load into the same wrapping built with other weights and a fresh optimizer:
  every rank holds again, byte for byte, its shards and optimizer state of save time;
* names are clean (torch's rule), so a checkpoint of one wrapping loads into another, also
  at another world size, equal to the saved state gathered by torch's ``get_state_dict``;
* a torch FSDP1 model whose ranks each train their own copy is refused on every rank,
  nothing written.

Snapshots of the same wrappings, a SIGKILL and ``Pool.recover``: test_recover_wrapped.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_interactive import checkpoint as ck
from tests.checkpoint import _wrappings as w
from tests.frameworks._installed import modules_for, require

WORLDS = [
    pytest.param("ranks2", id="2ranks"),
    pytest.param("ranks4", id="4ranks", marks=pytest.mark.world4),
]


def _without_rng(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "rng"}


def _save_then_load(kind: str, path: str) -> dict[str, Any]:
    model, optim = w.build(kind)
    w.train(model, optim, 0, 2)
    saved = w.local_state(model, optim)
    ck.save(path, model, optim, step=2)
    fresh, fresh_optim = w.build(kind, seed=1)
    before = w.local_state(fresh, fresh_optim)
    report = ck.load(path, fresh, fresh_optim)
    loaded = w.local_state(fresh, fresh_optim)
    return {
        "differences": w.differences(_without_rng(saved), _without_rng(loaded)),
        "fresh_differed": w.differences(_without_rng(saved), _without_rng(before)) != [],
        "keys": _model_keys(path),
        "loaded_optimizer": report.loaded_optimizer,
    }


def _model_keys(path: str) -> list[str]:
    from fsdp_interactive.checkpoint._format._safe_reader import read_metadata, section_paths

    return sorted(p[1] for p in section_paths(read_metadata(Path(path)), "model").values())


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", w.WRAPPINGS)
def test_save_then_load_gives_every_rank_its_state_bit_for_bit(kind, world, request, tmp_path):
    require(*modules_for(kind))
    ranks = request.getfixturevalue(world)
    results = ranks.run(_save_then_load, kind, str(tmp_path / kind))
    clean = sorted(_clean_keys())
    for rank, result in enumerate(results):
        assert result["differences"] == [], (rank, result["differences"][:5])
        assert result["fresh_differed"] and result["loaded_optimizer"]
        assert result["keys"] == clean, rank


def _clean_keys() -> list[str]:
    from tests.models import TinyLM

    return list(TinyLM().state_dict())


def _save_full(kind: str, path: str) -> dict[str, Any]:
    model, optim = w.build(kind)
    w.train(model, optim, 0, 2)
    ck.save(path, model, optim)
    return w.full_state(model, optim)


def _load_full(kind: str, path: str) -> dict[str, Any]:
    model, optim = w.build(kind, seed=1)
    ck.load(path, model, optim)
    return w.full_state(model, optim)


# (saved by, on ranks) -> (loaded into, on ranks): torch FSDP1 and fully_shard both ways,
# flat parameters from DDP; resharding 2 -> 4 and 4 -> 2 on the way.
CROSSINGS = [
    ("fsdp1-flat-FULL_SHARD", "ranks2", "fully_shard", "ranks4"),
    ("fully_shard", "ranks4", "fsdp1-flat-FULL_SHARD", "ranks2"),
    ("fsdp1-orig-HYBRID_SHARD", "ranks4", "fsdp1-flat-SHARD_GRAD_OP", "ranks2"),
    ("ddp", "ranks2", "fsdp1-flat-HYBRID_SHARD", "ranks4"),
]


@pytest.mark.world4
@pytest.mark.parametrize(("source", "saved_on", "target", "loaded_on"), CROSSINGS)
def test_a_checkpoint_loads_into_another_wrapping_at_another_world_size(
    source, saved_on, target, loaded_on, request, tmp_path
):
    path = str(tmp_path / "checkpoint")
    saved = request.getfixturevalue(saved_on).run(_save_full, source, path)[0]
    for rank, loaded in enumerate(request.getfixturevalue(loaded_on).run(_load_full, target, path)):
        assert w.differences(saved, loaded) == [], (rank, w.differences(saved, loaded)[:5])


def _hybrid_over_one_rank(path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from tests.models import Block, TinyLM

    outcome: dict[str, Any] = {}
    for how in ("mesh", "no_mesh"):
        extra = {"device_mesh": init_device_mesh("cpu", (dist.get_world_size(), 1))}
        model = FullyShardedDataParallel(
            TinyLM(),
            device_id=torch.device("cpu"),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            **(extra if how == "mesh" else {}),
        )
        try:
            ck.save(f"{path}-{how}", model)
        except ck.UnsupportedModelError as error:
            outcome[how] = str(error)
    outcome["written"] = sorted(os.listdir(os.path.dirname(path)))
    return outcome


def test_a_torch_fsdp1_model_whose_ranks_train_their_own_copies_is_refused(ranks2, tmp_path):
    results = ranks2.run(_hybrid_over_one_rank, str(tmp_path / "checkpoint"))
    for result in results:
        for how in ("mesh", "no_mesh"):
            assert "shards over 1 of the 2 ranks" in result[how], result
            assert "device_mesh=init_device_mesh" in result[how]
        assert result["written"] == []


def _torch_notices_of_the_kits_calls(kind: str, root: str) -> dict[str, Any]:
    import warnings

    from tests.checkpoint import _snapshots as s

    s.place(root)
    model, optim = w.build(kind)
    w.train(model, optim, 0, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.save(f"{root}/saved", model, optim)
        ck.load(f"{root}/saved", model, optim)
        taken = ck.snapshot(model, optim)
        ck.restore_snapshot(taken.id, objects={"model": model, "optimizer": optim})
        warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
    return {"shown": [str(w_.message) for w_ in caught]}


def test_a_torch_fsdp1_models_checkpoints_say_nothing_of_torchs_sharded_tensor(ranks2, tmp_path):
    """Saving, loading, snapshotting and restoring a torch FSDP1 model show none of torch's
    notices about ShardedTensor (which the user did not choose); other warnings still
    show."""
    for result in ranks2.run(
        _torch_notices_of_the_kits_calls, "fsdp1-orig-FULL_SHARD", str(tmp_path)
    ):
        assert result["shown"] == ["a warning of the user's own"], result["shown"]
