"""Snapshots restore the training state bit for bit (parameters, AdamW state, scheduler,
a step counter, every rank's random streams), at the same world size and resharded
(2 -> 1, 4 -> 2); names are recorded by identity in the calling cell's globals; rank 0
publishes the notice with the call that took it. Real gloo ranks, a TinyLM wrapped per
block with this package's FullyShardedDataParallel."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fsdp_interactive import checkpoint as ck
from tests.checkpoint import _snapshots as s

SNAPSHOT, RESTORE = s.SNAPSHOT, s.RESTORE


def _snapshot_go_on_restore(root: str) -> dict:
    s.place(root)
    ns = s.cell_namespace(seed=0)
    s.train(ns, 3)
    s.seed_per_rank(5)
    expected = s.exact_state(ns)
    record = s.run_cell(ns, SNAPSHOT)
    after_call = s.exact_state(ns)
    s.train(ns, 2)
    torch.rand(3), random.random(), np.random.rand()
    moved_on = s.differences(expected, s.exact_state(ns))
    ns["snapshot_id"] = record.id
    report = s.run_cell(ns, RESTORE)
    return {
        "record": record,
        "report": report,
        "changed_by_call": s.differences(expected, after_call),
        "moved_on": moved_on,
        "after_restore": s.differences(expected, s.exact_state(ns)),
        "listed": [r.id for r in ck.list_snapshots()],
    }


def test_restore_at_the_same_world_size_is_exact(ranks2, tmp_path):
    results = ranks2.run(_snapshot_go_on_restore, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["changed_by_call"] == [], f"rank {rank}: snapshot() changed the state"
        # The training that followed changed every kind of value the snapshot holds ...
        kinds = {name.split(":")[0] for name in r["moved_on"]}
        assert {"param", "optim", "group", "sched", "counter", "rng"} <= kinds, kinds
        # ... and the restore brought every one of them back exactly.
        assert r["after_restore"] == [], f"rank {rank}: differ after restore: {r['after_restore']}"
        assert r["record"] == results[0]["record"]
        assert r["report"].id == r["record"].id and not r["report"].resharded
        assert r["listed"] == [r["record"].id]
    record = results[0]["record"]
    assert record.names == {
        "model": "model",
        "optimizer": "optim",
        "stateful": {"sched": "sched", "counter": "counter"},
    }
    assert record.step == 3 and record.world_size == 2 and len(record.hosts) == 2
    assert record.keys == sorted(record.keys) and "embed.weight" in record.keys
    assert results[0]["report"].names == {
        "model": "model",
        "optimizer": "optim",
        "sched": "sched",
        "counter": "counter",
    }


def test_restore_resharded_from_2_to_1_rank_is_exact(ranks2, ranks1, tmp_path):
    saved = ranks2.run(s.take, str(tmp_path))
    assert s.differences(saved[0][0], saved[1][0]) != []  # per-rank streams really differ
    restored = ranks1.run(s.restore_into_fresh_objects, str(tmp_path), saved[0][1].id)
    s.check_resharded(saved, restored)


@pytest.mark.world4
def test_restore_resharded_from_4_to_2_ranks_is_exact(ranks4, ranks2, tmp_path):
    saved = ranks4.run(s.take, str(tmp_path))
    restored = ranks2.run(s.restore_into_fresh_objects, str(tmp_path), saved[0][1].id)
    s.check_resharded(saved, restored)


def _names_and_notice(root: str) -> dict:
    from fsdp_interactive import _notices

    s.place(root)
    ns = s.cell_namespace(seed=0)
    ns["alias"] = ns["model"]  # a second name for the model: the first one is recorded
    notices: list[dict] = []
    _notices.set_sink(notices.append)
    _notices.set_current_call(41)
    try:
        synchronous = s.run_cell(ns, "result = fsdp_interactive.snapshot(model=alias, step=1)")
        handle = s.run_cell(
            ns,
            "result = fsdp_interactive.snapshot(model=model, optimizer=optim, "
            "background=True, sched=sched)",
        )
        _notices.set_current_call(42)  # the call that took it is the one current when called
        background = handle.wait()
        # In a notebook call, an object found nowhere is refused: no recovery could find it.
        try:
            s.run_cell(ns, "result = fsdp_interactive.snapshot(model=model, anon=type(counter)())")
            anonymous = None
        except Exception as error:
            anonymous = (type(error).__name__, getattr(error, "missing", None))
    finally:
        _notices.set_sink(None)
        _notices.set_current_call(None)
    return {
        "sync": synchronous,
        "background": background,
        "notices": notices,
        "anonymous": anonymous,
    }


def test_names_by_identity_and_the_notice_of_rank0(ranks2, tmp_path):
    results = ranks2.run(_names_and_notice, str(tmp_path))
    sync, background = results[0]["sync"], results[0]["background"]
    assert sync.names == {"model": "model", "optimizer": None, "stateful": {}}
    assert background.names == {
        "model": "model",
        "optimizer": "optim",
        "stateful": {"sched": "sched"},
    }
    assert results[0]["anonymous"] == results[1]["anonymous"] == ("SnapshotObjectsError", ["anon"])
    assert sync.call == 41 and background.call == 41
    # Each notice is the record, and the snapshots every host still holds after it.
    held = [notice.pop("held") for notice in results[0]["notices"]]
    assert results[0]["notices"] == [
        {"kind": "snapshot", **sync.to_dict()},
        {"kind": "snapshot", **background.to_dict()},
    ]
    assert held[0][-1] == sync.id and held[1][-1] == background.id
    assert results[1]["notices"] == []  # rank 0 tells the kernel, once per snapshot
