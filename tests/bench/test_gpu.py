"""The GPU figure: measured on CUDA hosts, a clear refusal elsewhere.

``test_gpu_figure_measures_every_contender`` runs the real quick GPU figure (NCCL ranks,
a CUDA pool, torchrun with NCCL) and is marked ``cuda``; the other test runs everywhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu
from bench.runner import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_gpu_figure_says_what_it_needs_without_two_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpu, "cuda_devices", lambda: 1)
    with pytest.raises(RuntimeError, match=r"at least 2 CUDA devices.*torch sees 1"):
        gpu.run(Settings(quick=True))


@pytest.mark.cuda
def test_gpu_figure_measures_every_contender() -> None:
    if gpu.cuda_devices() < 2:
        pytest.skip("the GPU figure needs two CUDA devices")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--quick"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    figure = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert figure["error"] is None, figure["error"]
    cases = {c["case"] for c in figure["comparisons"]}
    assert {"2 GPUs, dispatch", "2 GPUs, start", "2 GPUs, training step, bf16"} <= cases
    for c in figure["comparisons"]:
        assert c["ratio"] is not None and c["ratio"] > 0, c
    mfu = [v for k, v in figure["measurements"].items() if ": MFU, " in k]
    assert mfu and all(0 < s < 1 for stat in mfu for s in stat["samples"])
