"""Smoke test of the benchmark command: ``python -m bench --quick`` writes a sane report.

Runs the real quick mode (real ranks, clusters, pools and torchrun relaunches) into a
temporary folder and checks that every figure is present, finished and carries positive
numbers, that the Markdown table has a row per comparison, and that the plot is a PNG.
No timing is asserted: speed is what the report shows, not what a test checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench._runs import run_module

# The quick run's checkpoint figure starts a group of four ranks.
pytestmark = pytest.mark.world4

FIGURES = (
    "dispatch",
    "cold_start",
    "death",
    "probes",
    "train_step",
    "memory",
    "grad_norm",
    "checkpoint",
    "debug_cost",
    "state_scaling",
    "hang_watch",
    "attach",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-quick")
    returncode, output = run_module(["bench", "--quick", "--out", str(out)], timeout=480)
    assert returncode == 0, f"python -m bench --quick failed:\n{output[-6000:]}"
    return out


def _figures(report_dir: Path) -> dict[str, dict]:
    payload = json.loads((report_dir / "benchmarks.json").read_text())
    assert payload["info"]["quick"] is True
    return {figure["key"]: figure for figure in payload["figures"]}


def test_every_figure_is_present_and_finished(quick_report: Path) -> None:
    figures = _figures(quick_report)
    assert tuple(figures) == FIGURES
    for key, figure in figures.items():
        assert figure["error"] is None, f"{key} failed:\n{figure['error']}"
        assert figure["comparisons"], f"{key} has no comparison"
        assert figure["measurements"], f"{key} has no measurement"


def test_measured_numbers_are_positive(quick_report: Path) -> None:
    for key, figure in _figures(quick_report).items():
        for name, stat in figure["measurements"].items():
            assert stat["samples"], f"{key}: {name} has no samples"
            assert all(v > 0 for v in stat["samples"]), f"{key}: {name}: {stat['samples']}"
            assert stat["min"] <= stat["median"] <= stat["max"], f"{key}: {name}"


def test_comparisons_have_a_ratio_or_say_why_not(quick_report: Path) -> None:
    for key, figure in _figures(quick_report).items():
        for c in figure["comparisons"]:
            label = f"{key}: {c['case']}: {c['subject_name']} vs {c['reference_name']}"
            assert c["reference"] is not None, label
            if c["unavailable"]:
                assert c["unavailable"].startswith("not available yet"), label
                assert c["subject"] is None and c["ratio"] is None, label
            else:
                assert c["ratio"] is not None and c["ratio"] > 0, label
                if c["target"] is None:
                    # a ratio shown without a target says why it has none
                    assert c["met"] is None and c["note"], label
                else:
                    assert c["verdict"] in ("met", "missed", "unresolved"), label
                    assert c["met"] == {"met": True, "missed": False}.get(c["verdict"]), label


def test_markdown_has_a_row_per_comparison(quick_report: Path) -> None:
    text = (quick_report / "benchmarks-appendix.md").read_text()
    assert "## Summary" in text and "## How to reproduce" in text
    assert "- Command: `python -m bench --quick --out " in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    for key, figure in _figures(quick_report).items():
        for c in figure["comparisons"]:
            assert any(
                c["case"] in row and c["subject_name"] in row and c["reference_name"] in row
                for row in rows
            ), f"no summary row for {key}: {c['case']}: {c['subject_name']}"
        for name in figure["measurements"]:
            assert any(f"| {name} |" in row for row in rows), f"no row for {key}: {name}"


def test_plot_is_a_png(quick_report: Path) -> None:
    data = (quick_report / "benchmarks.png").read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000


def test_recorded_causes_name_comparisons_a_quick_run_makes(quick_report: Path) -> None:
    from bench.findings import load

    findings = load()
    made = {
        (key, c["subject_name"], c["reference_name"])
        for key, figure in _figures(quick_report).items()
        for c in figure["comparisons"]
    }
    stale = sorted(set(findings.causes) - made)
    assert not stale, f"findings that no comparison would ever quote: {stale}"
    assert set(findings.observations) <= set(FIGURES)


def test_probes_figure_measures_gpt2_small(quick_report: Path) -> None:
    """The real-size case: every probe on GPT-2 small at 2 ranks, wrapped by ours (DTensor)
    and by torch FSDP1 (flat parameters), each held to its 1 s budget."""
    probes = _figures(quick_report)["probes"]
    wanted = ("layout", "grad norms", "summon stats of transformer.wte.weight", "memory")
    for wrapping in ("DTensor", "torch FSDP1 (flat)"):
        case = f"2 ranks, GPT-2 small, {wrapping}"
        gpt2 = {n: stat for n, stat in probes["measurements"].items() if n.startswith(case)}
        assert sorted(name.rsplit(": ", 1)[1] for name in gpt2) == sorted(wanted), list(gpt2)
        budgets = [c for c in probes["comparisons"] if c["case"] == case]
        assert [c["subject_name"] for c in budgets] == [
            f"{name} probe (ours)" for name in ("layout", "grad norms", "summon stats", "memory")
        ]
        for budget in budgets:
            assert budget["unavailable"] is None and budget["subject"]["samples"]
            assert budget["reference"]["samples"] == [1.0]
