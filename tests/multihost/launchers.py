"""The ipyparallel launcher settings that start a pool's engines on the simulated hosts.

Each function returns the keyword arguments for ``Pool(...)`` (``engines``,
``controller_ip``, ``profile_dir``, ``config``) for one launcher. They hold what a
multi-host pool needs beyond ``engines=`` today:

* every launcher: ``controller_ip`` set to an address the hosts reach (the controller
  listens on loopback by default), and a ``traitlets.config.Config`` (``Cluster``
  rejects a plain ``dict``);
* ssh: the ssh options for ``ssh`` *and* ``scp`` (connection files are copied), the
  remote Python, and a remote profile directory;
* SLURM: a batch script that spreads the tasks over the nodes (the default one packs
  them onto as few nodes as the CPUs allow) and names its output file; ``sbatch`` runs
  with the caller's environment, so ``SLURM_CONF`` must be in ``os.environ``;
* MPI: ``mpiexec`` over ssh forwards only ``OMPI_*`` variables to remote ranks, so
  ipyparallel's ``IPP_*`` variables (connection info, profile, cluster id) are passed
  with ``-x``; without them remote engines look for a connection file in
  ``~/.ipython`` and exit.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from traitlets.config import Config

from fsdp_interactive.pool import Pool
from tests.multihost.testhosts import HostSet

#: ipyparallel's environment for engines, which mpiexec must forward to remote ranks.
IPP_ENGINE_ENV = ("IPP_CLUSTER_ID", "IPP_PROFILE_DIR", "IPP_CONNECTION_INFO")


def ssh_pool_kwargs(
    hosts: HostSet, per_host: int | Mapping[str, int], profile_dir: str
) -> dict[str, Any]:
    """``engines="ssh"``: ``per_host`` engines on every host (or ``{host: engines}``),
    started over ssh."""
    engines = (
        dict(per_host)
        if isinstance(per_host, Mapping)
        else {host.name: per_host for host in hosts.hosts}
    )
    config = Config(
        {
            "SSHEngineSetLauncher": {
                "engines": engines,
                "remote_python": sys.executable,
                # The file system is shared: the same directory on every host.
                "remote_profile_dir": profile_dir,
                "ssh_args": hosts.ssh_args,
                "scp_args": hosts.ssh_args,
            }
        }
    )
    return {
        "engines": "ssh",
        "controller_ip": hosts.head_address,
        "profile_dir": profile_dir,
        "config": config,
    }


def slurm_batch_template(n_nodes: int, per_node: int) -> str:
    """An engine batch script for ipyparallel's SLURM launcher: ``per_node`` tasks per node."""
    return "\n".join(
        [
            "#!/bin/sh",
            "#SBATCH --job-name=ipengine-{cluster_id}",
            f"#SBATCH --nodes={n_nodes}",
            "#SBATCH --ntasks={n}",
            f"#SBATCH --ntasks-per-node={per_node}",
            "#SBATCH --output={output_file}",
            "#SBATCH --export=ALL",
            "srun {program_and_args}",
            "",
        ]
    )


def slurm_pool_kwargs(hosts: HostSet, per_node: int, profile_dir: str) -> dict[str, Any]:
    """``engines="slurm"``: one job of ``per_node`` tasks on every node."""
    template = slurm_batch_template(len(hosts.hosts), per_node)
    return {
        "engines": "slurm",
        "controller_ip": hosts.head_address,
        "profile_dir": profile_dir,
        "config": Config({"SlurmEngineSetLauncher": {"batch_template": template}}),
    }


def mpi_args(hosts: HostSet, per_host: int) -> list[str]:
    """``mpiexec`` arguments placing ``per_host`` ranks on every host and forwarding IPP_*."""
    placement = ",".join(f"{host.name}:{per_host}" for host in hosts.hosts)
    forwarded = [arg for name in IPP_ENGINE_ENV for arg in ("-x", name)]
    return ["-H", placement, *forwarded]


def mpi_pool_kwargs(hosts: HostSet, per_host: int, profile_dir: str) -> dict[str, Any]:
    """``engines="mpi"``: one ``mpiexec`` over ssh (its ``OMPI_*`` settings: ``hosts.mpi_env``)."""
    return {
        "engines": "mpi",
        "controller_ip": hosts.head_address,
        "profile_dir": profile_dir,
        "config": Config({"MPILauncher": {"mpi_args": mpi_args(hosts, per_host)}}),
    }


@contextlib.contextmanager
def running_ssh_pool(
    hosts: HostSet, per_host: int | Mapping[str, int], profile_dir: str
) -> Iterator[Pool]:
    """A started CPU pool of ssh engines as :func:`ssh_pool_kwargs` places them; stopped
    when the block ends, also on failure."""
    kwargs = ssh_pool_kwargs(hosts, per_host, profile_dir)
    ranks = sum(kwargs["config"].SSHEngineSetLauncher.engines.values())
    pool = Pool(ranks, devices="cpu", timeout=240, show_topology=False, **kwargs)
    try:
        yield pool.start()
    finally:
        pool.stop()
