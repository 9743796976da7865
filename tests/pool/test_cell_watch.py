"""What a rank notes around each cell (``pool/rank/_cell_watch.py``) and the parameter
initialization a replay defers (``pool/rank/_init_deferral.py``), in this process: the
generators captured and set again, the names rebound and the modules reshaped behind the
code's back, the initializations dropped for what the snapshot restores and run for the
rest."""

from __future__ import annotations

import random

import numpy
import pytest
import torch
from torch import nn

from fsdp_interactive import _notices
from fsdp_interactive.pool.rank import _cell_watch
from fsdp_interactive.pool.rank._init_deferral import InitDeferral


@pytest.fixture
def published(monkeypatch) -> list[dict]:
    """The notices published (the pool's sink stands in for the kernel)."""
    sent: list[dict] = []
    _notices.set_sink(sent.append)
    yield sent
    _notices.set_sink(None)
    _notices.set_current_call(None)


def run_cell(namespace: dict, code: str, call: int | None = 7, replayed: int | None = None):
    """Run ``code`` in ``namespace`` between the hooks, as an engine's shell does."""
    _notices.set_current_call(call, replaying=replayed is not None)
    _cell_watch.replaying_entry(replayed)
    _cell_watch.before_cell(namespace)
    try:
        exec(code, namespace)
    finally:
        _cell_watch.after_cell(namespace)
        _notices.set_current_call(None)


def draws() -> tuple:
    return (torch.rand(3).tolist(), random.random(), float(numpy.random.rand()))


def test_generators_round_trip_through_plain_data():
    torch.manual_seed(3)
    random.seed(3)
    numpy.random.seed(3)
    state = _cell_watch.capture_generators()
    assert set(state) >= {"torch", "python", "numpy"}
    assert isinstance(state["torch"], bytes) and isinstance(state["numpy"][1], bytes)
    first = draws()
    _cell_watch.apply_generators(state)
    assert draws() == first
    assert _cell_watch.digest(state) != _cell_watch.digest(_cell_watch.capture_generators())
    _cell_watch.apply_generators(state)
    assert _cell_watch.digest(state) == _cell_watch.digest(_cell_watch.capture_generators())


def test_a_cell_reports_its_generators_and_what_its_code_did_not_say(published):
    namespace: dict = {"nn": nn, "__name__": "__main__"}  # as in an engine's namespace
    run_cell(
        namespace,
        "model = nn.Linear(2, 2)\ndef rebuild():\n    global model\n    model = nn.Linear(2, 2)\n",
    )
    run_cell(
        namespace,
        "def attach(m):\n    m.register_forward_hook(lambda *a: None)\n",
        call=8,
    )
    run_cell(namespace, "rebuild()\nx = 1", call=9)
    run_cell(namespace, "attach(model)", call=10)
    run_cell(namespace, "model(__import__('torch').ones(2))", call=11)
    # A library's own hook (added inside one of its calls) is not the notebook's change.
    run_cell(namespace, "model.register_forward_hook(__import__('json').dumps)", call=12)
    reports = {n["call"]: n for n in published if n["kind"] == "cell"}
    assert set(reports) == {7, 8, 9, 10, 11, 12}
    assert reports[12]["reshaped"] == {}
    assert reports[9]["rebound"] == ["model", "x"]
    assert reports[9]["reshaped"] == {}
    assert reports[10]["rebound"] == []
    assert reports[10]["reshaped"] == {"model": "hooks (0 -> 1)"}
    assert reports[11]["reshaped"] == {}  # a forward pass changes nothing a snapshot lacks
    # The generators: building a Linear draws; each distinct state is sent once.
    first, second = reports[7], reports[8]
    assert first["rng_start"] != first["rng_end"]
    assert set(first["states"]) == {first["rng_start"], first["rng_end"]}
    assert second["rng_start"] == second["rng_end"] == first["rng_end"]
    assert second["states"] == {}


def test_replay_sets_the_original_generators_around_the_cell(published):
    namespace: dict = {"torch": torch}
    torch.manual_seed(11)
    start = _cell_watch.capture_generators()
    torch.rand(5)
    end = _cell_watch.capture_generators()
    after_original = torch.rand(2).tolist()
    torch.manual_seed(99)  # a fresh rank: other generators
    _cell_watch.prepare_replay({4: {"start": start, "end": end, "skip_init": False}})
    run_cell(namespace, "drawn = torch.rand(5)", call=None, replayed=4)
    torch.manual_seed(11)
    assert torch.equal(namespace["drawn"], torch.rand(5))
    assert torch.rand(2).tolist() == after_original
    assert published == []  # a replay reports nothing
    assert _cell_watch.finish_replay(namespace, []) == {"skipped": 0, "initialized": 0}


def test_replay_skips_the_initialization_the_snapshot_overwrites(published):
    namespace: dict = {"nn": nn, "torch": torch}
    torch.manual_seed(0)
    start = _cell_watch.capture_generators()
    exec(
        "model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))\nhead = nn.Linear(64, 3)",
        {"nn": nn},
    )
    end = _cell_watch.capture_generators()
    later = torch.rand(3)
    plan = {5: {"start": start, "end": end, "skip_init": True}}
    _cell_watch.prepare_replay(plan)
    code = (
        "model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))\n"
        "head = nn.Linear(64, 3)\n"
        "gone = nn.Linear(8, 8)\n"
        "del gone\n"
    )
    run_cell(namespace, code, call=None, replayed=5)
    # While deferred, nothing was drawn or written: the parameters are as allocated.
    assert torch.equal(torch.rand(3), later)  # the generators are where the original left them
    counts = _cell_watch.finish_replay(namespace, ["model"])
    # model: weight, bias, norm weight, norm bias (skipped); gone: 2 (freed, skipped);
    # head: weight and bias (run: not restored).
    assert counts == {"skipped": 6, "initialized": 2}
    bound = 1 / 8.0  # kaiming_uniform_(a=sqrt(5)) on 64 inputs
    weight = namespace["head"].weight
    assert weight.abs().max() <= bound and weight.abs().sum() > 0
    assert torch.nn.init.normal_.__module__ == "torch.nn.init"  # put back


def test_deferral_runs_initializations_of_views_at_once():
    deferral = InitDeferral()
    base = torch.zeros(4, 4)
    deferral.start()
    try:
        torch.nn.init.ones_(base[1])  # a view: run at once
        whole = torch.zeros(3)
        torch.nn.init.ones_(whole)
    finally:
        deferral.stop()
    assert base[1].sum() == 4 and whole.sum() == 0
    assert deferral.finish([]) == {"skipped": 0, "initialized": 1}
    assert whole.sum() == 3
