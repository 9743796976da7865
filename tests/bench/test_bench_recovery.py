"""Smoke test of ``python -m bench.recovery``: with a tiny GPT-2 and one sample, every
contender (``Pool.recover()``, a torchrun restart, a manual ``Pool.restart()``) recovers
from a SIGKILL, ours by replaying the build cell alone with parameter initializations
skipped (the benchmark fails otherwise), and the JSON records carry positive numbers, the
ratios against the three targets (ours against torchrun, the replay against the build
cell's first run, the restore's rate against 2 GB/s per host) and their verdicts. No timing is asserted (the figures are in
docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.recovery import (
    BUILD,
    OURS,
    RATE_REFERENCE,
    REPLAY,
    RESTART,
    RESTORE_RATE,
    TORCHRUN,
)
from tests.bench._runs import run_module


def test_recovery_benchmark_measures_every_contender(tmp_path: Path) -> None:
    out = tmp_path / "recovery.json"
    returncode, output = run_module(
        [
            *("bench.recovery", "--tiny", "--samples", "1"),
            *("--cost-steps", "4", "--cost-every", "2", "--json", str(out)),
        ],
        timeout=400,
    )
    assert returncode == 0, output
    figure = json.loads(out.read_text())
    assert figure["key"] == "recovery" and figure["error"] is None
    measurements = figure["measurements"]
    for name in (OURS, TORCHRUN, RESTART):
        stat = measurements[f"2 ranks: kill to a trained step, {name}"]
        assert stat["unit"] == "s" and stat["samples"] and all(v > 0 for v in stat["samples"])
        ready = measurements[f"2 ranks: kill to the state restored, {name}"]
        assert 0 < ready["median"] < stat["median"]  # the first step comes after it
    held = measurements["2 ranks: one snapshot in host memory, per host"]
    assert held["unit"] == "B" and held["median"] > 0
    rate = measurements[f"2 ranks: {RESTORE_RATE}"]  # the held bytes over the restore phase
    restore = measurements["2 ranks: ours: restore"]
    assert rate["unit"] == "GB/s"
    assert rate["samples"] == [held["samples"][0] / restore["samples"][0] / 1e9]
    assert measurements["2 ranks: ours: skipped_inits"]["median"] > 0
    for name, stat in measurements.items():
        # Counts (page faults, preemptions, the load average) may be 0 on an idle host, and
        # so may a tiny step's kernel seconds (the kernel splits CPU time by tick samples).
        may_be_zero = not stat["unit"] or name.endswith("_kernel")
        assert all(v >= 0 if may_be_zero else v > 0 for v in stat["samples"]), name
    for step in ("step", "next_step"):
        for label in ("ours", "by hand"):  # the recovery's and the manual restart's records
            assert measurements[f"2 ranks: {label}: {step}_wall"]["median"] > 0
            assert f"2 ranks: {label}: {step}_kernel" in measurements
    target = [c for c in figure["comparisons"] if c["target"] is not None]
    assert [(c["subject_name"], c["reference_name"]) for c in target] == [
        (OURS, TORCHRUN),
        (REPLAY, BUILD),
        (RESTORE_RATE, RATE_REFERENCE),
    ]
    for comparison in target:
        assert comparison["ratio"] > 0
        assert comparison["verdict"] in ("met", "missed", "unresolved")
    assert any(c["subject_name"].startswith("steps/s") for c in figure["comparisons"])
    assert f"{OURS} / {TORCHRUN} = " in output and f"{REPLAY} / {BUILD} = " in output
    assert "| Measurement |" in output
