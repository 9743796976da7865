"""A pool whose engines ipyparallel's ssh launcher starts on two hosts, one rank each.

One rank per host: the ssh launcher starts engines one after another, several ssh
round trips each, so every engine adds seconds to start, restart and stop; two ranks
per host are covered by the SLURM and MPI pools.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fsdp_interactive.pool import Pool
from tests.multihost.capture import captured
from tests.multihost.conftest import left_on_hosts
from tests.multihost.launchers import running_ssh_pool
from tests.multihost.testhosts import HostSet

pytestmark = pytest.mark.multihost

PER_HOST = 1


@pytest.fixture(scope="module")
def ssh_pool(testhosts, tmp_path_factory) -> Iterator[Pool]:
    profile_dir = str(tmp_path_factory.mktemp("ssh-profile"))
    with running_ssh_pool(testhosts, PER_HOST, profile_dir) as pool:
        yield pool


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


def test_errors_and_interrupts_of_remote_ranks(ssh_pool):
    from fsdp_interactive.pool import RankError, RankInterrupted

    with pytest.raises(RankError) as caught:
        ssh_pool.run("x = 1 / 0 if rank == 1 else 0", stream=False)
    assert caught.value.ranks == [1] and "ZeroDivisionError" in str(caught.value)

    timer = threading.Timer(3, ssh_pool.interrupt)
    timer.start()
    try:
        with pytest.raises(RankInterrupted) as interrupted:
            ssh_pool.run("import time\nfor _ in range(600):\n    time.sleep(0.1)", stream=False)
    finally:
        timer.cancel()
    assert interrupted.value.ranks == [0, 1] and not interrupted.value.needs_restart
    assert ssh_pool.run("rank", stream=False).results == {0: "0", 1: "1"}


def test_a_hang_shows_every_remote_ranks_stack_over_the_network(ssh_pool):
    from fsdp_interactive.pool import RankTimeout

    code = (
        "import time\n"
        "def late_barrier():\n"
        "    time.sleep(10)\n"
        "    dist.barrier()\n"
        "dist.barrier() if rank == 0 else late_barrier()"
    )
    with pytest.raises(RankTimeout) as caught:
        ssh_pool.run(code, timeout=3, stream=False)
    error = caught.value
    # rank 0 (hosta) waits in the barrier; rank 1 (hostb) still sleeps before it
    assert "barrier" in error.where[0], error.where
    assert "dist.barrier() if rank == 0" in error.stacks[0], error.stacks[0]
    assert "late_barrier" in error.stacks[1] and "time.sleep(10)" in error.stacks[1]
    assert "(stack written on" not in error.stacks[0] + error.stacks[1]
    error.wait(60)  # rank 1 reaches the barrier: the group stays usable


def test_the_network_carries_no_cell_source_output_or_stack(ssh_pool, testhosts):
    """CurveZMQ on every channel of ipyparallel, TLS on the diagnostics agent's: what the
    network carries between the kernel and the hosts names no cell's source, output or
    stack (captured on this machine's link to the hosts)."""
    from fsdp_interactive.pool import RankTimeout

    client_file = ssh_pool._processes.cluster.controller.connection_files["client"]
    assert json.loads(Path(client_file).read_text())["curve_serverkey"]
    source, output, stack = (f"{what}-{os.urandom(6).hex()}" for what in ("src", "out", "stk"))
    with captured(testhosts.head_link) as wire:
        out = ssh_pool.run(f"{source!r}\nprint({output[:4]!r} + {output[4:]!r})", stream=False)
        assert [out.stdout[r].strip() for r in (0, 1)] == [output, output]
        # a hang: every rank's stack comes back over the agents' (encrypted) links
        with pytest.raises(RankTimeout) as caught:
            ssh_pool.run(
                f"import time\ntime.sleep(6 + 0 * len({stack!r}))", timeout=2, stream=False
            )
        assert all(stack in caught.value.stacks[r] for r in (0, 1)), caught.value.stacks
        caught.value.wait(60)
    assert len(wire) > 10_000  # the capture saw the traffic
    for secret in (source, output, stack):
        assert secret.encode() not in wire, f"{secret} crossed the network in clear"


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
    controller = psutil.Process(ssh_pool._processes.cluster.controller.pid)
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


def test_rendezvous_store_listens_on_rank0s_address_only(ssh_pool, testhosts):
    rank0 = ssh_pool.topology[0]
    port = store_port(ssh_pool)
    sockets = {s for s in listening(testhosts, rank0.host, rank0.pid) if s[1] == port}
    assert sockets == {(rank0.address, port)}


def established(hosts: HostSet, host: str, pid: int) -> set[tuple[str, int, str, int]]:
    """``(local address, port, peer address, port)`` of process ``pid``'s established TCP
    connections, on ``host``."""
    found = set()
    for line in hosts.run(host, ["ss", "-H", "-tnp"]).stdout.splitlines():
        fields = line.split()
        if fields and fields[0] == "ESTAB" and f"pid={pid}," in line:
            local, peer = (f.rsplit(":", 1) for f in fields[3:5])
            found.add((local[0], int(local[1]), peer[0], int(peer[1])))
    return found


def interface_of(hosts: HostSet, host: str, address: str) -> str:
    """The interface that holds ``address`` on ``host`` (``ip -o addr`` there)."""
    for line in hosts.run(host, ["ip", "-o", "-4", "addr", "show"]).stdout.splitlines():
        if f" {address}/" in line:
            return line.split()[1].split("@")[0]
    raise AssertionError(f"no interface holds {address} on {host}")


def test_gloo_binds_each_ranks_cluster_interface_not_loopback(ssh_pool, testhosts):
    rank0, remote = ssh_pool.topology
    ifnames = ssh_pool.run("import os; os.environ.get('GLOO_SOCKET_IFNAME')", stream=False).results
    assert ifnames == {
        0: repr(interface_of(testhosts, rank0.host, rank0.address)),
        1: repr(interface_of(testhosts, remote.host, remote.address)),
    }
    ssh_pool.run("dist.all_reduce(torch.ones(1))", stream=False)  # the gloo pair is connected
    port = store_port(ssh_pool)
    # Connections between the two rank processes: the store client's and gloo's pair.
    rank0_ends = {(c[0], c[1]) for c in established(testhosts, rank0.host, rank0.pid)}
    between = {
        c for c in established(testhosts, remote.host, remote.pid) if (c[2], c[3]) in rank0_ends
    }
    gloo = {c for c in between if c[3] != port}
    assert gloo, f"no gloo connection between the ranks' processes: {between}"
    assert {(c[0], c[2]) for c in between} == {(remote.address, rank0.address)}, between
    assert not any(address.startswith("127.") for c in gloo for address in (c[0], c[2]))


def test_a_remote_rank_killed_by_sigkill_is_reported_with_its_signal_and_log(ssh_pool, testhosts):
    from fsdp_interactive.pool import RankDied

    victim = ssh_pool.topology[1]
    assert victim.host == "hostb"

    def kill_when_busy() -> None:
        time.sleep(2)
        testhosts.run("hostb", ["kill", "-KILL", str(victim.pid)])

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    began = time.monotonic()
    try:
        with pytest.raises(RankDied) as caught:
            ssh_pool.run(
                "import os\n"
                "os.write(2, f'rank {rank} looping\\n'.encode())  # into the engine's log\n"
                "while True:\n"
                "    dist.all_reduce(torch.ones(1))",
                stream=False,
            )
    finally:
        killer.join()
    error = caught.value
    print(f"RankDied {time.monotonic() - began - 2:.1f}s after the kill")  # shown with -s
    assert error.ranks == [1] or 1 in error.ranks, error
    assert error.exit_codes[1] == -9, error.exit_codes
    assert f"rank 1 (pid {victim.pid} on hostb) died: killed by signal SIGKILL" in str(error)
    assert "rank 1 looping" in error.log_tails[1], error.log_tails
    # what the remote rank wrote during this call, from its launcher: no earlier lines
    assert "--- rank 1's engine log during this call ---\nrank 1 looping" in str(error), error
    assert "Handling" not in str(error) and "Registering" not in str(error), error
    assert ssh_pool.state == "broken"


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
