"""The processes a pool starts, and the one object that owns and ends them.

:class:`LaunchedProcesses` starts an ipyparallel cluster (controller and engines) on a
private event loop (:mod:`._loop`), records every process it started by pid *and* start
time (controller, engines, their nannies, the engine forker), keeps the orphan reaper
(:mod:`._reaper`) informed, and ends all of them on :meth:`~LaunchedProcesses.stop`.

Start-up: how the engines start is :mod:`._engine_starts`' choice, one way per launcher
name. Local engines are forked from one process that imports torch while the controller
starts (:mod:`._forked_launcher`, :mod:`._engine_forker`); they wait for the
controller's connection file themselves (:mod:`._engine_entry`), so controller, torch
import and engine start-up overlap instead of following each other. ``engines="ssh"``
does the same on every host: one forker per host, started over one ssh command before
the controller, forks that host's engines once the controller is up
(:mod:`._ssh_forked_launcher`); the hosts' versions are checked meanwhile
(:mod:`._ssh_check`), and nothing is forked on a refusal. A restart, and the teardown
of a group that lost a rank, keep the forkers; :meth:`LaunchedProcesses.stop` ends
them, and each removes the pool's snapshot root on its host
(:mod:`fsdp_interactive.pool.common._snapshot_root`; the kernel's host's root is also
removed here and by the orphan reaper). The SLURM, MPI and other launchers are
ipyparallel's own, their engine command run under :mod:`fsdp_interactive._engine_parent`
(which reports each engine's exit status, on whatever host it runs); a ``config`` that
sets the local or ssh engine command gets ipyparallel's launcher unchanged. Remote
engines' pids are never taken for local processes: they are not recorded, and the
launcher (or the parent's report) tells whether they run.

Each engine is asked about through its launcher (:class:`EngineProcess`): whether it
runs, its exit status, the last lines of its output, and signals go through it too.
The rest of the pool asks only these calls (finding a rank's engine by the pid the
rank reported), so launchers of engines on other hosts can answer through them.

Not done: starting or stopping single engines; engines of a cluster the pool connected
to (it never owns those).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from fsdp_interactive import _controller_entry, _engine_parent, _private_files
from fsdp_interactive.pool.common import _snapshot_root, _socket_folder
from fsdp_interactive.pool.errors import PoolStartError
from fsdp_interactive.pool.processes import _channels, _engine_starts, _launch_watch
from fsdp_interactive.pool.processes._channels import Channels
from fsdp_interactive.pool.processes._engine_report import EngineReport, engine_report
from fsdp_interactive.pool.processes._host_forkers import HostForkers
from fsdp_interactive.pool.processes._loop import LoopThread
from fsdp_interactive.pool.processes._pids import end_processes, is_running, start_time
from fsdp_interactive.pool.processes._reaper import start_reaper, write_pid_file

log = logging.getLogger(__name__)

_POLL_S = 0.05
#: How long to wait for a launcher to report that its process ended (exit code, output).
_STOP_REPORT_WAIT_S = 3.0
_LOG_TAIL_LINES = 20
_STOP_TIMEOUT_S = 60.0
_REAP_GRACE_S = 10.0
#: Seconds the launchers get to stop the engines of a group that lost a rank.
BROKEN_STOP_TIMEOUT_S = 15.0

# Results are never fetched again from the controller: it need not keep them. The
# controller completes an engine's registration at the first heartbeat after the
# engine's heart answered one, so start-up waits one to two heartbeat periods: 0.1 s
# each (a ping every 0.1 s is one small message per engine, answered by the engine's
# heart thread outside the interpreter). Allowing 300 missed beats (30 s) keeps a busy
# engine from being declared dead by the heart monitor; an engine's death is reported
# by its nanny at once anyway.
_CONTROLLER_ARGS = [
    "--nodb",
    "--HeartMonitor.period=100",
    "--HeartMonitor.max_heartmonitor_misses=300",
]


@dataclass(frozen=True)
class EngineProcess:
    """One engine process, asked about through the ipyparallel launcher that started it.

    ``created``: its start time as recorded when the pool saw it (``None`` when it had
    already ended by then, or runs on another host).
    """

    launcher: Any
    created: float | None
    #: The pid the rank reported, when the launcher started the engine's parent
    #: (:mod:`fsdp_interactive._engine_parent`) rather than the engine itself.
    rank_pid: int | None = None
    #: The launcher started every engine at once (``mpiexec``, a batch job): it knows
    #: about the whole set only, and its output holds every engine's.
    shared: bool = False

    @property
    def pid(self) -> int:
        return int(self.launcher.pid)

    def alive(self) -> bool:
        """Whether the engine still runs: its launcher has not seen it end, and the
        process the launcher started here, named by its recorded ``(pid, start time)``,
        still runs (a reused pid is another process)."""
        if self.launcher.state == "after":
            return False
        if is_remote(self.launcher) or self.shared:
            return True  # its pid names a process on another host: the launcher knows
        return is_running(self.pid, self.created)

    def wait_stop_report(self, timeout: float = _STOP_REPORT_WAIT_S) -> bool:
        """Wait up to ``timeout`` seconds for the launcher to report the end; whether it did.

        The launcher learns of an exit on its event loop thread, shortly after it happens.
        """
        end = time.monotonic() + timeout
        while self.launcher.state != "after" and time.monotonic() < end:
            time.sleep(_POLL_S)
        return self.launcher.state == "after"

    def exit_code(self) -> int | None:
        """The exit status (negative: killed by that signal); ``None`` if unknown.

        A forked engine's status is the one its forker (its parent, on its host) reported.
        Another remote engine's is the one its parent reported in its output
        (:mod:`fsdp_interactive._engine_parent`): ipyparallel's ssh launcher's own status
        is -1 for any end.
        """
        if self.shared:
            return self._reported_exit()
        self.wait_stop_report()
        if is_remote(self.launcher) and not getattr(self.launcher, "reports_exit_code", False):
            return _engine_parent.parse_exit(self.output_tail(), pid=self.rank_pid)
        code = (self.launcher.stop_data or {}).get("exit_code")
        return int(code) if isinstance(code, int) else None

    def _reported_exit(self, timeout: float = _STOP_REPORT_WAIT_S) -> int | None:
        """The status this engine's parent wrote into the set's output, waiting up to
        ``timeout`` seconds for it to appear (``None``: it never did)."""
        end = time.monotonic() + timeout
        while True:
            code = _engine_parent.parse_exit(self._text(), pid=self.rank_pid)
            if code is not None or time.monotonic() > end:
                return code
            time.sleep(_POLL_S * 4)

    def _text(self) -> str:
        path = getattr(self.launcher, "output_file", "")
        if path and not is_remote(self.launcher):
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                return f.read()
        return ""

    def output(self) -> str:
        """The engine's whole output (its log file, or what its launcher kept; "" when
        neither can be read).

        A local launcher reads and removes the file when it notices the exit, so the file
        may already be gone.
        """
        text = ""
        path = getattr(self.launcher, "output_file", "")
        if is_remote(self.launcher):
            path = ""  # a local name of the remote file: ask the launcher (it copies it here)
        if path:
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                text = f.read()
        if not text:
            self.wait_stop_report()
            with contextlib.suppress(Exception):
                text = self.launcher.get_output() or ""
        return text

    def output_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines of the engine's output (:meth:`output`). A crash report of
        faulthandler ("Fatal Python error", after a segfault or abort) is kept from its
        first line.
        """
        all_lines = self.output().splitlines(keepends=True)
        fatal = [i for i, line in enumerate(all_lines) if line.startswith("Fatal Python error")]
        if fatal:
            return "".join(all_lines[fatal[-1] : fatal[-1] + 3 * lines])
        return "".join(all_lines[-lines:])

    def signal(self, sig: int) -> None:
        """Signal the engine through its launcher; a process that ended is ignored.
        Engines of a shared launcher cannot be signalled one by one: nothing is done."""
        if self.shared:
            return
        with contextlib.suppress(Exception):
            self.launcher.signal(sig)


class LaunchedProcesses:
    """Every process one pool started, across restarts, and how to end them.

    ``pids`` maps each recorded pid to its start time (the pool's ``launched_pids``).
    ``log_level``: the level the orphan reaper logs its decisions at (``None``: it
    logs nothing), into ``reaper-<cluster id>.log`` next to the engines' logs.
    ``snapshot_root``: the pool's snapshot root (the same path on every host), handed to
    every engine forker and removed on every host when the pool stops.
    ``insecure_network``: a pool that cannot keep its channels from others may start
    (:mod:`._channels`). ``socket_folder``: the pool's private socket folder on this host
    (made at the first one-host launch, kept across restarts, removed by :meth:`stop`);
    ``channels``: those of the current cluster.
    """

    def __init__(
        self,
        *,
        log_level: int | None = None,
        snapshot_root: str | None = None,
        insecure_network: bool = False,
    ) -> None:
        self.pids: dict[int, float] = {}
        self.log_level = log_level
        self.snapshot_root = snapshot_root
        self.insecure_network = insecure_network
        self.socket_folder: str | None = None
        self.channels: Channels | None = None
        self.cluster: Any = None
        self._loop: LoopThread | None = None
        self._launchers: dict[int, Any] = {}
        self._aliases: dict[int, int] = {}  # a rank's pid -> its parent's (the launcher's)
        self._retired: set[int] = set()  # launchers (by id) of engines given up on, replaced
        self._forkers = HostForkers(snapshot_root)
        self._reaper: Any = None
        self._state_dir: str | None = None  # the reaper's pid file; lives until stop()

    # ------------------------------------------------------------------ starting

    def launch(
        self,
        n: int,
        *,
        engines: str,
        cluster_kwargs: Mapping[str, Any],
        timeout: float,
        on_controller_up: Callable[[float], None] | None = None,
    ) -> Any:
        """Start a controller and ``n`` engines; return a connected ``ipyparallel.Client``.

        The engines may not have registered yet. ``on_controller_up(seconds)`` is called
        on the calling thread once the controller is up. Raises :class:`PoolStartError`
        when the cluster does not start; :meth:`stop` then ends what did start.
        """
        import ipyparallel as ipp

        self._loop = LoopThread()
        kwargs = dict(cluster_kwargs)
        kwargs.setdefault("log_level", logging.ERROR)
        # The pool stops its cluster at exit itself (engines first, on its own loop).
        kwargs.setdefault("shutdown_atexit", False)
        kwargs.setdefault("controller_args", list(_CONTROLLER_ARGS))
        kwargs.setdefault("engine_timeout", int(timeout))
        way = _engine_starts.choose(engines, kwargs)
        way.cluster_settings(kwargs)
        way.check()
        controller_up: list[float] = []  # seconds it took, once it is up

        async def start() -> None:
            began = time.monotonic()
            self.cluster = ipp.Cluster(n=n, engines=way.launcher, **kwargs)
            channels = self.channels = self._choose_channels(engines, way.forked_here, kwargs)
            log.debug("channels: %s", channels.describe())
            log_dir = self._log_dir()
            self._private_cluster_file(log_dir)
            launch = _engine_starts.Launch(
                cluster=self.cluster,
                n=n,
                log_dir=log_dir,
                forkers=self._forkers,
                socket_folder=self.socket_folder if channels.ipc else None,
                timeout=timeout,
            )
            # The forkers' imports are the longest step: they start first.
            engine_kwargs = await way.before_controller(launch)
            await self.cluster.start_controller(**self._controller_kwargs(channels, log_dir))
            controller_up.append(time.monotonic() - began)
            log.debug("controller up in %.2fs", controller_up[0])
            await way.after_controller(launch, engine_kwargs)
            began = time.monotonic()
            await self.cluster.start_engines(n, **engine_kwargs)
            how = way.describe(self._forkers)
            log.debug("%d engines started (%s) in %.2fs", n, how, time.monotonic() - began)

        try:
            self._loop.run(start, timeout=timeout, poll=_call_once(controller_up, on_controller_up))
        except PoolStartError:
            raise  # says what to fix already
        except Exception as exc:
            raise PoolStartError(f"could not launch the cluster: {exc}") from exc
        finally:
            self.record()
        return self.connect_client(timeout)

    def connect_client(self, timeout: float) -> Any:
        """A new ``ipyparallel.Client`` of the current cluster: its connection reply names
        every engine registered by then (raises ``TimeoutError`` after ``timeout`` s)."""
        assert self._loop is not None and self.cluster is not None, "nothing was launched"
        cluster = self.cluster
        return self._loop.run(lambda: cluster.connect_client(timeout=timeout), timeout=timeout)

    def _choose_channels(self, engines: Any, forked: bool, kwargs: Mapping[str, Any]) -> Channels:
        """The cluster's channels (:mod:`._channels`); makes the socket folder they need."""
        from ipyparallel.cluster.launcher import LocalControllerLauncher

        local = isinstance(self.cluster.controller_launcher_class, type) and issubclass(
            self.cluster.controller_launcher_class, LocalControllerLauncher
        )
        channels = _channels.choose(
            engines=engines,
            forked=forked,
            controller_ip=kwargs.get("controller_ip"),
            local_controller=local,
            insecure_network=self.insecure_network,
        )
        if channels.ipc and self.socket_folder is None:
            try:
                self.socket_folder = _socket_folder.make_folder()
            except OSError as exc:
                raise PoolStartError(str(exc)) from None
        return channels

    def _controller_kwargs(self, channels: Channels, log_dir: str) -> dict[str, Any]:
        """What the controller launcher is made with: this package's controller entry, its
        settings in its environment (:mod:`._controller_entry`), its log in ``log_dir``;
        nothing for a controller launcher a config chose."""
        if not channels.configurable:
            return {}
        output = os.path.join(log_dir, f"ipcontroller-{self.cluster.cluster_id}.log")
        os.close(_private_files.open_log(output))
        return {
            "controller_cmd": _controller_entry.controller_command(),
            "environment": _controller_entry.settings_env(
                ipc=self.socket_folder if channels.ipc else None,
                curve=channels.curve,
                log_dir=log_dir,
            ),
            "output_file": output,
        }

    def _private_cluster_file(self, log_dir: str) -> None:
        """ipyparallel's cluster file in the private ``log_dir``, made mode 0600 before
        ipyparallel writes it (it keeps the mode of a file that exists)."""
        path = os.path.join(log_dir, f"cluster-{self.cluster.cluster_id}.json")
        os.close(_private_files.open_log(path))
        self.cluster.cluster_file = path

    @property
    def forkers(self) -> HostForkers:
        """The engine forkers, one per host, kept from one group to the next."""
        return self._forkers

    def _log_dir(self) -> str:
        """The cluster's private log folder, ``<profile>/log/fsdpi-<cluster id>`` (mode
        0700, made here): the controller's, the engines', the forkers' and the reaper's
        logs and ipyparallel's cluster file, each mode 0600."""
        log_dir = os.path.join(self.cluster.profile_dir, "log")
        os.makedirs(log_dir, exist_ok=True)
        folder = os.path.join(log_dir, f"fsdpi-{self.cluster.cluster_id}")
        try:
            _private_files.make_private_folder(folder, exist_ok=True)
        except _private_files.NotPrivateError as exc:
            raise PoolStartError(f"refusing the pool's log folder: {exc}") from None
        return folder

    def record(self) -> None:
        """Remember pids (with start time) of controller, engines, nannies and forkers
        (an ssh host's forker by its local ssh client), and keep the orphan reaper's list
        current (starting the reaper once)."""
        cluster = self.cluster
        found: list[int] = self._forkers.pids()
        if cluster is not None:
            found += self._cluster_pids(cluster)
        for pid in list(found):
            with contextlib.suppress(psutil.Error):
                found += [child.pid for child in psutil.Process(pid).children(recursive=True)]
        for pid in found:
            # A recorded pid whose process ended may since name a new process of ours.
            if not is_running(pid, self.pids.get(pid)):
                created = start_time(pid)
                if created is not None:
                    self.pids[pid] = created
        self._arm_reaper()

    def _cluster_pids(self, cluster: Any) -> list[int]:
        """Local pids of the cluster's controller and engines (remote ones left out)."""
        found = []
        if cluster.controller is not None and getattr(cluster.controller, "pid", -1) > 0:
            found.append(cluster.controller.pid)
        for engine_set in cluster.engines.values():
            if not is_remote(engine_set) and getattr(engine_set, "pid", -1) > 0:
                found.append(engine_set.pid)  # mpiexec: one local process for all engines
            for launcher in _set_launchers(engine_set):
                if getattr(launcher, "pid", -1) > 0:
                    if id(launcher) not in self._retired:
                        self._launchers[launcher.pid] = launcher
                    # A remote engine's pid is not a process here: never record it.
                    if not is_remote(launcher):
                        found.append(launcher.pid)
        return found

    def _arm_reaper(self) -> None:
        """Rewrite the reaper's pid file; start the reaper if none runs.

        The reaper ends these processes, and removes the snapshot root, if this (the
        owning) process dies without stopping the pool; see
        :mod:`fsdp_interactive.pool.processes._reaper`. It watches from the first launch
        to :meth:`stop`, also while the forkers are kept between groups.
        """
        if self._state_dir is None:
            self._state_dir = tempfile.mkdtemp(prefix="fsdpi-launched-")
        pid_file = os.path.join(self._state_dir, "launched.json")
        write_pid_file(pid_file, self.pids)
        if self._reaper is None or self._reaper.poll() is not None:
            log_path = None
            if self.log_level is not None and self.cluster is not None:
                log_path = os.path.join(self._log_dir(), f"reaper-{self.cluster.cluster_id}.log")
            self._reaper = start_reaper(
                pid_file,
                log_level=self.log_level,
                log_path=log_path,
                remove=[f for f in (self.snapshot_root, self.socket_folder) if f],
            )
            log.debug(
                "orphan reaper started (pid %d) for %d processes%s",
                self._reaper.pid,
                len(self.pids),
                f"; its log: {log_path}" if log_path else "",
            )

    # ------------------------------------------------------------------ asking

    def engine(self, pid: int) -> EngineProcess | None:
        """The engine this pool started with ``pid`` (``None``: not one of its engines).

        ``pid`` may be the one a rank reported, whose launcher started its parent
        (see :meth:`alias`).
        """
        launcher = self._launchers.get(pid)
        if launcher is not None:
            return EngineProcess(launcher, self.pids.get(pid))
        parent = self._aliases.get(pid)
        launcher = self._launchers.get(parent) if parent is not None else None
        if launcher is not None:
            return EngineProcess(launcher, self.pids.get(parent), rank_pid=pid)
        shared = self._shared_launcher()
        if shared is not None and pid in self._aliases:
            return EngineProcess(shared, None, rank_pid=pid, shared=True)
        return None

    def _shared_launcher(self) -> Any:
        """The cluster's one engine set launcher that started every engine at once
        (``mpiexec``, a batch job), if that is how its engines were started."""
        if self.cluster is None:
            return None
        sets = list(self.cluster.engines.values())
        if len(sets) == 1 and getattr(sets[0], "launchers", None) is None:
            return sets[0]
        return None

    def alias(self, rank_pid: int, parent_pid: int | None) -> None:
        """Rank ``rank_pid`` is the engine whose parent the launcher started as
        ``parent_pid`` (remote engines run under :mod:`fsdp_interactive._engine_parent`)."""
        if parent_pid and rank_pid not in self._launchers:
            self._aliases[rank_pid] = parent_pid

    def engines(self) -> list[EngineProcess]:
        """Every engine of the current cluster."""
        return [
            EngineProcess(launcher, self.pids.get(pid)) for pid, launcher in self._launchers.items()
        ]

    def launch_problem(self) -> str | None:
        """Why the engines can no longer register (a launcher exited, a batch job ended or
        can never run), with the launcher's output; ``None`` while they still may."""
        if self.cluster is None:
            return None
        for engine_set in list(self.cluster.engines.values()):
            problem = _launch_watch.launch_problem(engine_set)
            if problem:
                return problem
        return None

    def launch_state(self) -> str:
        """Where the engine launchers stand, for a start-up that timed out ("": nothing)."""
        if self.cluster is None:
            return ""
        states = [_launch_watch.launch_state(s) for s in list(self.cluster.engines.values())]
        return "\n".join(state for state in states if state)

    def exited_engines(self) -> list[EngineProcess]:
        """Engines of the current cluster that no longer run."""
        return [engine for engine in self.engines() if not engine.alive()]

    def engine_launchers(self) -> list[Any]:
        """Every engine launcher of the current cluster that starts one engine: started,
        ended or not started yet (a set that starts all its engines at once, ``mpiexec``
        or a batch job, has none); engines replaced by a retry are left out."""
        if self.cluster is None:
            return []
        found: dict[int, Any] = {}
        for engine_set in list(self.cluster.engines.values()):
            for launcher in _set_launchers(engine_set):
                found[id(launcher)] = launcher
        for launcher in self._launchers.values():  # ended ones leave their set's list
            found[id(launcher)] = launcher
        return [launcher for key, launcher in found.items() if key not in self._retired]

    def unregistered(
        self, registered: set[int], *, full: int | None = None
    ) -> list[tuple[Any, EngineReport]]:
        """Each engine whose pid is not in ``registered`` (the pids the registered engines
        gave, and their parents'), with its report (:mod:`._engine_report`: running,
        ended or never started), in launch order; ``full``: only the first so many
        reports read stacks and logs (``None``: all)."""
        missing = [
            launcher
            for launcher in self.engine_launchers()
            if getattr(launcher, "pid", None) not in registered
        ]
        missing.sort(key=lambda launcher: _launch_order(str(getattr(launcher, "identifier", ""))))
        return [
            (launcher, self.report(launcher, full=full is None or i < full))
            for i, launcher in enumerate(missing)
        ]

    def report(self, launcher: Any, *, full: bool = True) -> EngineReport:
        """What can be told of the engine of ``launcher`` from outside it (see
        :func:`._engine_report.engine_report`)."""
        started = getattr(launcher, "state", "") != "before"
        engine = EngineProcess(launcher, self.pids.get(getattr(launcher, "pid", 0) or 0))
        alive = started and engine.alive()
        if not started or alive:
            return engine_report(launcher, alive=alive, full=full)
        # Its status and its output's end as the launcher tells them (a crash report kept
        # from its first line), also for engines on other hosts.
        return engine_report(
            launcher,
            alive=False,
            exit_code=engine.exit_code(),
            last_output=engine.output_tail() if full else None,
            full=full,
        )

    def can_replace(self, launcher: Any) -> bool:
        """Whether the engine of ``launcher`` can be started once more on its own (its set
        forks engines one by one: the pool's local and ssh forked engines)."""
        return self._set_of(launcher) is not None

    def replace_engine(self, launcher: Any, timeout: float) -> Any:
        """End the engine of ``launcher`` (SIGKILL, if it runs) and start one in its place;
        the new engine's launcher. Its end is no failure of the start any more (it is
        still ended by pid when the pool stops). Raises :class:`PoolStartError` when the
        new one cannot be started."""
        engine_set = self._set_of(launcher)
        if engine_set is None or self._loop is None:
            raise PoolStartError(f"engine {launcher.identifier} cannot be started on its own")
        self._retired.add(id(launcher))
        pid = getattr(launcher, "pid", None)
        if isinstance(pid, int) and pid > 0:
            self._launchers.pop(pid, None)
            if getattr(launcher, "state", "") == "running":
                EngineProcess(launcher, self.pids.get(pid)).signal(signal.SIGKILL)
        identifier = str(launcher.identifier)
        try:
            key, new_pid = self._loop.run(
                lambda: engine_set.start_replacement(identifier), timeout=timeout
            )
        except Exception as exc:
            raise PoolStartError(f"engine {identifier} could not be started again: {exc}") from exc
        self.record()
        log.debug("engine %s replaced by %s (pid %s)", identifier, key, new_pid)
        return engine_set.launchers[key]

    def _set_of(self, launcher: Any) -> Any:
        """The engine set that started ``launcher``, if it can start one engine more."""
        if self.cluster is None:
            return None
        for engine_set in list(self.cluster.engines.values()):
            if hasattr(engine_set, "start_replacement") and launcher.parent is engine_set:
                return engine_set
        return None

    def kill_engines(self) -> None:
        """SIGKILL every engine of the current cluster through its launcher.

        For a group that lost a rank: survivors may be blocked in a collective that
        never completes (NCCL waits forever; SIGTERM handlers do not run inside C++).
        """
        log.debug("SIGKILL to the engines %s through their launchers", sorted(self._launchers))
        for engine in self.engines():
            engine.signal(signal.SIGKILL)

    # ------------------------------------------------------------------ ending

    def stop(self, *, keep_forker: bool = False, engines_timeout: float | None = None) -> None:
        """End the current cluster and every recorded process; idempotent.

        Engines and controller are stopped through ipyparallel's launcher handles
        (SIGTERM, then SIGKILL after a grace period), the engine forkers and the orphan
        reaper through theirs; any recorded process still alive afterwards is ended by
        its exact pid and start time. ``keep_forker``: leave the engine forkers (of every
        host) and the reaper running, for a restart or a recovery to fork from;
        otherwise the forkers end and the snapshot root is removed on every host.
        ``engines_timeout``: seconds the launchers get to stop the engines (a launcher
        that lost a host, e.g. ``mpiexec``, may wait on it for good; what it started
        locally is then ended by pid).
        """
        cluster, loop = self.cluster, self._loop
        if cluster is not None and loop is not None:
            began = time.monotonic()
            # Engines first: their nannies can then tell a live controller and exit at once.
            with contextlib.suppress(Exception):
                loop.run(cluster.stop_engines, timeout=engines_timeout or _STOP_TIMEOUT_S)
            log.debug("engines stopped in %.2fs", time.monotonic() - began)
            began = time.monotonic()
            with contextlib.suppress(Exception):
                loop.run(cluster.stop_controller, timeout=_STOP_TIMEOUT_S)
            log.debug("controller stopped in %.2fs", time.monotonic() - began)
        kept = set(self._forkers.pids()) if keep_forker else set()
        if keep_forker:
            if kept:
                log.debug("engine forkers %s kept for the next group", sorted(kept))
        else:
            self._forkers.close()
        survivors = end_processes(
            {pid: created for pid, created in self.pids.items() if pid not in kept},
            grace=_REAP_GRACE_S,
        )
        if survivors:
            log.debug("survived their handles' stop and were ended by pid: %s", survivors)
        if not keep_forker:
            with contextlib.suppress(ValueError):
                _snapshot_root.remove_root(self.snapshot_root)  # this host's, forked or not
            _socket_folder.remove_folder(self.socket_folder)
            self.socket_folder = None
            self._stop_reaper()
        if loop is not None:
            loop.close()
        self.cluster = self._loop = None
        self._launchers = {}
        self._aliases = {}
        self._retired = set()

    def _stop_reaper(self) -> None:
        """End the orphan reaper through the handle that started it; remove its pid file."""
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            with contextlib.suppress(OSError):
                reaper.terminate()
            try:
                reaper.wait(timeout=10)
            except Exception:
                reaper.kill()
                reaper.wait(timeout=10)
            log.debug("orphan reaper (pid %d) stopped", reaper.pid)
        if self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)
            self._state_dir = None


def _call_once(
    values: list[float], callback: Callable[[float], None] | None
) -> Callable[[], None] | None:
    """A poll that calls ``callback(values[0])`` once, as soon as ``values`` has one."""
    if callback is None:
        return None
    done: list[bool] = []

    def poll() -> None:
        if values and not done:
            done.append(True)
            callback(values[0])

    return poll


def _set_launchers(engine_set: Any) -> list[Any]:
    """The engine launchers of ``engine_set``: those it lists, and, for the pool's forked
    sets, every one it made (an engine that ended at once leaves ``launchers`` before the
    pool records it; it must still be found, to tell of it or retry it)."""
    # Copied at once: the loop thread changes these while engines start and end.
    listed = list(getattr(engine_set, "launchers", {}).values())
    made = list(getattr(engine_set, "made", {}).values())
    return list({id(launcher): launcher for launcher in [*listed, *made]}.values())


def _launch_order(index: str) -> tuple[int, str]:
    """Sort key of engine identifiers ("0", "3-retry", "host/1") in launch order."""
    head = index.rsplit("/", 1)[-1].split("-", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, index)


def is_remote(launcher: Any) -> bool:
    """Whether ``launcher`` runs its process on another host (its ``pid`` is not ours)."""
    if getattr(launcher, "runs_remotely", False):
        return True
    return any(cls.__name__ == "SSHLauncher" for cls in type(launcher).__mro__)
