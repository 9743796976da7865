"""Checkpoint round trips on real gloo ranks: resume equals the uninterrupted run,
async saves stage a copy and let training go on, rotation and listing."""

from __future__ import annotations

import contextlib
import errno
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fsdp_interactive import checkpoint as ck
from fsdp_interactive.checkpoint import _load
from tests.checkpoint import _common as c


def _resume_equals_uninterrupted(root: str, kind: str, optim_kind: str) -> dict:
    model = c.build(kind, seed=0)
    opt = c.optimizer(model, optim_kind)
    for i in range(2):
        c.train_step(model, opt, i)
    saved = ck.save(f"{root}/step-2", model, opt, extra={"step": 2, "lr_scale": 0.5})
    expected_loss = c.train_step(model, opt, 2)
    expected = c.full_values(model)

    fresh = c.build(kind, seed=123)
    fresh_opt = c.optimizer(fresh, optim_kind)
    steps: list[int] = []
    fresh_opt.register_step_pre_hook(lambda *_: steps.append(1))
    report = ck.load(f"{root}/step-2", fresh, fresh_opt)
    steps_in_load = len(steps)
    resumed_loss = c.train_step(fresh, fresh_opt, 2)
    return {
        "saved": saved,
        "report": report,
        "loss_diff": abs(expected_loss - resumed_loss),
        "param_diff": c.max_diff(expected, c.full_values(fresh)),
        "steps_in_load": steps_in_load,
    }


@pytest.mark.parametrize("optim_kind", ["adamw", "sgd"])
def test_resume_step_equals_uninterrupted_step(ranks2, tmp_path, optim_kind):
    results = ranks2.run(_resume_equals_uninterrupted, str(tmp_path), "fsdp2", optim_kind)
    for r in results:
        assert r["loss_diff"] == 0.0
        assert r["param_diff"] == 0.0
        # Loading into a fresh optimizer takes no step to create state it then replaces.
        assert r["steps_in_load"] == 0
        assert r["report"].loaded_optimizer
        assert r["report"].extra == {"step": 2, "lr_scale": 0.5}
        assert r["report"].step == 2 and r["report"].saved_world_size == 2
    assert results[0]["saved"] == results[1]["saved"]
    assert results[0]["saved"].path == str(tmp_path / "step-2")


def _one_rank_cannot_read(root: str) -> dict:
    model = c.build("fsdp2", seed=0)
    opt = c.optimizer(model, "adamw")
    c.train_step(model, opt, 0)
    ck.save(f"{root}/ckpt", model, opt)
    fresh = c.build("fsdp2", seed=1)
    fresh_opt = c.optimizer(fresh, "adamw")
    before = c.full_values(fresh)
    if dist.get_rank() == 1:  # a read error on this rank's disk alone (EIO cannot be made here)
        failing = mock.patch.object(
            _load, "safe_load", side_effect=OSError(errno.EIO, "Input/output error")
        )
    else:
        failing = contextlib.nullcontext()
    error = None
    with failing:
        try:
            ck.load(f"{root}/ckpt", fresh, fresh_opt)
        except ck.CheckpointError as exc:
            error = (type(exc).__name__, str(exc))
    return {"error": error, "changed": c.max_diff(before, c.full_values(fresh))}


def test_a_rank_that_cannot_read_fails_the_load_on_every_rank(ranks2, tmp_path):
    # Each rank reads its part alone (no DCP collective): the ranks still agree, at once.
    first, second = ranks2.run(_one_rank_cannot_read, str(tmp_path))
    assert first["error"] is not None
    assert first["error"] == second["error"]
    kind, message = first["error"]
    assert kind == "CheckpointError"
    assert "failed on rank 1: OSError" in message and "Input/output error" in message
    assert str(tmp_path / "ckpt") in message
    assert first["changed"] == second["changed"] == 0.0


def _async_save_stages_a_copy(root: str) -> dict:
    model = c.build("fsdp2")
    opt = c.optimizer(model)
    c.train_step(model, opt, 0)
    at_save = c.full_values(model)
    handle = ck.async_save(f"{root}/step-1", model, opt, step=1)
    # Training continues while the writer thread runs; the in-place update must not leak.
    c.train_step(model, opt, 1)
    after_step = c.full_values(model)
    result = handle.wait(timeout=120)
    fresh = c.build("fsdp2", seed=9)
    ck.load(result.path, fresh)
    return {
        "done": handle.done(),
        "diff_to_save_time": c.max_diff(at_save, c.full_values(fresh)),
        "training_moved": c.max_diff(at_save, after_step),
        "step": result.step,
    }


def test_async_save_keeps_the_state_of_save_time_while_training_goes_on(ranks2, tmp_path):
    for r in ranks2.run(_async_save_stages_a_copy, str(tmp_path)):
        assert r["done"] and r["step"] == 1
        assert r["training_moved"] > 0
        assert r["diff_to_save_time"] == 0.0


def _second_save_while_busy(root: str) -> dict:
    import time

    import torch.distributed.checkpoint.filesystem as fs

    model = c.build("fsdp2")
    original = fs._FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        time.sleep(1.5)
        return original(self, plan, planner)

    fs._FileSystemWriter.write_data = slow_write
    try:
        first = ck.async_save(f"{root}/a", model, step=1)
        try:
            ck.async_save(f"{root}/b", model, step=2, if_busy="error")
            refused = None
        except ck.CheckpointBusyError as exc:
            refused = str(exc)
        second = ck.async_save(f"{root}/b", model, step=2)  # waits for the first
        first_done_before_second_started = first.done()
        second.wait(timeout=120)
    finally:
        fs._FileSystemWriter.write_data = original
    return {
        "refused": refused,
        "first_done": first_done_before_second_started,
        "listed": [r.name for r in ck.list_checkpoints(root)],
    }


def test_second_save_is_refused_or_waits_for_the_running_one(ranks2, tmp_path):
    for r in ranks2.run(_second_save_while_busy, str(tmp_path)):
        assert r["refused"] is not None and "still running" in r["refused"]
        assert r["first_done"]
        assert r["listed"] == ["a", "b"]


def _rotation(root: str) -> list:
    model = c.build("fsdp2")
    opt = c.optimizer(model, "sgd")
    results = []
    for step in range(1, 5):
        c.train_step(model, opt, step)
        results.append(ck.save(f"{root}/step-{step}", model, opt, step=step, keep_last=2))
    return [results, ck.list_checkpoints(root)]


def test_keep_last_rotation_and_listing(ranks2, tmp_path):
    (results, records), _ = ranks2.run(_rotation, str(tmp_path))
    assert [r.step for r in records] == [3, 4]
    assert [r.name for r in records] == ["step-3", "step-4"]
    assert results[3].removed_by_rotation == [str(tmp_path / "step-2")]
    for record in records:
        assert record.world_size == 2 and record.has_optimizer
        assert record.size_bytes > 0 and record.num_files == 3
        assert record.created_utc.endswith("+00:00")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4"]
    # Listing is a plain file read: it works in this (non-rank) process too.
    assert ck.list_checkpoints(tmp_path) == records
    assert ck.latest_checkpoint(tmp_path) == records[-1]


def test_extra_must_be_json(tmp_path):
    model = c.plain_model()
    with pytest.raises(TypeError, match="extra must hold only JSON data"):
        ck.save(tmp_path / "x", model, extra={"when": object()})
    with pytest.raises(ValueError, match=r"extra\['loss'\] is nan"):
        ck.save(tmp_path / "x", model, extra={"loss": float("nan")})
    assert not any(tmp_path.iterdir())


def test_plain_module_round_trip_in_one_process(tmp_path):
    model = c.plain_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    ck.save(tmp_path / "one", model, opt, step=7)
    fresh = c.plain_model(5)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    report = ck.load(tmp_path / "one", fresh, fresh_opt)
    assert report.step == 7 and report.world_size == 1
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert torch.equal(
        opt.state_dict()["state"][0]["momentum_buffer"],
        fresh_opt.state_dict()["state"][0]["momentum_buffer"],
    )


def test_optimizer_without_state_or_with_partial_state_round_trips(tmp_path):
    model = c.plain_model(0)
    fresh_opt = torch.optim.Adam(model.parameters(), lr=0.3)
    ck.save(tmp_path / "fresh", model, fresh_opt)
    assert not fresh_opt.state  # saving did not initialise the optimizer
    other = c.plain_model(1)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    ck.load(tmp_path / "fresh", other, other_opt)
    assert not other_opt.state and other_opt.param_groups[0]["lr"] == 0.3

    model(torch.randn(4, 6)).sum().backward()
    model.inp.bias.grad = None  # no state yet for this parameter
    fresh_opt.step()
    ck.save(tmp_path / "partial", model, fresh_opt)
    ck.load(tmp_path / "partial", other, other_opt)
    assert other.inp.bias not in other_opt.state
    assert torch.equal(
        other_opt.state[other.inp.weight]["exp_avg"], fresh_opt.state[model.inp.weight]["exp_avg"]
    )
    assert len(other_opt.state) == len(fresh_opt.state) == 7  # 8 parameters, one without state
