"""How a pool's engines start: one class per way, picked from one table.

A pool's ``engines`` names one of ipyparallel's engine set launchers (``"local"``,
``"ssh"``, ``"slurm"``, ``"mpi"``, ... or a launcher class). For some of them the pool has
a way of its own, listed in :data:`STARTS` by the name it serves:

* ``"local"``: :class:`ForkedHere`, engines forked from one process on this host that
  imports torch while the controller starts (:mod:`._forked_launcher`);
* ``"ssh"``: :class:`ForkedOverSSH`, the same on every ssh host, one forker per host
  reached by one ssh command, started before the controller; the hosts' versions are
  checked meanwhile and nothing is forked before the answer (:mod:`._ssh_forked_launcher`).

Any other name, a way that does not apply (forking unsupported here, a ``config`` that
sets that launcher's own ``engine_cmd``), or a cluster setting that picks the engine
launcher itself, gets :class:`IpyparallelLauncher`: ipyparallel's launcher, its engine
command run under :mod:`fsdp_interactive._engine_parent` (which reports how each engine
ended), and for ``"ssh"`` the hosts' versions checked before anything starts.

:func:`choose` picks the way; :meth:`LaunchedProcesses.launch
<._launched.LaunchedProcesses.launch>` calls its steps in order around the controller's
start (:class:`EngineStart`). Adding a launcher is one :class:`EngineStart` subclass and
one row of :data:`STARTS`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

from fsdp_interactive import _engine_parent
from fsdp_interactive.pool.common import _socket_folder
from fsdp_interactive.pool.errors import PoolStartError
from fsdp_interactive.pool.processes import _ssh_check
from fsdp_interactive.pool.processes._engine_entry import engine_command
from fsdp_interactive.pool.processes._forked_launcher import (
    ForkedEngineSetLauncher,
    forking_supported,
)
from fsdp_interactive.pool.processes._host_forkers import HostForkers
from fsdp_interactive.pool.processes._ssh_forked_launcher import (
    SSHForkedEngineSetLauncher,
    plan_hosts,
)

log = logging.getLogger(__name__)

#: Cluster settings that choose the engine launcher themselves: the pool's ways are not used.
_LAUNCHER_SETTINGS = frozenset({"send_engines_connection_env", "engine_launcher_class"})


@dataclass
class Launch:
    """What one cluster's start gives the way its engines start."""

    #: The ``ipyparallel.Cluster`` being started (its controller not yet up).
    cluster: Any
    #: How many engines to start.
    n: int
    #: The cluster's private log folder (engines', forkers' logs).
    log_dir: str
    #: The pool's engine forkers, one per host, kept from one group to the next.
    forkers: HostForkers
    #: The pool's private socket folder when the channels are unix sockets, else ``None``.
    socket_folder: str | None
    #: Seconds the start may take.
    timeout: float


def configures_engine_command(config: Any, sections: tuple[str, ...]) -> bool:
    """Whether an ipyparallel ``config`` sets ``engine_cmd`` in one of ``sections`` (then
    that launcher runs its command unchanged)."""
    if not config:
        return False
    return any("engine_cmd" in config.get(section, {}) for section in sections)


class EngineStart:
    """One way of starting a pool's engines.

    ``launcher``: what ``ipyparallel.Cluster(engines=...)`` is given. The pool calls, in
    order: :meth:`cluster_settings` (the cluster's settings, before it is made),
    :meth:`check` (before anything starts), :meth:`before_controller` (what starts while
    the controller does; the settings ``cluster.start_engines`` gets),
    :meth:`after_controller` (once the controller is up, before the engines start).
    """

    #: The ipyparallel config sections whose ``engine_cmd`` a user's config may set: a
    #: config that does keeps ipyparallel's launcher (:class:`IpyparallelLauncher`).
    command_sections: ClassVar[tuple[str, ...]] = ()
    #: The engines are forked by the pool's engine forkers (which outlive a group).
    forked: ClassVar[bool] = False
    #: The engines are forked on this host (the channels may be unix sockets).
    forked_here: ClassVar[bool] = False

    def __init__(self, engines: Any, config: Any) -> None:
        self.engines = engines
        self.config = config

    @classmethod
    def applies(cls, engines: Any, config: Any) -> bool:
        """Whether this way can start ``engines`` under ``config``."""
        return not configures_engine_command(config, cls.command_sections)

    @property
    def launcher(self) -> Any:
        raise NotImplementedError

    def cluster_settings(self, kwargs: MutableMapping[str, Any]) -> None:
        """Add the settings this way needs to the cluster's ``kwargs``."""

    def check(self) -> None:
        """Refuse (:class:`PoolStartError`) to start, before anything starts."""

    async def before_controller(self, launch: Launch) -> dict[str, Any]:
        """Start what runs beside the controller's start; the keyword arguments of
        ``cluster.start_engines``."""
        return {}

    async def after_controller(self, launch: Launch, engine_kwargs: dict[str, Any]) -> None:
        """The controller is up: complete ``engine_kwargs``, wait for what must be known
        before an engine starts."""

    def describe(self, forkers: HostForkers) -> str:
        """How the engines were started, for the log."""
        if self.forked:
            return f"forked by {forkers.describe()}"
        return f"launcher {self.engines!r}"


class ForkedHere(EngineStart):
    """Engines forked on this host by one forker that imports torch while the controller
    starts; each engine waits for the controller's connection file itself
    (:mod:`._engine_entry`)."""

    command_sections = ("LocalEngineSetLauncher", "LocalEngineLauncher", "EngineLauncher")
    forked = True
    forked_here = True
    launcher = ForkedEngineSetLauncher

    @classmethod
    def applies(cls, engines: Any, config: Any) -> bool:
        # Spelled as written: the channels' one-host rule reads the name so (._channels).
        return engines == "local" and forking_supported() and super().applies(engines, config)

    def cluster_settings(self, kwargs: MutableMapping[str, Any]) -> None:
        # The engines read the connection file themselves, once the controller wrote it.
        kwargs["send_engines_connection_env"] = False

    async def before_controller(self, launch: Launch) -> dict[str, Any]:
        engine_kwargs: dict[str, Any] = {
            "forker": launch.forkers.local(launch.log_dir, str(launch.cluster.cluster_id)),
            "log_dir": launch.log_dir,
        }
        if launch.socket_folder:
            engine_kwargs["environment"] = {_socket_folder.ENV_VAR: launch.socket_folder}
        return engine_kwargs

    async def after_controller(self, launch: Launch, engine_kwargs: dict[str, Any]) -> None:
        connection_file = launch.cluster.controller.connection_files["engine"]
        engine_kwargs["engine_cmd"] = engine_command(connection_file, launch.timeout)


class ForkedOverSSH(EngineStart):
    """Engines forked on every ssh host by one forker per host, each reached by one ssh
    command and started before the controller; the hosts' versions are checked while
    the forkers import and the controller starts, and nothing is forked before the
    answer."""

    command_sections = ("SSHEngineSetLauncher", "SSHEngineLauncher", "EngineLauncher")
    forked = True
    launcher = SSHForkedEngineSetLauncher

    def __init__(self, engines: Any, config: Any) -> None:
        super().__init__(engines, config)
        self._checked: asyncio.Future[None] | None = None

    async def before_controller(self, launch: Launch) -> dict[str, Any]:
        hosts = _plan(launch)
        forkers, started = launch.forkers.on_ssh_hosts(
            hosts, launch.log_dir, str(launch.cluster.cluster_id)
        )
        self._checked = asyncio.get_running_loop().run_in_executor(
            None, check_ssh_hosts, self.config, started
        )
        return {"hosts": hosts, "forkers": forkers}

    async def after_controller(self, launch: Launch, engine_kwargs: dict[str, Any]) -> None:
        if self._checked is not None:
            await self._checked


class IpyparallelLauncher(EngineStart):
    """ipyparallel's own launcher named ``engines``, its engine command run under
    :mod:`fsdp_interactive._engine_parent` (``"local"`` and launcher classes unchanged);
    an ssh pool's hosts are checked before anything starts."""

    @property
    def launcher(self) -> Any:
        if isinstance(self.engines, str) and self.engines != "local":
            return _with_engine_parent(self.engines)
        return self.engines

    def check(self) -> None:
        if _kind(self.engines) == "ssh":
            check_ssh_hosts(self.config)


#: The pool's own ways of starting engines, by the ``engines`` name they serve (matched
#: as ipyparallel matches launcher names, in any case).
STARTS: dict[str, type[EngineStart]] = {
    "local": ForkedHere,
    "ssh": ForkedOverSSH,
}


def choose(engines: Any, cluster_kwargs: Mapping[str, Any]) -> EngineStart:
    """The way a cluster made with ``cluster_kwargs`` starts ``engines``: the row of
    :data:`STARTS` it names when that way applies, else ipyparallel's launcher."""
    config = cluster_kwargs.get("config")
    way = STARTS.get(_kind(engines) or "")
    own_launcher = not _LAUNCHER_SETTINGS & set(cluster_kwargs)
    if way is not None and own_launcher and way.applies(engines, config):
        return way(engines, config)
    return IpyparallelLauncher(engines, config)


def _kind(engines: Any) -> str | None:
    return engines.lower() if isinstance(engines, str) else None


def check_ssh_hosts(config: Any, only: set[str] | None = None) -> None:
    """Refuse (:class:`PoolStartError`) ssh hosts that do not answer with our versions
    (``only``: those of these host keys)."""
    if only is not None and not only:
        return
    began = time.monotonic()
    try:
        _ssh_check.check_hosts(config, only)
    except RuntimeError as exc:
        raise PoolStartError(str(exc)) from None
    log.debug("ssh hosts checked in %.2fs", time.monotonic() - began)


def _plan(launch: Launch) -> list[Any]:
    """Which ssh hosts get how many of the engines, from the same settings the cluster's
    :class:`SSHForkedEngineSetLauncher` will read."""
    cluster = launch.cluster
    planner = SSHForkedEngineSetLauncher(
        parent=cluster, profile_dir=cluster.profile_dir, cluster_id=cluster.cluster_id
    )
    try:
        return plan_hosts(planner, launch.n)
    except ValueError as exc:
        raise PoolStartError(str(exc)) from None


def _with_engine_parent(engines: str) -> Any:
    """ipyparallel's engine set launcher named ``engines``, its engines run under
    :mod:`fsdp_interactive._engine_parent` (which reports how each ended), under the same
    class name (so the configuration of that name and of its bases applies unchanged)."""
    from ipyparallel.cluster.launcher import find_launcher_class

    try:
        base = find_launcher_class(engines, "engine")
    except (KeyError, ValueError, ImportError):
        return engines  # a launcher named by its import path: ipyparallel resolves it

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self.engine_cmd = _engine_parent.wrap(list(self.engine_cmd))

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})
