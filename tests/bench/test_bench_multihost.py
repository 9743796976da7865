"""The two-host figure (``bench/multihost.py``) runs on the simulated hosts in quick mode
and reports positive numbers for every contender. No timing is asserted."""

from __future__ import annotations

import pytest

from bench.multihost import (
    MPI_START,
    POOL_RESTART,
    POOL_RUN,
    POOL_START,
    TORCHRUN_READY,
    TORCHRUN_TOTAL,
    run,
)
from bench.runner import Settings
from tests.multihost.conftest import testhosts  # noqa: F401  (the simulated hosts)

pytestmark = pytest.mark.multihost


def test_the_two_host_figure_measures_every_contender(testhosts, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FSDPI_TESTHOSTS", str(testhosts.state_dir))
    result = run(Settings(quick=True))
    assert result.error is None, result.error
    names = {POOL_START, MPI_START, POOL_RESTART, TORCHRUN_READY, TORCHRUN_TOTAL, POOL_RUN}
    assert set(result.measurements) == names
    assert all(stat.median > 0 for stat in result.measurements.values())
    assert [(c.subject_name, c.reference_name) for c in result.comparisons] == [
        (POOL_START, TORCHRUN_READY),
        (MPI_START, TORCHRUN_READY),
        (POOL_RESTART, TORCHRUN_READY),
        (POOL_RUN, TORCHRUN_TOTAL),
    ]
    assert all(c.ratio is not None and c.ratio > 0 for c in result.comparisons)


def test_without_hosts_the_figure_says_what_it_needs(monkeypatch):
    monkeypatch.delenv("FSDPI_TESTHOSTS", raising=False)
    result = run(Settings(quick=True))
    assert result.error and "FSDPI_TESTHOSTS=DIR" in result.error
