"""A pool whose engines ipyparallel's ssh launcher starts on two hosts, one rank each.

One rank per host: the ssh launcher starts engines one after another, several ssh
round trips each, so every engine adds seconds to start, restart and stop; two ranks
per host are covered by the SLURM and MPI pools.
"""

from __future__ import annotations

from collections.abc import Iterator

import psutil
import pytest

from fsdp_interactive.pool import Pool
from tests.multihost.conftest import left_on_hosts
from tests.multihost.launchers import ssh_pool_kwargs
from tests.multihost.testhosts import HostSet

pytestmark = pytest.mark.multihost

PER_HOST = 1


@pytest.fixture(scope="module")
def ssh_pool(testhosts, tmp_path_factory) -> Iterator[Pool]:
    profile_dir = str(tmp_path_factory.mktemp("ssh-profile"))
    pool = Pool(
        2 * PER_HOST,
        devices="cpu",
        timeout=240,
        show_topology=False,
        **ssh_pool_kwargs(testhosts, PER_HOST, profile_dir),
    )
    try:
        yield pool.start()
    finally:
        pool.stop()


def test_topology_shows_each_ranks_host_and_local_rank(ssh_pool, testhosts):
    topology = ssh_pool.topology
    assert [r.host for r in topology] == ["hosta", "hostb"]
    assert [r.local_rank for r in topology] == [0, 0]
    assert [r.address for r in topology] == [testhosts.host(r.host).address for r in topology]
    table = ssh_pool.topology_table()
    assert table.count("hosta") == 1 and table.count("hostb") == 1


def test_ranks_see_torchrun_variables_per_host(ssh_pool, testhosts):
    code = (
        "import os, socket\n"
        "print(socket.gethostname(), *(os.environ[k] for k in "
        "('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'WORLD_SIZE', 'MASTER_ADDR')))"
    )
    out = ssh_pool.run(code, stream=False).stdout
    rank0 = testhosts.host("hosta").address
    assert [out[r].split() for r in range(2)] == [
        ["hosta", "0", "0", "1", "2", rank0],
        ["hostb", "1", "0", "1", "2", rank0],
    ]


def test_all_reduce_crosses_hosts(ssh_pool):
    results = ssh_pool.run(
        "t = torch.tensor([float(rank + 1)]); dist.all_reduce(t); t.item()", stream=False
    ).results
    assert results == {0: "3.0", 1: "3.0"}


def test_stacks_of_ranks_on_other_hosts_name_host_and_file(ssh_pool):
    stacks, where = ssh_pool.stacks()
    for record in ssh_pool.topology:
        assert stacks[record.rank].startswith(f"(stack written on {record.host}:")
        assert where[record.rank] == "unknown: no stack dump received"


def listening(hosts: HostSet, host: str, pid: int) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` listens on, on ``host``."""
    out = hosts.run(host, ["ss", "-H", "-tlnp"]).stdout
    found = set()
    for line in out.splitlines():
        if f"pid={pid}," in line:
            address, port = line.split()[3].rsplit(":", 1)
            found.add((address, int(port)))
    return found


def store_port(pool: Pool) -> int:
    return int(
        pool.run("import os; os.environ['MASTER_PORT']", targets=0, stream=False)
        .results[0]
        .strip("'")
    )


def test_controller_and_gloo_listen_on_the_pools_addresses_only(ssh_pool, testhosts):
    controller = psutil.Process(ssh_pool._cluster.controller.pid)
    addresses = {
        c.laddr.ip
        for proc in [controller, *controller.children(recursive=True)]
        for c in proc.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
    assert addresses and addresses <= {testhosts.head_address, "127.0.0.1"}, addresses
    port = store_port(ssh_pool)
    for record in ssh_pool.topology:
        sockets = listening(testhosts, record.host, record.pid) - {("0.0.0.0", port), ("*", port)}
        assert sockets, f"rank {record.rank} listens on nothing"
        assert {address for address, _ in sockets} <= {record.address, "127.0.0.1"}, sockets


@pytest.mark.xfail(
    strict=True,
    reason="rank 0 binds the rendezvous store to all interfaces on multi-host pools "
    "(open_store('')); a socket bound to rank 0's address, passed as master_listen_fd, works",
)
def test_rendezvous_store_listens_on_rank0s_address_only(ssh_pool, testhosts):
    rank0 = ssh_pool.topology[0]
    port = store_port(ssh_pool)
    sockets = {s for s in listening(testhosts, rank0.host, rank0.pid) if s[1] == port}
    assert sockets == {(rank0.address, port)}


def test_restart_brings_a_fresh_group_up_on_both_hosts(ssh_pool):
    before = {r.rank: r.pid for r in ssh_pool.topology}
    ssh_pool.restart()
    after = ssh_pool.topology
    assert [r.host for r in after] == ["hosta", "hostb"]
    assert not {r.pid for r in after} & set(before.values())
    assert ssh_pool.run("dist.all_reduce(t := torch.ones(1)); t.item()", stream=False).results == {
        0: "2.0",
        1: "2.0",
    }


def test_stop_leaves_nothing_on_any_host(ssh_pool, testhosts):
    assert all(testhosts.processes_on(h.name) for h in testhosts.hosts)
    ssh_pool.stop()
    assert left_on_hosts(testhosts) == {}
