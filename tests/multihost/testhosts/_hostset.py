"""A set of simulated hosts described by a state directory: bringing it up and down."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from fsdp_interactive.pool.processes._pids import start_time
from tests.multihost.testhosts._services import HostServices
from tests.multihost.testhosts._system import (
    HEAD_HOST,
    LOCK,
    NETNS_PREFIX,
    TERM_GRACE_S,
    HostSetError,
    alive,
    end,
    ip,
    netns_names,
    netns_sysctl,
    processes_in_netns,
    safe,
    slot_of,
    write_sysctl,
)
from tests.multihost.testhosts._tools import missing_tools


@dataclass(frozen=True)
class Host:
    """One simulated host: its name (hostname and ssh/SLURM name), address, namespace."""

    name: str
    address: str
    netns: str
    #: pid of the process that holds the host's UTS and mount namespaces
    holder_pid: int


class HostSet(HostServices):
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
    def head_link(self) -> str:
        """The network interface, in this machine's own namespace, that joins it to the
        hosts: everything between the kernel and the hosts crosses it (a capture point)."""
        return self._state["head_link"]

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
            p["name"]: p["pid"] for p in self._state.get("processes", []) if alive(p)
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
        own_pids = {p["pid"] for p in self._state.get("processes", []) if alive(p)}
        # slurmctld's helper (slurmscriptd) belongs to it; jobs run under slurmd instead.
        for record in self._state.get("processes", []):
            if record["name"].startswith("slurmctld") and alive(record):
                with contextlib.suppress(psutil.Error):
                    own_pids.update(c.pid for c in psutil.Process(record["pid"]).children())
        found = []
        for proc in processes_in_netns({inode}):
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
            step = "giving each host its own /dev/shm"
            for entry in self._state["hosts"]:
                self.private_dir(entry["name"], "/dev/shm")
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
        os.makedirs(os.path.dirname(LOCK), exist_ok=True)
        with open(LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = {slot_of(name) for name in netns_names()}
            free = [n for n in range(256) if n not in used]
            if not free:
                raise HostSetError("all 256 host-set subnets of 198.18.0.0/16 are in use")
            slot = free[0]
            prefix = f"198.18.{slot}"
            self._state = {
                "phase": "starting",
                "slot": slot,
                "subnet": f"{prefix}.0/24",
                "head_address": f"{prefix}.{HEAD_HOST}",
                "unused_address": f"{prefix}.{100}",
                "head_link": f"{NETNS_PREFIX}{slot}h",
                "switch_netns": f"{NETNS_PREFIX}{slot}-sw",
                "hosts": [
                    {
                        "name": f"host{chr(ord('a') + i)}",
                        "address": f"{prefix}.{i + 1}",
                        "netns": f"{NETNS_PREFIX}{slot}-{chr(ord('a') + i)}",
                    }
                    for i in range(n_hosts)
                ],
                "netns": [],
                "processes": [],
            }
            # The switch's name claims the slot for others as soon as the lock is released.
            self._state["netns"].append(self._state["switch_netns"])
            self._save()
            ip("netns", "add", self._state["switch_netns"])

    def _make_network(self) -> None:
        switch = self._state["switch_netns"]
        ip("-n", switch, "link", "set", "lo", "up")
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        netns_sysctl(switch, "net.ipv6.conf.all.disable_ipv6=1")
        netns_sysctl(switch, "net.ipv6.conf.default.disable_ipv6=1")
        ip("-n", switch, "link", "set", "br0", "up")
        for index, entry in enumerate(self._state["hosts"]):
            netns = entry["netns"]
            self._state["netns"].append(netns)
            self._save()
            ip("netns", "add", netns)
            netns_sysctl(netns, "net.ipv6.conf.all.disable_ipv6=1")
            netns_sysctl(netns, "net.ipv6.conf.default.disable_ipv6=1")
            port = f"p{index}"
            ip(
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
            ip("-n", switch, "link", "set", port, "master", "br0", "up")
            ip("-n", netns, "link", "set", "lo", "up")
            ip("-n", netns, "addr", "add", f"{entry['address']}/24", "dev", "eth0")
            ip("-n", netns, "link", "set", "eth0", "up")
            entry["net_inode"] = os.stat(f"/run/netns/{netns}").st_ino
        # The head's end lives in this machine's own namespace: only the subnet's route
        # comes with its address, no default route changes.
        head = self._state["head_link"]
        ip("link", "add", head, "type", "veth", "peer", "name", "head", "netns", switch)
        write_sysctl(f"net/ipv6/conf/{head}/disable_ipv6", "1")
        ip("-n", switch, "link", "set", "head", "master", "br0", "up")
        ip("addr", "add", f"{self.head_address}/24", "dev", head)
        ip("link", "set", head, "up")
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
        created = start_time(proc.pid)
        self._state["processes"].append({"name": name, "pid": proc.pid, "start_time": created})
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
            alive(p) for p in self._state["processes"] if p["name"].startswith("slurmctld")
        ):
            with contextlib.suppress(Exception):
                subprocess.run(
                    ["scancel", "--full", f"--partition={self.slurm_partition}"],
                    env=dict(os.environ, **self.slurm_env),
                    timeout=10,
                    capture_output=True,
                )
        recorded = [p for p in self._state.get("processes", []) if alive(p)]
        report["recorded"] = [f"{p['name']}:{p['pid']}" for p in recorded]
        end(
            [psutil.Process(p["pid"]) for p in reversed(recorded) if alive(p)],
            grace=TERM_GRACE_S,
        )
        inodes = {h["net_inode"] for h in self._state.get("hosts", []) if "net_inode" in h}
        for name in self._state.get("netns", []):
            with contextlib.suppress(OSError):
                inodes.add(os.stat(f"/run/netns/{name}").st_ino)
        strays = processes_in_netns(inodes) if inodes else []
        report["on_hosts"] = [f"{' '.join(p.cmdline()[:3])}:{p.pid}" for p in safe(strays)]
        end(strays, grace=TERM_GRACE_S)
        head = self._state.get("head_link")
        if head and os.path.exists(f"/sys/class/net/{head}"):
            ip("link", "del", head, check=False)
        for name in reversed(self._state.get("netns", [])):
            if os.path.exists(f"/run/netns/{name}"):
                ip("netns", "del", name, check=False)
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
