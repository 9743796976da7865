"""A kernel killed while its pool runs on other hosts leaves nothing behind on them.

The kernel here is a separate Python process that starts a pool (one rank on each
host), has the ranks run a long cell, and is then SIGKILLed: no ``stop()``, no
``atexit``. Nothing local can end the ranks (the orphan reaper ends only this host's
processes). In a SLURM pool the job belongs to SLURM: the ranks notice that their kernel
is gone and exit, and with them the job. In an ssh pool each host's engine forker sees
its ssh connection close: it ends that host's ranks and removes the pool's snapshot root
there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.multihost.conftest import exists_on, left_on_hosts, squeue, wait_until

pytestmark = pytest.mark.multihost

REPO = str(Path(__file__).resolve().parents[2])

KERNEL = textwrap.dedent(
    """
    import sys, threading, time
    from fsdp_interactive.pool import Pool
    from tests.multihost.launchers import slurm_pool_kwargs
    from tests.multihost.testhosts import HostSet

    hosts = HostSet(sys.argv[1])
    pool = Pool(2, devices="cpu", timeout=240, show_topology=False,
                **slurm_pool_kwargs(hosts, 1, sys.argv[2])).start()
    job = next(iter(pool._processes.cluster.engines.values())).job_id
    # busy ranks: their engines' event loops, which watch the controller, do not run
    threading.Thread(target=pool.run, args=("import time; time.sleep(3600)",),
                     kwargs={"stream": False}, daemon=True).start()
    time.sleep(2)
    print("ready", job, *(r.pid for r in pool.topology), flush=True)
    time.sleep(3600)
    """
)


def test_a_killed_kernel_leaves_no_rank_and_no_job_on_the_hosts(
    testhosts, slurm_env, workdir, tmp_path_factory
):
    profile_dir = str(tmp_path_factory.mktemp("killed-kernel-profile"))
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL, str(testhosts.state_dir), profile_dir],
        stdout=subprocess.PIPE,
        text=True,
        cwd=workdir,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    job = None
    try:
        line = kernel.stdout.readline() if kernel.stdout else ""
        assert line.startswith("ready "), line
        _, job, *_ = line.split()
        assert f"{job} RUNNING" in squeue(slurm_env)
        assert {h.name for h in testhosts.hosts if testhosts.processes_on(h.name)} == {
            "hosta",
            "hostb",
        }
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(30)
        assert wait_until(lambda: squeue(slurm_env) == [], 60), squeue(slurm_env)
        assert left_on_hosts(testhosts, timeout=30) == {}
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait(30)
        if job is not None:
            subprocess.run(["scancel", job], check=False, timeout=30)


SSH_KERNEL = textwrap.dedent(
    """
    import sys, threading, time
    from fsdp_interactive.pool import Pool
    from tests.multihost.launchers import ssh_pool_kwargs
    from tests.multihost.testhosts import HostSet

    hosts = HostSet(sys.argv[1])
    pool = Pool(2, devices="cpu", timeout=240, show_topology=False,
                **ssh_pool_kwargs(hosts, 1, sys.argv[2])).start()
    pool.run("import os; os.makedirs(os.path.join(os.environ['FSDPI_SNAPSHOT_ROOT'], 's1'))",
             stream=False)
    threading.Thread(target=pool.run, args=("import time; time.sleep(3600)",),
                     kwargs={"stream": False}, daemon=True).start()
    time.sleep(2)
    print("ready", pool.snapshot_root, flush=True)
    time.sleep(3600)
    """
)


def test_a_killed_kernel_leaves_no_rank_forker_or_snapshot_root_on_ssh_hosts(
    testhosts, workdir, tmp_path_factory
):
    hosts = testhosts
    profile_dir = str(tmp_path_factory.mktemp("killed-ssh-kernel-profile"))
    kernel = subprocess.Popen(
        [sys.executable, "-c", SSH_KERNEL, str(hosts.state_dir), profile_dir],
        stdout=subprocess.PIPE,
        text=True,
        cwd=workdir,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    try:
        line = kernel.stdout.readline() if kernel.stdout else ""
        assert line.startswith("ready "), line
        root = line.split()[1]
        for host in hosts.hosts:
            assert hosts.processes_on(host.name)
            assert exists_on(hosts, host.name, f"{root}/s1")
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(30)
        assert left_on_hosts(hosts, timeout=30) == {}
        for host in hosts.hosts:
            assert not exists_on(hosts, host.name, root)
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait(30)
