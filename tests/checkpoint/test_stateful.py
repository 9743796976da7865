"""Stateful objects next to model and optimizer in one process: what round-trips, what is
refused, what a load without them reports, and the log records a save and a load leave."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from fsdp_interactive import checkpoint as ck
from tests.checkpoint import _common as c


class Record:
    """A Stateful whose state uses what DCP's own flattening would change."""

    def __init__(self, state: dict | None = None):
        self.state = state or {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _trained(lr: float = 0.1) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model = c.plain_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def test_scheduler_and_plain_state_round_trip_exactly(tmp_path):
    model, opt, sched = _trained()
    odd = Record({0: "int key", "empty": {}, "pair": (1, 2.5), "t": torch.arange(3)})
    ck.save(tmp_path / "a", model, opt, stateful={"lr_scheduler": sched, "odd": odd})
    fresh_model, fresh_opt, fresh_sched = _trained(lr=0.7)
    fresh_sched.step()
    back = Record()
    report = ck.load(
        tmp_path / "a", fresh_model, fresh_opt, stateful={"lr_scheduler": fresh_sched, "odd": back}
    )
    assert report.loaded_stateful == ["lr_scheduler", "odd"] and report.missing_keys == []
    assert fresh_sched.state_dict() == sched.state_dict()
    assert fresh_sched.get_last_lr() == sched.get_last_lr() == [0.05]
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert back.state.keys() == odd.state.keys() and back.state["pair"] == (1, 2.5)
    assert back.state["empty"] == {} and back.state[0] == "int key"
    assert torch.equal(back.state["t"], torch.arange(3))


def test_async_save_keeps_the_scheduler_state_of_save_time(tmp_path):
    model, opt, sched = _trained()
    at_save = sched.state_dict()
    handle = ck.async_save(tmp_path / "a", model, opt, stateful={"lr_scheduler": sched})
    sched.step()
    sched.step()
    handle.wait(timeout=60)
    fresh_model, fresh_opt, fresh_sched = _trained(lr=0.3)
    ck.load(handle.path, fresh_model, fresh_opt, stateful={"lr_scheduler": fresh_sched})
    assert fresh_sched.state_dict() == at_save != sched.state_dict()


def test_missing_or_mismatched_stateful_on_load(tmp_path):
    model, _, sched = _trained()
    ck.save(tmp_path / "a", model, stateful={"rng": ck.RNGState()})
    target = c.plain_model(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ck.IncompatibleCheckpointError, match="stateful:lr_scheduler") as info:
        ck.load(tmp_path / "a", target, stateful={"lr_scheduler": sched})
    assert info.value.missing_keys == ["stateful:lr_scheduler"]
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    sched_state = sched.state_dict()
    report = ck.load(tmp_path / "a", target, stateful={"lr_scheduler": sched}, strict=False)
    assert report.missing_keys == ["stateful:lr_scheduler"] and report.loaded_stateful == []
    assert sched.state_dict() == sched_state
    with pytest.raises(ck.IncompatibleCheckpointError, match="was saved per-rank"):
        ck.load(tmp_path / "a", target, stateful={"rng": Record()}, strict=False)


class Unsafe:
    pass


def test_bad_stateful_arguments_leave_nothing_on_disk(tmp_path):
    model = c.plain_model(0)
    with pytest.raises(TypeError, match="stateful must be a mapping"):
        ck.save(tmp_path / "a", model, stateful=[Record()])
    with pytest.raises(ValueError, match=r"without '\.'"):
        ck.save(tmp_path / "a", model, stateful={"a.b": Record()})
    with pytest.raises(TypeError, match=r"stateful\['x'\] must have state_dict"):
        ck.save(tmp_path / "a", model, stateful={"x": object()})
    with pytest.raises(ValueError, match=r"stateful\['x'\].state_dict\(\) holds data"):
        ck.save(tmp_path / "a", model, stateful={"x": Record({"obj": Unsafe()})})
    with pytest.raises(TypeError, match="stateful must be a mapping"):
        ck.load(tmp_path / "a", model, stateful=Record())
    assert list(tmp_path.iterdir()) == []


class Refusing(Record):
    def load_state_dict(self, state: dict) -> None:
        raise ValueError("not this one")


def test_a_failing_load_state_dict_leaves_model_and_optimizer_alone(tmp_path):
    model, opt, _ = _trained()
    ck.save(tmp_path / "a", model, opt, stateful={"r": Record({"a": 1})})
    target, target_opt, _ = _trained(lr=0.9)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ck.CheckpointError, match=r"stateful\['r'\].load_state_dict failed: "):
        ck.load(tmp_path / "a", target, target_opt, stateful={"r": Refusing()})
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    assert target_opt.param_groups[0]["initial_lr"] == 0.9


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        r.getMessage() for r in caplog.records if r.name.startswith("fsdp_interactive.checkpoint")
    )


def test_save_and_load_log_their_steps_and_stay_silent_by_default(tmp_path, caplog):
    model, opt, sched = _trained()
    with caplog.at_level(logging.WARNING):
        ck.save(tmp_path / "quiet", model, opt)
    assert _messages(caplog) == ""
    leftover = tmp_path / ".s2.partial-000000000000"
    leftover.mkdir()
    with caplog.at_level(logging.INFO, logger="fsdp_interactive.checkpoint"):
        ck.save(tmp_path / "s1", model, opt, step=1, stateful={"lr_scheduler": sched})
        ck.async_save(tmp_path / "s2", model, opt, step=2, keep_last=2).wait(timeout=60)
        ck.load(tmp_path / "s2", model, opt)
    text = _messages(caplog)
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    for expected in (
        f"save {s1} (sync, 1 ranks): writing to {tmp_path}/.s1.partial-",
        "rank 0 captured model, optim, stateful (",
        "rank 0 wrote its shards in ",
        f"manifest of {s1}: 2 files",
        f"published {s1} (renamed from .s1.partial-",
        f"removed {leftover}, left by a save that did not finish",
        f"save {s2} (async, 1 ranks)",
        "rank 0 staged its shards in ",
        "rank 0 wrote its shards in ",
        f"rotation (keep_last=2) removed {tmp_path / 'quiet'}",
        f"save {s2} finished in ",
        f"load {s2}: step 2, saved by 1 ranks (2 files, stateful []); loading on 1 ranks",
    ):
        assert expected in text, expected
    assert not Path(leftover).exists()
