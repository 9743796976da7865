"""Smoke test of ``python -m bench.views``: every view is probed and rendered on real
ranks and the JSON and the Markdown table carry a positive number for each.  No timing is
asserted (the figures are in docs/benchmarks.md)."""

from __future__ import annotations

import json

from bench.views import VIEWS
from tests.bench._runs import run_module


def test_views_benchmark_measures_every_view(tmp_path):
    out = tmp_path / "views.json"
    returncode, output = run_module(
        ["bench.views", "--ranks", "2", "--sizes", "30", "--repeats", "1", "--out", str(out)],
        timeout=300,
    )
    assert returncode == 0, output
    results = json.loads(out.read_text())
    assert results["ranks"] == 2 and list(results["sizes"]) == ["30"]
    for view in VIEWS:
        samples = results["sizes"]["30"][view]
        assert samples["probe"][0] > 0 and samples["render"][0] > 0, view
        assert f"| {view} | " in output
    assert "Reference figure" in output
