"""``fsdp-interactive doctor``: the report and its exit status."""

from __future__ import annotations

import torch

from fsdp_interactive.cli import main


def test_doctor_reports_environment(capsys):
    assert main(["doctor", "--no-smoke"]) == 0
    out = capsys.readouterr().out
    assert f"[ ok ] torch: {torch.__version__}" in out
    assert "[ ok ] devices:" in out
    assert "[ ok ] backends: gloo" in out
    assert "[ ok ] ipyparallel: " in out
    assert out.rstrip().endswith("PASS")


def test_doctor_smoke_test_passes_on_two_cpu_ranks(capsys):
    assert main(["doctor", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "[ ok ] smoke test (gloo): 2 ranks up in" in out
    assert "all_reduce correct" in out
    assert out.rstrip().endswith("PASS")


def test_doctor_smoke_failure_gives_exit_status_1(capsys):
    # nccl without CUDA devices cannot start: the check fails cleanly
    if torch.cuda.is_available():
        return
    assert main(["doctor", "--backend", "nccl"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] smoke test (nccl)" in out and out.rstrip().endswith("FAIL")


def test_doctor_rejects_bad_rank_count(capsys):
    assert main(["doctor", "--ranks", "0"]) == 2
    assert "--ranks must be >= 1" in capsys.readouterr().err
