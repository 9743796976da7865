"""What a rank notes around each cell (``pool/rank/_cell_watch.py``) and the parameter
initialization a replay skips (``pool/rank/_init_deferral.py``), in this process: the
generators captured and set again, the names rebound and the modules reshaped behind the
code's back, where each initialized tensor ended, the initializations skipped exactly for
what the snapshot restores (the rest equal to the original, bit for bit), and the check
that names a skipped tensor nothing restores."""

from __future__ import annotations

import random

import numpy
import pytest
import torch
from torch import nn

from fsdp_interactive import _notices
from fsdp_interactive.pool._replay import restored_suffix
from fsdp_interactive.pool.rank import _cell_watch


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
    _cell_watch.prepare_replay({4: {"start": start, "end": end, "skip_init": None}})
    run_cell(namespace, "drawn = torch.rand(5)", call=None, replayed=4)
    torch.manual_seed(11)
    assert torch.equal(namespace["drawn"], torch.rand(5))
    assert torch.rand(2).tolist() == after_original
    assert published == []  # a replay reports nothing
    assert _cell_watch.finish_replay(namespace, []) == {"skipped": 0, "initialized": 0, "unset": []}


def original_and_replay(published, code: str, restored: list[str]) -> tuple[dict, dict, dict]:
    """Run ``code`` as a journaled cell, then replay it on other generators with the
    initialization calls skipped that a snapshot of ``restored`` writes; the original's
    namespace, the replay's, and what :func:`finish_replay` said."""
    original: dict = {"nn": nn, "torch": torch}
    torch.manual_seed(0)
    start = _cell_watch.capture_generators()
    run_cell(original, code, call=21)
    end = _cell_watch.capture_generators()
    report = next(n for n in published if n["kind"] == "cell" and n["call"] == 21)
    calls = [(f, tuple(s), tuple(w)) for f, s, w in report["inits"]]
    skip = {"from": restored_suffix(calls, restored), "calls": [(f, s) for f, s, _ in calls]}
    torch.manual_seed(99)
    _cell_watch.prepare_replay({5: {"start": start, "end": end, "skip_init": skip}})
    replayed: dict = {"nn": nn, "torch": torch}
    run_cell(replayed, code, call=None, replayed=5)
    assert _cell_watch.capture_generators() == end  # where the original left them
    return original, replayed, _cell_watch.finish_replay(replayed, restored)


def same(first: nn.Module, second: nn.Module) -> bool:
    pairs = zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    return all(torch.equal(a, b) for a, b in pairs)


def test_a_cell_reports_where_each_initialized_tensor_ended(published):
    namespace: dict = {"nn": nn}
    code = (
        "class Box:\n    pass\n"
        "box = Box()\nbox.net = nn.Linear(3, 3)\n"
        "model = nn.Sequential(nn.Linear(4, 4))\nalias = model\n"
        "scratch = nn.Linear(2, 2)\ndel scratch\n"
    )
    run_cell(namespace, code, call=31)
    report = next(n for n in published if n["call"] == 31)
    assert report["inits"] == [
        ["kaiming_uniform_", [3, 3], ["box.net"]],
        ["uniform_", [3], ["box.net"]],
        ["kaiming_uniform_", [4, 4], ["alias", "model"]],
        ["uniform_", [4], ["alias", "model"]],
        ["kaiming_uniform_", [2, 2], []],
        ["uniform_", [2], []],
    ]
    assert {"box", "model", "alias", "Box"} <= set(report["names"])


def test_replay_skips_only_the_initializations_the_snapshot_writes(published):
    # The model the snapshot restores is built last: its calls are skipped, the head's run
    # on the generators the original had, so the head equals what the cell built.
    code = "head = nn.Linear(64, 3)\nmodel = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))\n"
    original, replayed, said = original_and_replay(published, code, ["model"])
    assert said == {"skipped": 4, "initialized": 2, "unset": []}
    assert same(original["head"], replayed["head"])
    assert not same(original["model"], replayed["model"])  # not drawn: the restore writes it


def test_replay_skips_nothing_that_an_unrestored_tensor_drawn_after_would_miss(published):
    # The restored model first: skipping it would move the head's draws, so nothing is.
    code = "model = nn.Sequential(nn.Linear(64, 64))\nhead = nn.Linear(64, 3)\n"
    original, replayed, said = original_and_replay(published, code, ["model"])
    assert said == {"skipped": 0, "initialized": 4, "unset": []}
    assert same(original["head"], replayed["head"]) and same(original["model"], replayed["model"])


def test_a_skipped_tensor_no_restored_object_holds_is_named(published):
    code = "head = nn.Linear(5, 3)\nmodel = nn.Sequential(nn.Linear(64, 64))\n"
    original: dict = {"nn": nn, "torch": torch}
    run_cell(original, code, call=41)
    report = next(n for n in published if n["call"] == 41)
    calls = [(f, tuple(s), tuple(w)) for f, s, w in report["inits"]]
    skip = {"from": restored_suffix(calls, ["model"]), "calls": [(f, s) for f, s, _ in calls]}
    _cell_watch.prepare_replay({6: {"start": None, "end": None, "skip_init": skip}})
    # The replay binds the model elsewhere: the snapshot's location no longer holds it.
    replayed: dict = {"nn": nn, "torch": torch}
    run_cell(replayed, code.replace("model =", "other ="), call=None, replayed=6)
    said = _cell_watch.finish_replay(replayed, ["model"])
    assert said["unset"] == ["other.0.weight (kaiming_uniform_)", "other.0.bias (uniform_)"]


def test_a_replay_that_takes_another_path_skips_nothing_more(published):
    _cell_watch.prepare_replay(
        {7: {"skip_init": {"from": 0, "calls": [("kaiming_uniform_", (9, 9))]}}}
    )
    namespace: dict = {"nn": nn, "torch": torch}
    base = torch.zeros(4, 4)
    namespace["base"] = base
    run_cell(namespace, "model = nn.Linear(4, 4)\nnn.init.ones_(base[1])", call=None, replayed=7)
    assert base[1].sum() == 4  # a view is never skipped
    said = _cell_watch.finish_replay(namespace, ["model"])
    assert said == {"skipped": 0, "initialized": 3, "unset": []}
    assert torch.nn.init.normal_.__module__ == "torch.nn.init"  # the wrapper looks the same
