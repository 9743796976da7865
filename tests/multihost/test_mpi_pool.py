"""A pool whose engines are the ranks of one ``mpiexec`` over ssh, two on each host."""

from __future__ import annotations

import pytest

from fsdp_interactive.pool import Pool
from tests.multihost.conftest import left_on_hosts
from tests.multihost.launchers import mpi_pool_kwargs

pytestmark = pytest.mark.multihost


def test_mpi_pool_spans_both_hosts_and_stops_every_rank(testhosts, mpi_env, tmp_path_factory):
    profile_dir = str(tmp_path_factory.mktemp("mpi-profile"))
    pool = Pool(
        4,
        devices="cpu",
        timeout=240,
        show_topology=False,
        **mpi_pool_kwargs(testhosts, 2, profile_dir),
    )
    try:
        pool.start()
        assert [r.host for r in pool.topology] == ["hosta", "hosta", "hostb", "hostb"]
        assert [r.local_rank for r in pool.topology] == [0, 1, 0, 1]
        out = pool.run(
            "import os; print(os.environ['OMPI_COMM_WORLD_RANK'], os.environ['LOCAL_WORLD_SIZE'])",
            stream=False,
        ).stdout
        # engine ids are MPI ranks, and ranks follow engine ids within the host order
        assert [out[r].split() for r in range(4)] == [[str(r), "2"] for r in range(4)]
        results = pool.run(
            "t = torch.tensor([float(rank + 1)]); dist.all_reduce(t); t.item()", stream=False
        ).results
        assert results == {r: "10.0" for r in range(4)}
    finally:
        pool.stop()
    assert left_on_hosts(testhosts) == {}
