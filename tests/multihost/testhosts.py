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
id space and the kernel, as with containers. A host can be given a private directory
(a tmpfs mounted in that host's mount namespace only) with :meth:`HostSet.private_dir`.

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

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

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
DEFAULT_STATE = "/tmp/fsdpi-testhosts"
_LOCK = "/run/lock/fsdpi-testhosts.lock"
_RUNTIME_ROOT = "/run/fsdpi-testhosts"
_NETNS_PREFIX = "fsdpi"
_HEAD_HOST = 254
_TERM_GRACE_S = 5.0


class HostSetError(RuntimeError):
    """The host set could not be brought up (the message says which step and why)."""


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


@dataclass(frozen=True)
class Host:
    """One simulated host: its name (hostname and ssh/SLURM name), address, namespace."""

    name: str
    address: str
    netns: str
    #: pid of the process that holds the host's UTS and mount namespaces
    holder_pid: int


class HostSet:
    """A set of simulated hosts described by the state directory ``state``.

    :meth:`up` brings them up, :meth:`down` ends them; an instance made on an existing
    state directory (``HostSet(path)``) reads what is running there.
    """

    def __init__(self, state: str | os.PathLike) -> None:
        self.state_dir = Path(state).absolute()
        self._state: dict[str, Any] = {}
        self._load()

    # ------------------------------------------------------------------ description

    @property
    def is_up(self) -> bool:
        return self._state.get("phase") == "up"

    @property
    def hosts(self) -> list[Host]:
        return [
            Host(h["name"], h["address"], h["netns"], h.get("holder", {}).get("pid", -1))
            for h in self._state.get("hosts", [])
        ]

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} in this set; hosts: {[h.name for h in self.hosts]}")

    @property
    def head_address(self) -> str:
        """This machine's own address on the hosts' network (e.g. a pool's ``controller_ip``)."""
        return self._state["head_address"]

    @property
    def subnet(self) -> str:
        return self._state["subnet"]

    @property
    def unused_address(self) -> str:
        """An address in the hosts' subnet that nothing answers on (an unreachable host)."""
        return self._state["unused_address"]

    @property
    def ssh_config(self) -> str:
        """ssh client config naming every host (``ssh -F <this> hosta``); root, key auth."""
        return str(self.state_dir / "ssh" / "config")

    @property
    def ssh_args(self) -> list[str]:
        """Arguments for ``ssh`` and ``scp`` (also ipyparallel's ``ssh_args``/``scp_args``)."""
        return ["-F", self.ssh_config]

    @property
    def slurm_env(self) -> dict[str, str]:
        """Environment that points SLURM's clients (sbatch, squeue, scancel) at the set."""
        if not self._state.get("slurm"):
            raise HostSetError("this host set was brought up without SLURM")
        return {"SLURM_CONF": self._state["slurm"]["conf"]}

    @property
    def slurm_partition(self) -> str:
        return "hosts"

    @property
    def mpi_env(self) -> dict[str, str]:
        """Environment for OpenMPI's ``mpiexec`` across the hosts (over this set's ssh)."""
        return {
            "OMPI_MCA_plm_rsh_agent": "ssh",
            "OMPI_MCA_plm_rsh_args": f"-F {self.ssh_config}",
            "OMPI_MCA_oob_tcp_if_include": self.subnet,
            "OMPI_MCA_btl_tcp_if_include": self.subnet,
            "OMPI_MCA_btl": "self,tcp",
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        }

    def status(self) -> dict[str, Any]:
        """The recorded state plus which recorded processes still run."""
        status = dict(self._state)
        status["running"] = {
            p["name"]: p["pid"] for p in self._state.get("processes", []) if _alive(p)
        }
        return status

    # ------------------------------------------------------------------ using the hosts

    def enter_command(self, host: str, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """``argv`` wrapped to run on ``host`` (its network, UTS and mount namespaces)."""
        pid = self.host(host).holder_pid
        return [
            "nsenter",
            "-t",
            str(pid),
            "--net",
            "--uts",
            "--mount",
            f"--wd={cwd or os.getcwd()}",
            "--",
            *argv,
        ]

    def run(
        self, host: str, argv: Sequence[str], *, timeout: float = 60, check: bool = True, **kw: Any
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` to completion (text output captured)."""
        kw.setdefault("capture_output", True)
        return subprocess.run(
            self.enter_command(host, argv), timeout=timeout, check=check, text=True, **kw
        )

    def ssh(
        self, host: str, command: str, *, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run the shell ``command`` on ``host`` through ssh from the head."""
        return subprocess.run(
            ["ssh", *self.ssh_args, host, command],
            timeout=timeout,
            check=check,
            text=True,
            capture_output=True,
            stdin=subprocess.DEVNULL,
        )

    def processes_on(self, host: str, *, own: bool = False) -> list[psutil.Process]:
        """Processes running on ``host`` (in its network namespace).

        The set's own daemons (namespace holder, sshd listener, slurmd, slurmctld and its
        helper) are left out unless ``own``; ssh sessions and SLURM job steps are not.
        """
        entry = self._host_entry(host)
        inode = entry.get("net_inode")
        if inode is None:
            return []
        own_pids = {p["pid"] for p in self._state.get("processes", []) if _alive(p)}
        # slurmctld's helper (slurmscriptd) belongs to it; jobs run under slurmd instead.
        for record in self._state.get("processes", []):
            if record["name"].startswith("slurmctld") and _alive(record):
                with contextlib.suppress(psutil.Error):
                    own_pids.update(c.pid for c in psutil.Process(record["pid"]).children())
        found = []
        for proc in _processes_in_netns({inode}):
            if own or proc.pid not in own_pids:
                found.append(proc)
        return found

    def private_dir(self, host: str, path: str | os.PathLike) -> str:
        """Give ``host`` its own empty tmpfs at ``path``; other hosts and the head keep theirs.

        ``path`` is created (on the shared file system) if missing. The mount lives in the
        host's mount namespace and goes with it; :meth:`release_private_dir` ends it sooner.
        """
        path = os.path.abspath(path)
        os.makedirs(path, exist_ok=True)
        self.run(host, ["mount", "-t", "tmpfs", "-o", "size=256m,mode=0755", "tmpfs", path])
        return path

    def release_private_dir(self, host: str, path: str | os.PathLike) -> None:
        self.run(host, ["umount", os.path.abspath(path)])

    # ------------------------------------------------------------------ up

    def up(self, n_hosts: int = 2, slurm: bool = True) -> HostSet:
        """Bring the hosts up; on any failure everything started is ended and it raises.

        Raises :class:`HostSetError` naming the step that failed.
        """
        if os.geteuid() != 0:
            raise HostSetError("the simulated hosts need root (network namespaces, mounts)")
        if not 1 <= n_hosts <= 8:
            raise HostSetError(f"n_hosts must be 1..8, got {n_hosts}")
        missing = missing_tools(slurm)
        if missing:
            raise HostSetError(
                "missing tools: "
                + ", ".join(missing)
                + " (python -m tests.multihost.testhosts install)"
            )
        if self._state:
            raise HostSetError(
                f"{self.state_dir} already describes a host set (phase "
                f"{self._state.get('phase')!r}); bring it down first"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        step = "starting"
        try:
            step = "allocating a subnet"
            self._allocate(n_hosts)
            step = "creating the network"
            self._make_network()
            step = "starting the hosts' namespaces"
            for entry in self._state["hosts"]:
                self._start_holder(entry)
            step = "starting sshd"
            self._start_sshd()
            if slurm:
                step = "starting munge and SLURM"
                self._start_slurm()
            self._state["phase"] = "up"
            self._state["up_seconds"] = round(time.monotonic() - started, 2)
            self._save()
        except BaseException as exc:
            self._state["phase"] = "failed"
            self._save()
            with contextlib.suppress(Exception):
                self.down()
            if isinstance(exc, HostSetError):
                raise
            if isinstance(exc, Exception):
                raise HostSetError(f"failed while {step}: {exc}") from exc
            raise
        return self

    def _allocate(self, n_hosts: int) -> None:
        os.makedirs(os.path.dirname(_LOCK), exist_ok=True)
        with open(_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = {_slot_of(name) for name in _netns_names()}
            free = [n for n in range(256) if n not in used]
            if not free:
                raise HostSetError("all 256 host-set subnets of 198.18.0.0/16 are in use")
            slot = free[0]
            prefix = f"198.18.{slot}"
            self._state = {
                "phase": "starting",
                "slot": slot,
                "subnet": f"{prefix}.0/24",
                "head_address": f"{prefix}.{_HEAD_HOST}",
                "unused_address": f"{prefix}.{100}",
                "head_link": f"{_NETNS_PREFIX}{slot}h",
                "switch_netns": f"{_NETNS_PREFIX}{slot}-sw",
                "hosts": [
                    {
                        "name": f"host{chr(ord('a') + i)}",
                        "address": f"{prefix}.{i + 1}",
                        "netns": f"{_NETNS_PREFIX}{slot}-{chr(ord('a') + i)}",
                    }
                    for i in range(n_hosts)
                ],
                "netns": [],
                "processes": [],
            }
            # The switch's name claims the slot for others as soon as the lock is released.
            self._state["netns"].append(self._state["switch_netns"])
            self._save()
            _ip("netns", "add", self._state["switch_netns"])

    def _make_network(self) -> None:
        switch = self._state["switch_netns"]
        _ip("-n", switch, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _netns_sysctl(switch, "net.ipv6.conf.all.disable_ipv6=1")
        _netns_sysctl(switch, "net.ipv6.conf.default.disable_ipv6=1")
        _ip("-n", switch, "link", "set", "br0", "up")
        for index, entry in enumerate(self._state["hosts"]):
            netns = entry["netns"]
            self._state["netns"].append(netns)
            self._save()
            _ip("netns", "add", netns)
            _netns_sysctl(netns, "net.ipv6.conf.all.disable_ipv6=1")
            _netns_sysctl(netns, "net.ipv6.conf.default.disable_ipv6=1")
            port = f"p{index}"
            _ip(
                "-n",
                switch,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                netns,
            )
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            _ip("-n", netns, "addr", "add", f"{entry['address']}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            entry["net_inode"] = os.stat(f"/run/netns/{netns}").st_ino
        # The head's end lives in this machine's own namespace: only the subnet's route
        # comes with its address, no default route changes.
        head = self._state["head_link"]
        _ip("link", "add", head, "type", "veth", "peer", "name", "head", "netns", switch)
        _write_sysctl(f"net/ipv6/conf/{head}/disable_ipv6", "1")
        _ip("-n", switch, "link", "set", "head", "master", "br0", "up")
        _ip("addr", "add", f"{self.head_address}/24", "dev", head)
        _ip("link", "set", head, "up")
        self._save()

    def _host_files(self, entry: Mapping[str, Any]) -> Path:
        directory = self.state_dir / entry["name"]
        directory.mkdir(exist_ok=True)
        return directory

    def _start_holder(self, entry: dict[str, Any]) -> None:
        directory = self._host_files(entry)
        hosts_file = directory / "hosts"
        lines = ["127.0.0.1\tlocalhost"]
        lines += [f"{h['address']}\t{h['name']}" for h in self._state["hosts"]]
        lines.append(f"{self.head_address}\thead")
        hosts_file.write_text("\n".join(lines) + "\n")
        resolv = self.state_dir / "resolv.conf"
        resolv.write_text("# no name servers: names come from /etc/hosts only\n")
        script = "; ".join(
            [
                "set -e",
                f"hostname {entry['name']}",
                f"mount --bind {shlex.quote(str(hosts_file))} /etc/hosts",
                f"mount --bind {shlex.quote(str(resolv))} /etc/resolv.conf",
                "echo ready",
                "exec sleep infinity >/dev/null",
            ]
        )
        # nsenter --net rather than `ip netns exec`: the latter remounts /sys, which hides
        # the cgroup hierarchy slurmd needs.
        argv = [
            "nsenter",
            f"--net=/run/netns/{entry['netns']}",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
        ]
        proc = self._spawn(f"namespaces@{entry['name']}", argv, stdout=subprocess.PIPE)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != b"ready":
            proc.wait(5)
            raise HostSetError(
                f"the namespaces of {entry['name']} did not come up: "
                + (directory / "namespaces.log").read_text(errors="replace")
            )
        entry["holder"] = self._state["processes"][-1]
        self._save()

    def _start_sshd(self) -> None:
        ssh_dir = self.state_dir / "ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        key = ssh_dir / "id_ed25519"
        _keygen(key, "fsdpi-testhosts")
        (ssh_dir / "authorized_keys").write_text((ssh_dir / "id_ed25519.pub").read_text())
        # sshd refuses to start without its privilege separation directory.
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        known = []
        for entry in self._state["hosts"]:
            directory = self._host_files(entry)
            host_key = directory / "ssh_host_ed25519_key"
            _keygen(host_key, entry["name"])
            public = (directory / "ssh_host_ed25519_key.pub").read_text().split()[:2]
            known.append(f"{entry['name']},{entry['address']} {' '.join(public)}")
            sshd_config = directory / "sshd_config"
            sshd_config.write_text(
                "\n".join(
                    [
                        f"ListenAddress {entry['address']}",
                        "Port 22",
                        f"HostKey {host_key}",
                        f"PidFile {directory / 'sshd.pid'}",
                        f"AuthorizedKeysFile {ssh_dir / 'authorized_keys'}",
                        "PermitRootLogin prohibit-password",
                        "PubkeyAuthentication yes",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        "UsePAM no",
                        "StrictModes no",
                        "UseDNS no",
                        "PrintMotd no",
                        # ipyparallel's ssh launcher opens a connection per engine and per poll.
                        "MaxStartups 200",
                        "MaxSessions 200",
                        # Debian's scp speaks SFTP; without this line scp fails.
                        f"Subsystem sftp {SFTP_SERVER}",
                        "",
                    ]
                )
            )
            _quiet(["/usr/sbin/sshd", "-t", "-f", str(sshd_config)])
            self._spawn(
                f"sshd@{entry['name']}",
                self.enter_command(
                    entry["name"], ["/usr/sbin/sshd", "-D", "-e", "-f", str(sshd_config)], cwd="/"
                ),
            )
        (ssh_dir / "known_hosts").write_text("\n".join(known) + "\n")
        lines = []
        for entry in self._state["hosts"]:
            lines += [f"Host {entry['name']}", f"    HostName {entry['address']}"]
        lines += [
            "Host *",
            "    User root",
            f"    IdentityFile {key}",
            "    IdentitiesOnly yes",
            f"    UserKnownHostsFile {ssh_dir / 'known_hosts'}",
            "    StrictHostKeyChecking yes",
            "    BatchMode yes",
            "    ConnectTimeout 5",
            "    LogLevel ERROR",
            "",
        ]
        Path(self.ssh_config).write_text("\n".join(lines))
        for entry in self._state["hosts"]:
            _wait_for_port(entry["address"], 22, timeout=10, what=f"sshd on {entry['name']}")

    def _start_slurm(self) -> None:
        # munged wants every directory above its socket searchable by all (a pytest
        # temporary directory is not), so its files live under /run.
        munge = Path(_RUNTIME_ROOT) / f"{self._state['slot']}-munge"
        self._state["runtime_dirs"] = [str(munge)]
        self._save()
        os.makedirs(_RUNTIME_ROOT, mode=0o755, exist_ok=True)
        munge.mkdir(mode=0o711, exist_ok=True)
        os.chmod(munge, 0o711)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = munge / "munge.socket.2"
        # One munged in the head's namespace: its socket is a file path, so the hosts
        # (which share the file system) reach it too.
        munged = self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={self.state_dir / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        _wait_for(
            lambda: socket_path.exists(),
            10,
            "munged's socket",
            log=self.state_dir / "munged.log",
            process=munged,
        )

        slurm = self.state_dir / "slurm"
        slurm.mkdir(exist_ok=True)
        (slurm / "state").mkdir(exist_ok=True)
        controller = self._state["hosts"][0]
        conf = slurm / "slurm.conf"
        nodes = [
            f"NodeName={h['name']} NodeAddr={h['address']} CPUs={os.cpu_count() or 1} State=UNKNOWN"
            for h in self._state["hosts"]
        ]
        conf.write_text(
            "\n".join(
                [
                    f"ClusterName=fsdpi{self._state['slot']}",
                    f"SlurmctldHost={controller['name']}({controller['address']})",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={socket_path}",
                    f"StateSaveLocation={slurm / 'state'}",
                    f"SlurmdSpoolDir={slurm / 'spool-%n'}",
                    f"SlurmctldPidFile={slurm / 'slurmctld.pid'}",
                    f"SlurmdPidFile={slurm / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={slurm / 'slurmctld.log'}",
                    f"SlurmdLogFile={slurm / 'slurmd-%n.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/backfill",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "SlurmctldTimeout=30",
                    "SlurmdTimeout=30",
                    "InactiveLimit=0",
                    "KillWait=5",
                    "MinJobAge=300",
                    *nodes,
                    "PartitionName=hosts Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        env = dict(os.environ, SLURM_CONF=str(conf))
        self._state["slurm"] = {"conf": str(conf), "dir": str(slurm)}
        self._save()
        self._spawn(
            f"slurmctld@{controller['name']}",
            self.enter_command(
                controller["name"], ["slurmctld", "-D", "-c", "-f", str(conf)], cwd="/"
            ),
            env=env,
        )
        for entry in self._state["hosts"]:
            self._spawn(
                f"slurmd@{entry['name']}",
                self.enter_command(
                    entry["name"],
                    ["slurmd", "-D", "-N", entry["name"], "-f", str(conf)],
                    cwd="/",
                ),
                env=env,
            )
        names = {h["name"] for h in self._state["hosts"]}

        def all_idle() -> bool:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                env=env,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            idle = {line.split()[0] for line in out.splitlines() if line.split()[1:] == ["idle"]}
            return names <= idle

        _wait_for(all_idle, 60, "every slurmd to report idle", log=slurm / "slurmctld.log")

    def _spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        stdout: Any = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen:
        """Start ``argv`` in a session of its own and record its pid and start time."""
        log_name = name.split("@")[0] + ".log"
        where = name.split("@")[1] if "@" in name else None
        directory = self.state_dir / where if where else self.state_dir
        directory.mkdir(exist_ok=True)
        with open(directory / log_name, "ab") as log:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=stdout if stdout is not None else log,
                stderr=log,
                start_new_session=True,
                env=dict(env) if env is not None else None,
            )
        try:
            created = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:
            created = None
        self._state["processes"].append({"name": name, "pid": proc.pid, "create_time": created})
        self._save()
        if created is None:
            raise HostSetError(f"{name} exited at once; see {directory / log_name}")
        return proc

    # ------------------------------------------------------------------ down

    def down(self) -> dict[str, Any]:
        """End everything the set started or left; idempotent. Returns what was ended."""
        report: dict[str, Any] = {"recorded": [], "on_hosts": [], "netns": []}
        if not self._state:
            return report
        started = time.monotonic()
        # Jobs first, so that slurmd can still end their steps cleanly.
        if self._state.get("slurm") and any(
            _alive(p) for p in self._state["processes"] if p["name"].startswith("slurmctld")
        ):
            with contextlib.suppress(Exception):
                subprocess.run(
                    ["scancel", "--full", f"--partition={self.slurm_partition}"],
                    env=dict(os.environ, **self.slurm_env),
                    timeout=10,
                    capture_output=True,
                )
        recorded = [p for p in self._state.get("processes", []) if _alive(p)]
        report["recorded"] = [f"{p['name']}:{p['pid']}" for p in recorded]
        _end(
            [psutil.Process(p["pid"]) for p in reversed(recorded) if _alive(p)],
            grace=_TERM_GRACE_S,
        )
        inodes = {h["net_inode"] for h in self._state.get("hosts", []) if "net_inode" in h}
        for name in self._state.get("netns", []):
            with contextlib.suppress(OSError):
                inodes.add(os.stat(f"/run/netns/{name}").st_ino)
        strays = _processes_in_netns(inodes) if inodes else []
        report["on_hosts"] = [f"{' '.join(p.cmdline()[:3])}:{p.pid}" for p in _safe(strays)]
        _end(strays, grace=_TERM_GRACE_S)
        head = self._state.get("head_link")
        if head and os.path.exists(f"/sys/class/net/{head}"):
            _ip("link", "del", head, check=False)
        for name in reversed(self._state.get("netns", [])):
            if os.path.exists(f"/run/netns/{name}"):
                _ip("netns", "del", name, check=False)
                report["netns"].append(name)
        for directory in self._state.get("runtime_dirs", []):
            shutil.rmtree(directory, ignore_errors=True)
        report["down_seconds"] = round(time.monotonic() - started, 2)
        self._state = {}
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / "state.json").unlink()
        return report

    # ------------------------------------------------------------------ internals

    def _host_entry(self, name: str) -> dict[str, Any]:
        for entry in self._state.get("hosts", []):
            if entry["name"] == name:
                return entry
        raise KeyError(f"no host {name!r} in this set")

    def _load(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._state = json.loads((self.state_dir / "state.json").read_text())

    def _save(self) -> None:
        path = self.state_dir / "state.json"
        partial = path.with_name("state.json.partial")
        partial.write_text(json.dumps(self._state, indent=1))
        os.replace(partial, path)


@contextlib.contextmanager
def host_set(state: str | os.PathLike, n_hosts: int = 2, slurm: bool = True) -> Iterator[HostSet]:
    """Hosts brought up in ``state`` for the duration of the block, then brought down."""
    hosts = HostSet(state)
    try:
        yield hosts.up(n_hosts, slurm)
    finally:
        hosts.down()


# ---------------------------------------------------------------------- helpers


@contextlib.contextmanager
def environ_set(env: dict[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` for the block; each key's earlier value (or absence) after."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _ip(*args: str, check: bool = True) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise HostSetError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def _netns_sysctl(netns: str, setting: str) -> None:
    key, value = setting.split("=")
    _quiet(["nsenter", f"--net=/run/netns/{netns}", "sysctl", "-q", "-w", f"{key}={value}"])


def _write_sysctl(path: str, value: str) -> None:
    with open(f"/proc/sys/{path}", "w") as f:
        f.write(value)


def _keygen(path: Path, comment: str) -> None:
    """A fresh passphrase-less ed25519 key pair at ``path`` (replacing an old one)."""
    for old in (path, path.with_name(path.name + ".pub")):
        old.unlink(missing_ok=True)
    _quiet(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])


def _quiet(argv: Sequence[str]) -> None:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise HostSetError(
            f"`{shlex.join(argv)}` failed: {(result.stderr or result.stdout).strip()}"
        )


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _slot_of(netns: str) -> int | None:
    if not netns.startswith(_NETNS_PREFIX):
        return None
    digits = netns[len(_NETNS_PREFIX) :].split("-")[0]
    return int(digits) if digits.isdigit() else None


def _alive(record: Mapping[str, Any]) -> bool:
    if record.get("create_time") is None:
        return False
    try:
        proc = psutil.Process(record["pid"])
        return proc.create_time() == record["create_time"] and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _processes_in_netns(inodes: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.stat(f"/proc/{proc.pid}/ns/net").st_ino in inodes:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def _safe(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.cmdline()
            alive.append(proc)
    return alive


def _end(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds, each of ``procs`` (already matched)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, left = psutil.wait_procs(procs, timeout=grace)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=grace)


def _wait_for(
    condition: Any,
    timeout: float,
    what: str,
    log: Path | None = None,
    poll: float = 0.1,
    process: subprocess.Popen | None = None,
) -> None:
    """Wait for ``condition``; raise with ``log``'s tail on timeout or when ``process`` exits."""
    end = time.monotonic() + timeout
    while not condition():
        exited = process is not None and process.poll() is not None
        if exited or time.monotonic() > end:
            tail = ""
            if log is not None and log.exists():
                tail = (
                    "; last lines of "
                    + str(log)
                    + ":\n"
                    + "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
                )
            reason = (
                f"it exited ({process.returncode})" if exited else f"timed out after {timeout:g}s"
            )
            raise HostSetError(f"{reason} waiting for {what}{tail}")
        time.sleep(poll)


def _wait_for_port(address: str, port: int, timeout: float, what: str) -> None:
    def listening() -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((address, port)) == 0

    _wait_for(listening, timeout, what)


# ---------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.multihost.testhosts")
    parser.add_argument("--state", default=os.environ.get("FSDPI_TESTHOSTS", DEFAULT_STATE))
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="apt-get install the tools the hosts need")
    up = commands.add_parser("up", help="bring the hosts up")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--no-slurm", action="store_true")
    commands.add_parser("down", help="end everything the set started; idempotent")
    commands.add_parser("status", help="print the recorded state as JSON")
    run = commands.add_parser("run", help="run a command on a host")
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    if args.command == "install":
        install_tools()
        return 0
    hosts = HostSet(args.state)
    if args.command == "up":
        started = time.monotonic()
        hosts.up(args.hosts, slurm=not args.no_slurm)
        print(
            f"up in {time.monotonic() - started:.1f}s: "
            + ", ".join(f"{h.name}={h.address}" for h in hosts.hosts)
            + f", head={hosts.head_address}; ssh -F {hosts.ssh_config} {hosts.hosts[0].name}"
        )
    elif args.command == "down":
        print(json.dumps(hosts.down()))
    elif args.command == "status":
        print(json.dumps(hosts.status(), indent=1))
    elif args.command == "run":
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return subprocess.call(hosts.enter_command(args.host, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
