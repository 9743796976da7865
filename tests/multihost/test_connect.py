"""``Pool.connect()`` to a cluster started by hand: ``ipcontroller`` on hosta, ``ipengine``s over ssh."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.pool import Pool
from tests.multihost.conftest import left_on_hosts, wait_until
from tests.multihost.testhosts import HostSet

pytestmark = pytest.mark.multihost


def start_over_ssh(hosts: HostSet, host: str, argv: list[str], log: Path) -> int:
    """Start ``argv`` in the background on ``host`` through ssh, as a user would; its pid."""
    command = f"nohup {shlex.join(argv)} > {shlex.quote(str(log))} 2>&1 < /dev/null & echo $!"
    return int(hosts.ssh(host, command).stdout.strip())


@pytest.fixture(scope="module")
def hand_started_cluster(testhosts, tmp_path_factory) -> Iterator[tuple[Path, dict[int, str]]]:
    """A controller on hosta and one engine on each host; ended over ssh afterwards."""
    tmp_path = tmp_path_factory.mktemp("hand-started")
    profile = tmp_path / "profile"
    pids: dict[int, str] = {}
    controller_address = testhosts.host("hosta").address
    try:
        pid = start_over_ssh(
            testhosts,
            "hosta",
            [
                sys.executable,
                "-m",
                "ipyparallel.controller",
                f"--profile-dir={profile}",
                f"--ip={controller_address}",
                "--nodb",
            ],
            tmp_path / "controller.log",
        )
        pids[pid] = "hosta"
        engine_file = profile / "security" / "ipcontroller-engine.json"
        assert wait_until(engine_file.exists, 60), (tmp_path / "controller.log").read_text()
        for host in ("hosta", "hostb"):
            pid = start_over_ssh(
                testhosts,
                host,
                [sys.executable, "-m", "ipyparallel.engine", f"--profile-dir={profile}"],
                tmp_path / f"engine-{host}.log",
            )
            pids[pid] = host
        yield profile, pids
    finally:
        for pid, host in pids.items():
            testhosts.ssh(host, f"kill {pid}", check=False)
        assert left_on_hosts(testhosts) == {}


def test_connect_forms_a_group_across_hosts_and_leaves_the_engines(testhosts, hand_started_cluster):
    profile, pids = hand_started_cluster
    client_file = profile / "security" / "ipcontroller-client.json"
    address = testhosts.host("hosta").address
    assert json.loads(client_file.read_text())["interface"] == f"tcp://{address}"
    pool = Pool.connect(
        profile_dir=str(profile),
        n=2,
        devices="cpu",
        timeout=120,
        show_topology=False,
        insecure_network=True,  # started by hand without CurveZMQ
    )
    try:
        pool.start()
        assert [r.host for r in pool.topology] == ["hosta", "hostb"]
        engine_pids = {r.pid for r in pool.topology}
        assert engine_pids <= set(pids)
        results = pool.run(
            "t = torch.tensor([float(rank + 1)]); dist.all_reduce(t); t.item()", stream=False
        ).results
        assert results == {0: "3.0", 1: "3.0"}
        pool.restart()  # the same engines form a new group
        assert {r.pid for r in pool.topology} == engine_pids
        assert pool.run("dist.get_world_size()", stream=False).results == {0: "2", 1: "2"}
    finally:
        pool.stop()
    assert all(psutil.pid_exists(pid) for pid in pids), (
        "a connected pool leaves the engines running"
    )


def test_connect_by_client_connection_file(hand_started_cluster):
    profile, _ = hand_started_cluster
    client_file = profile / "security" / "ipcontroller-client.json"
    pool = Pool.connect(
        str(client_file),
        n=2,
        devices="cpu",
        timeout=60,
        show_topology=False,
        insecure_network=True,  # started by hand without CurveZMQ
    )
    try:
        pool.start()
        assert [r.host for r in pool.topology] == ["hosta", "hostb"]
    finally:
        pool.stop()
