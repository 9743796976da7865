"""The services every simulated host runs: sshd on its address, and SLURM (munged,
slurmctld on the first host, one slurmd each).

:class:`HostServices` is part of :class:`~._hostset.HostSet`; it writes each service's
configuration under the set's state directory and starts it inside the host's
namespaces through the set's recorded spawning."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.multihost.testhosts._system import (
    RUNTIME_ROOT,
    keygen,
    quiet,
    wait_for,
    wait_for_port,
)
from tests.multihost.testhosts._tools import SFTP_SERVER


class HostServices:
    """sshd and SLURM on the hosts of a :class:`~._hostset.HostSet`."""

    def _start_sshd(self) -> None:
        ssh_dir = self.state_dir / "ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        key = ssh_dir / "id_ed25519"
        keygen(key, "fsdpi-testhosts")
        (ssh_dir / "authorized_keys").write_text((ssh_dir / "id_ed25519.pub").read_text())
        # sshd refuses to start without its privilege separation directory.
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        known = []
        for entry in self._state["hosts"]:
            directory = self._host_files(entry)
            host_key = directory / "ssh_host_ed25519_key"
            keygen(host_key, entry["name"])
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
            quiet(["/usr/sbin/sshd", "-t", "-f", str(sshd_config)])
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
            wait_for_port(entry["address"], 22, timeout=10, what=f"sshd on {entry['name']}")

    def _start_slurm(self) -> None:
        # munged wants every directory above its socket searchable by all (a pytest
        # temporary directory is not), so its files live under /run.
        munge = Path(RUNTIME_ROOT) / f"{self._state['slot']}-munge"
        self._state["runtime_dirs"] = [str(munge)]
        self._save()
        os.makedirs(RUNTIME_ROOT, mode=0o755, exist_ok=True)
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
        wait_for(
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

        wait_for(all_idle, 60, "every slurmd to report idle", log=slurm / "slurmctld.log")
