"""CPU ranks share their host's cores: each gets cores // ranks-on-the-host intra-op
threads (at least one), as torchrun's ``OMP_NUM_THREADS=1`` gives one core per rank;
``OMP_NUM_THREADS`` set by the user rules instead."""

from __future__ import annotations

import os

import torch

from fsdp_interactive.pool import Pool
from fsdp_interactive.pool.rank._bootstrap import share_cores


def test_each_cpu_rank_of_the_pool_gets_its_share_of_the_cores(pool: Pool):
    cores = len(os.sched_getaffinity(0))
    # The pool's ranks inherit this process's environment, where a user's value rules.
    chosen = os.environ.get("OMP_NUM_THREADS")
    expected = int(chosen) if chosen else max(1, cores // pool.world_size)
    results = pool.run("torch.get_num_threads()", stream=False).results
    assert results == {rank: str(expected) for rank in range(pool.world_size)}


def test_share_cores_divides_and_leaves_omp_num_threads_to_rule(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        cores = len(os.sched_getaffinity(0))
        assert share_cores(1) == cores == torch.get_num_threads()
        assert share_cores(cores * 4) == 1 == torch.get_num_threads()
        torch.set_num_threads(3)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert share_cores(cores * 4) == 3 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
