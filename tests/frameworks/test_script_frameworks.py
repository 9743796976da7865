"""Unmodified torchrun scripts built on the HF Trainer and on an accelerate loop, run with
``Pool.run_script`` on a real 2-rank pool: paused after an optimizer step taken inside the
framework, looked at with the views (true to torch's own gradient norm), continued to the
end, and equal bit for bit to the same script under plain ``torchrun``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.pool import Pool
from tests.frameworks._installed import require
from tests.torchrun_reference import SCRIPTS, differences, torchrun

TORCH_NORM = (
    "torch.nn.utils.clip_grad_norm_([p for p in {} .parameters() if p.grad is not None], "
    "float('inf')).item()"
)


def _value(pool: Pool, expression: str) -> object:
    return ast.literal_eval(pool.run(expression, stream=False, journal=False).results[0])


@pytest.mark.parametrize(
    ("script", "args", "model", "kept"),
    [
        ("hf_trainer.py", ["--max-steps", "6"], "model", ("trainer", "Trainer")),
        ("accelerate_ddp.py", ["--steps", "6"], "model", ("optimizer", "AcceleratedOptimizer")),
    ],
    ids=["hf-trainer", "accelerate"],
)
def test_framework_script_paused_viewed_continued_equals_torchrun(
    framework_pool: Pool, tmp_path: Path, script, args, model, kept
):
    require("transformers", "accelerate")
    if script == "hf_trainer.py":
        args = [*args, "--output-dir", str(tmp_path / "trainer")]
    torchrun(SCRIPTS / script, 2, *args, "--save", str(tmp_path / "torchrun"))

    status = framework_pool.run_script(
        SCRIPTS / script, [*args, "--save", str(tmp_path / "pool")], stop_at=3
    )
    assert status.paused and status.steps == 3
    assert kept in status.kept
    view = RankModel(framework_pool, model)
    assert view.layout().params
    assert view.grad_norms().total == pytest.approx(
        _value(framework_pool, TORCH_NORM.format(model)), rel=1e-6
    )

    status = framework_pool.continue_script()
    assert status.state == "ended" and status.steps == 6
    assert differences(tmp_path / "torchrun", tmp_path / "pool", 2) == []
