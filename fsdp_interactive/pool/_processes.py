"""The processes a pool starts, and the one object that owns and ends them.

:class:`LaunchedProcesses` starts an ipyparallel cluster (controller and engines) on a
private event loop (:mod:`._loop`), records every process it started by pid *and* start
time (controller, engines, their nannies, the engine forker), keeps the orphan reaper
(:mod:`._reaper`) informed, and ends all of them on :meth:`~LaunchedProcesses.stop`.

Start-up: local engines are forked from one process that imports torch while the
controller starts (:mod:`._forked_launcher`, :mod:`._engine_forker`); they wait for the
controller's connection file themselves (:mod:`._engine_entry`), so controller, torch
import and engine start-up overlap instead of following each other. A restart keeps the
forker and forks fresh engines from it. An ``engines=`` launcher other than ``"local"``
gets ipyparallel's own launcher, its engine command run under :mod:`fsdp_interactive._engine_parent`
(which reports each engine's exit status, on whatever host it runs); ssh hosts are
checked before anything starts (:mod:`._ssh_check`); a ``config`` that sets the local
engine command gets ipyparallel's local launcher unchanged. Remote engines' pids are
never taken for local processes: they are not recorded, and the launcher (or the
parent's report) tells whether they run.

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
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from fsdp_interactive import _engine_parent
from fsdp_interactive.pool import _launch_watch, _ssh_check
from fsdp_interactive.pool._engine_entry import engine_command
from fsdp_interactive.pool._loop import LoopThread
from fsdp_interactive.pool._pids import end_processes, is_running, start_time
from fsdp_interactive.pool._reaper import start_reaper, write_pid_file
from fsdp_interactive.pool.errors import PoolStartError

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

        A remote engine's status is the one its parent reported in its output
        (:mod:`fsdp_interactive._engine_parent`): the ssh launcher's own status is -1 for any end.
        """
        if self.shared:
            return self._reported_exit()
        self.wait_stop_report()
        if is_remote(self.launcher):
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

    def output_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines of the engine's output (its log file, or what its launcher kept).

        A local launcher reads and removes the file when it notices the exit, so the file
        may already be gone. A crash report of faulthandler ("Fatal Python error", after a
        segfault or abort) is kept from its first line.
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
        all_lines = text.splitlines(keepends=True)
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
    """

    def __init__(self, *, log_level: int | None = None) -> None:
        self.pids: dict[int, float] = {}
        self.log_level = log_level
        self.cluster: Any = None
        self._loop: LoopThread | None = None
        self._launchers: dict[int, Any] = {}
        self._aliases: dict[int, int] = {}  # a rank's pid -> its parent's (the launcher's)
        self._forker: Any = None  # an EngineForker once local engines were forked
        self._reaper: Any = None
        self._pid_file: str | None = None

    # ------------------------------------------------------------------ starting

    def launch(
        self,
        n: int,
        *,
        engines: str,
        cluster_kwargs: Mapping[str, Any],
        timeout: float,
        run_dir: str,
    ) -> Any:
        """Start a controller and ``n`` engines; return a connected ``ipyparallel.Client``.

        The engines may not have registered yet. ``run_dir``: the pool's directory for
        this start (the reaper's pid file goes there). Raises :class:`PoolStartError` when
        the cluster does not start; :meth:`stop` then ends what did start.
        """
        import ipyparallel as ipp

        from fsdp_interactive.pool._forked_launcher import (
            ForkedEngineSetLauncher,
            forking_supported,
        )

        self._pid_file = os.path.join(run_dir, "launched.json")
        self._loop = LoopThread()
        kwargs = dict(cluster_kwargs)
        kwargs.setdefault("log_level", logging.ERROR)
        # The pool stops its cluster at exit itself (engines first, on its own loop).
        kwargs.setdefault("shutdown_atexit", False)
        kwargs.setdefault("controller_args", list(_CONTROLLER_ARGS))
        kwargs.setdefault("engine_timeout", int(timeout))

        launcher: Any = engines
        forked = (
            engines == "local"
            and forking_supported()
            and not {"send_engines_connection_env", "engine_launcher_class"} & set(kwargs)
            and not _configures_engine_command(kwargs.get("config"))
        )
        if forked:
            # Engines forked from a process that has torch imported, started with the
            # controller: each waits for the connection file itself (see _engine_entry).
            kwargs["send_engines_connection_env"] = False
            launcher = ForkedEngineSetLauncher

        if not forked and engines != "local" and isinstance(engines, str):
            launcher = _with_engine_parent(engines)
        if isinstance(engines, str) and engines.lower() == "ssh":
            began = time.monotonic()
            try:
                _ssh_check.check_hosts(kwargs.get("config"))
            except RuntimeError as exc:
                raise PoolStartError(str(exc)) from None
            log.debug("ssh hosts checked in %.2fs", time.monotonic() - began)

        async def start() -> None:
            began = time.monotonic()
            self.cluster = ipp.Cluster(n=n, engines=launcher, **kwargs)
            # The forker's imports are the longest step: it starts first.
            forker = self._running_forker() if forked else None
            await self.cluster.start_controller()
            log.debug("controller up in %.2fs", time.monotonic() - began)
            began = time.monotonic()
            engine_kwargs = {}
            if forked:
                connection_file = self.cluster.controller.connection_files["engine"]
                engine_kwargs["engine_cmd"] = engine_command(connection_file, timeout)
                engine_kwargs["forker"] = forker
            await self.cluster.start_engines(n, **engine_kwargs)
            how = f"forked from pid {self._forker.pid}" if forked else f"launcher {engines!r}"
            log.debug("%d engines started (%s) in %.2fs", n, how, time.monotonic() - began)

        try:
            self._loop.run(start, timeout=timeout)
        except Exception as exc:
            raise PoolStartError(f"could not launch the cluster: {exc}") from exc
        self.record()
        return self._loop.run(self.cluster.connect_client, timeout=timeout)

    def record(self) -> None:
        """Remember pids (with start time) of controller, engines, nannies and forker,
        and keep the orphan reaper's list current (starting the reaper once)."""
        cluster = self.cluster
        found: list[int] = []
        if cluster.controller is not None and getattr(cluster.controller, "pid", -1) > 0:
            found.append(cluster.controller.pid)
        for engine_set in cluster.engines.values():
            if getattr(engine_set, "forker_pid", None):
                found.append(engine_set.forker_pid)
            if not is_remote(engine_set) and getattr(engine_set, "pid", -1) > 0:
                found.append(engine_set.pid)  # mpiexec: one local process for all engines
            for launcher in getattr(engine_set, "launchers", {}).values():
                if getattr(launcher, "pid", -1) > 0:
                    self._launchers[launcher.pid] = launcher
                    # A remote engine's pid is not a process here: never record it.
                    if not is_remote(launcher):
                        found.append(launcher.pid)
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

    def _arm_reaper(self) -> None:
        """Rewrite the reaper's pid file; start the reaper if none runs.

        The reaper ends these processes if this (the owning) process dies without
        stopping the pool; see :mod:`fsdp_interactive.pool._reaper`.
        """
        assert self._pid_file is not None
        write_pid_file(self._pid_file, self.pids)
        if self._reaper is None or self._reaper.poll() is not None:
            log_path = None
            if self.log_level is not None and self.cluster is not None:
                log_path = os.path.join(
                    self.cluster.profile_dir, "log", f"reaper-{self.cluster.cluster_id}.log"
                )
            self._reaper = start_reaper(self._pid_file, log_level=self.log_level, log_path=log_path)
            log.debug(
                "orphan reaper started (pid %d) for %d processes%s",
                self._reaper.pid,
                len(self.pids),
                f"; its log: {log_path}" if log_path else "",
            )

    def _running_forker(self) -> Any:
        """The engine forker local engines are forked from; started once, kept by restarts."""
        from fsdp_interactive.pool._forked_launcher import EngineForker

        if self._forker is None or not self._forker.running():
            self._stop_forker()
            log_dir = os.path.join(self.cluster.profile_dir, "log")
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, f"ipengine-forker-{self.cluster.cluster_id}.log")
            self._forker = EngineForker(path, dict(os.environ))
            log.debug("engine forker started (pid %d); its log: %s", self._forker.pid, path)
        return self._forker

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
        (SIGTERM, then SIGKILL after a grace period), the engine forker and the orphan
        reaper through theirs; any recorded process still alive afterwards is ended by
        its exact pid and start time. ``keep_forker``: leave the engine forker running,
        for a restart to fork from; ``engines_timeout``: seconds the launchers get to stop
        the engines (a launcher that lost a host, e.g. ``mpiexec``, may wait on it for
        good; what it started locally is then ended by pid).
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
        kept = self._forker.pid if keep_forker and self._forker is not None else None
        if kept is None:
            self._stop_forker()
        else:
            log.debug("engine forker (pid %d) kept for the restart", kept)
        survivors = end_processes(
            {pid: created for pid, created in self.pids.items() if pid != kept},
            grace=_REAP_GRACE_S,
        )
        if survivors:
            log.debug("survived their handles' stop and were ended by pid: %s", survivors)
        self._stop_reaper()
        if loop is not None:
            loop.close()
        self.cluster = self._loop = None
        self._launchers = {}
        self._aliases = {}
        self._pid_file = None

    def _stop_forker(self) -> None:
        """End the engine forker through its handle, if one runs."""
        forker, self._forker = self._forker, None
        if forker is not None:
            forker.close()
            log.debug("engine forker (pid %d) stopped", forker.pid)

    def _stop_reaper(self) -> None:
        """End the orphan reaper through the handle that started it."""
        reaper, self._reaper = self._reaper, None
        if reaper is None:
            return
        with contextlib.suppress(OSError):
            reaper.terminate()
        try:
            reaper.wait(timeout=10)
        except Exception:
            reaper.kill()
            reaper.wait(timeout=10)
        log.debug("orphan reaper (pid %d) stopped", reaper.pid)


def _with_engine_parent(engines: str) -> Any:
    """ipyparallel's engine set launcher named ``engines``, its engines run under
    :mod:`fsdp_interactive._engine_parent` (which reports how each ended), under the same class name
    (so the configuration of that name and of its bases applies unchanged)."""
    from ipyparallel.cluster.launcher import find_launcher_class

    try:
        base = find_launcher_class(engines, "engine")
    except (KeyError, ValueError, ImportError):
        return engines  # a launcher named by its import path: ipyparallel resolves it

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self.engine_cmd = _engine_parent.wrap(list(self.engine_cmd))

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})


def is_remote(launcher: Any) -> bool:
    """Whether ``launcher`` runs its process on another host (its ``pid`` is not ours)."""
    return any(cls.__name__ == "SSHLauncher" for cls in type(launcher).__mro__)


def _configures_engine_command(config: Any) -> bool:
    """Whether an ipyparallel ``config`` sets the local launchers' ``engine_cmd``."""
    if not config:
        return False
    sections = ("LocalEngineSetLauncher", "LocalEngineLauncher", "EngineLauncher")
    return any("engine_cmd" in config.get(section, {}) for section in sections)
