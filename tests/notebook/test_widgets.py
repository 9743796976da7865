"""Views against the real pool: drive the controls, compare with rank-side truth."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from fsdp_interactive._text import number
from fsdp_interactive.inspect import record_to_json
from fsdp_interactive.notebook import (
    Dashboard,
    GradNormMonitor,
    GradNormView,
    LayoutView,
    ProbeInputError,
    ProbeView,
    RankModel,
    SummonPanel,
    UnknownNameError,
)

SETUP = """
from tests.models import backward, sharded_and_reference
from fsdp_interactive.inspect import GradNormRecorder
widget_model, widget_reference = sharded_and_reference()
widget_optim = torch.optim.Adam(widget_model.parameters(), lr=0.01)
backward(widget_model)
widget_optim.step()
widget_optim.zero_grad()
backward(widget_model)
"""


def figures_dir(tmp_path: Path) -> Path:
    """PNGs go to out/figures when that folder can be made (kept for looking), else tmp."""
    target = Path(__file__).resolve().parents[2] / "out" / "figures"
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError:
        return tmp_path
    return target


@pytest.fixture(scope="module")
def source(pool_shell):
    from fsdp_interactive.notebook.magics import current_pool

    pool = current_pool()
    pool.run(SETUP, stream=False)
    try:
        yield RankModel(pool, "widget_model", optimizer="widget_optim", recorder="widget_recorder")
    finally:
        if pool.running:
            pool.run("del widget_model, widget_reference, widget_optim", stream=False)


def as_json(records):
    """Records as comparable dicts (NaN != NaN in the dataclasses themselves)."""
    return [record_to_json(r) for r in records]


def rank_truth(pool, expression):
    pool.run(f"_truth = {expression}", stream=False)
    return pool.pull("_truth")


def test_layout_view_matches_the_ranks(source, tmp_path):
    view = LayoutView(source)
    layout = view.data
    reference_bytes = rank_truth(
        source.pool, "sum(p.numel() * p.element_size() for p in widget_reference.parameters())"
    )[0]
    assert layout.model_bytes == reference_bytes
    assert sum(layout.held_bytes(r) for r in range(2)) == reference_bytes
    local_bytes = rank_truth(
        source.pool,
        "sum(p.to_local().numel() * p.element_size() for p in widget_model.parameters())",
    )
    assert [layout.held_bytes(r) for r in range(2)] == local_bytes
    widget = view.widget
    for name in ("embed.weight", "block.2.bias"):
        assert name in view._table.value and name in view.text()
    view._refresh_button.click()
    assert view.data == layout
    assert view._image.value[:4] == b"\x89PNG"
    view.figure().savefig(figures_dir(tmp_path) / "layout.png")
    assert widget is view.widget


def test_grad_norm_view_global_norm_is_clip_grad_norms(source, tmp_path):
    clip_total = rank_truth(
        source.pool,
        "float(torch.nn.utils.clip_grad_norm_(widget_model.parameters(), 1e9).full_tensor())",
    )
    view = GradNormView(source)
    widget = view.widget
    assert view.data.total == pytest.approx(clip_total[0], rel=1e-5)
    assert number(view.data.total) in view._total.value
    assert "block.0.weight" in view._table.value
    view._toggle.value = "modules"
    assert view.by == "modules" and "block" in view._table.value
    assert "block.0.weight" not in view._table.value
    view.figure().savefig(figures_dir(tmp_path) / "grad_norms_modules.png")
    view._refresh_button.click()
    assert view.data.total == pytest.approx(clip_total[0], rel=1e-5)
    assert widget is view.widget


def test_summon_panel_stats_and_confirmed_edit(source, tmp_path):
    panel = SummonPanel(source, fqn="embed.weight")
    assert panel.widget is not None
    full = rank_truth(source.pool, "widget_model.block[0].weight.full_tensor().detach()")[
        0
    ].double()
    panel._choice.value = "block.0.weight"
    assert panel.fqn == "block.0.weight"
    assert panel.data.mean == pytest.approx(float(full.mean()), rel=1e-9)
    assert panel.data.std == pytest.approx(float(full.std()), rel=1e-9)
    assert panel.data.max == float(full.max())
    assert number(panel.data.mean) in panel._stats.value
    panel.figure().savefig(figures_dir(tmp_path) / "summon_histogram.png")

    panel._expression.value = "x[0] = 0"
    panel._apply_button.click()
    assert panel.pending == "x[0] = 0" and not panel._confirm_button.disabled
    unchanged = rank_truth(source.pool, "widget_model.block[0].weight.full_tensor().detach()")[0]
    assert torch.equal(unchanged, full.float())  # nothing written before Confirm
    panel._confirm_button.click()
    edited = rank_truth(source.pool, "widget_model.block[0].weight.full_tensor().detach()")
    expected = full.float().clone()
    expected[0] = 0
    assert all(torch.equal(e, expected) for e in edited)
    assert panel.data.min <= 0 <= panel.data.max and "applied" in panel._status.value
    with pytest.raises(ValueError, match="confirm=True"):
        panel.apply("x * 2")
    with pytest.raises(ValueError, match="not a parameter or module"):
        panel.select("nope")
    panel._choice.value = "block"
    assert panel.data.names == ("block.0.weight", "block.0.bias", "block.2.weight", "block.2.bias")
    assert panel._apply_button.disabled


TRAIN = """
widget_recorder = GradNormRecorder(widget_model, log_path={log!r}).attach(widget_optim)
for step in range({steps}):
    widget_optim.zero_grad()
    backward(widget_model, seed=100 + step)
    if step == {nan_step}:  # record the bad step, skip the update (as a guard would)
        widget_model.embed.bias.grad.to_local().fill_(float("nan"))
        widget_recorder.record()
        continue
    widget_optim.step()
"""

MORE = """
import time
for step in range(3):
    widget_optim.zero_grad()
    backward(widget_model, seed=200 + step)
    widget_optim.step()
    time.sleep(0.3)
"""


def test_monitor_follows_the_recorder_while_training(source, tmp_path):
    log = str(tmp_path / "norms.jsonl")
    pool = source.pool
    pool.run(TRAIN.format(log=log, steps=6, nan_step=4), stream=False)
    try:
        monitor = GradNormMonitor(log_path=log)
        new = monitor.poll()
        truth = rank_truth(pool, "widget_recorder.history()")
        assert as_json(new) == as_json(truth[0]) == as_json(truth[1])
        assert monitor.nonfinite_steps == [4]
        assert "NaN/Inf at steps: [4]" in monitor.text()
        assert monitor.widget is not None
        monitor.follow(interval=0.1)
        pool.run(MORE, stream=False)
        # The log holds all 9 steps once the run returned; the monitor reads it every 0.1 s.
        deadline = time.monotonic() + 120
        while len(monitor.records) < 9 and time.monotonic() < deadline:
            time.sleep(0.05)
        monitor.stop()
        steps = [r.step for r in monitor.records]
        assert steps == list(range(9)), f"the monitor followed the log to steps {steps} in 120 s"
        assert as_json(monitor.records) == as_json(rank_truth(pool, "widget_recorder.history()")[0])
        monitor.figure().savefig(figures_dir(tmp_path) / "grad_norm_history.png")

        from_ranks = GradNormMonitor(source)
        assert as_json(from_ranks.poll()) == as_json(monitor.records)
        assert from_ranks.poll() == []
    finally:
        pool.run("widget_recorder.detach()", stream=False)


def test_dashboard_combines_topology_memory_and_views(source, tmp_path):
    dashboard = Dashboard(source)
    text = dashboard.text()
    for record in source.pool.topology:
        assert str(record.pid) in text
    assert [m.pid for m in dashboard.memory] == [r.pid for r in source.pool.topology]
    assert all(m.rss_bytes > 0 for m in dashboard.memory)
    widget = dashboard.widget
    assert [widget.children[1].get_title(i) for i in range(5)] == [
        "Ranks",
        "Layout",
        "Gradients",
        "Summon",
        "Snapshots",
    ]
    # Only the open tab is drawn; a part's widget appears when its tab is selected.
    tabs = widget.children[1]
    assert tabs.selected_index == 0 and tabs.children[1].children == ()
    assert dashboard.layout._widget is None
    tabs.selected_index = 1
    assert tabs.children[1].children == (dashboard.layout.widget,)
    assert tabs.children[2].children == ()
    dashboard._refresh_button.click()
    assert "embed.weight" in dashboard.layout._table.value
    html = dashboard.html()
    assert html.count("<img") >= 4 and "embed.weight" in html


def test_views_render_as_text_and_html_outside_a_kernel(source):
    view = LayoutView(source.layout())
    bundle = view._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert "embed.weight" in bundle["text/plain"] and "<table" in bundle["text/html"]
    with pytest.raises(RuntimeError, match="fixed data"):
        view.refresh()


def test_rank_model_rejects_bad_names(source):
    with pytest.raises(ValueError, match="not a Python expression"):
        RankModel(source.pool, "widget model")
    with pytest.raises(ValueError, match="no recorder"):
        RankModel(source.pool, "widget_model").history()


def test_a_failing_edit_shows_the_error_line_first_and_only_the_users_frame(source):
    panel = SummonPanel(source, fqn="embed.weight")
    before = panel.data
    assert panel.widget is not None
    panel._expression.value = "x.view(-1, 1000003)"
    panel._apply_button.click()
    panel._confirm_button.click()  # the failure is shown in the panel, not raised
    status = panel._status.value
    assert status.startswith('<div style="color:#b00"><b>edit failed: ranks 0, 1: RuntimeError: ')
    assert "<details><summary>traceback (your code)</summary>" in status
    assert "File &lt;edit&gt;:1" in status
    assert "_fsdp_interactive_probe" not in status and "_summon.py" not in status
    assert panel.message.startswith("edit failed: ranks 0, 1: RuntimeError: ")
    assert panel.data == before
    panel._expression.value = "x * 1"
    panel._apply_button.click()
    assert "edit failed" not in panel._status.value  # a new request clears the error


def test_confirm_looks_disabled_until_an_edit_waits(source):
    panel = SummonPanel(source, fqn="embed.weight")
    assert panel.widget is not None
    confirm = panel._confirm_button

    def looks() -> tuple[bool, str]:
        return confirm.disabled, confirm.button_style

    assert looks() == (True, "")  # nothing to confirm: greyed out, not red
    panel._apply_button.click()  # no expression typed: still nothing to confirm
    assert looks() == (True, "") and "type an expression first" in panel._status.value
    panel._expression.value = "x * 1"
    panel._apply_button.click()
    assert looks() == (False, "danger")  # an edit waits: red, clickable
    panel._cancel_button.click()
    assert looks() == (True, "")
    panel._apply_button.click()
    panel._confirm_button.click()
    assert "applied" in panel._status.value and looks() == (True, "")
    panel._expression.value = "x.view(-1, 1000003)"
    panel._apply_button.click()
    panel._confirm_button.click()  # fails on the ranks: nothing waits any more
    assert "edit failed" in panel._status.value and looks() == (True, "")


def test_summon_panel_filter_narrows_the_tensor_list(source):
    panel = SummonPanel(source, fqn="embed.weight")
    assert panel.widget is not None
    panel._filter.value = "block.2"
    labels = [label for label, _ in panel._choice.options]
    assert labels == ["embed.weight", "block.2.weight", "block.2.bias", "block.2 (module)"]
    assert panel.fqn == "embed.weight"  # filtering does not gather another tensor
    assert "3 match" in panel._matches.value
    assert panel.filter("*.bias") == 3
    panel.max_choices = 2
    options, matched = panel.choices(None)
    assert matched == len(panel.params) + len(panel.modules) and len(options) == 2
    panel.filter(None)
    assert "of" in panel._matches.value and "refine the filter" in panel._matches.value
    with pytest.raises(TypeError, match="pattern must be a string"):
        panel.filter(7)


def _short(error: BaseException) -> str:
    """The error as the notebook shows it, checked to carry no rank traceback or pdb advice."""
    text = str(error)
    assert "Traceback" not in text and "debug" not in text and "\n" not in text, text
    return text


def test_a_variable_the_ranks_lack_fails_at_once_naming_the_close_ones(source):
    pool = source.pool
    with pytest.raises(ProbeInputError) as info:
        RankModel(pool, "widget_modle")
    assert _short(info.value) == (
        "RankModel(pool, model='widget_modle'): no variable 'widget_modle' on the ranks; "
        "did you mean 'widget_model'?"
    )
    with pytest.raises(
        ProbeInputError, match=r"^RankModel\(pool, model='widget_optim'\): "
    ) as info:
        RankModel(pool, "widget_optim")
    assert _short(info.value).endswith(
        "'widget_optim' is a Adam on the ranks, not a torch.nn.Module; the ranks' models: "
        "widget_model, widget_reference"
    )
    with pytest.raises(ProbeInputError, match="did you mean 'widget_optim'") as info:
        RankModel(pool, "widget_model", optimizer="widget_optm")
    _short(info.value)
    # A recorder is looked up when first used (training code often makes it later).
    late = RankModel(pool, "widget_model", recorder="widget_recordr")
    with pytest.raises(ProbeInputError, match="no variable 'widget_recordr' on the ranks"):
        late.history()


def test_a_parameter_name_the_model_lacks_is_a_short_error_with_close_matches(source):
    with pytest.raises(UnknownNameError) as info:
        source.summon("embed.wieght")
    assert isinstance(info.value, KeyError)
    assert _short(info.value).startswith(
        "RankModel.summon('embed.wieght'): no parameter or module named 'embed.wieght' in the "
        "model; did you mean 'embed.weight'"
    )
    with pytest.raises(UnknownNameError, match=r"did you mean 'block\.0\.weight'"):
        SummonPanel(source, fqn="block.0.wieght")
    with pytest.raises(ProbeInputError, match="edit_param edits one parameter; 'block' is a"):
        source.edit("block", "x * 0")
    with pytest.raises(ProbeInputError, match=r"norm_type must be a number > 0 or float\('inf'\)"):
        source.grad_norms("two")
    assert source.summon("embed.weight").fqn == "embed.weight"  # nothing left behind


def test_the_max_norm_works_in_the_probe_and_the_view(source):
    truth = rank_truth(
        source.pool,
        "float(torch.nn.utils.clip_grad_norm_(widget_model.parameters(), 1e9, norm_type=float('inf'))"
        ".full_tensor())",
    )
    norms = source.grad_norms(float("inf"))
    assert norms.norm_type == float("inf") and norms.total == pytest.approx(truth[0], rel=1e-6)
    view = GradNormView(source, norm_type=float("inf"))
    assert view.data.total == norms.total
    assert view.text().startswith(f"global Linf gradient norm: {number(norms.total)}")


def test_a_model_without_gradients_says_so(source):
    pool = source.pool
    pool.run("no_grads_yet = torch.nn.Linear(3, 2)", stream=False)
    try:
        norms = RankModel(pool, "no_grads_yet").grad_norms()
        assert not norms.has_gradients
        assert repr(norms) == (
            "GradNorms(norm_type=2, no gradients yet: run a backward pass on the ranks first)"
        )
        assert "total=" in repr(source.grad_norms())  # a model with gradients shows them
    finally:
        pool.run("del no_grads_yet", stream=False)


def test_any_declared_probe_is_asked_by_name_and_shown_by_its_record_type(source):
    truth = rank_truth(
        source.pool,
        "float(torch.nn.utils.clip_grad_norm_(widget_model.parameters(), 1e9, norm_type=1.0)"
        ".full_tensor())",
    )
    norms = ProbeView(source, "grad_norms", norm_type=1.0)
    assert norms.data.total == pytest.approx(truth[0], rel=1e-6)
    assert norms.text().startswith(f"global L1 gradient norm: {number(norms.data.total)}")
    pids = rank_truth(source.pool, "__import__('os').getpid()")
    memory = ProbeView(source, "memory")
    assert [m.pid for m in memory.data] == pids
    widget = memory.widget
    assert f">{pids[1]}<" in memory._table.value and str(pids[1]) in memory.text()
    memory._refresh_button.click()
    assert [m.pid for m in memory.data] == pids and widget is memory.widget
    with pytest.raises(
        ProbeInputError, match=r"RankModel.ask\('memroy'\): .*did you mean 'memory'"
    ):
        source.ask("memroy")
    with pytest.raises(ProbeInputError, match="is not a plain value"):
        source.ask("grad_norms", object())
