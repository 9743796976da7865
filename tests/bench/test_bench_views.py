"""Smoke test of ``python -m bench.views``: every view is probed and rendered on real
ranks and the JSON and the Markdown table carry a positive number for each.  No timing is
asserted (the figures are in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.views import VIEWS

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_views_benchmark_measures_every_view(tmp_path):
    out = tmp_path / "views.json"
    command = [sys.executable, "-m", "bench.views", "--ranks", "2", "--sizes", "30"]
    proc = subprocess.Popen(
        [*command, "--repeats", "1", "--out", str(out)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, output
    results = json.loads(out.read_text())
    assert results["ranks"] == 2 and list(results["sizes"]) == ["30"]
    for view in VIEWS:
        samples = results["sizes"]["30"][view]
        assert samples["probe"][0] > 0 and samples["render"][0] > 0, view
        assert f"| {view} | " in output
    assert "Reference figure" in output
