"""The programs simulated hosts need, and installing them (Debian packages)."""

from __future__ import annotations

import os
import shutil
import subprocess

APT_PACKAGES = ("openssh-server", "openssh-client", "slurm-wlm", "munge", "openmpi-bin")
#: Programs the set needs, and the Debian package that brings each.
TOOLS = {
    "ip": "iproute2",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "munged": "munge",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "sbatch": "slurm-wlm",
    "mpiexec": "openmpi-bin",
}
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch")
SFTP_SERVER = "/usr/lib/openssh/sftp-server"


def missing_tools(slurm: bool = True) -> list[str]:
    """``"program (package)"`` for each needed program not on ``PATH``."""
    needed = [t for t in TOOLS if slurm or t not in SLURM_TOOLS]
    missing = [f"{t} ({TOOLS[t]})" for t in needed if shutil.which(t) is None]
    if not os.path.exists(SFTP_SERVER):
        missing.append(f"{SFTP_SERVER} (openssh-sftp-server)")
    return missing


def install_tools() -> None:
    """``apt-get install`` the packages (services are not started: none is enabled here)."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=600", *APT_PACKAGES],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
