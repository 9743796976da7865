"""A pool whose engines are one SLURM job of two tasks on each of two nodes."""

from __future__ import annotations

import pytest

from fsdp_interactive.pool import Pool
from tests.multihost.conftest import left_on_hosts, squeue, wait_until
from tests.multihost.launchers import slurm_pool_kwargs

pytestmark = pytest.mark.multihost


def engine_job(pool: Pool) -> str:
    (engine_set,) = pool._processes.cluster.engines.values()
    return engine_set.job_id


HYBRID = """
import socket
from fsdp_interactive._torch_compat import HYBRID_SHARD_ZERO2
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
hosts = [None] * world_size
dist.all_gather_object(hosts, socket.gethostname())
for strategy in (ShardingStrategy.HYBRID_SHARD, HYBRID_SHARD_ZERO2):
    model = FSDP(torch.nn.Linear(8, 8), sharding_strategy=strategy)
    model(torch.ones(2, 8)).sum().backward()
    mesh = model.weight.device_mesh
    shard = dist.get_process_group_ranks(mesh.get_group(1))
    replicas = dist.get_process_group_ranks(mesh.get_group(0))
    print(strategy.name, tuple(mesh.shape), sorted({hosts[r] for r in shard}),
          sorted({hosts[r] for r in replicas}))
"""


def check_hybrid_meshes_follow_the_hosts(pool: Pool) -> None:
    """HYBRID_SHARD and _HYBRID_SHARD_ZERO2 without a mesh: shard within a host,
    replicate across hosts, and a training step runs on that mesh."""
    out = pool.run(HYBRID, stream=False).stdout
    for record in pool.topology:
        lines = [line.split(" ", 1) for line in out[record.rank].splitlines()]
        assert [name for name, _ in lines] == ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"], out
        for _, layout in lines:
            assert layout == f"(2, 2) ['{record.host}'] ['hosta', 'hostb']", (record, layout)


def test_slurm_pool_spans_both_nodes_and_its_job_leaves_the_queue(
    testhosts, slurm_env, workdir, tmp_path_factory
):
    profile_dir = str(tmp_path_factory.mktemp("slurm-profile"))
    pool = Pool(
        4,
        devices="cpu",
        timeout=240,
        show_topology=False,
        **slurm_pool_kwargs(testhosts, 2, profile_dir),
    )
    try:
        pool.start()
        job = engine_job(pool)
        assert f"{job} RUNNING" in squeue(slurm_env)
        assert sorted(r.host for r in pool.topology) == ["hosta", "hosta", "hostb", "hostb"]
        by_host = {}
        for record in pool.topology:
            by_host.setdefault(record.host, []).append(record.rank)
        assert all(ranks == [ranks[0], ranks[0] + 1] for ranks in by_host.values()), by_host
        out = pool.run(
            "import os, socket\n"
            "print(socket.gethostname(), os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'],"
            " os.environ['SLURM_JOB_ID'])",
            stream=False,
        ).stdout
        assert sorted(out[r].split()[:3] for r in range(4)) == [
            ["hosta", "0", "2"],
            ["hosta", "1", "2"],
            ["hostb", "0", "2"],
            ["hostb", "1", "2"],
        ]
        assert {out[r].split()[3] for r in range(4)} == {job}
        results = pool.run(
            "t = torch.tensor([float(rank + 1)]); dist.all_reduce(t); t.item()", stream=False
        ).results
        assert results == {r: "10.0" for r in range(4)}
        check_hybrid_meshes_follow_the_hosts(pool)

        pool.restart()  # a new job; the old one leaves the queue
        new_job = engine_job(pool)
        assert new_job != job
        assert wait_until(lambda: not any(j.startswith(f"{job} ") for j in squeue(slurm_env)), 60)
        assert pool.run("dist.all_reduce(t := torch.ones(1)); t.item()", stream=False).results == {
            r: "4.0" for r in range(4)
        }
    finally:
        pool.stop()
    assert wait_until(lambda: squeue(slurm_env) == [], 60), squeue(slurm_env)
    assert left_on_hosts(testhosts) == {}
