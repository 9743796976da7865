"""A pool over an ipyparallel cluster it did not start: it forms the group, never ends engines."""

from __future__ import annotations

import logging

import ipyparallel as ipp
import pytest

from fsdp_interactive.pool import Pool, PoolStartError, visible_cuda_device_count
from fsdp_interactive.pool.processes import _devices
from fsdp_interactive.pool.processes._pids import start_time, still_running
from tests.pool.conftest import record, wait_gone


def test_connect_to_a_running_cluster(profile_dir, monkeypatch):
    # This host "has 4 GPUs" (a stand-in for CUDA): the connected engines' own hosts decide.
    monkeypatch.setattr(_devices, "_count", lambda visible, timeout: 4)
    assert visible_cuda_device_count() == 4
    cluster = ipp.Cluster(n=2, profile_dir=profile_dir, log_level=logging.ERROR)
    cluster.start_cluster_sync()
    try:
        client = cluster.connect_client_sync()
        client.wait_for_engines(2, timeout=120)
        client.close()
        engine_pids = {
            launcher.pid: start_time(launcher.pid)
            for engine_set in cluster.engines.values()
            for launcher in engine_set.launchers.values()
        }
        with pytest.raises(TypeError, match="does not do: controller_ip"):
            Pool.connect(profile_dir=profile_dir, cluster_id=cluster.cluster_id, controller_ip="*")
        # A cluster on plain loopback TCP: any local user could read it; refused unless told
        refused = Pool.connect(profile_dir=profile_dir, cluster_id=cluster.cluster_id)
        with pytest.raises(PoolStartError) as refusal:
            refused.start()
        assert "listens on tcp://127.0.0.1 without CurveZMQ" in str(refusal.value)
        assert "insecure_network=True" in str(refusal.value)
        # n defaults to every registered engine
        pool = Pool.connect(
            profile_dir=profile_dir, cluster_id=cluster.cluster_id, insecure_network=True
        )
        assert not pool.owns_engines
        pool.start()
        record(pool)
        assert {r.pid for r in pool.topology} == set(engine_pids)
        # The engines report no CUDA device: CPU ranks over gloo, whatever this host has.
        assert [(r.device, r.backend) for r in pool.topology] == [("cpu", "gloo")] * 2
        assert pool.run("dist.all_reduce(t := torch.ones(1)); t.item()", stream=False).results == {
            0: "2.0",
            1: "2.0",
        }
        pool.restart()  # leaves the group and forms a new one on the same engines
        assert {r.pid for r in pool.topology} == set(engine_pids)
        assert pool.call(lambda: __import__("torch.distributed").distributed.get_world_size()) == [
            2,
            2,
        ]
        pool.stop()
        assert pool.launched_pids == {}
        assert sorted(still_running(engine_pids)) == sorted(engine_pids), (
            "engines it does not own survive"
        )
    finally:
        cluster.stop_cluster_sync()
    assert wait_gone(engine_pids) == []
