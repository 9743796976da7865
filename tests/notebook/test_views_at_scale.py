"""The views on Llama-shaped records of 300 and 3,000 parameters at 4 and 8 ranks: grouped
by FSDP unit, filtered, cut to the top k, pictures of bounded height (no ranks needed)."""

from __future__ import annotations

import json
import math

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from fsdp_interactive.inspect import GradNormRecord, record_to_json
from fsdp_interactive.notebook import GradNormMonitor, GradNormView, LayoutView
from fsdp_interactive.notebook.plots import (
    MAX_FIGURE_HEIGHT,
    grad_norm_history_figure,
    layout_figure,
    plain_number,
)
from fsdp_interactive.notebook.render import render_history
from tests.notebook.synthetic import llama_layout, llama_norms

LAYERS_300 = 33  # 3 + 9 * 33 = 300 parameters


@pytest.fixture(scope="module")
def layout300():
    return llama_layout(LAYERS_300, 4)


def test_alike_decoder_layers_fold_into_one_unit_row(layout300):
    view = LayoutView(layout300)
    assert len(layout300.params) == 300
    assert [row.label for row in view.selection.rows] == ["(root)", "model.layers.{0..32}"]
    assert "model.layers.{0..32}  x33" in view.text()
    assert "300 parameters in 34 FSDP units" in view.text()
    unfolded = view.show(fold=False)
    assert unfolded.row_count == 34 and len(unfolded.rows) == 30
    assert "showing 30 of 34 unit rows" in view.text()


def test_the_parameter_table_is_cut_to_top_k_and_says_so(layout300):
    view = LayoutView(layout300, top=12)
    assert len(view.selection.params) == 12 and view.selection.param_count == 300
    assert "showing 12 of 300 parameters" in view.text()
    assert view.text().count("self_attn.q_proj.weight") == 1  # only layer 0's rows shown
    largest = view.show(sort="size")
    sizes = [p.nbytes for p in largest.params]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == max(p.nbytes for p in layout300.params)


def test_filter_and_drill_down(layout300):
    view = LayoutView(layout300, top=100)
    assert view.show(pattern="q_proj").param_count == LAYERS_300
    assert view.show(pattern="model.layers.1?.*").param_count == 10 * 9
    drilled = view.show(pattern=None, unit="model.layers.5")
    assert drilled.param_count == 9
    assert {p.fqn.rsplit(".", 2)[0] for p in drilled.params} <= {
        "model.layers.5",
        "model.layers.5.self_attn",
        "model.layers.5.mlp",
    }
    assert "parameters of model.layers.5" in view.text()
    assert view.show(unit="model.layers.{0..32}").param_count == 297
    assert view.show(unit="(root)").param_count == 3
    # a filter that empties the drilled unit drops the drill-down rather than failing
    assert view.show(pattern="embed_tokens").unit == "(root)"
    assert view.show(pattern="q_proj").unit is None


def test_bad_choices_name_the_argument_and_change_nothing(layout300):
    view = LayoutView(layout300)
    before = view.selection
    with pytest.raises(ValueError, match="top must be a positive integer"):
        view.show(top=0)
    with pytest.raises(ValueError, match="sort must be one of 'model', 'size'"):
        view.show(sort="name")
    with pytest.raises(ValueError, match="unit='nope' is not a row of the unit table"):
        view.show(unit="nope")
    with pytest.raises(TypeError, match="pattern must be a string"):
        view.show(pattern=3)
    with pytest.raises(TypeError, match="unknown arguments"):
        view.show(colour="red")
    assert view.selection == before
    with pytest.raises(ValueError, match="by must be one of"):
        GradNormView(llama_norms(2), by="layers")


def _bars(figure):
    return figure.axes[0]


@pytest.mark.parametrize("layers", [LAYERS_300, 333])
def test_the_layout_picture_has_one_bar_per_unit_row_and_a_bounded_height(layers):
    model_layout = llama_layout(layers, 4)
    figure = layout_figure(model_layout)
    assert figure.get_figheight() <= MAX_FIGURE_HEIGHT
    labels = [t.get_text() for t in _bars(figure).get_yticklabels()]
    assert len(labels) == 2 and labels[0].startswith(f"model.layers.{{0..{layers - 1}}} x{layers}")
    unfolded = LayoutView(model_layout, fold=False, top=10**6)
    figure = unfolded.figure()
    assert figure.get_figheight() <= MAX_FIGURE_HEIGHT
    assert len(_bars(figure).get_yticklabels()) == 30
    assert "first 30 of" in _bars(figure).get_title()


def test_a_narrow_selection_is_drawn_one_bar_per_parameter(layout300):
    figure = LayoutView(layout300, unit="model.layers.7").figure()
    labels = [t.get_text() for t in _bars(figure).get_yticklabels()]
    assert len(labels) == 9 and all(label.startswith("model.layers.7.") for label in labels)


def test_eight_ranks_each_get_a_segment_and_a_memory_bar():
    figure = layout_figure(llama_layout(LAYERS_300, 8))
    segments = [p for p in _bars(figure).patches if p.get_fill()]
    assert len(segments) == 2 * 8  # two unit rows, one segment per rank
    memory = figure.axes[1]
    assert [t.get_text() for t in memory.get_xticklabels()] == [f"r{r}" for r in range(8)]


def test_memory_legend_sits_beside_its_plot_with_distinct_swatches(layout300):
    figure = layout_figure(layout300)
    FigureCanvasAgg(figure).draw()
    memory = figure.axes[1]
    legend = memory.get_legend()
    colours = [tuple(h.get_facecolor()) for h in legend.legend_handles]
    assert [t.get_text() for t in legend.get_texts()] == ["params", "grads", "optimizer", "buffers"]
    assert len(set(colours)) == 4
    assert all(t.get_fontsize() >= 9 for t in legend.get_texts())
    box, axes_box = legend.get_window_extent(), memory.get_window_extent()
    assert box.x0 >= axes_box.x1  # beside the plot, not under it
    assert abs(box.y1 - axes_box.y1) < 0.1 * axes_box.height  # top-aligned with it


def test_grad_norms_top_k_by_norm_per_parameter_and_per_unit():
    norms = llama_norms(LAYERS_300)
    view = GradNormView(norms, top=5)
    names = [row[0] for row in _table_rows(view.text())]
    assert names[0] == "lm_head.weight" and len(names) == 5
    assert "5 of 300 parameters, largest first" in view.text()
    view.show(by="units", top=3)
    assert [row[0] for row in _table_rows(view.text())] == [
        "model.layers.32",
        "model.layers.31",
        "model.layers.30",
    ]
    view.show(by="params", pattern="q_proj", sort="model", top=100)
    names = [row[0] for row in _table_rows(view.text())]
    assert len(names) == LAYERS_300 and names[0] == "model.layers.0.self_attn.q_proj.weight"
    figure = view.figure()
    assert figure.get_figheight() <= MAX_FIGURE_HEIGHT
    assert len(figure.axes[0].get_yticklabels()) == 30


def _table_rows(text):
    """The rows of the last fixed-width table in ``text``."""
    lines = text.split("\n")
    rule = max(i for i, line in enumerate(lines) if line.startswith("---"))
    return [line.split() for line in lines[rule + 1 :] if line.strip()]


def test_the_global_norm_is_stated_once_in_the_widget():
    view = GradNormView(llama_norms(3))
    widget = view.widget
    shown = " ".join(child.value for child in (view._total, view._table))
    assert shown.count("global") == 1 and "global L2 gradient norm" in view._total.value
    assert "global" not in view.figure().axes[0].get_title()
    assert view.text().count("global") == 1
    view._toggle.value = "units"
    assert view.by == "units" and "(root)" in view._table.value
    view._filter.value = "layers.2"
    assert view.pattern == "layers.2" and "model.layers.1" not in view._table.value
    assert widget is view.widget


def _records(totals):
    return [GradNormRecord(step, total, {}, 0, 0) for step, total in enumerate(totals)]


def test_log_scale_ticks_read_as_plain_numbers():
    for totals in ([0.61, 0.72, 0.85, 0.66], [0.003, 0.5, 20.0, 900.0]):
        figure = grad_norm_history_figure(_records(totals))
        FigureCanvasAgg(figure).draw()
        axis = figure.axes[0].yaxis
        labels = [t.get_text() for t in axis.get_ticklabels() + axis.get_ticklabels(minor=True)]
        labels = [label for label in labels if label]
        assert labels, totals
        for label in labels:
            assert float(label) > 0, label  # a mathtext label ("$10^{-1}$") would not parse
    assert [plain_number(v) for v in (0.7, 20.0, 0.0005, 1e-12, 3e6)] == [
        "0.7",
        "20",
        "0.0005",
        "1e-12",
        "3000000",
    ]


def test_monitor_summary_and_plot_count_the_same_steps(tmp_path):
    log = tmp_path / "norms.jsonl"
    log.write_text("".join(json.dumps(record_to_json(r)) + "\n" for r in _records([1.0] * 10)))
    monitor = GradNormMonitor(log_path=log)
    monitor.poll()
    assert monitor.widget is not None
    assert "10 steps (steps 0..9) recorded" in render_history(monitor.records).text()
    assert "10 steps (steps 0..9) recorded" in monitor._summary.value
    assert monitor.figure().axes[0].get_title() == "gradient norm history: 10 steps (steps 0..9)"
    assert math.isfinite(monitor.totals[-1])
