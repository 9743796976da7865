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


def test_each_contenders_peak_memory_is_measured_with_no_other_model_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The order of events on a (mocked) GPU: the peak statistics are reset, one model is
    built and trained, its peak read, and it is gone before the next one is built."""
    import weakref

    import torch
    from torch import nn

    import bench.models
    from bench.models import ModelSize

    events: list[tuple] = []
    alive: weakref.WeakSet = weakref.WeakSet()

    def wrap(name: str, model: nn.Module) -> nn.Module:
        events.append(("build", name, sorted(m.contender for m in alive)))
        model.contender = name
        alive.add(model)
        return model

    monkeypatch.setattr(gpu, "_wrap", wrap)
    monkeypatch.setattr(gpu, "build_model", lambda size: nn.Linear(2, 2))
    monkeypatch.setattr(bench.models, "train_step", lambda *a: events.append(("step",)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: events.append(("reset",)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: float(len(events)))

    size = ModelSize(dim=2, blocks=1, batch=1)
    memory = {n: gpu._peak_memory_alone(n, size, torch.zeros(1, 2), 2) for n in gpu.LABELS}

    builds = [e for e in events if e[0] == "build"]
    assert [b[1] for b in builds] == list(gpu.LABELS)
    assert all(others == [] for _, _, others in builds), builds  # no other model alive
    per_contender = len(events) // len(gpu.LABELS)
    assert events[:per_contender] == [("reset",), builds[0], ("step",), ("step",)]
    assert list(memory.values()) == [4.0, 8.0, 12.0]  # each read after its own steps
