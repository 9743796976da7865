"""The simulated hosts themselves: names, isolation, sshd, SLURM, OpenMPI, private dirs, teardown."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from fsdp_interactive.pool.processes._pids import start_time
from tests.multihost.conftest import squeue
from tests.multihost.testhosts import HostSet, HostSetError

pytestmark = pytest.mark.multihost


def test_each_host_has_its_own_name_and_resolves_the_others(testhosts):
    for host in testhosts.hosts:
        out = testhosts.ssh(host.name, "hostname; getent hosts hosta hostb head").stdout.split()
        assert out[0] == host.name
        resolved = dict(zip(out[2::2], out[1::2], strict=True))
        assert resolved == {
            "hosta": testhosts.host("hosta").address,
            "hostb": testhosts.host("hostb").address,
            "head": testhosts.head_address,
        }


def test_hosts_reach_nothing_beyond_their_subnet(testhosts):
    probe = (
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(3)\n"
        "print(s.connect_ex(('192.0.2.1', 80)))\n"  # TEST-NET-1: never a real host
    )
    for host in testhosts.hosts:
        routes = testhosts.run(host.name, ["ip", "-4", "route", "show"]).stdout.splitlines()
        assert [r.split()[0] for r in routes] == [testhosts.subnet], routes
        assert testhosts.run(host.name, ["ip", "-6", "addr", "show"]).stdout.strip() == ""
        code = testhosts.run(host.name, [sys.executable, "-c", probe]).stdout.strip()
        assert int(code) == errno.ENETUNREACH
        resolv = testhosts.run(host.name, ["cat", "/etc/resolv.conf"]).stdout
        assert "nameserver" not in resolv


def test_ssh_between_hosts_uses_the_sets_key_and_config(testhosts):
    # From hosta to hostb by name, with the same client config the head uses.
    out = testhosts.ssh("hosta", f"ssh -F {testhosts.ssh_config} hostb hostname").stdout
    assert out.strip() == "hostb"
    # scp (SFTP on Debian) works: ipyparallel's ssh launcher copies files with it.
    source = testhosts.state_dir / "scp-probe"
    source.write_text("probe")
    subprocess.run(
        ["scp", *testhosts.ssh_args, str(source), f"hostb:{source}.copy"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert (testhosts.state_dir / "scp-probe.copy").read_text() == "probe"


def test_slurm_runs_one_task_on_every_node(testhosts, slurm_env, tmp_path):
    output = tmp_path / "job.out"
    subprocess.run(
        [
            "sbatch",
            "--wait",
            "--nodes=2",
            "--ntasks-per-node=1",
            f"--output={output}",
            "--wrap",
            "srun hostname",
        ],
        env=dict(os.environ, **slurm_env),
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert sorted(output.read_text().split()) == ["hosta", "hostb"]


def test_mpiexec_runs_ranks_on_both_hosts(testhosts, mpi_env):
    code = (
        "from mpi4py import MPI; import socket; c = MPI.COMM_WORLD; "
        "print(c.rank, socket.gethostname(), c.allreduce(c.rank + 1))"
    )
    out = subprocess.run(
        ["mpiexec", "-H", "hosta,hostb", "-n", "2", sys.executable, "-c", code],
        env=dict(os.environ, **mpi_env),
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert sorted(out.splitlines()) == ["0 hosta 3", "1 hostb 3"]


def test_a_private_dir_is_seen_by_its_host_only(testhosts, tmp_path):
    shared = tmp_path / "checkpoints"
    shared.mkdir()
    (shared / "from-head").write_text("x")
    testhosts.private_dir("hosta", shared)
    try:
        testhosts.ssh("hosta", f"touch {shared}/from-hosta")
        assert testhosts.ssh("hosta", f"ls {shared}").stdout.split() == ["from-hosta"]
        assert testhosts.ssh("hostb", f"ls {shared}").stdout.split() == ["from-head"]
        assert sorted(os.listdir(shared)) == ["from-head"]
    finally:
        testhosts.release_private_dir("hosta", shared)
    assert testhosts.ssh("hosta", f"ls {shared}").stdout.split() == ["from-head"]


def test_each_host_has_its_own_dev_shm_as_separate_machines_do(testhosts):
    name = f"fsdpi-test-{os.getpid()}"
    testhosts.ssh("hosta", f"touch /dev/shm/{name}")
    try:
        assert testhosts.ssh("hosta", f"ls /dev/shm/{name}").returncode == 0
        assert testhosts.ssh("hostb", f"test -e /dev/shm/{name}", check=False).returncode == 1
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        testhosts.ssh("hosta", f"rm -f /dev/shm/{name}")


def test_down_ends_everything_a_failed_up_started(testhosts, tmp_path, monkeypatch):
    """A second set beside the session's: its own subnet; a failure half-way cleans up."""

    def fail(self):
        raise RuntimeError("injected failure after sshd started")

    monkeypatch.setattr(HostSet, "_start_slurm", fail)
    second = HostSet(tmp_path / "second")
    with pytest.raises(HostSetError, match="injected failure"):
        second.up(2)
    assert not second.is_up
    recorded = HostSet(tmp_path / "second")  # state left for inspection
    assert recorded.status() == {"running": {}}
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "hosta" not in netns
    for host in testhosts.hosts:
        assert host.netns in netns, "the session's hosts are untouched"
    # down again, on a set already down, is a no-op
    assert second.down() == {"recorded": [], "on_hosts": [], "netns": []}


def test_every_daemon_is_recorded_with_its_start_time(testhosts):
    status = testhosts.status()
    names = {p["name"] for p in status["processes"]}
    assert {"sshd@hosta", "sshd@hostb", "slurmd@hosta", "slurmd@hostb"} <= names
    assert {"slurmctld@hosta", "munged"} <= names
    for record in status["processes"]:
        assert start_time(record["pid"]) == record["start_time"]
    assert set(status["running"]) == names
    # squeue answers: slurmctld and munge are reachable from the head
    assert isinstance(squeue(testhosts.slurm_env), list)
