"""``bench/findings.md``: every entry names a comparison that exists, and the report quotes it.

No benchmark runs here: the comparisons are read from the committed full report
(``docs/benchmarks.json``); ``test_bench_quick.py`` checks them against a fresh quick run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import FIGURES
from bench.findings import load, parse
from bench.report import render_appendix
from bench.run_info import RunInfo
from bench.runner import Comparison, FigureResult, Stat, Target

REPO_ROOT = Path(__file__).resolve().parents[2]


def committed_comparisons() -> set[tuple[str, str, str]]:
    payload = json.loads((REPO_ROOT / "docs" / "benchmarks.json").read_text())
    return {
        (figure["key"], c["subject_name"], c["reference_name"])
        for figure in payload["figures"]
        for c in figure["comparisons"]
    }


def test_every_cause_names_a_comparison_of_the_committed_report():
    findings = load()
    assert findings.causes, "bench/findings.md has no causes"
    unknown = sorted(set(findings.causes) - committed_comparisons())
    assert not unknown, f"findings for comparisons that the report does not make: {unknown}"


def test_every_observation_names_a_figure():
    unknown = sorted(set(load().observations) - set(FIGURES))
    assert not unknown, f"observations for figures that do not exist: {unknown}"


def test_headings_in_a_row_share_the_text_after_them():
    findings = parse(
        "Preamble, not an entry.\n\n## fig: a vs b\n## fig\n\nFirst line\njoined.\n\n"
        "## other: c vs d\nOwn text.\n"
    )
    assert findings.causes == {
        ("fig", "a", "b"): "First line joined.",
        ("other", "c", "d"): "Own text.",
    }
    assert findings.observations == {"fig": "First line joined."}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("## fig: c vs d\ntext\n## fig: a vs b\n\n", r"findings.md:3: heading 'fig: a vs b' has"),
        ("## fig: a and b\ntext\n", r"findings.md:1: expected '## fig: SUBJECT vs REFERENCE'"),
        ("## two words\ntext\n", r"findings.md:1: expected '## FIGURE'"),
        ("## fig: a vs b\nx\n## fig: a vs b\ny\n", r"findings.md:3: a second text for fig: a vs b"),
    ],
)
def test_malformed_entries_name_their_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse(text)


def _figure(subject: float, target: Target) -> FigureResult:
    comparison = Comparison(
        figure="fig",
        case="2 ranks",
        subject_name="ours",
        reference_name="theirs",
        subject=Stat([subject], "s"),
        reference=Stat([1.0], "s"),
        target=target,
    )
    return FigureResult("fig", "A figure", comparisons=[comparison])


def test_the_report_quotes_the_cause_of_a_miss_and_the_figure_observation():
    info = RunInfo("start", "end", True, "python -m bench --quick")
    findings = parse("## fig: ours vs theirs\nWhy ours is slow.\n\n## fig\nWhere time goes.\n")
    missed = render_appendix(info, [_figure(2.0, Target("<=", 1.2))], "plot.png", findings)
    section = missed.split("## Missed targets and their causes", 1)[1].split("\n## ", 1)[0]
    assert "**A figure: ours vs theirs**" in section and "Why ours is slow." in section
    assert "Profiled: Where time goes." in missed

    met = render_appendix(info, [_figure(1.0, Target("<=", 1.2))], "plot.png", findings)
    assert "Why ours is slow." not in met and "No target of ours was missed" in met

    unknown = render_appendix(info, [_figure(2.0, Target("<=", 1.2))], "plot.png", parse(""))
    assert "no profile of this miss is recorded yet." in unknown
