"""Background snapshots (the blocking part writes the state into host memory, measured and
returned; later changes of the state do not reach what is written; a second snapshot
waits for the one in flight; a failure of the write raises at once, one of the
publishing on the handle), ``persist_snapshot`` to a disk checkpoint that
``checkpoint.load`` reads exactly, and ``drop_snapshots``."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fsdp_interactive import checkpoint as ck
from tests.checkpoint import _snapshots as s

BACKGROUND = (
    "result = fsdp_interactive.snapshot(model=model, optimizer=optim, step=counter.step, "
    "background=True, keep_last=2, sched=sched, counter=counter)"
)


class _HeldWrites:
    """What snapshots and checkpoint saves do after their call returns, logged by folder:
    a snapshot's publishing (copies, descriptions, rename), a save's DCP write. The first
    one is held until :meth:`release`."""

    def __init__(self) -> None:
        import torch.distributed.checkpoint.filesystem as fs

        from fsdp_interactive.checkpoint._snapshot import _publish

        self.originals = [
            (fs._FileSystemWriter, "write_data", fs._FileSystemWriter.write_data),
            (_publish, "finish", _publish.finish),
        ]
        self.log: list[str] = []
        self.gate = threading.Event()
        held = self
        write_original, finish_original = (o[2] for o in self.originals)

        def hold(name: str) -> None:
            held.log.append(f"start {name}")
            if len(held.log) == 1:
                held.gate.wait(timeout=60)

        def write_data(writer, plan, planner):
            hold(Path(writer.path).name)
            future = write_original(writer, plan, planner)
            future.wait()
            held.log.append(f"end {Path(writer.path).name}")
            return future

        def finish(plan, *args, **kwargs):
            hold(plan.partial.name)
            try:
                return finish_original(plan, *args, **kwargs)
            finally:
                held.log.append(f"end {plan.partial.name}")

        fs._FileSystemWriter.write_data = write_data
        _publish.finish = finish

    def release(self) -> None:
        self.gate.set()

    def restore(self) -> None:
        self.gate.set()
        for owner, name, original in self.originals:
            setattr(owner, name, original)


def _background_then_change(root: str) -> dict:
    s.place(root)
    ns = s.cell_namespace(seed=0)
    s.train(ns, 3)
    s.seed_per_rank(8)
    expected = s.exact_state(ns)
    held = _HeldWrites()
    try:
        handle = s.run_cell(ns, BACKGROUND)
        # Training goes on while the snapshot is written: everything changes.
        s.train(ns, 2)
        torch.rand(4), random.random(), np.random.rand()
        still_running = not handle.done()
        changed = s.differences(expected, s.exact_state(ns))
        # A second snapshot while the first is in flight waits for it.
        threading.Timer(0.5, held.release).start()
        second = s.run_cell(ns, BACKGROUND.replace("background=True", "background=False"))
        first = handle.wait()
        order = list(held.log)
    finally:
        held.restore()
    ns["snapshot_id"] = first.id
    s.run_cell(ns, s.RESTORE)
    return {
        "handle_seconds": handle.seconds,
        "handle_id": handle.id,
        "first": first,
        "second": second,
        "still_running": still_running,
        "changed": changed,
        "restored": s.differences(expected, s.exact_state(ns)),
        "order": order,
        "listed": [r.id for r in ck.list_snapshots()],
    }


def test_background_snapshot_keeps_the_state_of_the_call(ranks2, tmp_path):
    results = ranks2.run(_background_then_change, str(tmp_path))
    first, second = results[0]["first"], results[0]["second"]
    for rank, r in enumerate(results):
        assert r["still_running"], rank  # publishing was held while the state changed
        assert {n.split(":")[0] for n in r["changed"]} >= {"param", "optim", "counter", "rng"}
        assert r["restored"] == [], (rank, r["restored"])
        assert r["handle_id"] == first.id and r["first"] == first and r["second"] == second
        assert 0 < r["handle_seconds"] <= first.seconds
        # The second snapshot's write began only after the first one's ended.
        assert [entry.split(".partial-")[0] for entry in r["order"]] == [
            f"start .{first.id}",
            f"end .{first.id}",
            f"start .{second.id}",
            f"end .{second.id}",
        ]
        assert r["listed"] == [first.id, second.id]
    assert first.seconds == max(r["handle_seconds"] for r in results)
    assert first.step == 3 and second.step == 5


def _background_failures(root: str) -> dict:
    from fsdp_interactive.checkpoint._format._raw_storage import RawWriter
    from fsdp_interactive.checkpoint._snapshot import _store

    s.place(root)
    ns = s.cell_namespace(seed=0)
    previous = s.run_cell(ns, s.SNAPSHOT)
    write, describe = RawWriter.write_data, _store.write_descriptions

    def broken(*args):
        raise OSError("device error while writing")

    # The write (the blocking part) fails on rank 1: the call itself raises, on every rank.
    if dist.get_rank() == 1:
        RawWriter.write_data = broken
    try:
        s.run_cell(ns, BACKGROUND)
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    else:
        raised = None
    finally:
        RawWriter.write_data = write
    # The publishing (in the background) fails on rank 0, the host's leader: on the handle.
    if dist.get_rank() == 0:
        _store.write_descriptions = broken
    try:
        handle = s.run_cell(ns, BACKGROUND)
        try:
            handle.wait(timeout=120)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            error = None
    finally:
        _store.write_descriptions = describe
    return {
        "raised": raised,
        "error": error,
        "exception": type(handle.exception()).__name__,
        "listed": [r.id for r in ck.list_snapshots()],
        "previous": previous.id,
        "left": sorted(p.name for p in Path(root).iterdir()),
    }


def test_a_failed_background_snapshot_raises_at_once_or_on_its_handle(ranks2, tmp_path):
    results = ranks2.run(_background_failures, str(tmp_path))
    for r in results:
        assert r["raised"] is not None and r["raised"].startswith("CheckpointError")
        assert "device error while writing" in r["raised"]
        assert r["error"] is not None and r["error"].startswith("SnapshotError")
        assert "describing the snapshot" in r["error"] and "device error" in r["error"]
        assert r["exception"] == "SnapshotError"
        assert r["listed"] == [r["previous"]]
    # The host's leader (rank 0) removed the unfinished folders before it reported.
    assert results[0]["left"] == [results[0]["previous"]]


def _persist_then_load(root: str, disk: str) -> dict:
    s.place(root)
    ns = s.cell_namespace(seed=0)
    s.train(ns, 3)
    s.seed_per_rank(2)
    expected = s.exact_state(ns)
    record = s.run_cell(ns, s.SNAPSHOT)
    persisted = ck.persist_snapshot(record.id, f"{disk}/from-{record.id}")
    fresh = s.cell_namespace(seed=11, lr=0.3)
    s.train(fresh, 1)
    s.seed_per_rank(50)
    report = ck.load(
        persisted.path,
        fresh["model"],
        fresh["optim"],
        stateful={
            "sched": fresh["sched"],
            "counter": fresh["counter"],
            "snapshot_rng": ck.RNGState(),
        },
    )
    loaded = s.differences(expected, s.exact_state(fresh))
    # The persisted folder also restores as the snapshot did: by the names it recorded.
    again = s.cell_namespace(seed=12, lr=0.7)
    s.seed_per_rank(51)
    again["folder"] = persisted.path
    restored = s.run_cell(
        again,
        "from fsdp_interactive.checkpoint import restore_snapshot\n"
        "result = restore_snapshot(folder, globals())",
    )
    return {
        "persisted": persisted,
        "report_step": report.step,
        "loaded": loaded,
        "listed": [c.name for c in ck.list_checkpoints(disk)],
        "restored": s.differences(expected, s.exact_state(again)),
        "restored_names": restored.names,
        "restored_id": restored.id,
    }


def test_persisted_snapshot_is_a_checkpoint_load_reads_exactly(ranks2, tmp_path):
    results = ranks2.run(_persist_then_load, str(tmp_path / "shm"), str(tmp_path / "disk"))
    persisted = results[0]["persisted"]
    for r in results:
        assert r["loaded"] == [] and r["report_step"] == 3 and r["persisted"] == persisted
        assert r["restored"] == [] and r["restored_id"] == persisted.path
        assert r["restored_names"] == {
            "model": "model",
            "optimizer": "optim",
            "sched": "sched",
            "counter": "counter",
        }
    assert results[0]["listed"] == [persisted.name] and persisted.world_size == 2
    assert persisted.has_optimizer and persisted.num_files == 3  # .metadata + 2 ranks


def _snapshot_then_drop(root: str, drop: bool) -> list[str]:
    s.place(root)
    ns = s.cell_namespace(seed=0)
    s.run_cell(ns, "result = fsdp_interactive.snapshot(model=model)")
    dist.barrier()
    return ck.drop_snapshots() if drop and dist.get_rank() == 0 else []


def test_drop_snapshots_removes_the_hosts_root(ranks2, tmp_path):
    root = tmp_path / "shm"
    removed = ranks2.run(_snapshot_then_drop, str(root), True)[0]
    assert len(removed) == 1 and not root.exists()
    # A root that also holds anything else keeps it, and stays.
    ranks2.run(_snapshot_then_drop, str(root), False)
    (root / "notes.txt").write_text("mine")
    assert len(ck.drop_snapshots(root)) == 1
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]


def _snapshot_and_async_save(root: str, disk: str, snapshot_first: bool) -> list[str]:
    s.place(root)
    ns = s.cell_namespace(seed=0)
    held = _HeldWrites()
    try:
        threading.Timer(0.5, held.release).start()
        if snapshot_first:
            handle = s.run_cell(ns, BACKGROUND)
            ck.async_save(f"{disk}/ckpt", ns["model"], ns["optim"]).wait()
            handle.wait()
        else:
            saving = ck.async_save(f"{disk}/ckpt", ns["model"], ns["optim"])
            s.run_cell(ns, BACKGROUND).wait()
            saving.wait()
    finally:
        held.restore()
    return [entry.split(".partial-")[0] for entry in held.log]


def test_a_background_snapshot_and_an_async_save_take_turns(ranks2, tmp_path):
    """One write of the training state at a time per process: neither starts while the
    other still writes in the background."""
    for snapshot_first in (True, False):
        disk = tmp_path / f"disk-{snapshot_first}"
        log = ranks2.run(_snapshot_and_async_save, str(tmp_path / "shm"), str(disk), snapshot_first)
        for entries in log:
            starts = [e for e in entries if e.startswith("start")]
            ends = [e for e in entries if e.startswith("end")]
            assert len(starts) == 2 and entries == [starts[0], ends[0], starts[1], ends[1]]
            assert (".ckpt" in starts[1]) == snapshot_first, entries
