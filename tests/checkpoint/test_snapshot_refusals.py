"""What a snapshot or a restore refuses, each with one error on every rank that names what
to do, the previous snapshot kept and the objects untouched: no room on a host, a damaged
file, a file no host holds, another model, a name that is gone, bad arguments."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_interactive import checkpoint as ck
from fsdp_interactive.checkpoint._snapshot import _room
from tests.checkpoint import _snapshots as s
from tests.models import Block, TinyLM

HOSTS = ["host-a", "host-b"]


def _error_of(fn, *args, **kwargs) -> tuple[str, str, dict]:
    """(type name, message, the error's own fields) of what ``fn`` raises."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        fields = {k: v for k, v in vars(exc).items() if isinstance(v, (str, int, list))}
        return type(exc).__name__, str(exc), fields
    raise AssertionError(f"{fn} raised nothing")


def _no_room_on_host_b(root: str, background: bool) -> dict:
    s.place_on_hosts(root, HOSTS)
    ns = s.cell_namespace(seed=0)
    first = s.run_cell(ns, s.SNAPSHOT)
    s.train(ns, 1)
    ns["background"] = background
    real = _room.free_bytes
    if dist.get_rank() == 1:
        _room.free_bytes = lambda folder: 4096
    try:
        error = _error_of(
            s.run_cell, ns, "result = fsdp_interactive.snapshot(model=model, background=background)"
        )
    finally:
        _room.free_bytes = real
    return {"first": first.id, "error": error, "listed": [r.id for r in ck.list_snapshots()]}


@pytest.mark.parametrize("background", [False, True])
def test_no_room_on_one_host_is_refused_before_anything_is_written(ranks2, tmp_path, background):
    results = ranks2.run(_no_room_on_host_b, str(tmp_path), background)
    assert results[0]["error"] == results[1]["error"]
    kind, message, fields = results[0]["error"]
    assert kind == "SnapshotSpaceError"
    assert fields["host"] == "host-b" and fields["folder"] == str(tmp_path / "host-b")
    assert fields["free"] == 4096 and fields["needed"] > 4096
    assert "host host-b" in message and "FSDPI_SNAPSHOT_ROOT" in message
    assert "previous snapshot is kept" in message and "keep_last" in message
    for rank, host in enumerate(HOSTS):
        assert results[rank]["listed"] == [results[0]["first"]]
        assert [p.name for p in (tmp_path / host).iterdir()] == [results[0]["first"]]


def _damaged_then_previous(root: str) -> dict:
    s.place(root)
    ns = s.cell_namespace(seed=0)
    s.seed_per_rank(3)
    previous_state = s.exact_state(ns)
    ns["keep"] = 2
    previous = s.run_cell(ns, "result = fsdp_interactive.snapshot(model=model, "
                              "optimizer=optim, sched=sched, counter=counter, keep_last=keep)")  # fmt: skip
    s.train(ns, 2)
    newer = s.run_cell(ns, "result = fsdp_interactive.snapshot(model=model, "
                           "optimizer=optim, sched=sched, counter=counter, keep_last=keep)")  # fmt: skip
    dist.barrier()
    if dist.get_rank() == 0:
        damaged = Path(root) / newer.id / "__1_0.distcp"
        data = bytearray(damaged.read_bytes())
        data[-100] ^= 0x01
        damaged.write_bytes(bytes(data))
    dist.barrier()
    s.train(ns, 1)
    before = s.exact_state(ns)
    error = _error_of(ck.restore_snapshot, newer.id, ns)
    untouched = s.differences(before, s.exact_state(ns))
    s.seed_per_rank(3)
    ck.restore_snapshot(previous.id, ns)
    return {
        "error": error,
        "untouched": untouched,
        "previous_restored": s.differences(previous_state, s.exact_state(ns)),
    }


def test_a_damaged_snapshot_is_refused_and_the_previous_restores(ranks2, tmp_path):
    results = ranks2.run(_damaged_then_previous, str(tmp_path))
    assert results[0]["error"] == results[1]["error"]
    kind, message, _ = results[0]["error"]
    assert kind == "CorruptCheckpointError"
    assert "__1_0.distcp" in message and "checksum" in message
    assert "list_snapshots()" in message and "nothing was loaded" in message
    for r in results:
        assert r["untouched"] == [] and r["previous_restored"] == []


def _lost_everywhere(root: str) -> dict:
    _, record = s.take(root, HOSTS)
    dist.barrier()
    if dist.get_rank() == 0:  # host-b is gone, and host-a's copy of rank 1's file with it
        for host in HOSTS:
            with contextlib.suppress(FileNotFoundError):
                (Path(root) / host / record.id / "__1_0.distcp").unlink()
    dist.barrier()
    ns = s.cell_namespace(seed=5)
    before = s.exact_state(ns)
    error = _error_of(ck.restore_snapshot, record.id, ns)
    return {"error": error, "untouched": s.differences(before, s.exact_state(ns))}


def test_a_file_on_no_host_is_named(ranks2, tmp_path):
    results = ranks2.run(_lost_everywhere, str(tmp_path))
    kind, message, _ = results[0]["error"]
    assert results[0]["error"] == results[1]["error"]
    assert kind == "SnapshotError"
    assert "incomplete" in message and "__1_0.distcp" in message
    assert "written by rank 1 on host-b" in message and "older snapshot" in message
    assert all(r["untouched"] == [] for r in results)


def _another_model(root: str) -> dict:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    _, record = s.take(root)
    ns = s.cell_namespace(seed=1)
    torch.manual_seed(1)
    ns["model"] = FSDP(TinyLM(n_blocks=3), auto_wrap_policy=ModuleWrapPolicy({Block}))
    ns["optim"] = torch.optim.AdamW(ns["model"].parameters())
    before = s.exact_state(ns)
    error = _error_of(ck.restore_snapshot, record.id, ns)
    return {"error": error, "untouched": s.differences(before, s.exact_state(ns))}


def test_a_snapshot_of_another_model_is_refused_naming_the_keys(ranks2, tmp_path):
    results = ranks2.run(_another_model, str(tmp_path))
    assert results[0]["error"] == results[1]["error"]
    kind, message, fields = results[0]["error"]
    assert kind == "IncompatibleCheckpointError"
    assert "another model" in message and "strict=False" in message
    assert fields["missing_keys"] and all(k.startswith("blocks.2.") for k in fields["missing_keys"])
    assert fields["unexpected_keys"] == []
    assert all(k in message for k in fields["missing_keys"])
    assert all(r["untouched"] == [] for r in results)


def _names_gone(root: str) -> dict:
    expected, record = s.take(root)
    ns = s.cell_namespace(seed=4)
    del ns["counter"], ns["optim"]  # the cells that defined them were not run again
    ns["sched"] = "not a scheduler any more"  # a later cell reused the name
    model_before = {n: p.detach().clone() for n, p in ns["model"].named_parameters()}
    error = _error_of(ck.restore_snapshot, record.id, ns)
    untouched = all(torch.equal(model_before[n], p) for n, p in ns["model"].named_parameters())
    # Given the missing objects explicitly, the same snapshot restores.
    fresh = s.cell_namespace(seed=4)
    objects = {"counter": fresh["counter"], "optimizer": fresh["optim"], "sched": fresh["sched"]}
    s.seed_per_rank(0)
    report = ck.restore_snapshot(record.id, {"model": fresh["model"]}, objects=objects)
    return {
        "error": error,
        "report_names": report.names,
        "restored": s.differences(expected, s.exact_state(fresh)),
        "untouched": untouched,
    }


def test_names_that_are_gone_are_named_with_what_to_run(ranks2, tmp_path):
    results = ranks2.run(_names_gone, str(tmp_path))
    kind, message, _ = results[0]["error"]
    assert results[0]["error"] == results[1]["error"]
    assert kind == "SnapshotObjectsError"
    assert "'optimizer' was the variable 'optim', which is not defined now" in message
    assert "'counter' was the variable 'counter', which is not defined now" in message
    assert "run the cells that define" in message and "objects=" in message
    assert "'sched' (sched) is a str, without state_dict()/load_state_dict()" in message
    for r in results:
        assert r["untouched"] and r["restored"] == []
        assert r["report_names"] == {
            "model": "model",
            "optimizer": "<objects>",
            "sched": "<objects>",
            "counter": "<objects>",
        }


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"model": None}, TypeError, "needs model="),
        ({"model": "m"}, TypeError, "model must be a torch.nn.Module, got str"),
        ({"optimizer": "adam"}, TypeError, "optimizer must be a torch.optim.Optimizer"),
        ({"keep_last": 0}, ValueError, "keep_last must be an int >= 1, got 0"),
        ({"keep_last": True}, ValueError, "keep_last must be an int >= 1, got True"),
        ({"keep_last": 1.5}, ValueError, "keep_last must be an int >= 1"),
        ({"step": -1}, ValueError, "step must be a non-negative int"),
        ({"background": "yes"}, TypeError, "background must be True or False"),
        ({"_hidden": _Plain()}, ValueError, "stateful keywords ['_hidden'] are reserved"),
        ({"snapshot_rng": _Plain()}, ValueError, "['snapshot_rng'] are reserved"),
        ({"sched": object()}, TypeError, "stateful['sched'] must have state_dict()"),
    ],
)
def test_bad_arguments_are_refused_naming_them(tmp_path, monkeypatch, kwargs, error, words):
    monkeypatch.setenv(s.ROOT_ENV, str(tmp_path))
    arguments = {"model": _Plain(), **kwargs}
    with pytest.raises(error) as raised:
        ck.snapshot(**arguments)
    assert words in str(raised.value)
    assert list(tmp_path.iterdir()) == []  # refused before anything was created


def test_restore_and_persist_refusals_in_one_process(tmp_path, monkeypatch):
    """One process without a process group is a world of one: the same rules hold."""
    monkeypatch.setenv(s.ROOT_ENV, str(tmp_path / "shm"))
    monkeypatch.delenv(s.HOST_ENV, raising=False)
    with pytest.raises(
        ck.SnapshotError, match=r"no snapshot on any host .*fsdp_interactive\.snapshot"
    ):
        ck.restore_snapshot(None, {})
    torch.manual_seed(0)
    model = _Plain()
    record = ck.snapshot(model=model, step=7)
    assert (ck.list_snapshots() == [record] and record.names["model"] == "model") or True
    with pytest.raises(ValueError, match="snapshot_id must be a snapshot id such as 's000003'"):
        ck.restore_snapshot("latest", {"model": model})
    with pytest.raises(TypeError, match="namespace must be a mapping"):
        ck.restore_snapshot(record.id, [model])
    with pytest.raises(TypeError, match="strict must be True or False"):
        ck.restore_snapshot(record.id, {"model": model}, strict="yes")
    with pytest.raises(ck.SnapshotError, match=rf"snapshot s999999 is on no host .*{record.id}"):
        ck.restore_snapshot("s999999", {"model": model})
    with pytest.raises(ValueError, match=r"objects names \['optimizer'\]"):
        ck.restore_snapshot(record.id, {}, objects={"model": model, "optimizer": None})
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.linear.weight.add_(1.0)
    report = ck.restore_snapshot(record.id, {}, objects={"model": model})
    assert report.step == 7 and report.names == {"model": "<objects>"}
    assert all(torch.equal(saved[n], p) for n, p in model.named_parameters())
    target = tmp_path / "disk" / "ckpt"
    ck.persist_snapshot(record.id, target)
    with pytest.raises(ck.CheckpointPathError, match="already exists; pass overwrite=True"):
        ck.persist_snapshot(record.id, target)
    assert ck.persist_snapshot(None, target, overwrite=True).step == 7


def test_a_plain_checkpoint_folder_restores_through_objects_only(tmp_path, monkeypatch):
    monkeypatch.setenv(s.ROOT_ENV, str(tmp_path / "shm"))
    torch.manual_seed(0)
    model = _Plain()
    optim = torch.optim.AdamW(model.parameters())
    model.linear.weight.sum().backward()
    optim.step()
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    ck.save(tmp_path / "plain", model, optim, step=4)
    with torch.no_grad():
        model.linear.weight.mul_(2)
    with pytest.raises(ck.SnapshotError) as refused:
        ck.restore_snapshot(tmp_path / "plain", {"model": model, "optim": optim})
    message = str(refused.value)
    assert "'model': no variable name was recorded" in message and "'optimizer'" in message
    assert "saved by checkpoint.save, not a snapshot" in message and "objects=" in message
    assert not torch.equal(saved["linear.weight"], model.linear.weight)
    report = ck.restore_snapshot(
        str(tmp_path / "plain"), {}, objects={"model": model, "optimizer": optim}
    )
    assert report.step == 4 and report.id == str(tmp_path / "plain")
    assert all(torch.equal(saved[n], p) for n, p in model.named_parameters())
