"""``make gpu-check``'s script: each check ends as one PASS/FAIL/SKIP line, a check that
needs a GPU is skipped without one, and the dry run's checks are the ones that need none."""

from __future__ import annotations

from bench import gpu_check


def _passes(ctx):
    return "fine"


def _fails(ctx):
    raise AssertionError("wrong value 3")


def _needs_gpu(ctx):
    raise AssertionError("ran without a GPU")


def test_each_check_ends_as_one_status_line():
    checks = (
        gpu_check.Check("passes", False, _passes),
        gpu_check.Check("fails", False, _fails),
        gpu_check.Check("on the GPU", True, _needs_gpu),
    )
    outcomes = list(gpu_check.run_checks(gpu_check.Context(gpu=False), checks))
    assert [(status, name) for status, name, _ in outcomes] == [
        ("PASS", "passes"),
        ("FAIL", "fails"),
        ("SKIP", "on the GPU"),
    ]
    assert outcomes[0][2].startswith("fine [")
    assert outcomes[1][2].startswith("wrong value 3 (_fails:")
    assert outcomes[2][2] == "needs a CUDA GPU"


def test_the_dry_run_covers_the_pool_checkpoints_and_the_kernel():
    dry = [check.name for check in gpu_check.CHECKS if not check.needs_gpu]
    assert dry[0].startswith("pool:") and dry[-1] == "kernel stays CUDA-free"
    assert "checkpoint save, async staging, load" in dry
    on_gpu = {check.name for check in gpu_check.CHECKS if check.needs_gpu}
    assert {"pytest -m cuda", "single-GPU bench figures"} <= on_gpu
