"""Resharding across world sizes (4 -> 2 -> 1 -> 4) and a rank dying in the middle of a
save (the previous checkpoint stays loadable, the partial one is never listed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp_interactive import checkpoint as ck
from tests.checkpoint import _common as c


def _train_and_save(root: str) -> dict:
    model = c.build("fsdp2", seed=0)
    opt = c.optimizer(model, "adamw")
    for step in range(2):
        c.train_step(model, opt, step)
    ck.save(f"{root}/w4", model, opt, step=2)
    return c.full_values(model)  # collective: every rank gathers


def _load_then_save(root: str, src: str, dst: str, kind: str) -> dict:
    model = c.build(kind, seed=dist.get_world_size() + 40)
    opt = c.optimizer(model, "adamw")
    report = ck.load(f"{root}/{src}", model, opt)
    ck.save(f"{root}/{dst}", model, opt, step=report.step)
    # The optimizer state came along: its full exp_avg per parameter is reported too.
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        osd = FSDP.optim_state_dict(model, opt)
    return {
        "values": c.full_values(model),
        "exp_avg": {k: v["exp_avg"] for k, v in osd["state"].items()},
        "saved_world_size": report.saved_world_size,
    }


def test_checkpoint_reshards_4_to_2_to_1_to_4(ranks4, ranks2, ranks1, tmp_path):
    root = str(tmp_path)
    original = ranks4.run(_train_and_save, root)[0]
    at2 = ranks2.run(_load_then_save, root, "w4", "w2", "wrapper")
    at1 = ranks1.run(_load_then_save, root, "w2", "w1", "fsdp2")
    at4 = ranks4.run(_load_then_save, root, "w1", "w4again", "fsdp2")
    assert [r["saved_world_size"] for r in (at2[0], at1[0], at4[0])] == [4, 2, 1]
    for results in (at2, at1, at4):
        for r in results:
            assert c.max_diff(original, r["values"]) == 0.0
            assert c.max_diff(at2[0]["exp_avg"], r["exp_avg"]) == 0.0
    assert [r.world_size for r in ck.list_checkpoints(root)] == [4, 2, 1, 4]


def _save_first(root: str) -> dict:
    model = c.build("fsdp2", seed=0)
    opt = c.optimizer(model, "sgd")
    c.train_step(model, opt, 0)
    ck.save(f"{root}/good", model, opt, step=1)
    return c.full_values(model)


def _die_during_save(root: str) -> None:
    import torch.distributed.checkpoint.filesystem as fs

    model = c.build("fsdp2", seed=0)
    opt = c.optimizer(model, "sgd")
    c.train_step(model, opt, 0)
    c.train_step(model, opt, 1)
    if dist.get_rank() == 1:
        original = fs._FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            original(self, plan, planner).wait()  # this rank's shard is on disk
            os._exit(17)

        fs._FileSystemWriter.write_data = write_then_die
    ck.save(f"{root}/bad", model, opt, step=2)


def _load_after_crash(root: str) -> dict:
    model = c.build("fsdp2", seed=99)
    opt = c.optimizer(model, "sgd")
    report = ck.load(f"{root}/good", model, opt)
    return {
        "values": c.full_values(model),
        "step": report.step,
        "listed": [r.name for r in ck.list_checkpoints(root)],
    }


def _save_again(root: str) -> list[str]:
    model = c.build("fsdp2", seed=0)
    ck.save(f"{root}/after", model, step=3)
    return sorted(p.name for p in Path(root).iterdir())


def test_rank_killed_mid_save_leaves_previous_checkpoint_and_no_listed_partial(ranks2, tmp_path):
    root = str(tmp_path)
    before = ranks2.run(_save_first, root)
    with pytest.raises((RuntimeError, TimeoutError)):
        ranks2.run(_die_during_save, root)
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert "bad" not in leftovers
    assert any(name.startswith(".bad.partial-") for name in leftovers)
    assert [r.name for r in ck.list_checkpoints(root)] == ["good"]

    for rank, r in enumerate(ranks2.run(_load_after_crash, root)):  # the group restarted
        assert r["step"] == 1 and r["listed"] == ["good"]
        assert c.max_diff(before[rank], r["values"]) == 0.0
    # The next save into the folder clears the crashed save's leftovers.
    assert ranks2.run(_save_again, root)[0] == ["after", "good"]
