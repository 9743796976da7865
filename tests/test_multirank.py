"""The rank harness itself: results in rank order, failures and hangs reported."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.multirank import RankFailure


def _rank_and_sum() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _fail_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    return dist.get_rank()


def test_results_come_back_in_rank_order(ranks2):
    assert ranks2.run(_rank_and_sum) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_failure_names_the_failing_rank_and_group_recovers(ranks2):
    with pytest.raises(RankFailure, match="deliberate failure on rank 1") as info:
        ranks2.run(_fail_on_rank_one)
    assert set(info.value.tracebacks) == {1}
    assert ranks2.run(_rank_and_sum) == [(0, 2, 3.0), (1, 2, 3.0)]
