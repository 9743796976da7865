"""Engines on ssh hosts, forked on each host by one engine forker reached over one ssh.

ipyparallel's ``SSHEngineSetLauncher`` starts every engine with its own series of ssh
commands (shell and Python checks, profile creation, a copy of the connection file, the
start, a fetch) and each engine then imports torch in a fresh interpreter.
:class:`SSHForkedEngineSetLauncher` takes the same settings (``SSHEngineSetLauncher.engines``
with its per-host overrides, ``ssh_cmd``, ``ssh_args``, ``remote_python``,
``remote_profile_dir``), but runs one :mod:`._engine_forker` per host through one
``ssh`` command whose stdin and stdout carry the forker's protocol; that host's engines
(with their nannies) are forked from it as local engines are.

Contract, as for the pool's local forked engines (:mod:`._forked_launcher`):

* ``Cluster(engines=SSHForkedEngineSetLauncher)`` with ``forkers={host key: EngineForker}``
  (the pool starts the forkers before the controller, so that their imports overlap
  with it, and keeps them across restarts: :func:`plan_hosts` says which hosts get how
  many engines, :meth:`SSHHost.forker_command` how a host's forker is started);
* engines get the controller's connection info in ``$IPP_CONNECTION_INFO`` (nothing is
  copied to the hosts), the host's ``remote_profile_dir`` as their profile, and their
  place in the plan in ``$FSDPI_LAUNCH_ORDER``, which orders the ranks as the hosts are
  ordered in ``engines`` (they register in any order);
* each engine's exit status and the last of its output come over the ssh channel from
  its parent, the forker, as it ends (``stop_data["exit_code"]``, ``get_output()``), and
  its output file on the host is then removed; ``signal``, ``stop`` and ``join`` act on
  the engine through the forker;
* stopping the set stops its engines; the forkers are ended by whoever started them
  (closing one ends what it forked and removes its host's snapshot root, which it created
  as it started);
* ``start_replacement(key)`` forks one engine more on that engine's host, in its place in
  the ranks' order (a start retries an engine that ended or never registered once).

Not done: hosts without ``os.pidfd_open`` (Linux 5.3+, Python 3.9+), password prompts
(ssh runs with ``BatchMode=yes``), a forker per host for SLURM or MPI (their launchers
start every engine through the scheduler or ``mpiexec``).
"""

from __future__ import annotations

import asyncio
import copy
import posixpath
import re
import shlex
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from signal import SIGKILL, SIGTERM

from ipyparallel.cluster.launcher import EngineLauncher, SSHEngineSetLauncher
from traitlets import Dict, Integer, List, Unicode

from fsdp_interactive.pool.common._topology import LAUNCH_ORDER_ENV
from fsdp_interactive.pool.processes._engine_entry import remote_engine_command
from fsdp_interactive.pool.processes._forked_launcher import (
    REPLACEMENT_SUFFIX,
    EngineForker,
    ForkerError,
    forker_command,
)

#: Seconds ssh waits for a host to answer before giving up.
CONNECT_TIMEOUT_S = 10
#: Per-host overrides in ``SSHEngineSetLauncher.engines`` that apply here (besides ``n``);
#: ``scp_*`` are accepted and unused (nothing is copied).
HOST_SETTINGS = frozenset(
    {"remote_python", "ssh_cmd", "ssh_args", "remote_profile_dir", "scp_cmd", "scp_args"}
)
_TERMINAL_ARGS = ("-t", "-tt")


@dataclass(frozen=True)
class SSHHost:
    """One host of an ssh pool and how to reach it."""

    #: The key of ``SSHEngineSetLauncher.engines`` (``[user@]host[:port]``).
    key: str
    #: ``[user@]host`` as ssh takes it, and the port (``None``: ssh's default).
    location: str
    port: str | None
    #: Engines placed on this host.
    n: int
    python: str
    #: ``ssh_cmd + ssh_args``, without terminal allocation (the channel carries JSON).
    ssh: tuple[str, ...]
    profile_dir: str

    def forker_command(self) -> list[str]:
        """The local command that runs this host's engine forker over ssh (its setup, the
        pool's snapshot root among it, goes over the ssh channel, never on a command line)."""
        remote = shlex.join(forker_command(self.python))
        return [
            *self.ssh,
            *(["-p", self.port] if self.port else []),
            "-T",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={CONNECT_TIMEOUT_S}",
            self.location,
            "--",
            f"exec {remote}",
        ]

    @property
    def file_name(self) -> str:
        """The host key as a file-name part."""
        return re.sub(r"[^A-Za-z0-9_.-]", "_", self.key)


def plan_hosts(launcher: SSHEngineSetLauncher, n: int) -> list[SSHHost]:
    """The hosts of ``launcher.engines`` that get engines, in order, ``n`` engines in all
    (a host gets at most its count; hosts after the ``n``-th engine get none).

    Raises ``ValueError`` naming the setting for a per-host override that does not apply
    here, a count that is not a number of engines, or fewer engines in all than ``n``.
    """
    hosts: list[SSHHost] = []
    remaining = n
    placed = 0
    for key, value in launcher.engines.items():
        overrides = dict(value) if isinstance(value, Mapping) else {}
        count = overrides.pop("n", 1) if isinstance(value, Mapping) else value
        unknown = sorted(set(overrides) - HOST_SETTINGS)
        if unknown:
            raise ValueError(
                f"SSHEngineSetLauncher.engines[{key!r}] sets {', '.join(unknown)}, which the "
                f"pool's ssh engines do not take; per host they take n and "
                f"{', '.join(sorted(HOST_SETTINGS))}"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"SSHEngineSetLauncher.engines[{key!r}] must be a number of engines "
                f"(or a dict with 'n'), got {count!r}"
            )
        placed += count
        take = min(count, remaining)
        if take <= 0:
            continue
        remaining -= take
        setting = {
            name: overrides.get(name, getattr(launcher, name))
            for name in ("remote_python", "ssh_cmd", "ssh_args", "remote_profile_dir")
        }
        location, port = str(key), None
        host_part = location.split("@", 1)[-1]
        if ":" in host_part:
            name, port = host_part.rsplit(":", 1)
            location = location[: len(location) - len(host_part)] + name
        ssh = [*setting["ssh_cmd"], *(a for a in setting["ssh_args"] if a not in _TERMINAL_ARGS)]
        hosts.append(
            SSHHost(
                key=str(key),
                location=location,
                port=port,
                n=take,
                python=str(setting["remote_python"]),
                ssh=tuple(ssh),
                profile_dir=str(setting["remote_profile_dir"] or launcher.profile_dir),
            )
        )
    if remaining > 0:
        raise ValueError(
            f"SSHEngineSetLauncher.engines places {placed} engine(s) "
            f"({', '.join(map(str, launcher.engines)) or 'no hosts'}); the pool needs {n}"
        )
    return hosts


class RemoteForkedEngineLauncher(EngineLauncher):
    """One engine forked by its host's engine forker, watched through it."""

    #: Its pid names a process on another host (the pool never looks it up here).
    runs_remotely = True
    #: ``stop_data["exit_code"]`` is the engine's own status, as its parent saw it.
    reports_exit_code = True

    host = Unicode(help="the key of its host in SSHEngineSetLauncher.engines")
    remote_profile_dir = Unicode()
    output_file = Unicode(help="the engine's output file on its host")
    pid = Integer(-1)
    stop_seconds_until_kill = Integer(5, config=True)

    _forker: EngineForker | None = None
    _exited_event: threading.Event | None = None
    _output: str | None = None

    def find_args(self) -> list[str]:
        return list(self.engine_cmd) + list(self.cluster_args) + list(self.engine_args)

    @property
    def cluster_env(self) -> dict[str, str]:
        return {"IPP_CLUSTER_ID": self.cluster_id, "IPP_PROFILE_DIR": self.remote_profile_dir}

    async def start_on(self, forker: EngineForker) -> int:
        """Fork this engine on ``forker``'s host; its pid there. Its exit is reported
        through ``notify_stop``."""
        if self.state != "before":
            raise RuntimeError(f"engine {self.identifier} was already started ({self.state})")
        self.loop  # noqa: B018 - bind the launcher's IOLoop on this (the loop's) thread
        self._exited_event = threading.Event()
        try:
            pid = await forker.fork(
                list(self.args),
                self.get_env(),
                None,
                self.output_file,
                nanny=True,
                extend_env=True,
                collect_output=True,
            )
        except BaseException:
            self._exited_event = None
            raise
        self._forker = forker
        self.pid = pid
        self.notify_start({"host": self.host, "pid": pid})
        forker.on_exit(pid, self._exited)
        return pid

    def _exited(self, exit_code: int | None) -> None:
        forker = self._forker
        assert forker is not None and self._exited_event is not None
        output = forker.take_output(self.pid) or ""
        if exit_code is None:
            output += (
                f"\n[the engine forker on {self.host} ended before this engine did; its "
                f"log:]\n{forker.log_tail()}"
            )
        self._output = output
        stop_data = {
            "exit_code": exit_code,
            "pid": self.pid,
            "identifier": self.identifier,
            "host": self.host,
        }
        self.loop.add_callback(lambda: self.notify_stop(stop_data))
        self._exited_event.set()

    def signal(self, sig: int) -> None:
        if self.state == "running" and self._forker is not None:
            self._forker.signal(self.pid, int(sig))

    async def join(self, timeout: float | None = None) -> None:
        """Wait for the engine to exit; ``TimeoutError`` after ``timeout`` seconds."""
        event = self._exited_event
        if event is None:
            return
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not event.is_set():
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError(
                    f"engine pid {self.pid} on {self.host} did not exit in {timeout} seconds"
                )
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_seconds_until_kill``; returns once it ended."""
        self.signal(SIGTERM)
        try:
            await self.join(self.stop_seconds_until_kill)
            return
        except TimeoutError:
            self.log.warning("engine pid %s on %s ignored SIGTERM", self.pid, self.host)
        self.signal(SIGKILL)
        await self.join(self.stop_timeout)

    def poll(self) -> int | None:
        if self.state != "after":
            return None
        return (self.stop_data or {}).get("exit_code")

    def get_output(self, remove: bool = False) -> str:
        """The engine's last output, as its forker sent it when the engine ended ("" before)."""
        return self._output or ""


class SSHForkedEngineSetLauncher(SSHEngineSetLauncher):
    """ipyparallel's ssh engine set, its engines forked on each host by one forker.

    ``forkers``: the running :class:`EngineForker` of every host that gets engines, by
    host key; ``hosts``: the plan they were started for (:func:`plan_hosts`; made here
    when not given).
    """

    launcher_class = RemoteForkedEngineLauncher
    forkers = Dict(help="host key -> the EngineForker running on that host")
    hosts = List(help="the SSHHost plan of this set (plan_hosts)")
    #: Engine key -> (its host, its place in the ranks' order, its name in file names).
    _placed = Dict()
    #: Every engine launcher this set made, by key, ended ones too (``launchers`` forgets
    #: an engine as it ends, possibly before anyone looked at it).
    made = Dict()

    async def start(self, n: int) -> list[str]:  # type: ignore[override]
        """Fork ``n`` engines on the hosts; their keys (``host/index``)."""
        hosts = list(self.hosts) or plan_hosts(self, n)
        missing = [
            h.key for h in hosts if h.key not in self.forkers or not self.forkers[h.key].running()
        ]
        if missing:
            raise ForkerError(f"no running engine forker for the host(s) {', '.join(missing)}")
        started = []
        for host in hosts:
            for i in range(host.n):
                # Forked on all hosts at once, the engines register in any order: the
                # ranks follow this one (the hosts' order in the engines setting).
                engine = self._new_launcher(f"{host.key}/{i}", host, len(started), str(i))
                started.append(engine.start_on(self.forkers[host.key]))
        self.n = len(started)
        await asyncio.gather(*started)
        keys = list(self.launchers)
        self.notify_start(keys)
        return keys

    async def start_replacement(self, identifier: str) -> tuple[str, int]:
        """Fork one more engine on the host of engine ``identifier``, in its place in the
        ranks' order (it ended, or the caller gave up on it and ends it); ``(its key, its
        pid there)``."""
        host, order, name = self._placed[identifier]
        forker = self.forkers.get(host.key)
        if forker is None or not forker.running():
            raise ForkerError(f"no running engine forker for the host {host.key}")
        suffixed = f"{name}{REPLACEMENT_SUFFIX}"
        engine = self._new_launcher(f"{host.key}/{suffixed}", host, order, suffixed)
        return engine.identifier, await engine.start_on(forker)

    def _new_launcher(
        self, key: str, host: SSHHost, order: int, name: str
    ) -> RemoteForkedEngineLauncher:
        """The launcher of engine ``key`` on ``host``, ``order``-th in the ranks' order
        (``name``: its part of the output file's name)."""
        self._placed[key] = (host, order, name)
        environment = {**copy.deepcopy(self.environment), LAUNCH_ORDER_ENV: str(order)}
        engine = self.launchers[key] = RemoteForkedEngineLauncher(
            parent=self,
            log=self.log,
            profile_dir=self.profile_dir,
            cluster_id=self.cluster_id,
            engine_set_id=self.engine_set_id,
            environment=environment,
            identifier=key,
            host=host.key,
            remote_profile_dir=host.profile_dir,
            output_file=posixpath.join(
                host.profile_dir,
                "log",
                f"ipengine-{self.cluster_id}-{self.engine_set_id}-{host.file_name}-{name}.log",
            ),
        )
        engine.engine_cmd = remote_engine_command(host.python)
        engine.engine_args = copy.deepcopy(self.engine_args)
        engine.on_stop(self._notice_engine_stopped)
        self.made[key] = engine
        return engine

    def find_args(self) -> list[str]:
        return ["engine forkers over ssh"]
