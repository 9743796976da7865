"""Renderers and figures from plain records (no ranks needed)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from fsdp_interactive._text import human_bytes, text_table
from fsdp_interactive.inspect import GradNormRecord, GradNorms, TensorStats, find_spikes
from fsdp_interactive.notebook._format import figure_png
from fsdp_interactive.notebook.grad_norm_view import GradNormView
from fsdp_interactive.notebook.plots import grad_norm_history_figure, histogram_figure
from fsdp_interactive.notebook.render import render, render_grad_norms, render_history


def test_find_spikes_marks_jumps_over_the_recent_median():
    values = [1.0, 1.1, 0.9, 1.0, 5.0, 1.0, float("nan"), 1.0, 4.0]
    assert find_spikes(values, factor=3.0) == [4, 8]
    assert find_spikes([], factor=3.0) == []
    with pytest.raises(ValueError, match="factor"):
        find_spikes(values, factor=0)


def test_nonfinite_gradients_are_flagged_in_text_and_html():
    norms = GradNorms(
        2.0,
        math.nan,
        {"a.weight": math.nan, "a.bias": 0.5},
        {"": math.nan, "a": math.nan},
        nan_counts={"a.weight": 3},
    )
    text = render_grad_norms(norms).text()
    assert "NON-FINITE gradients in: a.weight" in text and "NaN x3" in text
    assert 'style="background:#fdd"' in render_grad_norms(norms).html()
    assert figure_png(GradNormView(norms).figure())[:4] == b"\x89PNG"


def test_empty_states_say_what_to_do():
    assert "run a backward pass" in render_grad_norms(GradNorms(2.0, 0.0, {}, {})).text()
    assert render_history([]).text() == "no gradient norms recorded yet"
    assert figure_png(grad_norm_history_figure([]))[:4] == b"\x89PNG"


def test_a_record_type_without_a_renderer_shows_its_fields():
    @dataclass(frozen=True)
    class Counted:
        rank: int
        mean: float

    one = render(Counted(0, 0.123456789))
    assert one.text().splitlines()[0] == "Counted"
    assert "mean   0.1235" in one.text() and "<td" in one.html()
    ranks = render([Counted(0, 1.0), Counted(1, math.inf)])
    assert ranks.text().splitlines()[:2] == ["2 Counted records", "rank  mean"]
    assert "1     inf" in ranks.text()
    assert render([]).text() == "no records"


def test_history_text_lists_nonfinite_steps_and_spikes():
    records = [GradNormRecord(i, 1.0, {}, 0, 0) for i in range(5)]
    records += [GradNormRecord(5, 9.0, {}, 0, 0), GradNormRecord(6, math.inf, {}, 0, 2)]
    text = render_history(records).text()
    assert "NaN/Inf at steps: [6]" in text and "spikes at steps: [5]" in text


def test_histogram_and_helpers():
    stats = TensorStats(
        "w",
        ("w",),
        (2, 2),
        "float32",
        4,
        0.5,
        0.1,
        0.0,
        1.0,
        1.2,
        0,
        0,
        (1, 2, 1),
        (0.0, 0.33, 0.66, 1.0),
    )
    assert figure_png(histogram_figure(stats))[:4] == b"\x89PNG"
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(None) == "-"
    assert text_table(("a", "bb"), [(1, 2)]).splitlines() == ["a  bb", "-  --", "1  2"]


def test_display_bundle_in_and_outside_a_kernel(monkeypatch):
    view = GradNormView(GradNorms(2.0, 1.0, {"a": 1.0}, {"": 1.0, "a": 1.0}))
    outside = view._repr_mimebundle_()
    assert set(outside) == {"text/plain", "text/html"} and "<img" in outside["text/html"]
    monkeypatch.setattr("fsdp_interactive.notebook._view.live_kernel", lambda: True)
    inside = view._repr_mimebundle_()
    assert inside["application/vnd.jupyter.widget-view+json"]["model_id"] == view.widget.model_id
    assert "<img" not in inside["text/html"] and "global L2 gradient norm" in inside["text/plain"]
