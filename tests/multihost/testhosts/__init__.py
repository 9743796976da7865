"""Simulated hosts on one machine for the multi-host tests (run as root).

Each host is a network namespace with its own hostname (UTS namespace), its own address in
198.18.N.0/24 (a /24 of the benchmarking range 198.18.0.0/15, one per host set so that
sets brought up side by side do not meet), its own ``/etc/hosts`` and an empty
``resolv.conf`` (a private mount namespace), an ``sshd`` on its address and one ``slurmd``;
host 0 also runs ``slurmctld``. The hosts and this machine's own network namespace (the
"head", where a notebook kernel would run) are joined by veth pairs on a bridge that lives
in a namespace of its own. No namespace of a set has a default route, so nothing started
on a host can reach any address but loopback and the set's own subnet; the head only
gains the route to that subnet. IPv6 is switched off on every link of a set.

What is shared: the file system (virtualenv, checkout, connection files), the process
id space and the kernel, as with containers; but every host has a ``/dev/shm`` of its own
(an empty tmpfs in its mount namespace), as separate machines do, so what a pool keeps in
host memory on one host is not the other's. A host can be given other private
directories with :meth:`HostSet.private_dir`.

Every process started here is recorded in ``STATE/state.json`` (pid and start time)
before anything else happens, and ``down`` ends exactly those, SIGTERM then SIGKILL,
only where pid and start time still match; processes that something else started on
the hosts (engines, SLURM job steps, ssh sessions) are found by their network
namespace and ended too, since a host that goes away ends what runs on it. ``down`` is
idempotent and cleans whatever a half-finished ``up`` left.

Command line::

    python -m tests.multihost.testhosts install          # apt-get the tools
    python -m tests.multihost.testhosts up [--state DIR] [--hosts N] [--no-slurm]
    python -m tests.multihost.testhosts status [--state DIR]
    python -m tests.multihost.testhosts run HOST [--state DIR] -- CMD ...
    python -m tests.multihost.testhosts down [--state DIR]

``--state`` defaults to ``$FSDPI_TESTHOSTS``, else ``/tmp/fsdpi-testhosts``. From the
head, ``ssh -F STATE/ssh/config hosta`` reaches a host by name; ``SLURM_CONF`` and the
``OMPI_*`` variables of :attr:`HostSet.slurm_env` / :attr:`HostSet.mpi_env` point SLURM
and OpenMPI clients at the set.

Not done: separate process-id namespaces (a remote pid is a valid local pid here, unlike
on real hosts), separate users, packet loss or latency.
"""

from tests.multihost.testhosts._hostset import Host, HostSet, host_set
from tests.multihost.testhosts._system import DEFAULT_STATE, HostSetError, environ_set
from tests.multihost.testhosts._tools import APT_PACKAGES, TOOLS, install_tools, missing_tools

__all__ = [
    "APT_PACKAGES",
    "DEFAULT_STATE",
    "TOOLS",
    "Host",
    "HostSet",
    "HostSetError",
    "environ_set",
    "host_set",
    "install_tools",
    "missing_tools",
]
