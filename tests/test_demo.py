"""``fsdp-interactive demo``, the README's main job, run for real on two CPU ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_interactive.checkpoint import list_checkpoints
from fsdp_interactive.examples import TinyTransformer, synthetic_batch


def _demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_interactive.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_trains_reports_and_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    done = _demo("--ranks", "2", "--steps", "6", "--dim", "16", "--layers", "1", "-o", str(out))
    assert done.returncode == 0, done.stderr + done.stdout
    assert "step 6/6" in done.stdout
    assert "FULL_SHARD over 2 ranks" in done.stdout
    assert "global L2 gradient norm" in done.stdout
    # Every parameter is split over both ranks: the per-rank table lists rank 0 and rank 1.
    assert "rank 0" in done.stdout and "rank 1" in done.stdout
    # A first run prints no warning the user did not cause (from any rank or the kernel).
    assert "Warning" not in done.stdout + done.stderr, done.stderr + done.stdout
    report = out / "report.png"
    assert report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (record,) = list_checkpoints(out / "checkpoints")
    assert (record.step, record.world_size, record.has_optimizer) == (6, 2, True)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--steps", "0"), "expected a positive integer"),
        (("--dim", "30"), "divisible by heads"),
        (("--backend", "mpi"), "invalid choice"),
    ],
)
def test_demo_rejects_bad_options_with_exit_2(args: tuple[str, ...], message: str) -> None:
    done = _demo(*args, timeout=60)
    assert done.returncode == 2
    assert message in done.stdout + done.stderr


def test_the_example_model_returns_its_heads_logits_unchanged() -> None:
    # The model returns a copy of the head's output (a view would lose FSDP's pre-backward
    # hook under an in-place edit, and fully_shard warns about it on every rank): the
    # values are the head's, bit for bit, so stored results made with them still hold.
    torch.manual_seed(0)
    model = TinyTransformer()
    inputs, _ = synthetic_batch(0, 0)
    hidden = model.embed(inputs) + model.pos[: inputs.shape[1]]
    for block in model.blocks:
        hidden = block(hidden)
    assert torch.equal(model(inputs), model.head(model.norm(hidden)))
